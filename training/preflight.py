"""A ``train`` command's inputs, checked without a framework and without MPI.

:func:`check_inputs` is what every rank checks first (``inputs.before_mpi`` runs it, then the
framework's own checks): the output directory can be written, the 3DGAN has a data source
and its ``--data`` files have the layout it reads, and with ``--resume`` a checkpoint in
``OUT/checkpoints`` can be read. :func:`preflight` parses a whole command line and runs the
same checks, so ``hpcai-launch``, ``sbatch`` and ``sweep`` refuse bad input once, with the
ranks' own ``error:``/``hint:``, before any rank starts.

Importing this module imports neither torch nor TensorFlow; checking ``--data`` imports
NumPy and h5py. The checkpoint is checked as a file (:func:`.checkpoint.check_resumable`:
a zip archive's CRCs and its pickle, tensors not loaded); that torch can use its tensors is
found by the ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..core.errors import UserError
from . import checkpoint
from .config import TrainConfig, check_command, check_output_dir

if TYPE_CHECKING:
    from .shower_data import DatasetIndex


def preflight(command: Sequence[str], program: str | None = None, *,
              inputs: bool = True) -> TrainConfig | None:
    """:func:`.config.check_command`, then (``inputs``) :func:`check_inputs` with
    ``--resume``'s checkpoint checked as a file. None for a command that is not hpcai's
    training (see ``check_command``). Reads the data files' metadata; writes nothing."""
    cfg = check_command(command, program)
    if cfg is not None and inputs:
        check_inputs(cfg)
        if cfg.resume:
            checkpoint.check_resumable(cfg.checkpoint_dir)
    return cfg


def check_inputs(cfg: TrainConfig) -> tuple[DatasetIndex | None, DatasetIndex | None]:
    """The output directory, then :func:`data_index`."""
    check_output_dir(cfg.out_dir)
    return data_index(cfg)


def data_index(cfg: TrainConfig) -> tuple[DatasetIndex | None, DatasetIndex | None]:
    """The 3DGAN's ``--data``: (training files, held-out files), validated; ``--generate``
    and the other models: (None, None). UserError without a data source."""
    if cfg.model != "3dgan":
        return None, None
    if cfg.data:
        from .shower_data import find_files, split_files, validate

        return split_files(validate(find_files(cfg.data)), cfg.test_files)
    if cfg.generate_events <= 0:
        raise UserError("3dgan needs data: --data DIR (Ele*_*.h5 files) or --generate EVENTS",
                        "e.g. train 3dgan --generate 2000 (synthetic showers into OUT/data)")
    return None, None
