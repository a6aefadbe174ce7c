"""Physics validation of the 3DGAN on held-out events, shared by the ranks (framework-neutral).

Every rank takes its share of the first ``--validate-events`` held-out events (event i goes
to rank i mod world), has the task generate ``--validate-draws`` showers at each event's
energy, each from a latent vector fixed per event and draw for the whole run (draw 0's are
those of a run with one draw), and summarises real and generated showers
(``physics.summarise``). Rank 0 gathers the summaries, compares them bin by bin
(``physics.compare``) and keeps the history in ``OUT/physics.json`` (rewritten atomically
after every validation, earlier validations kept on ``--resume``) with the plots beside it
(``physics_plots``). Every rank waits while rank 0 draws (about 1.5 s here), so ``PlotClock``
redraws them during a run at most once a minute, and always after the last validation and
when a preemption stops the run; ``hpcai-launch report`` redraws them from the JSON.

The task's hook: ``physics_pass(x, e, z, generator=G) -> (generated, aux_real, aux_gen)`` on
NumPy arrays (x (n,1,25,25,25) GeV, E' (n,), z (n, latent)): generator G at E' * z and the
discriminator's regressed E' on the real and the generated showers, both networks in
inference mode (moving BatchNorm statistics, no dropout), as CERN's analysis calls
``predict``. Every generator in the task's ``generators`` is judged on the same events and
latent vectors; the first is the run's result (the weight average with ``--generator-ema``),
the others go beside it into ``physics.json`` as ``others``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..models.gan3d_spec import ENERGY_SCALE_GEV, LATENT

from . import physics
from .atomic import replacing
from .physics_plots import PHYSICS_FILE, PLOT_NAMES, SCHEMA_VERSION, write_plots
from .shower_data import DatasetIndex, ShowerReader

LATENT_SEED = 0x3D6A   # with --seed: the per-event latent vectors of every validation
PLOT_EVERY_S = 60.0    # during a run, the plots are redrawn at most this often


def due(epoch: int, epochs: int, every: int) -> bool:
    """Validate after ``epoch`` (0-based): every ``every`` epochs, and after the last."""
    return epoch == epochs - 1 or (every > 0 and (epoch + 1) % every == 0)


def plots_behind(out_dir: Path) -> bool:
    """Whether ``OUT/physics.json`` holds validations its plots may lack: a plot is missing
    or older than it (an earlier invocation that failed before drawing them)."""
    try:
        written = (out_dir / PHYSICS_FILE).stat().st_mtime_ns
    except OSError:
        return False
    try:
        return any((out_dir / name).stat().st_mtime_ns < written for name in PLOT_NAMES)
    except OSError:
        return True


class PlotClock:
    """Rank 0's schedule for redrawing the plots: after the run's last validation, and
    after any other when the last drawing (at first, the clock's creation) is at least
    ``every_s`` old. ``behind``: a validation is in physics.json but not in the plots
    (``behind`` at creation: a resumed run's, :func:`plots_behind`)."""

    def __init__(self, every_s: float = PLOT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic, behind: bool = False) -> None:
        self.every_s, self.clock = every_s, clock
        self.last = clock()
        self.behind = behind

    def due(self, last: bool) -> bool:
        """Whether to draw after this validation (``last``: the run's last one). The plots
        lack it (``behind``) until :meth:`drawn`: a drawing that fails leaves them behind."""
        self.behind = True
        return last or self.clock() - self.last >= self.every_s

    def drawn(self) -> None:
        self.last, self.behind = self.clock(), False


class PhysicsValidator:
    def __init__(self, held_out: DatasetIndex, events: int, seed: int, comm,
                 draws: int = 1) -> None:
        self.comm, self.rank = comm, comm.Get_rank()
        self.held_out = held_out
        self.total = min(events, held_out.total)
        self.mine = np.arange(self.total)[self.rank::comm.Get_size()]
        rng = np.random.default_rng([seed, LATENT_SEED])
        self.z = [rng.standard_normal((self.total, LATENT), dtype=np.float32)[self.mine]
                  for _ in range(draws)]
        self._real: tuple[np.ndarray, np.ndarray] | None = None

    def describe(self) -> str:
        names = ", ".join(p.name for p in self.held_out.files)
        draws = (f", {len(self.z)} generated showers per event" if len(self.z) > 1 else "")
        return (f"{self.total} of {self.held_out.total} held-out events ({names}), "
                f"never trained on{draws}")

    def _real_events(self) -> tuple[np.ndarray, np.ndarray]:
        if self._real is None:
            with ShowerReader(self.held_out) as reader:
                self._real = reader.read(self.mine)
        return self._real

    def run(self, task, epoch: int) -> list[physics.Validation] | None:
        """Collective: every rank validates its share; rank 0 gets the comparisons, one per
        generator of ``task.generators``, in that order (the real side is the
        discriminator's first look at the real showers, the same for every generator)."""
        gathered = self.summaries(task)
        return None if gathered is None else self.compare(gathered, task, epoch)

    def summaries(self, task, batch_chunk: int | None = None) -> list | None:
        """Collective: every rank summarises its real showers and, per generator and draw,
        its generated ones; rank 0 gets every rank's (in rank order), the others None. With
        ``batch_chunk`` the generators run as in their training steps: BatchNorm on each
        ``batch_chunk`` consecutive events' own statistics (``physics_pass``)."""
        how = {} if batch_chunk is None else {"chunk": batch_chunk, "batch_statistics": True}
        x, e = self._real_events()
        e_gev = e.astype(np.float64) * ENERGY_SCALE_GEV
        aux_real = np.zeros(0)
        generated = []   # per generator: its showers' summaries, one per draw
        for k, which in enumerate(task.generators):
            parts = []
            for d, z in enumerate(self.z):
                showers, aux = x, np.zeros(0)             # a rank without events: empty
                if len(e):
                    first = k == 0 and d == 0             # D on x once, in the first pass
                    showers, aux_x, aux = task.physics_pass(x, e, z, generator=which,
                                                            real=first, **how)
                    if first:
                        aux_real = aux_x
                parts.append(physics.summarise(showers, e_gev, aux))
            generated.append(parts)
        mine = [physics.summarise(x, e_gev, aux_real), *generated]
        gathered = self.comm.gather(mine, root=0)
        return gathered if self.rank == 0 else None

    def compare(self, gathered: list, task, epoch: int,
                draws: range | None = None) -> list[physics.Validation]:
        """Rank 0: the comparisons of :meth:`summaries`, on ``draws`` (default all)."""
        real = physics.concat([m[0] for m in gathered])
        draws = range(len(self.z)) if draws is None else draws
        # draw after draw, each in rank order as ``real`` is
        return [physics.compare(real, physics.concat([m[i + 1][d] for d in draws
                                                      for m in gathered]), epoch,
                                generator=which)
                for i, which in enumerate(task.generators)]


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` whole over ``path`` (``atomic.replacing``), with the umask's
    permissions, as the run's other files (a group sharing a project directory reads it)."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def entry(validations: list[physics.Validation]) -> dict:
    """One validation of ``physics.json``: the first generator's comparison with its
    summary, and any others (the raw generator beside the average) under ``others``."""
    first, *rest = validations
    out = {**first.to_dict(), "summary": first.summary()}
    if rest:
        out["others"] = [{**v.to_dict(), "summary": v.summary()} for v in rest]
    return out


def record(out_dir: Path, validations: list[physics.Validation],
           held_out: DatasetIndex, draw: bool = True) -> dict:
    """Rank 0: add one validation (``validations``: one per generator, the run's result
    first) to ``OUT/physics.json`` (replacing any of the same or a later epoch, left by a
    run that was resumed) and, with ``draw``, redraw the plots, of the first generator.
    Returns the document written."""
    path = out_dir / PHYSICS_FILE
    epoch = validations[0].epoch
    history = []
    if path.exists():
        history = [v for v in json.loads(path.read_text(encoding="utf-8"))["validations"]
                   if v["epoch"] < epoch]
    history.append(entry(validations))
    doc = {"version": SCHEMA_VERSION, "energy_bins_gev": list(physics.ENERGY_BINS_GEV),
           "axes": list(physics.AXES),
           "held_out": {"files": [str(p) for p in held_out.files],
                        "events": list(held_out.counts)},
           "definitions": "docs/3dgan.md, Physics validation (hpcai.training.physics)",
           "validations": history}
    _atomic_write(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")
    if draw:
        write_plots(doc, out_dir)
    return doc


def redraw(out_dir: Path) -> list[Path]:
    """Rank 0: draw the plots of ``OUT/physics.json`` as it is."""
    doc = json.loads((out_dir / PHYSICS_FILE).read_text(encoding="utf-8"))
    return write_plots(doc, out_dir)
