"""The learning rate at a step: optional linear warm-up, then one of :data:`DECAYS`."""
from __future__ import annotations

import math
from typing import Callable

STEP_AT, STEP_FACTOR = 0.8, 0.1   # --lr-decay step: from 80 % of the steps on, a tenth

# after the warm-up: the share of the peak rate at ``progress`` (0 at the warm-up's end,
# 1 at the last step); ``train --lr-decay`` offers these names
DECAYS: dict[str, Callable[[float], float]] = {
    "none": lambda progress: 1.0,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    # the full rate for the first four fifths, a tenth of it for the last fifth: a GAN's
    # constant-rate swings settle where they are (measured for the 3DGAN, README)
    "step": lambda progress: 1.0 if progress < STEP_AT else STEP_FACTOR,
}


def learning_rate(done: int, total: int, warm_steps: float, base: float, target: float,
                  decay: str = "none") -> float:
    """The rate for the step after ``done`` steps of ``total``.

    During the warm-up (``done < warm_steps``) the rate rises linearly from ``base`` (the
    per-rank rate) to ``target`` (scaled by the world size). After it, ``decay`` "none" keeps
    ``target``; "cosine" follows half a cosine from ``target`` at the warm-up's end to 0 at
    ``total`` steps, so the last step still moves (its rate is above 0)."""
    if warm_steps > 0 and done < warm_steps:
        return base + (target - base) * done / warm_steps
    if decay not in DECAYS:
        raise ValueError(f"unknown learning-rate decay {decay!r}")
    span = total - warm_steps
    if span <= 0:
        return target
    progress = min(max((done - warm_steps) / span, 0.0), 1.0)
    return target * DECAYS[decay](progress)
