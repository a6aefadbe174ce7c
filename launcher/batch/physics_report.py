"""hpcai-launch report RUN_DIR, for a 3DGAN training run: its held-out physics validation.

Reads ``RUN_DIR/physics.json`` (written by the trainer, ``training/validation.py``), prints
Markdown (which generator was judged, every validation's summary against epoch, the trained
generator's beside the weight average's when the run kept one, then the latest validation bin
by bin) and redraws the PNGs into ``--out`` (default RUN_DIR), naming them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ...core.errors import UserError
from ...training.physics_plots import PHYSICS_FILE, SCHEMA_VERSION, write_plots


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}"


GENERATORS = {"raw": "the trained generator",
              "standing": "the trained generator, with BatchNorm statistics measured afresh "
                          "for its weights (train --validate-bn standing)",
              "average": "the generator's weight average (train --generator-ema)"}


def _summaries(history: list[dict]) -> list[str]:
    """A table of every validation's summary against epoch."""
    keys = sorted({k for v in history for k in v["summary"] if k != "events"})
    lines = ["| epoch | events | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    for v in history:
        s = v["summary"]
        lines.append(f"| {v['epoch']} | {v['events']} | "
                     + " | ".join(_fmt(s.get(k)) for k in keys) + " |")
    return lines


def render(doc: dict) -> str:
    history = doc["validations"]
    which = history[-1].get("generator", "raw")
    lines = ["# Physics validation on held-out events", "",
             "Held-out files: " + ", ".join(Path(f).name for f in doc["held_out"]["files"]),
             "", f"Judged: {GENERATORS.get(which, which)}.", "", *_summaries(history)]
    others = [v["others"][0] for v in history if v.get("others")]
    if others:   # the trained generator beside the average, on the same events
        other = others[-1].get("generator", "raw")
        lines += ["", f"Beside it, on the same events: {GENERATORS.get(other, other)}.", "",
                  *_summaries(others)]
    latest = history[-1]
    lines += ["", f"## Epoch {latest['epoch']}, per energy bin (real / generated)", "",
              "| E (GeV) | events | Σ/E | L1 x | L1 y | L1 z | depth mean | depth sd | hits |",
              "|---|---|---|---|---|---|---|---|---|"]
    for b in latest["bins"]:
        if not b["events"]:
            continue
        r, g = b["real"], b["gen"]

        def pair(key: str, axis: int | None = None) -> str:
            a, c = (r[key], g[key]) if axis is None else (r[key][axis], g[key][axis])
            return f"{_fmt(a)} / {_fmt(c)}"

        lines.append(f"| {b['e_lo_gev']:g}-{b['e_hi_gev']:g} | {b['events']} | "
                     f"{pair('sampling_fraction')} | "
                     + " | ".join(_fmt(d) for d in b["profile_distance"])
                     + f" | {pair('first_moment', 2)} | {pair('second_moment', 2)} | "
                     f"{pair('hits')} |")
    return "\n".join(lines) + "\n"


def run(run_dir: Path, out: Path) -> int:
    """Print the Markdown and redraw the PNGs of ``run_dir/physics.json`` into ``out``."""
    path = run_dir / PHYSICS_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}",
                        "give a 3dgan run directory written by train --out") from exc
    if doc.get("version") != SCHEMA_VERSION or not doc.get("validations"):
        raise UserError(f"{path} is not a physics validation of version {SCHEMA_VERSION} "
                        "with at least one validation",
                        "read it with the hpcai version that wrote it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        pngs = write_plots(doc, out)
    except OSError as exc:
        raise UserError(f"cannot write the plots into {out}: {exc.strerror or exc}",
                        "give a writable --out DIR") from exc
    print(render(doc), end="", flush=True)
    print("hpcai-launch report: plots " + ", ".join(str(p) for p in pngs), file=sys.stderr)
    return 0
