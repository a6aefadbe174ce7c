"""Trace and time one rank's ``hpcai-launch`` wrapper; count its file-system calls by place.

As a program, run by srun or mpirun in place of the wrapper:

    python startup_trace.py trace OUTDIR -- hpcai-launch ... -- CMD   # strace -f -y
    python startup_trace.py time OUTDIR -- hpcai-launch ... -- CMD    # wall and CPU

writes ``OUTDIR/rank-<rank>.trace`` or ``.json``. The wrapper's work ends where it execs the
command (CMD should be a program that does nothing, e.g. ``/bin/true``): :func:`parse` cuts
the trace there, and ``time`` reads the CPU time of the wrapper (children included) with
``wait4`` after a command that costs next to nothing.

As a module: :func:`parse` counts a trace's calls that name a file (by path, or by an fd
that strace's ``-y`` resolves) per :class:`Places` category, and lists the programs the
wrapper ran and the directories it listed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field

_LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)$")
_PATH = re.compile(r'^(?:AT_FDCWD(?:<[^>]*>)?, |\d+<[^>]*>, )?"([^"]*)"')
_FD = re.compile(r"^-?\d+<([^>]*)>")
METADATA = {"open", "openat", "openat2", "stat", "lstat", "newfstatat", "statx", "access",
            "faccessat", "faccessat2", "readlink", "readlinkat", "execve", "getdents64",
            "getdents", "statfs", "mkdir", "mkdirat", "unlink", "unlinkat", "rename",
            "renameat", "renameat2", "symlink", "symlinkat", "chdir", "getcwd"}


def rank_id(env: dict[str, str]) -> str:
    for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in env:
            return env[name]
    return "x"


def run_rank(mode: str, outdir: str, argv: list[str]) -> int:
    """Trace (``strace -f -y``, exec'd in place) or time (fork, exec, ``wait4``) a rank."""
    rank = rank_id(dict(os.environ))
    if mode == "trace":
        out = os.path.join(outdir, f"rank-{rank}.trace")
        os.execvp("strace", ["strace", "-f", "-qq", "-y", "-s", "8", "-o", out, *argv])
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    with open(os.path.join(outdir, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
                   "exit": os.waitstatus_to_exitcode(status)}, f)
    return os.waitstatus_to_exitcode(status)


@dataclass(frozen=True)
class Places:
    """Categories of paths, most specific first: (name, prefixes). A prefix is a directory
    (the path or anything under it), or ends in ``*`` (any path that starts with it)."""

    categories: tuple[tuple[str, tuple[str, ...]], ...]

    def classify(self, path: str) -> str:
        for name, prefixes in self.categories:
            if any(path.startswith(p[:-1]) if p.endswith("*") else
                   path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes):
                return name
        return "node-local"


@dataclass
class RankTrace:
    """One rank's wrapper: file-system calls per category and syscall, what it ran."""

    calls: dict[str, int] = field(default_factory=dict)            # category -> count
    metadata: dict[str, int] = field(default_factory=dict)         # category -> path lookups
    syscalls: dict[str, dict[str, int]] = field(default_factory=dict)  # category -> name -> n
    programs: list[str] = field(default_factory=list)              # execve'd by children
    listed: list[str] = field(default_factory=list)                # directories read
    reached_exec: bool = False

    def to_dict(self) -> dict:
        return {"calls": self.calls, "metadata": self.metadata, "syscalls": self.syscalls,
                "programs": self.programs, "listed_dirs": len(set(self.listed)),
                "reached_exec": self.reached_exec}


def parse(text: str, places: Places, command: str) -> RankTrace:
    """Count the wrapper's file-system calls (up to its exec of ``command``, matched by
    base name) per category; a call counts when it names a path or a file's fd."""
    out = RankTrace()
    main: str | None = None
    pending: dict[str, str] = {}      # pid -> program of an execve not finished yet
    for line in text.splitlines():
        resumed = re.match(r"^(\d+)\s+<\.\.\. execve resumed>.*= 0$", line)
        if resumed and resumed.group(1) in pending:
            if _ran(out, pending.pop(resumed.group(1)), resumed.group(1) == main, command):
                break
            continue
        m = _LINE.match(line)
        if not m:
            continue
        pid, name, args = m.groups()
        main = main or pid
        if name == "execve":
            path = _PATH.match(args)
            program = path.group(1) if path else "?"
            if line.rstrip().endswith("<unfinished ...>"):
                pending[pid] = program
            elif line.rstrip().endswith("= 0") and _ran(out, program, pid == main, command):
                break
        named = _PATH.match(args)
        if named is None or not named.group(1).startswith("/"):
            named = _FD.match(args)
        if named is None or not named.group(1).startswith("/"):
            continue
        file = named.group(1)
        where = places.classify(file)
        out.calls[where] = out.calls.get(where, 0) + 1
        if name in METADATA:
            out.metadata[where] = out.metadata.get(where, 0) + 1
        per = out.syscalls.setdefault(where, {})
        per[name] = per.get(name, 0) + 1
        if name.startswith("getdents"):
            out.listed.append(file)
    return out


def _ran(out: RankTrace, program: str, by_main: bool, command: str) -> bool:
    """Note a successful execve; True when it is the wrapper's exec of ``command``."""
    if by_main:
        if os.path.basename(program) == command:
            out.reached_exec = True
            return True
        return False
    out.programs.append(program)
    return False


if __name__ == "__main__":
    if len(sys.argv) < 5 or sys.argv[1] not in ("trace", "time") or sys.argv[3] != "--":
        sys.exit("usage: startup_trace.py trace|time OUTDIR -- ARGV...")
    sys.exit(run_rank(sys.argv[1], sys.argv[2], sys.argv[4:]))
