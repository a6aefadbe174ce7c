"""Faults: preemption signals become a checkpoint, a crash on one rank ends all of them.

- SIGTERM and SIGUSR1 (what Slurm sends before preemption or time-out, e.g. with
  ``--signal=USR1@120``) only set a flag; the handler is installed first thing, before MPI
  starts and before data is generated, so an early signal is not fatal. At every step
  boundary the ranks agree on it with a one-integer allreduce, so all of them finish the
  same step, checkpoint and exit with :data:`EXIT_PREEMPTED`.
- :func:`abort_on_error` wraps a rank's work: any exception prints the root cause (rank,
  host, traceback) and calls ``MPI_Abort``, so no other rank is left waiting in a collective.
- A rank that stops making progress (frozen, hung node, stalled file system) is found by the
  stall watchdog (``watchdog.py``), which names it and aborts with :data:`EXIT_STALLED`.
"""

from __future__ import annotations

import signal
import socket
import sys
import traceback
from contextlib import contextmanager

EXIT_PREEMPTED = 75   # EX_TEMPFAIL: "try again later" - the rerun resumes
EXIT_CRASH = 1
EXIT_STALLED = 124    # a rank made no progress within the bound (as timeout(1) exits)


class Preemption:
    """A flag set by SIGTERM/SIGUSR1, agreed on collectively at step boundaries."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signal: int | None = None

    def install(self) -> "Preemption":
        for sig in self.SIGNALS:
            signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, _frame) -> None:
        self.signal = signum

    def agreed(self, comm) -> bool:
        """True on every rank as soon as any rank got a signal (collective)."""
        from mpi4py import MPI

        return bool(comm.allreduce(1 if self.signal is not None else 0, op=MPI.MAX))


@contextmanager
def abort_on_error(comm, label: str = "hpcai-train"):
    """Turn an exception on this rank into a reported MPI_Abort of the whole job."""
    from ..core.errors import UserError

    try:
        yield
    except SystemExit:
        raise
    except UserError as exc:
        # raised on some ranks only, perhaps: no collective here, abort with the usage code
        sys.stderr.write(f"{exc.render()}\n(rank {comm.Get_rank()} on {socket.gethostname()})\n")
        sys.stderr.flush()
        comm.Abort(2)
    except BaseException as exc:  # noqa: BLE001 - every failure must end the job
        rank, host = comm.Get_rank(), socket.gethostname()
        text = "".join(traceback.format_exception(exc))
        sys.stderr.write(f"error: {label}: rank {rank} of {comm.Get_size()} on {host} failed: "
                         f"{type(exc).__name__}: {exc}\n{text}"
                         f"hint: this is the root cause; aborting all ranks (MPI_Abort)\n")
        sys.stderr.flush()
        comm.Abort(EXIT_CRASH)
