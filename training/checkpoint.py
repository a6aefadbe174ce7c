"""Checkpoints that are never half-written, and resume from the newest good one.

Rank 0 writes ``ckpt-E{epoch:04d}-S{step:06d}.pt`` (epoch and the next step to run) to a
temporary file in the same directory, fsyncs it, renames it into place and fsyncs the
directory; only then are old ones beyond ``keep`` removed. A file that fails to load (a
crash of the file system, a truncated copy) is skipped with a warning on resume.

The framework's trainer says how a state is written and read: PyTorch runs write with
``torch.save`` (a zip archive), TensorFlow runs a plain pickle of NumPy arrays
(:func:`write_pickle`). :func:`read` reads both (torch is imported for a ``torch.save``
file only); :func:`read_without_torch`, the TensorFlow runs' reader, reads both without
torch: TensorFlow checkpoints of earlier versions were ``torch.save`` files of NumPy arrays,
and of a PyTorch checkpoint it reads enough (all but the tensors) to say who wrote it.
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


def load_latest(directory: Path, read: Callable[[Path], dict]) -> tuple[Path, dict] | None:
    """The newest checkpoint that ``read(path)`` loads, or None."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, read(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is skipped
            print(f"warning: skipping unreadable checkpoint {path}: {exc}", file=sys.stderr)
    return None


def write_pickle(state: dict, handle: BinaryIO) -> None:
    pickle.dump(state, handle, protocol=pickle.HIGHEST_PROTOCOL)


def read(path: Path) -> dict:
    """A checkpoint of either format, tensors included."""
    if zipfile.is_zipfile(path):
        import torch

        return torch.load(path, map_location="cpu", weights_only=False)
    return read_without_torch(path)


def read_without_torch(path: Path) -> dict:
    """A checkpoint of either format, without importing torch; tensors of a ``torch.save``
    file come back as None."""
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as handle:
            return pickle.load(handle)
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        return _TensorsAsNone(io.BytesIO(archive.read(name))).load()


class _TensorsAsNone(pickle.Unpickler):
    """Unpickles ``torch.save``'s ``data.pkl``: torch's rebuild functions and its storages
    (persistent ids) become None, everything else loads as saved."""

    def find_class(self, module: str, name: str):
        if module == "torch" or module.startswith("torch."):
            return _none
        return super().find_class(module, name)

    def persistent_load(self, pid):
        return None


def _none(*_args, **_kwargs) -> None:
    return None
