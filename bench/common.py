"""Shared by the benchmarks: the environment that keeps MPI on loopback, generated data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def loopback_env(**extra: str) -> dict[str, str]:
    """This process's environment with Open MPI and UCX pinned to ``lo``."""
    return dict(os.environ, OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo",
                UCX_NET_DEVICES="lo", **extra)


def gan_data(workdir: Path, events: int = 1024) -> Path:
    """One file of generated 3DGAN showers under ``workdir`` (made once, then reused)."""
    data = workdir / "gan-data"
    if not data.exists():
        subprocess.run([sys.executable, "-m", "hpcai.training.showers", "generate", "--out",
                        str(data), "--files", "1", "--events", str(events)], check=True,
                       capture_output=True)
    return data
