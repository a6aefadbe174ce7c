"""What an epoch record says about speed: FLOPs counted, peak measured, provenance.

FLOP convention, written into every record: one multiply-add = 2 FLOP, as
``torch.utils.flop_counter.FlopCounterMode`` counts; the training cost per sample is the
forward and backward passes of one whole training iteration as counted (for the 3DGAN: all
four optimiser steps, including the generator runs that feed them).

Peak: a short fp32 GEMM probe per rank with the rank's own threads, so "% of peak" is
against what this rank can really do (override with ``--peak-gflops``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import torch

FLOP_CONVENTION = ("1 multiply-add = 2 FLOP (torch.utils.flop_counter.FlopCounterMode); "
                   "training FLOPs = forward + backward of one full iteration as counted")


def count_flops(fn) -> int:
    """FLOPs of running ``fn()`` once, as FlopCounterMode counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


def best_gemm_gflops(multiply, size: int, repeats: int) -> float:
    """GFLOP/s of the fastest of ``repeats`` calls of ``multiply()`` (one size^3 product,
    finished when it returns), after one warm-up call."""
    multiply()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        multiply()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def gemm_peak_gflops(size: int = 2048, repeats: int = 8) -> float:
    """Best-of-N fp32 GEMM rate of this process with its current torch thread count.

    2048^3 best of 8 varies by about 2 % run to run here; 1536^3 best of 5 varied by 25 %.
    """
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    return best_gemm_gflops(lambda: torch.mm(a, b), size, repeats)


def libmpi_path() -> str | None:
    from ..launcher.probe import mapped_libraries

    libs = mapped_libraries()
    return libs[0] if libs else None


def git_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=False)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    rev = out.stdout.strip()
    if not rev:
        return "unknown"
    return rev + ("-dirty" if dirty.stdout.strip() else "")


def comm_version(comm_backend: str) -> str:
    """Version of the library that carries the gradient allreduce."""
    import importlib

    module = {"mpi": "mpi4py", "horovod": "horovod", "gloo": "torch"}.get(comm_backend)
    try:
        return f"{module} {importlib.import_module(module).__version__}"
    except (ImportError, AttributeError, TypeError):
        return "unknown"


def provenance(comm, *, comm_backend: str, threads: int, framework: str = "pytorch",
               framework_version: str = torch.__version__) -> dict:
    """Who ran this: world, placement, MPI library, hosts, code revision (collective)."""
    from mpi4py import MPI

    hosts = comm.allgather(socket.gethostname())
    return {
        "world_size": comm.Get_size(),
        "ranks_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or
        max(hosts.count(h) for h in hosts),
        "threads_per_rank": threads,
        "cpus_rank0": os.environ.get("HPCAI_CPUS"),
        "framework": framework,
        "framework_version": framework_version,
        "comm": comm_backend,
        "comm_version": comm_version(comm_backend),
        "mpi_library_version":
            MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
        "libmpi": libmpi_path(),
        "hosts": sorted(set(hosts)),
        "git_revision": git_revision(),
        "torch": torch.__version__,
    }
