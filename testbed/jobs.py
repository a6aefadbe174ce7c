"""Training jobs started in the background: their rank processes found in /proc, by a tag."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable

from rigenv import base_env, run


def train(ranks: int, *args: str, env: dict | None = None, timeout: float = 300):
    return run(["hpcai-launch", "-N", str(ranks), "--", "train", *args], env or base_env(),
               timeout=timeout)


def rank_pids(tag: str) -> dict[int, int]:
    """PIDs of the ranks a test started (``HPCAI_TEST_TAG`` in their environment), by rank.
    A rank's own children inherit its environment (``train`` runs ``git`` in its
    ``training/`` folder for the records' provenance): a match whose parent matched too is
    such a child, not the rank."""
    candidates = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if f"HPCAI_TEST_TAG={tag}".encode() in env and b"train" in cmd \
                and b"hpcai.launcher" not in cmd and b"mpirun" not in cmd:
            for item in env:
                if item.startswith(b"RANK="):
                    candidates[int(entry.name)] = (int(item[5:]), parent)
    return {rank: pid for pid, (rank, parent) in candidates.items() if parent not in candidates}


def start(out: Path, *args: str, tag: str, ranks: int = 2):
    """``hpcai-launch -N ranks -- train ARGS --out OUT`` in the background, output to
    OUT.log (next to OUT)."""
    log = open(out.parent / f"{out.name}.log", "w")
    proc = subprocess.Popen(["hpcai-launch", "-N", str(ranks), "--", "train", *args,
                             "--out", str(out)], env=base_env(HPCAI_TEST_TAG=tag),
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, Path(log.name)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    """The process runs (a zombie or a PID that is gone does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def pid_files(out: Path) -> list[int]:
    """The PIDs a test program's ranks wrote to OUT/<rank>.pid."""
    return [int(p.read_text()) for p in out.glob("*.pid")]


def end_left(pids: Iterable[int], wait_s: float = 0.0) -> list[int]:
    """Those of ``pids`` (processes the test started) still running after up to ``wait_s``
    seconds (a launcher may exit while its kills are under way), killed with SIGKILL."""
    pids = list(pids)
    deadline = time.monotonic() + wait_s
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def both_ranks(tag: str) -> dict[int, int]:
    return wait_for(lambda: (p := rank_pids(tag)) and len(p) == 2 and p, 60, "both ranks")
