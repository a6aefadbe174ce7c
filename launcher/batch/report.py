"""hpcai-launch report: scaling tables and a plot from a sweep's results directory.

    hpcai-launch report RESULTS [--out DIR] [--include-first-epoch]

(A training run directory, one holding ``epochs.jsonl`` but no ``point.json``, gets its
full epoch records instead, ``epochs_report``; a 3DGAN one, holding ``physics.json``, its
physics validation too, ``physics_report``.)

Reads what ``hpcai-launch sweep`` leaves behind, one directory per point::

    RESULTS/<point>/point.json    {"nodes", "ranks_per_node", "threads_per_rank", "repeat",
                                   "job_id", "status": "done"|"failed"|..., "scaling"}
    RESULTS/<point>/epochs.jsonl  the training engine's per-epoch records (one JSON a line)

and writes ``scaling.md``, ``scaling.csv``, ``scaling.json`` and ``scaling.png`` into
``--out`` (default RESULTS), printing the Markdown on stdout.

How the numbers are made:

- Per run (one point directory), the epoch records are averaged. The first epoch of each run
  is left out, since it carries the warm-up (``--include-first-epoch`` keeps it); a run with
  a single epoch record uses it, and the report says so. A partial epoch after a resume
  (``first_step`` > 0) is left out and named.
- Repeats of the same (nodes, ranks per node, threads per rank) become one row: time per
  epoch is the mean of the runs' means, ``time_min_s`` the fastest counted epoch of any
  repeat, ``runs`` the number of repeats; samples/s, PFLOP/s (total GFLOP/s / 1e6, FLOPs as
  counted by the engine: 1 multiply-add = 2 FLOP) and % of peak (against the peak named in
  the records) are means the same way.
- Per configuration (ranks per node x threads per rank), sorted by nodes, with n0 the
  smallest node count that has a usable row: ``linear(n) = t(n0) * n0 / n`` and
  ``efficiency = linear / t``. The sweep's weak scaling (the paper's set-up) keeps the
  per-rank batch and the epoch fixed, so the ideal time per epoch falls as 1/nodes; strong
  scaling (global batch fixed, epoch fixed) has the same ideal.
- A point that cannot be used (no point.json, status other than done, no or empty
  epochs.jsonl, a line that is not JSON, a missing or non-numeric field, a record whose
  provenance disagrees with point.json) is named with its file and the reason as a
  ``warning:`` line on stderr and left out; the rest are still tabulated. Exit 0 when at
  least one point was tabulated, otherwise ``error:``/``hint:`` and exit 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ...core.cli import Parser, run_main
from ...core.errors import UserError
from ...training.record import EpochRecord, OtherRecord, RecordError
from ...training.physics_plots import PHYSICS_FILE
from .points import PointRecord

POINT_FILE = "point.json"
EPOCHS_FILE = "epochs.jsonl"
OUTPUT_NAMES = ("scaling.md", "scaling.csv", "scaling.json", "scaling.png")
EPOCH_NUM_FIELDS = ("epoch_time_s", "samples_per_s", "gflops_total", "pct_of_peak")
PROVENANCE_FIELDS = ("world_size", "ranks_per_node", "threads_per_rank")
FORMULA = ("linear(n) = t(n0) * n0 / n, efficiency = linear / t, n0 = the smallest node "
           "count of the configuration")
SCALING_NOTE = {
    "weak": "weak scaling: per-rank batch fixed, epoch size fixed, so the ideal time per "
            "epoch falls as 1/nodes",
    "strong": "strong scaling: global batch fixed, epoch size fixed, so the ideal time per "
              "epoch falls as 1/nodes",
}


@dataclass
class Row:
    """One table row: all usable repeats of one (nodes, ranks/node, threads) point."""

    nodes: int
    ranks_per_node: int
    threads_per_rank: int
    scaling: str
    runs: int                 # repeats aggregated
    epochs: int               # epoch records counted, over all repeats
    time_s: float             # mean over repeats of each run's mean epoch time
    time_min_s: float         # fastest counted epoch of any repeat
    linear_s: float           # t(n0) * n0 / n within the configuration
    efficiency: float         # linear_s / time_s
    samples_per_s: float      # mean (total over ranks)
    pflops: float             # mean achieved total GFLOP/s / 1e6
    pct_of_peak: float        # mean
    peak_gflops_per_rank: float | None = None
    first_epoch_excluded: bool = True  # False if any repeat counted its first epoch
    points: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def config(self) -> tuple[str, int, int]:
        return (self.scaling, self.ranks_per_node, self.threads_per_rank)


@dataclass
class _Run:
    name: str
    nodes: int
    rpn: int
    threads: int
    scaling: str
    times: list[float]
    samples: float
    gflops: float
    pct: float
    peak: float | None
    first_excluded: bool
    notes: list[str]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _read_point(pdir: Path) -> tuple[PointRecord | None, str | None]:
    path = pdir / POINT_FILE
    if not path.is_file():
        return None, f"{path}: missing (not a finished sweep point); skipped"
    try:
        record = PointRecord.load(path)
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path}: unreadable ({exc}); skipped"
    except json.JSONDecodeError as exc:
        return None, f"{path}: not JSON ({exc}); skipped"
    except ValueError as exc:
        return None, f"{path}: {exc}; skipped"
    status = record.status
    if status != "done":
        why = "failed" if status == "failed" else f"{status!r}, not done"
        if status in ("submitted", "running"):
            why += (" (if its job has ended, refresh the statuses with hpcai-launch sweep "
                    "--collect --results RESULTS)")
        return None, f"{path}: status {why}; skipped"
    return record, None


def _read_epochs(pdir: Path, record: PointRecord) -> tuple[list[EpochRecord] | None, str | None]:
    path = pdir / EPOCHS_FILE
    if not path.is_file():
        return None, f"{path}: missing (point status is done, but no epoch was recorded); skipped"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path}: unreadable ({exc}); skipped"
    point = record.point
    want = {"world_size": point.nodes * point.ranks_per_node,
            "ranks_per_node": point.ranks_per_node,
            "threads_per_rank": point.threads_per_rank}
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = EpochRecord.from_json(line)
        except OtherRecord:
            continue
        except RecordError as exc:
            return None, f"{where}: {exc}; skipped"
        for key in EPOCH_NUM_FIELDS:
            if not math.isfinite(getattr(rec, key)):
                return None, (f"{where}: field {key!r} not a finite number "
                              f"({getattr(rec, key)!r}); skipped")
        if rec.epoch_time_s <= 0:
            return None, f"{where}: epoch_time_s is {rec.epoch_time_s!r}, not > 0; skipped"
        for key in PROVENANCE_FIELDS:
            if getattr(rec.provenance, key) != want[key]:
                return None, (f"{where}: provenance.{key} is {getattr(rec.provenance, key)!r} "
                              f"but {POINT_FILE} says {want[key]!r} (nodes {point.nodes} x "
                              f"ranks/node {point.ranks_per_node}, threads "
                              f"{point.threads_per_rank}); skipped")
        records.append(rec)
    if not records:
        return None, f"{path}: no epoch records; skipped"
    return records, None


def _read_run(pdir: Path, include_first_epoch: bool) -> tuple[_Run | None, list[str]]:
    record, problem = _read_point(pdir)
    if record is None:
        return None, [problem]
    point = record.point
    records, problem = _read_epochs(pdir, record)
    if records is None:
        return None, [problem]
    path = pdir / EPOCHS_FILE
    notes: list[str] = []
    whole = [r for r in records if not r.first_step]
    for r in records:
        if r.first_step:
            notes.append(f"{path}: epoch {r.epoch} is partial (resumed at step "
                         f"{r.first_step}); left out")
    if not whole:
        return None, notes + [f"{path}: no whole epoch recorded; skipped"]
    whole.sort(key=lambda r: r.epoch)
    first_excluded = not include_first_epoch and len(whole) > 1
    used = whole[1:] if first_excluded else whole
    if not include_first_epoch and len(whole) == 1:
        notes.append(f"{path}: only one epoch ({whole[0].epoch}); used it, warm-up included")
    peaks = [r.peak.gflops_per_rank for r in used if math.isfinite(r.peak.gflops_per_rank)]
    run = _Run(name=pdir.name, nodes=point.nodes, rpn=point.ranks_per_node,
               threads=point.threads_per_rank, scaling=point.scaling,
               times=[r.epoch_time_s for r in used],
               samples=_mean([r.samples_per_s for r in used]),
               gflops=_mean([r.gflops_total for r in used]),
               pct=_mean([r.pct_of_peak for r in used]),
               peak=_mean(peaks) if peaks else None,
               first_excluded=first_excluded, notes=notes)
    return run, notes


def _point_dirs(results: Path, skip: Path | None) -> list[Path]:
    dirs = []
    for child in sorted(results.iterdir()):
        if not child.is_dir() or child.name.startswith("."):
            continue
        if skip is not None and child.resolve() == skip:
            continue
        if (child / POINT_FILE).exists() or (child / EPOCHS_FILE).exists():
            dirs.append(child)
    return dirs


def collect(results_dir: str | Path, include_first_epoch: bool = False, *,
            skip: str | Path | None = None) -> tuple[list[Row], list[str]]:
    """Rows (repeats aggregated, sorted by configuration then nodes, linear time and
    efficiency filled in) and problems (one string per unusable file or note, naming it).
    ``skip``: a subdirectory to ignore (the report's own --out)."""
    results = Path(results_dir)
    if not results.is_dir():
        raise UserError(f"{results} is not a directory",
                        "give the directory a sweep wrote: hpcai-launch sweep ... "
                        "--results RESULTS")
    skip_path = Path(skip).resolve() if skip is not None else None
    problems: list[str] = []
    groups: dict[tuple[int, int, int, str], list[_Run]] = defaultdict(list)
    for pdir in _point_dirs(results, skip_path):
        run, notes = _read_run(pdir, include_first_epoch)
        problems.extend(notes)
        if run is not None:
            groups[(run.nodes, run.rpn, run.threads, run.scaling)].append(run)
    rows = []
    for (nodes, rpn, threads, scaling), runs in groups.items():
        rows.append(Row(
            nodes=nodes, ranks_per_node=rpn, threads_per_rank=threads, scaling=scaling,
            runs=len(runs), epochs=sum(len(r.times) for r in runs),
            time_s=_mean([_mean(r.times) for r in runs]),
            time_min_s=min(min(r.times) for r in runs),
            linear_s=math.nan, efficiency=math.nan,
            samples_per_s=_mean([r.samples for r in runs]),
            pflops=_mean([r.gflops for r in runs]) / 1e6,
            pct_of_peak=_mean([r.pct for r in runs]),
            peak_gflops_per_rank=(_mean([r.peak for r in runs if r.peak is not None])
                                  if any(r.peak is not None for r in runs) else None),
            first_epoch_excluded=all(r.first_excluded for r in runs),
            points=sorted(r.name for r in runs),
            notes=[n for r in runs for n in r.notes]))
    rows.sort(key=lambda r: (r.scaling != "weak", r.scaling, r.ranks_per_node,
                             r.threads_per_rank, r.nodes))
    _fill_linear(rows)
    return rows, problems


def _fill_linear(rows: list[Row]) -> None:
    for config_rows in _by_config(rows).values():
        base = min(config_rows, key=lambda r: r.nodes)
        for row in config_rows:
            row.linear_s = base.time_s * base.nodes / row.nodes
            row.efficiency = row.linear_s / row.time_s


def _by_config(rows: list[Row]) -> dict[tuple[str, int, int], list[Row]]:
    configs: dict[tuple[str, int, int], list[Row]] = {}
    for row in rows:
        configs.setdefault(row.config, []).append(row)
    for config_rows in configs.values():
        config_rows.sort(key=lambda r: r.nodes)
    return configs


def config_label(ranks_per_node: int, threads_per_rank: int) -> str:
    return (f"{ranks_per_node} rank{'s' if ranks_per_node != 1 else ''} x "
            f"{threads_per_rank} thread{'s' if threads_per_rank != 1 else ''}")


def _seconds(value: float) -> str:
    if value >= 100:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 1000 else f"{value:.4g}"


def render_markdown(rows: list[Row], problems: list[str]) -> str:
    """The paper-style table, one per configuration, with the formula stated."""
    lines = ["# Scaling report", ""]
    if rows and all(r.first_epoch_excluded for r in rows):
        first = "the first epoch of each run left out (warm-up)"
    elif rows and not any(r.first_epoch_excluded for r in rows):
        first = "every epoch counted, the first (warm-up) included"
    else:
        first = "the first epoch of each run left out (warm-up), except where marked *"
    lines += [f"Time per epoch: mean over repeats of each run's mean epoch time, {first}. "
              f"{FORMULA}. PFLOP/s: achieved total GFLOP/s / 1e6 (FLOPs as the training "
              "engine counts them: 1 multiply-add = 2 FLOP); % of peak: against the peak "
              "named in the epoch records.", ""]
    for (scaling, rpn, threads), config_rows in _by_config(rows).items():
        base = config_rows[0]
        lines += [f"## {config_label(rpn, threads)} ({scaling} scaling)", "",
                  f"{SCALING_NOTE[scaling].capitalize()}: linear(n) = "
                  f"{_seconds(base.time_s)} s x {base.nodes} / n.", "",
                  "| nodes | ranks/node | threads | time/epoch (s) | linear (s) | efficiency "
                  "| samples/s | PFLOP/s | % of peak | runs |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in config_rows:
            mark = "" if r.first_epoch_excluded or not any(
                x.first_epoch_excluded for x in rows) else "*"
            lines.append(f"| {r.nodes} | {r.ranks_per_node} | {r.threads_per_rank} | "
                         f"{_seconds(r.time_s)}{mark} | {_seconds(r.linear_s)} | "
                         f"{100 * r.efficiency:.1f} % | {_rate(r.samples_per_s)} | "
                         f"{r.pflops:.4g} | {r.pct_of_peak:.1f} | {r.runs} |")
        peaks = sorted({round(r.peak_gflops_per_rank, 2) for r in config_rows
                        if r.peak_gflops_per_rank is not None})
        if peaks:
            lines += ["", "Peak: " + ", ".join(f"{p:g}" for p in peaks) + " GFLOP/s per rank."]
        lines.append("")
    if problems:
        lines += ["## Problems", ""] + [f"- {p}" for p in problems] + [""]
    return "\n".join(lines)


_CSV_FIELDS = [f.name for f in fields(Row)]


def write_csv(rows: list[Row], path: str | Path) -> None:
    """One line per row; floats at full precision (repr), lists joined with ';'."""
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(_CSV_FIELDS)
        for row in rows:
            values = []
            for name in _CSV_FIELDS:
                value = getattr(row, name)
                if isinstance(value, list):
                    value = ";".join(value)
                elif value is None:
                    value = ""
                elif isinstance(value, float):
                    value = repr(value)
                values.append(value)
            writer.writerow(values)


def write_json(rows: list[Row], problems: list[str], path: str | Path) -> None:
    doc = {"formula": FORMULA, "scaling": SCALING_NOTE,
           "pflops": "achieved total GFLOP/s / 1e6; 1 multiply-add = 2 FLOP",
           "rows": [asdict(r) for r in rows], "problems": list(problems)}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def plot(rows: list[Row], path: str | Path, measured: list[Row] | None = None) -> None:
    """Log-log time per epoch vs nodes: per configuration markers + line, dashed linear;
    ``measured`` rows (a prediction's sweep) as open squares in their configuration's colour."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter, ScalarFormatter

    fig = Figure(figsize=(7.5, 5.0), dpi=120)
    ax = fig.add_subplot()
    configs = _by_config(rows)
    scalings = {s for s, _, _ in configs}
    colours = matplotlib.colormaps["tab10"]
    for i, ((scaling, rpn, threads), config_rows) in enumerate(configs.items()):
        label = config_label(rpn, threads) + (f" ({scaling})" if len(scalings) > 1 else "")
        nodes = [r.nodes for r in config_rows]
        colour = colours(i % 10)
        ax.plot(nodes, [r.time_s for r in config_rows], marker="o", linestyle="-",
                color=colour, label=label)
        ax.plot(nodes, [r.linear_s for r in config_rows], linestyle="--", color=colour,
                alpha=0.7, label=f"{label}, linear")
        for r in config_rows[1:]:
            ax.annotate(f"{100 * r.efficiency:.0f}%", (r.nodes, r.time_s),
                        textcoords="offset points", xytext=(4, 4), fontsize=7, color=colour)
        seen = [r for r in measured or [] if r.config == (scaling, rpn, threads)]
        if seen:
            ax.plot([r.nodes for r in seen], [r.time_s for r in seen], marker="s",
                    linestyle="none", markerfacecolor="none", color=colour,
                    label=f"{label}, measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    all_nodes = sorted({r.nodes for r in rows})
    ax.set_xticks(all_nodes)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    plain = FuncFormatter(lambda value, _pos: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    times = [t for r in rows for t in (r.time_s, r.linear_s)] + [
        r.time_s for r in measured or []]
    # Under about a decade the minor ticks are the only ones: label them plainly too.
    ax.yaxis.set_minor_formatter(plain if times and max(times) < 20 * min(times)
                                 else NullFormatter())
    ax.set_xlabel("nodes")
    ax.set_ylabel("time per epoch (s)")
    kind = " and ".join(sorted(scalings)) if scalings else "weak"
    ax.set_title(f"Time per epoch vs nodes ({kind} scaling; dashed: linear)")
    ax.grid(True, which="both", alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = Parser(prog="hpcai-launch report",
                     description="Scaling tables and a plot from a sweep's results.")
    parser.add_argument("results", metavar="RESULTS",
                        help="the directory the sweep wrote, or a training run directory "
                             "(train --out: every field of its epochs.jsonl, and a 3dgan "
                             "run's physics.json as tables and PNGs)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where scaling.{md,csv,json,png} go (default RESULTS)")
    parser.add_argument("--include-first-epoch", action="store_true",
                        help="count each run's first epoch too (it carries the warm-up)")
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    """``hpcai-launch report RESULTS [--out DIR] [--include-first-epoch]``."""
    ns = _parse(argv)
    results = Path(ns.results)
    out = Path(ns.out) if ns.out else results
    if (results / EPOCHS_FILE).is_file() and not (results / POINT_FILE).exists():
        from .epochs_report import run as epochs_report   # one training run

        epochs_report(results)
        if not (results / PHYSICS_FILE).is_file():
            return 0
        print()
    if (results / PHYSICS_FILE).is_file():
        from .physics_report import run as physics_report

        return physics_report(results, out)
    rows, problems = collect(results, ns.include_first_epoch, skip=out)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    if not rows:
        found = len(_point_dirs(results, out.resolve()))
        if (results / POINT_FILE).exists():
            hint = (f"{results} is one point; give its parent, the directory holding "
                    f"<point>/{POINT_FILE}")
        elif found:
            hint = (f"{found} point director{'y' if found == 1 else 'ies'} found, none usable "
                    "(see the warnings); rerun the failed points or wait for pending ones")
        else:
            hint = (f"expected RESULTS/<point>/{POINT_FILE} and {EPOCHS_FILE}, as "
                    "hpcai-launch sweep writes them")
        raise UserError(f"no usable results in {results}", hint)
    try:
        out.mkdir(parents=True, exist_ok=True)
        markdown = render_markdown(rows, problems)
        (out / "scaling.md").write_text(markdown, encoding="utf-8")
        write_csv(rows, out / "scaling.csv")
        write_json(rows, problems, out / "scaling.json")
        plot(rows, out / "scaling.png")
    except OSError as exc:
        raise UserError(f"cannot write the report into {out}: {exc.strerror or exc}",
                        "give a writable --out DIR") from exc
    print(markdown, end="", flush=True)
    print(f"hpcai-launch report: {len(rows)} row(s) from "
          f"{sum(r.runs for r in rows)} run(s); wrote "
          + ", ".join(str(out / n) for n in OUTPUT_NAMES), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
