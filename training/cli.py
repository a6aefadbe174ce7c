"""hpcai-train (also `train`): synchronous data-parallel training over MPI.

Run it under the launcher, which places and binds the ranks:

  hpcai-launch --ranks-per-node 2 -- train 3dgan --generate 2000 --epochs 2 --out run1
  hpcai-launch --ranks-per-node 4 -- train 3dgan --data /scratch/ecal --batch-size 16
  hpcai-launch -N 2 -- train resnet50 --samples 256 --batch-size 32

Each epoch appends one JSON record to OUT/epochs.jsonl (rank 0; `hpcai-launch report OUT`
shows them) and prints a short line: epoch time, samples/s, % of peak, the main losses and
the worst held-out energy bin (console.py). Checkpoints go to OUT/checkpoints; SIGTERM/SIGUSR1
checkpoint and exit 75; --resume continues.
"""

from __future__ import annotations

import sys

from ..core.cli import run_main


def main(argv: list[str] | None = None) -> int:
    from .inputs import report_before_mpi

    return run_main(_train, argv, report=report_before_mpi)


def _train(argv: list[str]) -> int:
    from .config import parse
    from .loop import run

    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
