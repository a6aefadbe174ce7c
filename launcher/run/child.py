"""Starting the planned command: exec it in place of this process, or start it as a child in
a process group of its own that dies with this process; and ending this process as a child
ended. :mod:`.execute` and :mod:`.rankwatch` both use it."""

from __future__ import annotations

import contextlib
import os
import signal

from ...core.errors import UserError


class Child:
    """A started child: its process id, signals while it runs, and its exit status."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def send_signal(self, signum: int) -> None:
        """``signum`` to the child, unless it has been waited for (its id may be reused)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def wait(self) -> int:
        """Its exit status, as ``subprocess`` gives it (``-N``: ended by signal N)."""
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)     # restarted after each handler (PEP 475)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def start_child(argv: tuple[str, ...], plan_env: dict[str, str], *,
                dies_by: int = signal.SIGTERM, keep_fds: bool = False) -> Child:
    """``argv`` with this process's environment and ``plan_env``, in a process group of its
    own, sent ``dies_by`` when this process dies (PR_SET_PDEATHSIG). ``keep_fds``: it
    inherits this process's inheritable descriptors (a rank's PMI socket). Raises OSError
    when it cannot be started.

    A fork and exec of its own, as ``subprocess`` does with a ``preexec_fn``, without
    importing ``subprocess`` and its threading and selectors: a launch starts this child
    about 10 ms sooner. The child reports a failed exec's errno through a close-on-exec
    pipe; an empty pipe means the exec happened."""
    import ctypes       # here, not at import: a rank that only execs needs neither

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    env = with_environ(plan_env)
    parent = os.getpid()
    report_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        _exec_child(argv, env, prctl, dies_by, parent, write_fd, keep_fds)
    os.close(write_fd)
    with open(report_fd, "rb") as pipe:
        failed = pipe.read()
    if failed:
        os.waitpid(pid, 0)
        code = int(failed)
        raise OSError(code, os.strerror(code), argv[0])
    return Child(pid)


def _exec_child(argv: tuple[str, ...], env: dict[str, str], prctl, dies_by: int,
                parent: int, write_fd: int, keep_fds: bool) -> None:
    """In the forked child: its own process group, death with the parent, the signals that
    Python ignores back to their defaults, other descriptors closed unless ``keep_fds``,
    then the exec. Never returns: a failure writes its errno to ``write_fd`` and exits."""
    code = 0
    try:
        os.setpgid(0, 0)
        prctl(1, dies_by)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), dies_by)
        for signum in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        if not keep_fds:
            _close_fds_but(write_fd)
        os.execvpe(argv[0], list(argv), env)
    except OSError as exc:
        code = exc.errno or 1
    except BaseException:
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            os.write(write_fd, str(code or 1).encode())
        os._exit(127)


def _close_fds_but(keep: int) -> None:
    """Close every descriptor above 2 but ``keep``: those listed in /proc/self/fd, else the
    whole range (``close_range`` where the C library has it)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        return
    for fd in map(int, names):
        if fd > 2 and fd != keep:
            with contextlib.suppress(OSError):
                os.close(fd)


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


def exec_command(argv: tuple[str, ...], plan_env: dict[str, str]) -> None:
    """Replace this process with ``argv`` (this environment updated with ``plan_env``)."""
    try:
        os.execvpe(argv[0], list(argv), with_environ(plan_env))
    except OSError as exc:
        raise UserError(f"cannot start {argv[0]}: {exc.strerror}",
                        "check that the program exists and is executable") from exc
