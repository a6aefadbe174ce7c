"""Commands and batch jobs on a LocalCluster, for tests: a clean env, timeouts, job waits,
and the per-rank lines of ``testbed/rank_report`` (what each rank really ran on).

Nothing here sets ``MASTER_ADDR``: variables that would change what hpcai-launch derives
(:data:`UNSET`) are removed from every command's environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localcluster import LocalCluster

VENV_BIN = os.path.dirname(sys.executable)     # the venv running pytest holds hpcai-launch
RANK_REPORT = Path(__file__).parent / "rank_report"
# Variables from the caller's shell that would change what hpcai-launch plans.
UNSET = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
         "LOCAL_WORLD_SIZE", "NODE_RANK", "MPI4PY_MPIABI", "HPCAI_RANKS_PER_NODE",
         "HPCAI_THREADS_PER_RANK", "HPCAI_LAUNCHER", "HPCAI_MPI", "HPCAI_MPIRUN",
         "HPCAI_TOPOLOGY", "HPCAI_SITE", "HPCAI_CONTAINER", "I_MPI_PMI_LIBRARY",
         "PYTHONPATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "PYTHONHOME")


def job_env(cache: Path, **extra: str) -> dict[str, str]:
    """The env added to every command: this venv first on PATH, a private hpcai cache."""
    return {"PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", os.defpath),
            "HPCAI_CACHE": str(cache), **extra}


def run(cluster: LocalCluster, argv: list[str], env: dict[str, str], cwd: Path,
        timeout: float = 180) -> subprocess.CompletedProcess:
    unset = tuple(k for k in UNSET if k not in env and k not in cluster.env)
    try:
        return cluster.run(argv, timeout=timeout, env=env, unset=unset, cwd=str(cwd))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{shlex.join(argv)} did not finish in {timeout} s\n"
                    f"stdout: {exc.stdout!r}\nstderr: {exc.stderr!r}\n{cluster.log_tails()}")


def ok(cluster: LocalCluster, argv: list[str], env: dict[str, str], cwd: Path,
       timeout: float = 180) -> subprocess.CompletedProcess:
    result = run(cluster, argv, env, cwd, timeout)
    assert result.returncode == 0, (f"{shlex.join(argv)} exited {result.returncode}\n"
                                    f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def submit(cluster: LocalCluster, script: Path, env: dict[str, str], cwd: Path,
           args: tuple[str, ...] = (), timeout: float = 600) -> tuple[str, str]:
    """``sbatch [args] SCRIPT``, poll until the job ends; (``JobState ExitCode``, output)."""
    out = cwd / "job.out"
    job = ok(cluster, ["sbatch", "--parsable", "-o", str(out), *args, str(script)], env,
             cwd).stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        show = run(cluster, ["scontrol", "-o", "show", "job", job], env, cwd)
        fields = dict(f.split("=", 1) for f in show.stdout.split() if "=" in f)
        state = fields.get("JobState", "")
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return f"{state} {fields.get('ExitCode', '')}", _read(out)
        time.sleep(0.5)
    run(cluster, ["scancel", job], env, cwd)
    pytest.fail(f"batch job {job} did not end in {timeout} s (last state {state})\n"
                f"{_read(out)[-3000:]}\n{cluster.log_tails()}")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def copy_rank_report(workdir: Path) -> Path:
    """The ``sitecustomize`` that makes every MPI process print a ``rank-report`` line,
    copied into ``workdir`` (which containers see at /opt/hpcai/work)."""
    target = workdir / "rank_report"
    shutil.copytree(RANK_REPORT, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def rank_reports(text: str) -> dict[int, dict[str, str]]:
    """``{rank: {host, master, master_ip, libmpi, libpmi}}`` from ``rank-report`` lines."""
    found: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        m = re.match(r"rank-report rank=(\d+) (.*)$", line.strip())
        if m:
            found[int(m.group(1))] = dict(f.split("=", 1) for f in m.group(2).split())
    return found
