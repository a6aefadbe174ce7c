"""Checkpoints that are never half-written, and resume from the newest good one.

Rank 0 writes ``ckpt-E{epoch:04d}-S{step:06d}.pt`` (epoch and the next step to run) to a
temporary file in the same directory, fsyncs it, renames it into place and fsyncs the
directory; only then are old ones beyond ``keep`` removed. A file that fails to load (a
crash of the file system, a truncated copy) is skipped with a warning on resume.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

_NAME = re.compile(r"ckpt-E(\d{4})-S(\d{6})\.pt$")


def checkpoint_name(epoch: int, step: int) -> str:
    return f"ckpt-E{epoch:04d}-S{step:06d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.search(p.name)]
    return sorted(found, key=lambda p: tuple(int(g) for g in _NAME.search(p.name).groups()))


def save(directory: Path, state: dict, epoch: int, step: int, keep: int = 3) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(epoch, step)
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as handle:
        torch.save(state, handle)
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


def load_latest(directory: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads, or None."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is skipped
            print(f"warning: skipping unreadable checkpoint {path}: {exc}", file=sys.stderr)
    return None
