"""What an epoch record says about who ran it and how fast the machine is (no framework).

- :func:`provenance`: world, placement, libraries, hosts and code revision (collective);
- :func:`best_gemm_gflops`: the timing of the GEMM probe each trainer runs for the peak
  (``torch.mm`` or ``tf.linalg.matmul``), so "% of peak" is against what a rank with its own
  threads can really do (override with ``--peak-gflops``).

How FLOPs are counted is the tasks' business (``tasks.FLOP_CONVENTION``,
``keras_tasks.FLOP_CONVENTION_TF``); every record names its convention.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import socket
import subprocess
import time
from pathlib import Path

from ..launcher.mpi.libmpi import libmpi_path
from .record import Provenance


def best_gemm_gflops(multiply, size: int = 2048, repeats: int = 8) -> float:
    """GFLOP/s of the fastest of ``repeats`` calls of ``multiply()`` (one size^3 product,
    finished when it returns), after one warm-up call.

    2048^3 best of 8 varies by about 2 % run to run here; 1536^3 best of 5 varied by 25 %.
    """
    multiply()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        multiply()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


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
    module = {"mpi": "mpi4py", "horovod": "horovod", "gloo": "torch"}.get(comm_backend)
    try:
        return f"{module} {importlib.import_module(module).__version__}"
    except (ImportError, AttributeError, TypeError):
        return "unknown"


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, read from its metadata (not imported)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance(comm, *, comm_backend: str, threads: int, framework: str,
               framework_version: str) -> Provenance:
    """Who ran this: world, placement, MPI library, hosts, code revision (collective)."""
    from mpi4py import MPI

    hosts = comm.allgather(socket.gethostname())
    return Provenance(
        world_size=comm.Get_size(),
        ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or
        max(hosts.count(h) for h in hosts),
        threads_per_rank=threads,
        cpus_rank0=os.environ.get("HPCAI_CPUS"),
        framework=framework,
        framework_version=framework_version,
        comm=comm_backend,
        comm_version=comm_version(comm_backend),
        mpi_library_version=MPI.Get_library_version().replace("\x00", "").strip()
        .splitlines()[0],
        libmpi=libmpi_path(),
        hosts=tuple(sorted(set(hosts))),
        git_revision=git_revision(),
        torch=installed_version("torch"),
    )
