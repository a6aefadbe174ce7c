"""Fused gradient allreduce vs the best raw ``MPI_Allreduce`` of the same bytes, 2 ranks.

The payload is a real model's gradient set (ResNet50: 161 tensors, 102 MB; 3DGAN: 46
tensors, 3.8 MB). "fused" is the engine's ``GradAllreducer`` with its defaults (4 MiB
buckets, non-blocking): ``synchronize()`` after a backward that is not there starts every
bucket's ``MPI_Iallreduce``, waits for all and divides by the world size (the gradients are
views into the buckets, so nothing is packed); "fused blocking" is the same with
``overlap=False`` (a barrier, then ``MPI_Allreduce`` per bucket). "raw" is one float32 buffer of
the same bytes, reduced by one ``MPI_Allreduce`` of the whole buffer or by consecutive
``MPI_Allreduce`` calls of ``chunk`` bytes (``--chunks``); the best of those settings (by
median) is the baseline. Trials alternate fused / raw (A B B A ...), the first round is
warm-up. Row: raw time ÷ fused time = fused bandwidth ÷ raw bandwidth (target >= 0.95).
Each fused side has its own copy of the model (a gradient is a view into one reducer's
bucket). Three diagnostic sides, never baselines, say where a gap goes: the engine's
averaging pass alone (``div_`` of the buckets); raw ``MPI_Iallreduce`` of 4 MB chunks, all
started, then one ``Waitall``; and ``MPI_Allreduce`` of the engine's bucket sizes in separate
``torch.zeros`` buffers, as the engine allocated them before it took one numpy allocation
(which Linux backs with transparent huge pages). Each row's note gives their medians.

    python bench/allreduce_bw.py [--trials 20] [--chunks 1,4,16,64]  (launches itself, 2 ranks)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import (RESULTS, Row, alternating_order, loopback_env, print_rows, provenance,
                    write_result)

TARGET = 0.95
# measured beside the sides, to explain the gap; never a baseline
DIAG_AVERAGING = "diag: averaging pass alone"
DIAG_IALLREDUCE = "diag: raw MPI_Iallreduce, 4 MB chunks, all started then Waitall"
DIAG_SMALL_PAGES = "diag: raw MPI_Allreduce of the bucket sizes in torch.zeros buffers"


def _as_rank(trials: int, chunks_mb: list[float]) -> int:
    import numpy as np
    import torch
    from mpi4py import MPI

    from hpcai.models import gan3d, resnet
    from hpcai.training.allreduce import GradAllreducer, MpiTransport

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    out = {}
    for name, model in (("resnet50", resnet.resnet50()),
                        ("3dgan", torch.nn.ModuleList([gan3d.Generator(),
                                                       gan3d.Discriminator()]))):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        # the raw sides sum without averaging, so the buffer doubles at every call: start
        # small enough (still normal floats) that ~130 calls stay finite
        raw = (np.random.default_rng(comm.rank).standard_normal(nbytes // 4)
               * 2.0**-100).astype(np.float32)
        # each reducer on its own copy: a parameter's .grad is a view into one reducer's
        # bucket, so two reducers on one model would copy every gradient at each switch
        reducer = GradAllreducer(model, MpiTransport(comm))
        blocking = GradAllreducer(copy.deepcopy(model), MpiTransport(comm), overlap=False)

        def timed(fn) -> float:
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

        def raw_in(chunk: int):
            def run() -> None:
                for lo in range(0, raw.size, chunk):
                    comm.Allreduce(MPI.IN_PLACE, raw[lo:lo + chunk], op=MPI.SUM)
            return run

        settings = {"one call": raw_in(raw.size)}
        settings.update({f"{c:g} MB chunks": raw_in(int(c * 1e6) // 4) for c in chunks_mb
                         if c * 1e6 < nbytes})
        def averaging() -> None:   # the engine's pass after the sums, alone
            for bucket in blocking.buckets:
                bucket.flat.div_(comm.size)

        def raw_nonblocking(chunk: int = int(4e6) // 4) -> None:
            requests = [comm.Iallreduce(MPI.IN_PLACE, raw[lo:lo + chunk], op=MPI.SUM)
                        for lo in range(0, raw.size, chunk)]
            MPI.Request.Waitall(requests)

        small_pages = [torch.zeros(b.flat.numel()).numpy() for b in blocking.buckets]

        def raw_small_pages() -> None:   # the engine before it allocated through numpy
            for buffer in small_pages:
                comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)

        sides = {"fused": reducer.synchronize, "fused blocking": blocking.synchronize,
                 **settings, DIAG_AVERAGING: averaging, DIAG_IALLREDUCE: raw_nonblocking,
                 DIAG_SMALL_PAGES: raw_small_pages}
        values: dict[str, list[float]] = {s: [] for s in sides}
        for s in sides:   # warm-up round
            timed(sides[s])
        for s in alternating_order(list(sides), trials):
            values[s].append(timed(sides[s]))
        out[name] = {"bytes": nbytes, "tensors": len(list(model.parameters())),
                     "buckets": len(reducer.buckets), "seconds": values}
        reducer.close()
        blocking.close()
    if comm.rank == 0:
        print(json.dumps(out))
    return 0


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--chunks", default="1,4,16,64", help="raw chunk sizes in MB")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    if "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        return _as_rank(args.trials, [float(c) for c in args.chunks.split(",") if c])
    info = provenance()
    argv = ["hpcai-launch", "-N", "2", "--threads-per-rank", "1", "--", sys.executable,
            __file__, "--trials", str(args.trials), "--chunks", args.chunks]
    out = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return out.returncode
    results = json.loads(out.stdout.strip().splitlines()[-1])
    rows = []
    for name, r in results.items():
        secs = r["seconds"]
        raws = {k: v for k, v in secs.items() if not k.startswith(("fused", "diag"))}
        best = min(raws, key=lambda k: _median(raws[k]))
        for k, v in secs.items():
            med = _median(v)
            print(f"{name:9s} {r['bytes'] / 1e6:6.1f} MB {k:14s} median {med * 1e3:8.2f} ms "
                  f"({r['bytes'] / med / 1e9:.2f} GB/s)")
        ms = {k: f"{_median(v) * 1e3:.1f} ms" for k, v in secs.items()}
        for fused, how, diag in (
                ("fused", "default, Iallreduce",
                 f"raw MPI_Iallreduce of 4 MB chunks {ms[DIAG_IALLREDUCE]}"),
                ("fused blocking", "blocking, Allreduce", "")):
            note = (f"medians: best raw {ms[best]}, fused {ms[fused]}; of the fused time the "
                    f"averaging pass alone {ms[DIAG_AVERAGING]}" + (f"; {diag}" if diag else "")
                    + f"; for scale, the same bucket sizes in separate torch allocations "
                    f"(no huge pages) {ms[DIAG_SMALL_PAGES]}")
            rows.append(Row.measured(
                f"allreduce-{name}-{fused.replace(' ', '-')}",
                f"{name} gradients ({r['bytes'] / 1e6:.1f} MB, {r['buckets']} bucket(s), "
                f"{how}): fused bandwidth ÷ best raw MPI_Allreduce ({best})",
                ">=", TARGET, raws[best], secs[fused], note))
    print_rows(rows)
    path = write_result("allreduce_bw", info, rows, results,
                        {"ranks": 2, "threads_per_rank": 1, "trials": args.trials,
                         "warmup_rounds": 1, "raw_chunks_mb": args.chunks,
                         "fused": "GradAllreducer defaults (4 MiB buckets, Iallreduce per bucket)"},
                        out_dir=args.results)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
