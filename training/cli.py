"""hpcai-train (also `train`): synchronous data-parallel training over MPI.

Run it under the launcher, which places and binds the ranks:

  hpcai-launch --ranks-per-node 2 -- train 3dgan --generate 2000 --epochs 2 --out run1
  hpcai-launch --ranks-per-node 4 -- train 3dgan --data /scratch/ecal --batch-size 16
  hpcai-launch -N 2 -- train resnet50 --samples 256 --batch-size 32

Each epoch appends one JSON record to OUT/epochs.jsonl (rank 0) and prints a line: epoch
time, compute/communication/data split, samples/s, GFLOP/s and % of peak. Checkpoints go to
OUT/checkpoints; SIGTERM/SIGUSR1 checkpoint and exit 75; --resume continues.
"""

from __future__ import annotations

import sys

from hpcai.launcher.errors import UserError


def main(argv: list[str] | None = None) -> int:
    from .config import parse
    from .loop import report_before_mpi, run

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse(argv)
    except UserError as exc:
        return report_before_mpi(exc)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
