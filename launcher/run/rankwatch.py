"""A rank whose launcher would leave the job running when it fails: watch it, abort the job.

Hydra (mpiexec of MPICH and Intel MPI) ends a job when a rank calls ``MPI_Abort``, but a
rank that exits with a failure status before it has started MPI - a container that does not
start, a command that is not there, an import error - leaves the other ranks waiting in
``MPI_Init`` or their first collective until the time limit (:data:`.rankenv.STARTERS`).
So where the launcher that started this rank does not end the job itself
(:func:`.rankenv.abort_fd`), the rank wrapper does not exec the command but runs it as its
child (:func:`run`) and waits:

- the child runs in a process group of its own and is killed if the wrapper dies
  (``PR_SET_PDEATHSIG``). Hydra signals a rank's whole process group; the wrapper passes
  each signal it gets on to the child once;
- the child's exit status becomes the wrapper's. A failure - a status other than 0 and
  :data:`STOPPED` (75, EX_TEMPFAIL: the command stopped on purpose, as the trainer does
  when preempted, and its peers stop with it), or death by a signal the wrapper did not
  pass on - also ends the job: the wrapper says which rank failed on which host and how,
  waits :data:`GRACE_S` (peers that hit the same error say it meanwhile), then asks the
  launcher to abort the job through the PMI-1 socket the rank inherited (``cmd=init``, then
  ``cmd=abort exitcode=N``). mpiexec then ends every rank and exits with N (128 + the
  signal's number for a signal).
- A status after the wrapper has passed on a signal that stops a job (:data:`STOPS`) is the
  command's answer to it (a checkpoint and exit, as asked), never a reason to abort.

The cost is one waiting process per rank, the wrapper's Python. A rank the wrapper cannot
start (no such program) ends the job the same way, with status 127.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from .child import end_by_signal, start_child
from ..job.rankenv import RankInfo

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from typing import NoReturn

STOPPED = 75            # EX_TEMPFAIL: stopped on purpose (hpcai-train's EXIT_PREEMPTED)
GRACE_S = 3.0
CANNOT_START = 127      # as a shell says for a command it cannot run
# The signals a launcher, Slurm or a user sends a job to stop it (or to checkpoint and stop)
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
         signal.SIGUSR2, signal.SIGALRM)
RELAYED = (*STOPS, signal.SIGCONT, signal.SIGTSTP, signal.SIGWINCH)   # ... and the others


def run(argv: tuple[str, ...], plan_env: dict[str, str], info: RankInfo,
        pmi_fd: int) -> NoReturn:
    """Run ``argv`` (with ``plan_env``) as this rank's child, pass signals on, end with its
    status; abort the job through ``pmi_fd`` if it fails (see the module docstring)."""
    relayed: set[int] = set()
    try:        # the child keeps the PMI socket; it dies with this process
        child = start_child(argv, plan_env, dies_by=signal.SIGKILL, keep_fds=True)
    except OSError as exc:
        _fail(info, argv[0], f"could not be started ({exc.strerror})", CANNOT_START, pmi_fd)

    def relay(signum: int, _frame: object) -> None:
        if signum in STOPS:
            relayed.add(signum)
        child.send_signal(signum)

    for sig in RELAYED:
        signal.signal(sig, relay)
    code = child.wait()                     # restarted after each handler (PEP 475)
    if code == 0 or code == STOPPED or (relayed and code > 0):
        os._exit(code)
    if code < 0 and -code in relayed:       # stopped as asked: end the same way, quietly
        _end_by_signal(-code)
    how = (f"exited with status {code}" if code > 0 else
           f"was killed by {signal.Signals(-code).name}")
    _fail(info, argv[0], how, code if code > 0 else 128 - code, pmi_fd)


def _fail(info: RankInfo, program: str, how: str, code: int, pmi_fd: int) -> NoReturn:
    """Say which rank failed, give its peers :data:`GRACE_S` to say the same, abort the
    job through the launcher's PMI (or, if that fails, exit with ``code``)."""
    name = os.path.basename(program)
    host = os.uname().nodename
    _say(f"error: rank {info.rank} of {info.size} on {host}: {name} {how}; "
         f"hpcai-launch aborts the job (its mpiexec would leave the other ranks waiting)\n"
         f"hint: the output of rank {info.rank} above says why {name} failed\n")
    time.sleep(GRACE_S)
    try:
        _pmi_abort(pmi_fd, code)
    except OSError as exc:
        _say(f"warning: rank {info.rank}: the PMI abort failed ({exc}): other ranks may "
             "wait until the job's time limit\n")
    os._exit(code)


def _pmi_abort(fd: int, code: int) -> None:
    """PMI-1's wire protocol on the launcher's socket: init, then abort with ``code``."""
    import socket

    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.settimeout(10)
        sock.sendall(b"cmd=init pmi_version=1 pmi_subversion=1\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(256)
            if not chunk:
                raise ConnectionError("the launcher closed the PMI socket")
            reply += chunk
        sock.sendall(f"cmd=abort exitcode={code}\n".encode())
    finally:
        sock.close()


def _end_by_signal(signum: int) -> NoReturn:
    """End this process by ``signum`` (no core file), as the child ended."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os._exit(end_by_signal(signum))


def _say(text: str) -> None:
    os.write(sys.stderr.fileno(), text.encode())   # one write: no interleaving
