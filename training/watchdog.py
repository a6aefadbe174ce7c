"""The stall watchdog: a rank that stops making progress ends the job, named, within a bound.

A frozen rank (SIGSTOP, a hung node) or one stuck in a stalled file system would leave the
others waiting in the next collective forever. So every rank runs a watchdog thread:

- the trainer marks progress by entering phases (``data``, ``step``, ``gradient allreduce``
  (with PyTorch it includes the backward pass that the allreduce overlaps), ``replica
  check``, ``preemption check``, ``epoch end``, ``physics validation`` (3DGAN), ``evaluation
  and records``, ``checkpoint write``, ``checkpoint barrier``) in the same order on every
  rank, so the number of phases entered (``seq``) says how far a rank got
  (the one phase of rank 0 alone, ``physics plots`` when a preempted run stops, comes after
  the last collective, while the others finish);
- every beat (a sixtieth of the bound, 0.25 to 1 s) the thread sends a heartbeat - rank, seq,
  global step, phase, seconds in it - to the monitors, ranks 0 and 1, with non-blocking
  point-to-point messages on its own duplicate of the communicator: nothing there waits for
  a peer, and a frozen rank's heartbeats simply stop;
- a monitor estimates how long each rank has been without progress (its last heartbeat's
  seconds in the phase plus the silence since). When that exceeds the bound for any rank,
  the stalled rank is the one that got least far (:func:`stalled_rank`), and the monitor
  prints ``error: rank R on HOST made no progress for N s (step S, phase P)`` and calls
  ``MPI_Abort``. Rank 1 acts only a grace period (5 s or more) later, as rank 0 may be the
  frozen one; any other rank, which knows only itself, after twice that. A rank that finds
  it did not run for a while (it was the frozen one) distrusts what it heard before and
  stays quiet for a grace period: the others are ending the job.

The bound is ``--stall-timeout`` seconds or, by default, :data:`WARMUP_S` until this process
has done its second step and in a phase entered for the first time (the first step traces
and warms up, the first evaluation traces too), else max(:data:`FLOOR_S`,
:data:`STEP_FACTOR` x the longest step after the first). It covers the training from the
first step to the end: steps, the per-step preemption allreduce, epoch ends, checkpoint
writing and its barrier (data generation and the set-up before the first step are not
watched).
:meth:`Watchdog.finish` ends the threads collectively: the monitors receive every rank's last
heartbeat, so no message is left behind at ``MPI_Finalize``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import astuple, dataclass

from .faults import EXIT_STALLED, abort_on_error

WARMUP_S = 300.0     # until the second step is done, and a phase's first time
FLOOR_S = 60.0
STEP_FACTOR = 10.0
MONITORS = (0, 1)
TAG = 7311           # heartbeats, on the watchdog's own communicator
TICK_S = 0.1


@dataclass(frozen=True)
class Beat:
    """A rank's progress, as its heartbeat carries it."""

    rank: int
    seq: int          # phases entered so far: the same sequence on every rank
    step: int         # global step
    phase: str
    idle_s: float     # seconds in the phase when sent
    finished: bool = False


@dataclass(frozen=True)
class Stall:
    """The rank that made no progress, as one rank sees it."""

    beat: Beat        # its last heartbeat
    idle_s: float     # without progress until now (as last heard)
    silent_s: float   # since its last heartbeat


def stalled_rank(heard: dict[int, tuple[Beat, float]], now: float, bound: float,
                 silence_s: float) -> Stall | None:
    """The stalled rank, once some unfinished rank has been without progress for more than
    ``bound`` seconds; None before. ``heard`` maps a rank to its last heartbeat and the
    (monotonic) time it arrived. The stalled rank is the one that got least far (lowest
    ``seq``): the others wait for it in a later collective; among equals, one not heard from
    for more than ``silence_s`` (frozen), then the one without progress longest."""
    live = {r: (b, t) for r, (b, t) in heard.items() if not b.finished}
    idle = {r: b.idle_s + (now - t) for r, (b, t) in live.items()}
    if not idle or max(idle.values()) <= bound:
        return None
    rank = min(live, key=lambda r: (live[r][0].seq, now - live[r][1] <= silence_s, -idle[r], r))
    beat, arrived = live[rank]
    return Stall(beat, idle[rank], now - arrived)


class Watchdog:
    """One rank's progress marks (main thread) and its watchdog thread."""

    def __init__(self, comm, timeout_s: float | None) -> None:
        self.comm = comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.timeout_s = timeout_s
        # seq, step, phase, since, first time in the phase: one tuple, replaced whole
        self._where = (0, 0, "start", time.monotonic(), True)
        self._phases: set[str] = set()
        self._step_began = 0.0
        self._steps = 0
        self._longest_s = 0.0   # the longest step after this process's first
        self._finishing = False
        self._done = threading.Event()
        self._side = None
        self._peers: list[tuple[str, int]] = []   # (host, pid) by rank
        self._thread: threading.Thread | None = None

    # -- the bound ------------------------------------------------------------------------
    def bound(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        if self._steps < 2 or self._where[4]:
            return WARMUP_S
        return max(FLOOR_S, STEP_FACTOR * self._longest_s)

    def describe(self) -> str:
        if self.timeout_s == 0:
            return "off"
        if self.timeout_s is not None:
            return f"{self.timeout_s:g} s"
        return (f"auto ({WARMUP_S:g} s at first, then max({FLOOR_S:g} s, {STEP_FACTOR:g} x "
                "the longest step))")

    # -- progress, from the main thread ---------------------------------------------------
    def enter(self, phase: str, step: int | None = None) -> None:
        seq, last_step = self._where[:2]
        first = phase not in self._phases
        self._phases.add(phase)
        self._where = (seq + 1, last_step if step is None else step, phase, time.monotonic(),
                       first)

    def begin_step(self, step: int) -> None:
        """Global step ``step`` starts: its batch is fetched (phase ``data``)."""
        self.enter("data", step)
        self._step_began = self._where[3]

    def end_step(self) -> None:
        """The step is done (before any checkpoint): its time feeds the automatic bound."""
        self._steps += 1
        if self._steps > 1:
            self._longest_s = max(self._longest_s, time.monotonic() - self._step_began)

    def start(self) -> None:
        """Collective: the watchdog's communicator, every rank's host and PID, the thread."""
        if self.timeout_s == 0:
            return
        self._side = self.comm.Dup()
        self._peers = self._side.allgather((socket.gethostname(), os.getpid()))
        self._thread = threading.Thread(target=self._watch, name="hpcai-watchdog",
                                        daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Collective, at the end of training: wait until the monitors have every rank's
        last heartbeat (a rank that never gets here is reported as stalled)."""
        if self._thread is None:
            return
        self.enter("finish")
        self._finishing = True
        self._done.wait()
        self._thread.join()
        self._side.Free()

    # -- the thread -----------------------------------------------------------------------
    def _beat(self, now: float) -> Beat:
        seq, step, phase, since, _ = self._where
        return Beat(self.rank, seq, step, phase, now - since, self._finishing)

    def _watch(self) -> None:
        with abort_on_error(self.comm, "hpcai-train watchdog"):
            self._loop()

    def _loop(self) -> None:
        from mpi4py import MPI

        monitors = [m for m in MONITORS if m < self.world]
        is_monitor = self.rank in monitors
        sends = {m: None for m in monitors if m != self.rank}   # the outstanding heartbeat
        due = dict.fromkeys(sends, 0.0)
        final_sent: set[int] = set()
        last = time.monotonic()
        heard = {r: (Beat(r, 0, 0, "start", 0.0), last) for r in range(self.world)}
        quiet_until = 0.0
        while True:
            time.sleep(TICK_S)
            now = time.monotonic()
            bound = self.bound()
            beat_s = min(1.0, max(0.25, bound / 60))
            silence_s, grace_s = max(2.0, 3 * beat_s), max(5.0, 3 * beat_s)
            if now - last > silence_s:
                # this process did not run (stopped, or starved): what it heard is stale,
                # and the others may be ending the job because of it - look again later
                heard = {r: (b, now) for r, (b, _) in heard.items()}
                quiet_until = now + grace_s
            last = now
            me = self._beat(now)
            for m, request in sends.items():
                if request is not None and not request.Test():
                    continue
                sends[m] = None
                if (me.finished and m not in final_sent) or (not me.finished and now >= due[m]):
                    sends[m] = self._side.isend(astuple(me), dest=m, tag=TAG)
                    due[m] = now + beat_s
                    if me.finished:
                        final_sent.add(m)
            if is_monitor:
                while (message := self._side.improbe(MPI.ANY_SOURCE, TAG)) is not None:
                    beat = Beat(*message.recv())
                    heard[beat.rank] = (beat, now)
                heard[self.rank] = (me, now)
            if (me.finished and len(final_sent) == len(sends)
                    and all(request is None or request.Test() for request in sends.values())
                    and (not is_monitor or all(b.finished for b, _ in heard.values()))):
                self._done.set()
                return
            if now < quiet_until:
                continue
            extra_s = {0: 0.0, 1: grace_s}.get(self.rank, 2 * grace_s)
            stall = stalled_rank(heard if is_monitor else {self.rank: (me, now)}, now,
                                 bound + extra_s, silence_s)
            if stall is not None:
                self._abort(stall, me, bound, is_monitor, silence_s)

    def _abort(self, stall: Stall, me: Beat, bound: float, is_monitor: bool,
               silence_s: float) -> None:
        beat = stall.beat
        host, pid = self._peers[beat.rank]
        where = f"step {beat.step}, phase {beat.phase}"
        waits = f"rank {self.rank} waits in {me.phase} of step {me.step}"
        if not is_monitor:
            why = (f"rank {self.rank} sees only itself, and the monitors that see every rank "
                   f"(ranks {', '.join(str(m) for m in MONITORS if m < self.world)}) did "
                   "not end the job: they are stalled too, or their node is")
        elif beat.rank == self.rank:
            why = f"this rank is stuck in {beat.phase} itself (pid {pid})"
        elif stall.silent_s > silence_s:
            where += f"; last heard {stall.silent_s:.0f} s ago"
            why = f"the process (pid {pid}) is frozen or its node hung; {waits}"
        else:
            why = (f"the process (pid {pid}) is alive but stuck in {beat.phase} (a stalled file "
                   f"system, device or network?); {waits}")
        sys.stderr.write(
            f"error: rank {beat.rank} on {host} made no progress for {stall.idle_s:.0f} s "
            f"({where})\n"
            f"hint: {why}. The bound is {bound:g} s; the job ends (MPI_Abort). Rerun with "
            f"--resume to continue from the last checkpoint; if {beat.phase} legitimately "
            "takes longer, raise --stall-timeout\n")
        sys.stderr.flush()
        self.comm.Abort(EXIT_STALLED)
