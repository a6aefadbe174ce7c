"""Fused gradient allreduce vs one raw MPI_Allreduce of the same bytes, 2 ranks.

The payload is a real model's gradient set (ResNet50: 161 tensors, 102 MB; 3DGAN: 46
tensors, 3.8 MB). "fused" is hpcai's GradAllreducer in blocking mode (pack into buckets,
MPI_Allreduce per bucket, unpack and divide); "raw" is a single MPI_Allreduce of one buffer
of the same size. Trials alternate; medians are compared. Target: fused bandwidth >= 0.9 x
raw.

    python bench/allreduce_bw.py            (launches itself with hpcai-launch -N 2)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import loopback_env

TRIALS = 15
TARGET = 0.9


def _as_rank() -> int:
    import numpy as np
    import torch
    from mpi4py import MPI

    from hpcai.models import gan3d, resnet
    from hpcai.training.allreduce import GradAllreducer, MpiTransport

    comm = MPI.COMM_WORLD
    results = {}
    for name, model in (("resnet50", resnet.resnet50()),
                        ("3dgan", torch.nn.ModuleList([gan3d.Generator(),
                                                       gan3d.Discriminator()]))):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        raw = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        for bucket_mb in (4.0, 25.0):
            reducer = GradAllreducer(model, MpiTransport(comm), bucket_mb=bucket_mb,
                                     overlap=False)
            fused_t, raw_t = [], []
            for _ in range(TRIALS + 1):
                comm.Barrier()
                t0 = time.perf_counter()
                reducer.synchronize()
                fused_t.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
                comm.Barrier()
                t0 = time.perf_counter()
                comm.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM)
                raw_t.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            fused_s, raw_s = statistics.median(fused_t[1:]), statistics.median(raw_t[1:])
            results[f"{name}/{bucket_mb:g}MB"] = {
                "bytes": nbytes, "tensors": len(list(model.parameters())),
                "buckets": len(reducer.buckets), "fused_s": fused_s, "raw_s": raw_s,
                "fused_GBps": nbytes / fused_s / 1e9, "raw_GBps": nbytes / raw_s / 1e9,
                "bandwidth_ratio": raw_s / fused_s}
            reducer.close()
    if comm.rank == 0:
        print(json.dumps(results))
    return 0


def main() -> int:
    if "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        return _as_rank()
    env = loopback_env()
    out = subprocess.run(["hpcai-launch", "-N", "2", "--", sys.executable, __file__],
                         env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return out.returncode
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for key, r in results.items():
        print(f"{key:18s} {r['bytes'] / 1e6:7.1f} MB in {r['tensors']} tensors, "
              f"{r['buckets']} bucket(s): fused {r['fused_s'] * 1e3:7.2f} ms "
              f"({r['fused_GBps']:.2f} GB/s), raw {r['raw_s'] * 1e3:7.2f} ms "
              f"({r['raw_GBps']:.2f} GB/s), ratio {r['bandwidth_ratio']:.2f} "
              f"(target >= {TARGET})")
    path = Path("bench/results/allreduce_bw.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"trials": TRIALS, "target": TARGET, "results": results},
                               indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
