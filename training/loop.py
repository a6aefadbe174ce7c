"""The training engine's entry: checks first, then MPI, then the trainer.

Order of events on every rank:
1. the SIGTERM/SIGUSR1 handler (``faults.Preemption``), so a preemption signal that comes
   early only sets the flag, whatever follows;
2. checks that need no MPI (output directory, data layout, comm backend, with ``--resume``
   the checkpoint to resume from) - a user error stops every rank with `error:`/`hint:`
   before MPI starts and before anything is written;
3. MPI init (mpi4py: the libmpi the launcher chose), the framework's threads from the
   placement plan;
4. the trainer (``trainer.py`` with ``torch_trainer.py`` or ``tf_trainer.py`` hooks; the
   TensorFlow path never imports torch): data generated if asked, rank 0's weights
   broadcast and proven bit-identical on all ranks (CRC32), then the epochs under the stall
   watchdog; any exception on any rank aborts the job (MPI_Abort).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.cli import say_error
from ..core.errors import UserError

from . import checkpoint
from .config import TrainConfig, check_comm, check_device, check_framework
from .faults import Preemption
from .preflight import check_inputs

if TYPE_CHECKING:
    from .shower_data import DatasetIndex


@dataclass(frozen=True)
class Checked:
    """What the checks before MPI found."""

    index: DatasetIndex | None               # the 3DGAN's --data training files, validated
    held_out: DatasetIndex | None            # and its held-out files (--test-files)
    resume_from: tuple[Path, dict] | None    # --resume: the checkpoint and its state


def _rank_from_env() -> int:
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def report_before_mpi(exc: UserError) -> None:
    """Every rank hit the same user error before MPI started: only rank 0 says it."""
    if _rank_from_env() == 0:
        say_error(exc)


def preflight(cfg: TrainConfig) -> Checked:
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
    return Checked(index, held_out, resume_from)


def run(cfg: TrainConfig) -> int:
    """Entry point on every rank. Returns the process exit code."""
    preemption = Preemption().install()
    checked = preflight(cfg)   # a UserError here is reported by core.cli.run_main
    if cfg.framework == "tensorflow":
        from .tf_trainer import TfTrainer as Trainer

        _set_tf_threads()
    else:
        from .torch_trainer import TorchTrainer as Trainer

        _set_threads()
    from mpi4py import MPI

    from .faults import abort_on_error

    comm = MPI.COMM_WORLD
    with abort_on_error(comm):
        return Trainer(cfg, comm, checked, preemption).fit()
    return 1  # not reached: abort_on_error aborts


def _planned_threads(default: int) -> tuple[int, int]:
    """(intra-op, inter-op) threads from the placement plan's rank environment."""
    intra = int(os.environ.get("HPCAI_INTRA_OP_THREADS") or os.environ.get("OMP_NUM_THREADS")
                or default)
    return intra, int(os.environ.get("HPCAI_INTER_OP_THREADS", "1"))


def _set_threads() -> int:
    import torch

    threads, inter = _planned_threads(torch.get_num_threads())
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(inter)
    except RuntimeError:
        pass  # already set (a parallel op ran first)
    return threads


def _set_tf_threads() -> tuple[int, int]:
    """TensorFlow's intra-op / inter-op pools (before TensorFlow runs any op)."""
    import tensorflow as tf

    intra, inter = _planned_threads(os.cpu_count() or 1)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    except RuntimeError:
        pass  # TensorFlow already initialised its runtime (a second trainer in one process)
    return intra, inter
