"""The checks before MPI on every rank, and what they found for the trainer.

:func:`before_mpi` runs ``preflight.check_inputs`` (output directory, data layout) and the
checks of the framework, comm backend and device, and with ``--resume`` reads the checkpoint
to resume from: a user error stops every rank with `error:`/`hint:` before MPI starts and
before anything is written, and only rank 0 says it (:func:`report_before_mpi`). What the
checks found (:class:`Checked`) goes to the trainer; this module sits below both ``loop.py``
and ``trainer.py`` and imports neither.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.cli import say_error
from ..core.errors import UserError

from . import checkpoint, recipes
from .config import TrainConfig, check_comm, check_device, check_framework
from .preflight import check_inputs

if TYPE_CHECKING:
    from .shower_data import DatasetIndex


@dataclass(frozen=True)
class Checked:
    """What the checks before MPI found."""

    config: TrainConfig                      # the settings to run (a resume's recipe applied)
    index: DatasetIndex | None               # the 3DGAN's --data training files, validated
    held_out: DatasetIndex | None            # and its held-out files (--test-files)
    resume_from: tuple[Path, dict] | None    # --resume: the checkpoint and its state
    note: str | None = None                  # for rank 0 to print (a resume's recipe)


def rank_from_env() -> int:
    """This process's rank as the MPI launcher's environment says (0 when none does)."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def report_before_mpi(exc: UserError) -> None:
    """Every rank hit the same user error before MPI started: only rank 0 says it."""
    if rank_from_env() == 0:
        say_error(exc)


def before_mpi(cfg: TrainConfig) -> Checked:
    """Every check that can fail on bad input, before MPI and before writing anything."""
    if cfg.framework == "tensorflow":   # before anything imports TensorFlow (Horovod may)
        # errors only: TF's graph optimiser logs "remapper failed" as an error for the
        # 3DGAN's LeakyReLU gradients and goes on without that fusion (0 shows everything)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    check_framework(cfg)
    check_comm(cfg.comm, cfg.framework)
    check_device(cfg)
    index, held_out = check_inputs(cfg)
    resume_from = (checkpoint.load_for_resume(cfg.checkpoint_dir, cfg.framework)
                   if cfg.resume else None)
    note = None
    if resume_from is not None:
        values, note = recipes.for_resume(cfg.to_dict(), resume_from[1].get("config", {}))
        cfg = dataclasses.replace(cfg, **values)
    return Checked(cfg, index, held_out, resume_from, note)

