"""The PNGs beside ``physics.json`` (matplotlib, Agg): what a physicist looks at first.

- ``physics-profiles.png``: the x, y and z (depth) profiles (log scale), real against
  generated, for up to three energy bins (lowest, middle, highest filled), at the latest validation;
- ``physics-sampling-fraction.png``: Σcells / E against E per bin, real against generated
  (bars: the events' standard deviation), at the latest validation;
- ``physics-metrics.png``: every summary number of ``Validation.summary`` against epoch.

Rank 0 draws them after a validation (``validation.PlotClock`` says which) while the other
ranks wait, so the layout is fixed (margins in inches) rather than measured
(``tight_layout``), and the log axes have no minor ticks: each roughly halves the time a
figure takes.
"""

from __future__ import annotations

import math
from pathlib import Path

from .atomic import replacing

PHYSICS_FILE = "physics.json"   # written by ``validation.record``
SCHEMA_VERSION = 1              # of physics.json
PLOT_NAMES = ("physics-profiles.png", "physics-sampling-fraction.png", "physics-metrics.png")


def _figure(width: float, height: float, *, title: bool, hspace: float = 0.6):
    """A ``width`` × ``height`` inch figure with fixed margins: room for tick labels and an
    axis label on the left and below, and for a suptitle above if ``title``."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.2 / width, bottom=0.5 / height,
                        top=1 - (0.55 if title else 0.35) / height, wspace=0.3, hspace=hspace)
    return fig


def _log_axis(ax, values: list[float]) -> None:
    """A log y axis without minor ticks, spanning at least one decade below the largest
    power of ten under the data's maximum, so it always shows two labelled major ticks."""
    ax.set_yscale("log")
    ax.minorticks_off()
    positive = [v for v in values if v > 0]
    if positive:
        floor = 10.0 ** (math.floor(math.log10(max(positive))) - 1)
        ax.set_ylim(bottom=min(min(positive), floor) / 1.5, top=max(positive) * 1.5)


def _chosen_bins(bins: list[dict]) -> list[dict]:
    filled = [b for b in bins if b["events"]]
    picks = sorted({0, len(filled) // 2, len(filled) - 1}) if filled else []
    return [filled[i] for i in picks]


def profiles(doc: dict, path: Path) -> None:
    latest = doc["validations"][-1]
    rows = _chosen_bins(latest["bins"])
    fig = _figure(11, 2.8 * max(len(rows), 1), title=True)
    axes_names = doc["axes"]
    for r, b in enumerate(rows):
        for a, axis in enumerate(axes_names):
            ax = fig.add_subplot(len(rows), 3, 3 * r + a + 1)
            ax.step(range(25), b["real"]["profiles"][a], where="mid", color="black",
                    label="real (held out)")
            ax.step(range(25), b["gen"]["profiles"][a], where="mid", color="tab:red",
                    label="generated")
            distance = b["profile_distance"][a]
            ax.set_title(f"{b['e_lo_gev']:g}-{b['e_hi_gev']:g} GeV ({b['events']} ev.), "
                         f"{axis}: L1 {distance:.3g}" if distance is not None else
                         f"{b['e_lo_gev']:g}-{b['e_hi_gev']:g} GeV, {axis}", fontsize=8)
            ax.set_xlabel(f"{axis} cell" + (" (depth)" if axis == "z" else ""), fontsize=8)
            ax.set_ylabel("mean energy (GeV)", fontsize=8)
            _log_axis(ax, [*b["real"]["profiles"][a], *b["gen"]["profiles"][a]])
            ax.tick_params(labelsize=7)
            if r == 0 and a == 0:
                ax.legend(fontsize=7)
    fig.suptitle(f"Shower profiles after epoch {latest['epoch']}", fontsize=10)
    fig.savefig(path, format="png")


def sampling_fraction(doc: dict, path: Path) -> None:
    latest = doc["validations"][-1]
    fig = _figure(6, 4, title=False)
    ax = fig.add_subplot()
    filled = [b for b in latest["bins"] if b["events"]]
    centres = [(b["e_lo_gev"] + b["e_hi_gev"]) / 2 for b in filled]
    for side, colour, label, shift in (("real", "black", "real (held out)", -4),
                                       ("gen", "tab:red", "generated", 4)):
        points = [(c + shift, b[side]["sampling_fraction"], b[side]["sampling_fraction_std"])
                  for c, b in zip(centres, filled) if b[side]["sampling_fraction"] is not None]
        if points:
            xs, ys, errs = zip(*points)
            ax.errorbar(xs, ys, yerr=errs, fmt="o", color=colour, label=label, capsize=3)
    ax.set_xlabel("primary energy E (GeV, bin centre)")
    ax.set_ylabel("Σ cells / E")
    ax.set_title(f"Sampling fraction after epoch {latest['epoch']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, format="png")


def metrics(doc: dict, path: Path) -> None:
    history = doc["validations"]
    keys = sorted({k for v in history for k in v["summary"] if k != "events"})
    cols = 3
    rows = max(1, -(-len(keys) // cols))
    fig = _figure(11, 2.6 * rows, title=True, hspace=0.7)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(rows, cols, i + 1)
        points = [(v["epoch"], v["summary"][key]) for v in history if key in v["summary"]]
        ax.plot(*zip(*points), marker="o")
        ax.set_title(key, fontsize=8)
        ax.set_xlabel("epoch", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle("Held-out physics metrics against epoch", fontsize=10)
    fig.savefig(path, format="png")


def write_plots(doc: dict, out_dir: Path) -> list[Path]:
    """Draw the three PNGs of the physics.json document ``doc`` into ``out_dir``, each into a
    temporary file beside it renamed over it, so a reader never sees half a PNG and a redraw
    that fails leaves the last one whole."""
    paths = [out_dir / name for name in PLOT_NAMES]
    for draw, path in zip((profiles, sampling_fraction, metrics), paths):
        with replacing(path) as tmp:
            draw(doc, tmp)
    return paths
