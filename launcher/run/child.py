"""Starting the planned command: exec it in place of this process, or start it as a child in
a process group of its own that dies with this process; and ending this process as a child
ended. :mod:`.execute` and :mod:`.rankwatch` both use it."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from typing import TYPE_CHECKING

from ...core.errors import UserError

if TYPE_CHECKING:
    import subprocess


def start_child(argv: tuple[str, ...], plan_env: dict[str, str], *,
                dies_by: int = signal.SIGTERM, keep_fds: bool = False) -> subprocess.Popen:
    """``argv`` with this process's environment and ``plan_env``, in a process group of its
    own, sent ``dies_by`` when this process dies (PR_SET_PDEATHSIG). ``keep_fds``: it
    inherits this process's inheritable descriptors (a rank's PMI socket). Raises OSError
    when it cannot be started."""
    import ctypes       # here, not at import: a rank that only execs needs neither
    import subprocess

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return subprocess.Popen(argv, env=with_environ(plan_env), process_group=0,
                            close_fds=not keep_fds,
                            preexec_fn=functools.partial(_die_with_parent, prctl, dies_by,
                                                         os.getpid()))


def end_by_signal(signum: int) -> int:
    """End this process by ``signum``, as its child ended; returns ``128 + signum`` only
    for a signal whose default is not to end the process."""
    with contextlib.suppress(OSError, ValueError):      # SIGKILL cannot be set
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return 128 + signum


def with_environ(plan_env: dict[str, str]) -> dict[str, str]:
    """This process's environment updated with the plan's."""
    env = dict(os.environ)
    env.update(plan_env)
    return env


def _die_with_parent(prctl, signum: int, parent: int) -> None:
    """In the child, before exec: ``signum`` when the parent dies (libc's ``prctl``, looked
    up before the fork), or at once if ``parent`` already died."""
    prctl(1, signum)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


def exec_command(argv: tuple[str, ...], plan_env: dict[str, str]) -> None:
    """Replace this process with ``argv`` (this environment updated with ``plan_env``)."""
    try:
        os.execvpe(argv[0], list(argv), with_environ(plan_env))
    except OSError as exc:
        raise UserError(f"cannot start {argv[0]}: {exc.strerror}",
                        "check that the program exists and is executable") from exc
