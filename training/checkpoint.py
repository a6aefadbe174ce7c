"""Checkpoints that are never half-written, and resume from the newest good one.

Rank 0 writes ``ckpt-E{epoch:04d}-S{step:06d}.pt`` (epoch and the next step to run) to a
temporary file in the same directory, fsyncs it, renames it into place and fsyncs the
directory; only then are old ones beyond ``keep`` removed. On ``--resume``
(:func:`load_for_resume`) a newer file that fails to load (a crash of the file system, a
truncated copy) is skipped with a warning for an older one that loads; when there are
checkpoints and none of them loads, that is an error, never a silent start from scratch.
:func:`check_resumable` finds that error without torch (the launcher's pre-flight).

The framework's trainer says how a state is written: PyTorch runs write with ``torch.save``
(a zip archive), TensorFlow runs a plain pickle of NumPy arrays (:func:`write_pickle`).
Reading runs no code from the file: :func:`read` reads both (``torch.load`` with
``weights_only=True``, torch imported for a ``torch.save`` file only);
:func:`read_without_torch`, the TensorFlow runs' reader, reads both without torch
(TensorFlow checkpoints of earlier versions were ``torch.save`` files of NumPy arrays, and
of a PyTorch checkpoint it reads enough, all but the tensors, to say who wrote it) through
an allow-list unpickler (:class:`_Restricted`): Python's containers and scalars, NumPy
arrays and scalars; any other global in the file is refused.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import sys
import zipfile
from pathlib import Path
from typing import BinaryIO, Callable

from ..core.errors import UserError

_NAME = re.compile(r"ckpt-E(\d{4})-S(\d{6})\.pt$")


def checkpoint_name(epoch: int, step: int) -> str:
    return f"ckpt-E{epoch:04d}-S{step:06d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.search(p.name)]
    return sorted(found, key=lambda p: tuple(int(g) for g in _NAME.search(p.name).groups()))


def save(directory: Path, state: dict, epoch: int, step: int, *,
         write: Callable[[dict, BinaryIO], None], keep: int = 3) -> Path:
    """Write ``state`` with ``write(state, handle)`` atomically as the checkpoint of
    (epoch, step); keep the newest ``keep``."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(epoch, step)
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as handle:
        write(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def load_for_resume(directory: Path, framework: str) -> tuple[Path, dict] | None:
    """The newest checkpoint in ``directory`` that loads, read as a ``framework`` run reads
    it; None when there is no checkpoint yet. Raises :class:`UserError` when there are
    checkpoints and none of them loads."""
    found = list_checkpoints(directory)
    read_one = read if framework == "pytorch" else read_without_torch
    failures = []
    for path in reversed(found):
        try:
            return path, read_one(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is skipped
            failures.append(f"{path.name}: {_reason(exc)}")
            print(f"warning: skipping unreadable checkpoint {path}: {_reason(exc)}",
                  file=sys.stderr)
    if not failures:
        return None
    raise _none_readable(directory, failures)


def check_resumable(directory: Path) -> None:
    """What :func:`load_for_resume` refuses, found without torch and without printing:
    checkpoints in ``directory``, and none of them reads. A ``torch.save`` file is read as
    a zip archive whose members' CRCs hold and whose pickle :func:`read_without_torch`
    reads; its tensors are not loaded, so a file that passes may still be refused by
    :func:`load_for_resume` (a member torch cannot use)."""
    failures = []
    for path in reversed(list_checkpoints(directory)):
        try:
            if zipfile.is_zipfile(path):
                with zipfile.ZipFile(path) as archive:
                    bad = archive.testzip()
                if bad is not None:
                    raise zipfile.BadZipFile(f"{bad} fails its CRC check")
            read_without_torch(path)
            return
        except Exception as exc:  # noqa: BLE001 - as load_for_resume: any unreadable file
            failures.append(f"{path.name}: {_reason(exc)}")
    if failures:
        raise _none_readable(directory, failures)


def _none_readable(directory: Path, failures: list[str]) -> UserError:
    return UserError(
        f"--resume: none of the {len(failures)} checkpoint(s) in {directory} can be read "
        f"({'; '.join(failures)})",
        "a truncated or corrupt file (a crash while copying, a full or failing file system) "
        "or not a checkpoint of this program; nothing was trained. Restore a good copy, or "
        "move the file(s) away to start from scratch (or use a new --out)")


def _reason(exc: Exception) -> str:
    """The exception in one line (torch's weights-only message is a page long)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def write_pickle(state: dict, handle: BinaryIO) -> None:
    pickle.dump(state, handle, protocol=pickle.HIGHEST_PROTOCOL)


def read(path: Path) -> dict:
    """A checkpoint of either format, tensors included."""
    if zipfile.is_zipfile(path):
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)
    return read_without_torch(path)


def read_without_torch(path: Path) -> dict:
    """A checkpoint of either format, without importing torch; tensors of a ``torch.save``
    file come back as None."""
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as handle:
            return _Restricted(handle).load()
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        return _Restricted(io.BytesIO(archive.read(name))).load()


_ALLOWED = {
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),   # bytes in protocol 2 pickles (torch.save's)
    ("numpy", "ndarray"), ("numpy", "dtype"),
    *((f"numpy.{core}.multiarray", name) for core in ("core", "_core")
      for name in ("_reconstruct", "scalar")),
    *((f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")),
}


class _Restricted(pickle.Unpickler):
    """Unpickles only Python's containers and scalars, NumPy arrays and scalars: a
    checkpoint cannot run code.
    ``torch.save``'s ``data.pkl`` reads too: torch's rebuild functions and its storages
    (persistent ids) become None."""

    def find_class(self, module: str, name: str):
        if module == "torch" or module.startswith("torch."):
            return _none
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint")

    def persistent_load(self, pid):
        return None


def _none(*_args, **_kwargs) -> None:
    return None
