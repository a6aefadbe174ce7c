"""Allreduce timing probe, run as every rank: ``python -m hpcai.perf.probe --sizes ... --out F``.

Times ``MPI_Allreduce`` (in place, SUM, float32: the engine's gradient buckets) of each size
with mpi4py: ``--repeats`` timed calls after two warm-up calls, a barrier before each; a
call's time is the slowest rank's. Rank 0 writes ``{"ranks", "samples": [[bytes, median_s,
min_s], ...], "transport_env"}`` as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcai.perf.probe")
    parser.add_argument("--sizes", required=True, help="bytes, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", required=True)
    ns = parser.parse_args(argv)
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = []
    for nbytes in (int(s) for s in ns.sizes.split(",")):
        buf = np.ones(max(1, nbytes // 4), dtype=np.float32)
        times = []
        for i in range(ns.repeats + 2):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if i >= 2:
                times.append(elapsed)
        rows.append([buf.nbytes, statistics.median(times), min(times)])
    if comm.Get_rank() == 0:
        env = {k: v for k, v in os.environ.items() if k in ("OMPI_MCA_btl", "UCX_TLS")}
        with open(ns.out, "w", encoding="utf-8") as f:
            json.dump({"ranks": comm.Get_size(), "samples": rows, "transport_env": env,
                       "mpi": MPI.Get_library_version().splitlines()[0]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
