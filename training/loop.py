"""The training engine's entry: checks first, then MPI, then the trainer.

Order of events on every rank:
1. the SIGTERM/SIGUSR1 handler (``faults.Preemption``), so a preemption signal that comes
   early only sets the flag, whatever follows;
2. the checks that need no MPI (``inputs.py``, ``preflight.py``: output directory, data
   layout, comm backend, with ``--resume`` the checkpoint to resume from) - a user error
   stops every rank with `error:`/`hint:` before MPI starts and before anything is written;
3. MPI init (mpi4py: the libmpi the launcher chose), the framework's threads from the
   placement plan; before it, what the engine's communication thread needs from MPI
   (``allreduce.set_thread_env``: the waiting calls of Open MPI and Intel MPI yield the
   core);
4. the trainer (``trainer.py`` with ``torch_trainer.py`` or ``tf_trainer.py`` hooks; the
   TensorFlow path never imports torch): data generated if asked, rank 0's weights
   broadcast and proven bit-identical on all ranks (CRC32), then the epochs under the stall
   watchdog; any exception on any rank aborts the job (MPI_Abort).
"""

from __future__ import annotations

import os

from .config import TrainConfig
from .faults import Preemption
from .inputs import before_mpi


def run(cfg: TrainConfig) -> int:
    """Entry point on every rank. Returns the process exit code."""
    preemption = Preemption().install()
    checked = before_mpi(cfg)   # a UserError here is reported by core.cli.run_main
    cfg = checked.config       # a resume's recipe applied
    if cfg.framework == "tensorflow":
        from .tf_trainer import TfTrainer as Trainer

        _set_tf_threads()
    else:
        if cfg.mpi_overlap and cfg.allreduce_progress != "hook":
            from .allreduce import set_thread_env

            set_thread_env()   # read by MPI when it starts
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
