"""What rank 0 prints while it trains: one short line per epoch, and progress inside a long one.

The epoch line keeps what a person watches, under :data:`LINE_LIMIT` characters: the epoch,
its time, samples/s, % of peak, the main losses and, after a physics validation, the worst
energy bin of the sampling fraction. Everything else (time split, GFLOP/s, every loss, the
fixed-sample metrics, the whole validation summary) is in ``OUT/epochs.jsonl``, which
``hpcai-launch report RUN_DIR`` shows.

Progress: on a terminal (stdout and stderr both TTYs) a step counter rewritten in place;
otherwise (a log file, or under mpirun, which gives the ranks' stdout a pseudo-terminal but
not their stderr) a line every :func:`progress_every` steps.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import TYPE_CHECKING, Callable, TextIO

if TYPE_CHECKING:
    from .physics import Validation
    from .record import EpochRecord

LINE_LIMIT = 160
PROGRESS_ENV = "HPCAI_PROGRESS_EVERY"   # steps between progress lines (0: none)
PROGRESS_MIN_STEPS = 20   # shorter epochs print no progress lines by default
PROGRESS_LINES = 10       # by default about this many lines in a long epoch
TTY_INTERVAL_S = 0.5      # the in-place counter is redrawn at most this often


def worst_bin(validation: Validation) -> str:
    """The energy bin whose generated sampling fraction (sum of cells / E) is furthest from
    the real one, e.g. "worst sum/E 100-200 GeV -13.8%" (generated / real - 1); "worst
    sum/E -" when no bin has both sides."""
    judged = [b for b in validation.bins if b.sampling_fraction_rel_diff is not None]
    if not judged:
        return "worst sum/E -"
    b = max(judged, key=lambda b: abs(b.sampling_fraction_rel_diff))
    return (f"worst sum/E {b.e_lo_gev:g}-{b.e_hi_gev:g} GeV "
            f"{100 * b.sampling_fraction_rel_diff:+.3g}%")


def epoch_line(r: EpochRecord, keys: tuple[str, ...], physics: str | None = None,
               judged: str | None = None) -> str:
    """The console line of one epoch record, with the losses named in ``keys`` (the task's
    ``loss_keys``); ``physics``: the held-out validation's few words (:func:`worst_bin`), if
    one ran, of the generator ``judged`` names (None: the trained one)."""
    losses = " ".join(f"{k} {r.losses[k]:.3g}" for k in keys if k in r.losses)
    line = (f"epoch {r.epoch}: {r.epoch_time_s:.4g} s, {r.samples_per_s:.4g} samples/s, "
            f"{r.pct_of_peak:.3g}% of {r.precision or 'fp32'} peak")
    if losses:
        line += f" | {losses}"
    if physics:
        line += f" | {judged + ': ' if judged else ''}{physics}"
    return line


def progress_every(steps: int, environ: dict | None = None) -> int:
    """Steps between progress lines in an epoch of ``steps``: ``HPCAI_PROGRESS_EVERY`` if
    set (0: none), else about a tenth of the epoch when it has at least
    :data:`PROGRESS_MIN_STEPS` steps, else 0."""
    value = (os.environ if environ is None else environ).get(PROGRESS_ENV, "").strip()
    if value.isdigit():
        return int(value)
    return math.ceil(steps / PROGRESS_LINES) if steps >= PROGRESS_MIN_STEPS else 0


class Progress:
    """Rank 0's progress through one epoch of ``steps`` steps (``step(done)`` after each)."""

    def __init__(self, epoch: int, steps: int, out: TextIO | None = None,
                 tty: bool | None = None, every: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.epoch, self.steps = epoch, steps
        self.out = sys.stdout if out is None else out
        self.tty = (self.out.isatty() and sys.stderr.isatty()) if tty is None else tty
        self.every = progress_every(steps) if every is None else every
        self.clock = clock
        self.start = self.shown = clock()
        self.width = 0   # characters of the counter on screen (TTY)

    def step(self, done: int) -> None:
        """``done`` steps of the epoch are done (a resumed epoch counts from its start)."""
        now = self.clock()
        elapsed = now - self.start
        if self.tty:
            if now - self.shown >= TTY_INTERVAL_S and done < self.steps:
                text = f"epoch {self.epoch}: step {done}/{self.steps}, {elapsed:.0f} s"
                self.out.write("\r" + text.ljust(self.width))
                self.out.flush()
                self.width, self.shown = len(text), now
        elif self.every and done % self.every == 0 and done < self.steps:
            print(f"hpcai-train: epoch {self.epoch} step {done}/{self.steps} "
                  f"({elapsed:.1f} s)", file=self.out, flush=True)

    def clear(self) -> None:
        """Wipe the counter (TTY) before the epoch's line."""
        if self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.out.flush()
            self.width = 0
