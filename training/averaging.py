"""An exponential moving average of a module's weights (``train 3dgan --generator-ema``).

After the n-th optimiser step the average is

    avg_n = sum_k (1 - d) d^(n-k) w_k / (1 - d^n)     (k = 1 .. n)

of the weights w_k after each step: exponential weights with time constant about
1 / (1 - d) steps, normalised over the steps so far (Adam's bias correction), so the random
initial weights never enter and avg_1 = w_1. It depends only on the steps taken, not on the
run's length: a shorter run's average is a longer run's at the same step.

Only the parameters are averaged. The buffers (BatchNorm's moving statistics, themselves
moving averages) are the live module's, copied in by :meth:`WeightAverage.module` when the
average is used. Every rank holds the same weights after each step, so every rank's average
is the same without any communication.
"""

from __future__ import annotations

import copy

import torch


class WeightAverage:
    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must lie in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self._average = copy.deepcopy(module)
        self._average.requires_grad_(False)

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        """Take in ``module``'s weights after one more optimiser step."""
        self.updates += 1
        weight = (1.0 - self.decay) / (1.0 - self.decay ** self.updates)
        for avg, live in zip(self._average.parameters(), module.parameters()):
            avg.lerp_(live.detach(), weight)

    @torch.no_grad()
    def module(self, live: torch.nn.Module) -> torch.nn.Module:
        """The averaged module, with ``live``'s buffers copied in (its modes are the
        caller's to set)."""
        for avg, buf in zip(self._average.buffers(), live.buffers()):
            avg.copy_(buf)
        return self._average

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates,
                "parameters": [p.detach().clone() for p in self._average.parameters()]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state["decay"] != self.decay:
            raise ValueError(f"the saved average has decay {state['decay']}, not {self.decay}")
        params = list(self._average.parameters())
        if len(params) != len(state["parameters"]):
            raise ValueError("the saved average is of another module")
        for p, saved in zip(params, state["parameters"]):
            p.copy_(saved)
        self.updates = int(state["updates"])
