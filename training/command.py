"""Which commands are hpcai's training (``train …``, ``hpcai-train …``,
``python -m hpcai.training …``). Imports nothing of hpcai, so the launcher can tell before
it imports the training configuration."""

from __future__ import annotations

import os
import re

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from collections.abc import Sequence

TRAIN_PROGRAMS = ("train", "hpcai-train")
TRAIN_MODULES = ("hpcai.training", "hpcai.training.cli")


def train_arguments(command: Sequence[str]) -> list[str] | None:
    """The arguments of an hpcai training command, or None for any other command."""
    if not command:
        return None
    name = os.path.basename(command[0])
    if name in TRAIN_PROGRAMS:
        return list(command[1:])
    if re.fullmatch(r"python[0-9.]*", name) and len(command) >= 3 and command[1] == "-m" \
            and command[2] in TRAIN_MODULES:
        return list(command[3:])
    return None
