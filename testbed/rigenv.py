"""Where the repository and the venv are, and the environment a test bed starts ranks in:
the venv first on PATH, MPI on loopback, no job or hpcai variables from the caller."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
# Intel MPI (impi-rt): where scripts/env.sh points I_MPI_ROOT, else the venv's opt/impi-rt
IMPI_ROOT = Path(os.environ.get("I_MPI_ROOT", VENV_BIN.parent / "opt" / "impi-rt"))
LOOPBACK = {"OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo",
            "UCX_NET_DEVICES": "lo"}


# The suite runs several jobs at once on few cores (pytest-xdist workers, each job's ranks),
# so its Open MPI ranks are oversubscribed without mpirun knowing: their waits give up the
# core (as they do when mpirun knows), and a rank waiting for its peer does not spin on the
# core that peer needs. A test that needs Open MPI's own default (what ``train`` sets itself,
# ranks that must spin) removes it: ``base_env(**dict.fromkeys(SHARED_CORES))``.
SHARED_CORES = {"OMPI_MCA_mpi_yield_when_idle": "1"}
# Training runs take "% of peak" from this instead of a GEMM probe on every rank (2-4 s of each
# run's start-up here); tests/test_training.py runs the probe itself:
# ``base_env(HPCAI_PEAK_GFLOPS=None)``.
GIVEN_PEAK = {"HPCAI_PEAK_GFLOPS": "50"}

# glibc's malloc keeping freed memory instead of returning it to the kernel, for test runs
# whose large temporaries would otherwise be page-faulted in again at every step (the float64
# equivalence programs spent 34 of 80 CPU-s in the kernel without it). Numerics unchanged.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32),
                     "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def base_env(**extra: str | None) -> dict[str, str]:
    """Environment for launching ranks in tests: venv first on PATH, MPI on loopback, Open
    MPI's waits yielding (:data:`SHARED_CORES`), the peak given (:data:`GIVEN_PEAK`);
    ``extra`` last, where None removes."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI4PY_", "HPCAI_"))}
    env.update(LOOPBACK)
    env.update(SHARED_CORES)
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', os.defpath)}"
    env.update(GIVEN_PEAK)
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run(argv: list[str], env: dict[str, str], timeout: float = 120,
        cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, check=False)
