"""Waiting for one rank's serial work without holding a core.

Rank 0 alone generates the data, draws the physics plots, evaluates, writes the records and
the checkpoints, for up to seconds at a time. A blocking ``MPI_Barrier`` makes the other ranks
poll for all that time (Open MPI, MPICH and Intel MPI all busy-wait), each taking a core that
another job, a hyperthread sibling or rank 0's own helper threads could use.
:func:`idle_barrier` waits in ``MPI_Ibarrier`` instead, tested between sleeps that grow to at
most ``MAX_SLEEP_S``: it adds that much latency at most, once per such wait, never per step.
"""

from __future__ import annotations

import time

FIRST_SLEEP_S = 1e-4
MAX_SLEEP_S = 0.01


def idle_barrier(comm, first_sleep_s: float = FIRST_SLEEP_S,
                 max_sleep_s: float = MAX_SLEEP_S) -> int:
    """``comm``'s barrier, the wait spent mostly asleep (a world of one returns at once).
    Returns how many times it tested the request."""
    if comm.Get_size() == 1:
        return 0
    request = comm.Ibarrier()
    sleep, tests = first_sleep_s, 1
    while not request.Test():
        time.sleep(sleep)
        sleep, tests = min(2 * sleep, max_sleep_s), tests + 1
    return tests
