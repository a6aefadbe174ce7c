"""An exponential moving average of a module's weights (``train 3dgan --generator-ema``).

After the n-th optimiser step the average is

    avg_n = sum_k (1 - d) d^(n-k) w_k / (1 - d^n)     (k = 1 .. n)

of the weights w_k after each step: exponential weights with time constant about
1 / (1 - d) steps, normalised over the steps so far (Adam's bias correction), so the random
initial weights never enter and avg_1 = w_1. It depends only on the steps taken, not on the
run's length: a shorter run's average is a longer run's at the same step.

Only the parameters are averaged. BatchNorm's moving statistics belong to the weights they
were measured with, not to an average of weights: before the average is used or saved,
:func:`standing_statistics` measures them afresh for the averaged weights, on a fixed set of
inputs (BigGAN's "standing statistics", SWA's ``update_bn``). Every rank holds the same
weights after each step, so every rank's average is the same without any communication.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable

import torch


@torch.no_grad()
def standing_statistics(module: torch.nn.Module, batches: Iterable[torch.Tensor]) -> int:
    """Re-measure every BatchNorm's moving mean and variance of ``module`` as the plain mean
    over forward passes of ``batches`` in training mode (momentum None), leaving its weights,
    momenta and mode as they were. Returns the batches run (0 without BatchNorm)."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return 0
    momenta = [m.momentum for m in norms]
    modes = [(m, m.training) for m in module.modules()]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    module.train()
    count = 0
    try:
        for x in batches:
            module(x)
            count += 1
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        for m, mode in modes:
            m.training = mode
    return count


class WeightAverage:
    """The average of ``module``'s weights; ``inputs()`` yields the batches its BatchNorm
    statistics are measured on (the same every time)."""

    def __init__(self, module: torch.nn.Module, decay: float,
                 inputs: Callable[[], Iterable[torch.Tensor]]) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must lie in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self._inputs = inputs
        self._average = copy.deepcopy(module)
        self._average.requires_grad_(False)
        self._measured = False   # are the BatchNorm statistics the current average's?

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        """Take in ``module``'s weights after one more optimiser step."""
        self.updates += 1
        weight = (1.0 - self.decay) / (1.0 - self.decay ** self.updates)
        for avg, live in zip(self._average.parameters(), module.parameters()):
            avg.lerp_(live.detach(), weight)
        self._measured = False

    def module(self) -> torch.nn.Module:
        """The averaged module, its BatchNorm statistics measured for the averaged weights
        (again only after an update); its mode is the caller's to set."""
        if not self._measured:
            standing_statistics(self._average, self._inputs())
            self._measured = True
        return self._average

    def state_dict(self) -> dict:
        """Decay, updates and the averaged module's state (weights and their statistics)."""
        return {"decay": self.decay, "updates": self.updates,
                "module": {k: v.detach().clone() for k, v in self.module().state_dict().items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["decay"] != self.decay:
            raise ValueError(f"the saved average has decay {state['decay']}, not {self.decay}")
        self._average.load_state_dict(state["module"])
        self.updates = int(state["updates"])
        self._measured = True
