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


def provenance(repo: Path) -> dict:
    """Commit, date, host, CPU, and the load average when the benchmark started (the
    machine may be shared: every figure should be read against it)."""
    import datetime
    import platform
    import socket

    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "-uno"],
                           capture_output=True, text=True, check=False).stdout.strip()
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"git_commit": commit, "git_dirty": bool(dirty),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "machine": model, "cpus": os.cpu_count(),
            "python": platform.python_version(), "load_average_at_start": os.getloadavg()}
