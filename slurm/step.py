"""Does the srun that started this step end it when a task fails (``--kill-on-bad-exit``)?

srun exports nothing that says so (tried on the test cluster, Slurm 22.05: neither
``--kill-on-bad-exit`` nor ``-K`` puts ``SLURM_KILL_BAD_EXIT`` into the tasks' environment),
and the decision is srun's alone: it kills the step when a task exits non-zero. So the
answer is read from srun itself, in this order:

1. ``scontrol show step JOB.STEP`` names srun's host and PID (``SrunHost:Pid=vm:27278``);
   when srun runs on this host (a batch script's srun runs on the job's first node, where
   rank 0 is), its command line decides (``-K``, ``-K0``, ``--kill-on-bad-exit[=N]``, an
   abbreviation of it), then ``SLURM_KILL_BAD_EXIT`` in srun's environment;
2. otherwise the cluster default, ``KillOnBadExit`` of ``scontrol show config``, when it
   is 1 (srun on another host may still have the flag: a 0 there proves nothing).

None means "cannot tell" (srun elsewhere, scontrol missing or silent): no warning is given
on a guess. At most two scontrol calls of about 10 ms each, made by rank 0 only.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

LONG_FLAG = "--kill-on-bad-exit"
SHORT_FLAGS_WITHOUT_VALUE = set("luvQsOEHXZk")   # srun's short options that take no value


def flag_in_argv(srun_argv: list[str], program_args: list[str]) -> bool | None:
    """What srun's options say about kill-on-bad-exit (None: not given). ``program_args``:
    the arguments of the program srun started (this process's), which end srun's command
    line; only what comes before them is read, so a program's own ``-K`` is not srun's."""
    words = srun_argv[1:]
    if program_args and words[-len(program_args):] == program_args:
        words = words[:-len(program_args)]
    said: bool | None = None
    for arg in words:
        name, eq, value = arg.partition("=")
        if name.startswith("--kill") and LONG_FLAG.startswith(name):
            said = value != "0" if eq else True
        elif arg.startswith("-") and not arg.startswith("--") and "K" in arg:
            head, _, tail = arg[1:].partition("K")
            if set(head) <= SHORT_FLAGS_WITHOUT_VALUE and (tail == "" or tail.isdigit()):
                said = tail != "0"
    return said


def _scontrol(*args: str, env: dict[str, str]) -> str:
    binary = shutil.which("scontrol", path=env.get("PATH"))
    if binary is None:
        return ""
    try:
        result = subprocess.run([binary, *args], capture_output=True, text=True, timeout=5,
                                env=env, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout if result.returncode == 0 else ""


def _field(text: str, key: str) -> str | None:
    for word in text.split():
        if word.startswith(key + "="):
            return word[len(key) + 1:]
    return None


def _read_proc(pid: str, name: str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace") \
            .split("\0")[:-1]
    except OSError:
        return None


def srun_kills_on_bad_exit(env: dict[str, str], program_args: list[str]) -> bool | None:
    """True/False when it can be told for this step (see the module docstring), else None.
    ``program_args``: this process's arguments (see :func:`flag_in_argv`)."""
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if not job or not step:
        return None
    shown = _scontrol("-o", "show", "step", f"{job}.{step}", env=env)
    host, _, pid = (_field(shown, "SrunHost:Pid") or "").rpartition(":")
    here = socket.gethostname().split(".")[0]
    if pid.isdigit() and host.split(".")[0] == here:
        argv = _read_proc(pid, "cmdline")
        if argv and Path(argv[0]).name == "srun":
            said = flag_in_argv(argv, program_args)
            if said is not None:
                return said
            environ = dict(e.partition("=")[::2] for e in _read_proc(pid, "environ") or [])
            value = environ.get("SLURM_KILL_BAD_EXIT")
            if value is not None:
                return value.strip() not in ("", "0")
            return _cluster_default(env) or False
    return True if _cluster_default(env) else None


def _cluster_default(env: dict[str, str]) -> bool:
    """``KillOnBadExit = 1`` in the cluster's configuration."""
    for line in _scontrol("show", "config", env=env).splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "KillOnBadExit":
            return value.strip() not in ("", "0")
    return False
