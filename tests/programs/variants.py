"""What dp_equivalence.py and keras_dp_equivalence.py share: the communicator a variant runs
on, and ``--each``, several variants one after the other in one MPI job.

``--alone R`` in a variant's arguments runs it on world rank R alone (``MPI.COMM_SELF``: a
world of 1) while the other ranks skip it: the 1-rank reference computed inside a job of W
ranks. Consecutive ``--alone`` variants run at the same time on their ranks, which then meet
in ``training.waits.idle_barrier`` (asleep, not polling a core, while the others finish)
before the next variant that uses every rank, and at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from mpi4py import MPI

from hpcai.training.waits import idle_barrier


def variant_comm(argv: list[str]):
    """The communicator of the variant with arguments ``argv``: ``MPI.COMM_WORLD``; with
    ``--alone R`` ``MPI.COMM_SELF`` on world rank R, and None on the other ranks (they skip
    it)."""
    if "--alone" not in argv:
        return MPI.COMM_WORLD
    if MPI.COMM_WORLD.Get_rank() != int(argv[argv.index("--alone") + 1]):
        return None
    return MPI.COMM_SELF


def run_each(runs: Path, variant: Callable[[list[str]], None]) -> None:
    """``variant(argv)`` for each argument list of the JSON file ``runs``, in order."""
    alone = False
    for argv in json.loads(runs.read_text()):
        if alone and "--alone" not in argv:
            idle_barrier(MPI.COMM_WORLD)
        alone = "--alone" in argv
        variant(argv)
    if alone:
        idle_barrier(MPI.COMM_WORLD)
