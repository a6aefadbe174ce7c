"""Render the performance tables of README.md and docs/*.md from the committed result files.

Each table sits between ``<!-- results:BENCHMARK -->`` and ``<!-- /results -->`` in one of
those documents and is made from the newest ``bench/results/BENCHMARK-*.json`` (by provenance
date): one line per target row (median ratio, min-max, 95 % interval of the median, trials,
target, verdict; a miss says by how much the median misses), its notes, the settings and the
file's provenance. The ``learning`` block is made from every ``learning-*.json``, a row per
seed. The ``summary`` block (README.md) is one line per benchmark of ``SUMMARY``.

    python bench/render.py           rewrite README.md and docs/*.md
    python bench/render.py --check   exit 1 when a document differs from what the files give
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results -->)", re.S)


def by_date(benchmark: str, results: Path) -> list[tuple[Path, dict]]:
    """Every result file of ``benchmark`` with its data, oldest provenance date first."""
    files = [(f, json.loads(f.read_text())) for f in results.glob(f"{benchmark}-*.json")]
    if not files:
        raise FileNotFoundError(f"no {benchmark}-*.json under {results}")
    return sorted(files, key=lambda fd: (fd[1]["provenance"]["date"], fd[0].name))


def newest(benchmark: str, results: Path) -> Path:
    """The result file of ``benchmark`` with the latest provenance date."""
    return by_date(benchmark, results)[-1][0]


def _fmt(x: float) -> str:
    return f"{x:.3f}"


def _profile_lines(profiles: dict) -> list[str]:
    """A profile file (``bench/profile_sides.py``): per side, the share of the ranks'
    samples per category, and the top leaf frames of the synced step or the allreduce."""
    lines = ["| side | samples | where the ranks' samples fall | top leaf frames (share of all) "
             "| rank 0's CPU s per thread over the steps |", "|---|---|---|---|---|"]
    for side, p in profiles.items():
        cats = "; ".join(f"{k} {v:.1%}" for k, v in p["categories"].items())
        tops = "; ".join(f"{cat.split(': ', 1)[1]}: {leaf.split(' (')[0][:40]} {v:.1%}"
                         for cat, top in p["leaf_frames"].items()
                         if not cat.startswith("other")
                         for leaf, v in list(top.items())[:3])
        cpu = ", ".join(f"{n} {c:g}" for n, c in p.get("rank0_thread_cpu_s") or []) or "—"
        lines.append(f"| {side} | {p['samples']} | {cats} | {tops} | {cpu} |")
    return lines


def _startup_lines(data: dict) -> list[str]:
    """``bench/startup.py``: the model per job size, the measured ranks, the targets."""
    rate = data["metadata_ops_per_s"]
    lines = [f"Metadata rate {rate:,} ops/s: {data['rate_source']}.", "",
             "| ranks | design | shared metadata ops: wrapper's own | start-up | + hpcai's "
             "install tree | start-up | + Python runtime | start-up |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in data["model"]:
        lines.append(f"| {row['ranks']:,} | {row['design']} | "
                     + " | ".join(f"{row['metadata_ops_' + k]:,} | {row['startup_s_' + k]:.1f} s"
                                  for k in ("own", "with_install", "with_code")) + " |")
    lines += ["", "| launcher | design | ranks | shared calls / rank (metadata) | hpcai + venv "
              "calls (metadata) | Python runtime calls | all calls | CPU ms [min–max] | wall ms "
              "| programs run |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for key, s in data["measured"].items():
        launcher, design = key.split("/")
        for who, w in s.items():
            runtime = w["code_calls"]["median"] - w["install_calls"]["median"]
            programs = ", ".join(p.rsplit("/", 1)[-1] for p in w["programs"]) or "-"
            lines.append(
                f"| {launcher} | {design} | {who} | {w['shared_calls']['median']:.0f} "
                f"({w['shared_metadata']['median']:.0f}) | {w['install_calls']['median']:.0f} "
                f"({w['install_metadata']['median']:.0f}) | {runtime:.0f} | "
                f"{w['all_calls']['median']:.0f} | {1000 * w['cpu_s']['median']:.0f} "
                f"[{1000 * w['cpu_s']['min']:.0f}–{1000 * w['cpu_s']['max']:.0f}] | "
                f"{1000 * w['wall_s']['median']:.0f} | {programs} |")
    lines += ["", "| target (new design, non-planning ranks) | launcher | measured | target "
              "| verdict |", "|---|---|---:|---:|---|"]
    for v in data["verdicts"]:
        lines.append(f"| {v['what']} | {v['launcher']} | {v['value']:g} | ≤ {v['target']:g} "
                     f"| {v['verdict']} |")
    return lines


def _g(x: float | None) -> str:
    return "—" if x is None else f"{x:.2g}" if abs(x) < 10 else f"{x:.0f}"


def _learning_time(data: dict) -> str:
    """The run's wall time; for one resumed over several invocations, the last invocation's
    and the training time its seeds' epoch records hold, with the commits they ran."""
    wall = f"{data['wall_time_s'] / 60:.0f} min"
    runs = data["runs"]
    if not any(run.get("epochs_before") for run in runs):
        return wall
    revisions: Counter[str] = Counter()
    for run in runs:
        revisions.update(run["epochs_by_revision"])
    trained = sum(run["epoch_time_s_sum"] for run in runs) / 60
    return (f"resumed: {wall} in its last invocation (the provenance is that invocation's), "
            f"{trained:.0f} min of training in all, epochs per commit "
            + ", ".join(f"{rev[:10]} {n}" for rev, n in revisions.items()))


def _learning_table(files: list[tuple[str, dict]]) -> str:
    """``bench/learning.py``: every committed run, one row per seed, oldest first."""
    lines = ["| file | budget (2-rank steps × batch per rank, extra train arguments) | seed "
             "| worst-bin sampling-fraction difference, per validation | per bin at the end "
             "(low → high E) | empty generated showers, first → last | profile distance x, "
             "y, z: first → last | verdict of the file |", "|---|---|---|---|---|---|---|---|"]
    sources = []
    for name, data in files:
        b = data["budget"]
        budget = (f"{b['epochs']} × {b['steps_per_epoch']} × {b['batch_per_rank']}"
                  + (f", `{' '.join(b['train_args'])}`" if b.get("train_args") else ""))
        def said(v: dict) -> str:
            return ("passed" if v["passed"] else
                    f"not passed ({sum(not ok for ok in v['checks'].values())} of "
                    f"{len(v['checks'])} checks fail)")
        verdict = said(data["verdict"])
        if not data.get("complete", True):
            verdict += f"; incomplete: {len(data['runs'])} of {len(data['seeds'])} seeds"
        rows = [(run, str(run["seed"]), verdict) for run in data["runs"]]
        if "raw_generator" in data:   # --generator-ema: the average, then the raw control
            rows = [(run, f"{run['seed']} (average)", verdict) for run in data["runs"]] + [
                ({**run, **run["raw"]}, f"{run['seed']} ({run['raw']['generator']})",
                 said(data["raw_generator"]["verdict"])) for run in data["runs"]]
        for run, seed, verdict in rows:
            hist = run["history"]
            worst = ", ".join(_g(h["sampling_fraction_worst_rel_diff"]) for h in hist)
            if run.get("stopped_dead_at_epoch") is not None:
                worst += f"; stopped dead after epoch {run['stopped_dead_at_epoch']}"
            bins = ", ".join(f"{d:+.2f}" if d is not None else "—"
                             for d in run["sampling_fraction_rel_diff_per_bin_end"].values())
            empty = " → ".join(_g(hist[i].get("gen_empty_fraction")) for i in (0, -1))
            dist = ", ".join(f"{_g(hist[0]['profile_distance_' + a])} → "
                             f"{_g(hist[-1]['profile_distance_' + a])}" for a in "xyz")
            lines.append(f"| `{name}` | {budget} | {seed} | {worst} | {bins} | {empty} "
                         f"| {dist} | {verdict} |")
        p = data["provenance"]
        gpu = f"{p['gpus'].split(' (UUID')[0]}, " if p.get("gpus") else ""
        sources.append(f"`{name}`: commit {str(p['git_commit'])[:10]}"
                       f"{' + changes' if p['git_dirty'] else ''}, {p['date']}, "
                       f"{p['machine']}, {p['cpus']} CPUs, {gpu}"
                       f"{_learning_time(data)}, load average "
                       f"{p['load_average_at_start'][0]:.1f} → {p['load_average_at_end'][0]:.1f}")
    lines += ["", "Runs: " + "; ".join(sources) + "."]
    for name, data in files:
        lines += _rule_lines(name, data)
    return "\n".join(lines) + "\n"


def _rule_lines(name: str, data: dict) -> list[str]:
    """The 15 % rule at each seed's last validations and the statistics the exported
    generator has, where the file records them."""
    rule = data.get("rule_at_last_validations")
    if not rule:
        return []
    lines = ["", f"`{name}`, the 15 % rule at each seed's last {len(next(iter(rule.values())))} "
             "validations (worst bin, BatchNorm statistics judged with):", "",
             "| seed | " + " | ".join(f"validation {i + 1}" for i in
                                       range(len(next(iter(rule.values()))))) + " |",
             "|---|" + "---|" * len(next(iter(rule.values())))]
    for seed, rows in rule.items():
        lines.append(f"| {seed} | " + " | ".join(
            f"epoch {r['epoch']}: {r['worst_bin_rel_diff']:.1%}, {r['statistics']}, "
            f"{'within' if r['within'] else 'not within'}" for r in rows) + " |")
    exported = data.get("exported_generator")
    if exported:
        lines += ["", f"`export-onnx` ships the generator with {exported['batchnorm_statistics']} "
                  f"BatchNorm statistics: {exported['how']}."]
    return lines


SUMMARY = {   # benchmark: what its rows compare, for the README's one-line summary
    "training": "GFLOP/s ÷ GEMM peak; 2-rank ÷ 1-rank samples/s",
    "torch_baselines": "step time ÷ Horovod, exposed sync ÷ DDP",
    "allreduce_bw": "fused allreduce bandwidth ÷ best raw MPI_Allreduce",
    "progress_modes": "step time and wait for gradients, comm thread ÷ hooks, per MPI",
    "container_overhead": "samples/s and memory, container ÷ bare",
    "startup": "per-rank start-up work, plan once per job",
    "learning": "3DGAN learns physics (3 seeds, 15 % rule)",
}


# Benchmarks run once per MPI: their blocks show each MPI's newest file.
PER_MPI = {"allreduce_bw", "call_gap"}


def _newest_per_mpi(files: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """Each MPI's newest file, oldest first (``files`` is): their commits may differ, and
    each table's provenance line names its own."""
    newest = {_mpi(d): (f, d) for f, d in files}
    return [(f, d) for f, d in files if newest[_mpi(d)][0] == f]


def _mpi(data: dict) -> str:
    return data["settings"].get("mpi") or "auto"


def _summary_table(results: Path) -> str:
    """One line per benchmark of SUMMARY: its verdicts counted, and its newest file (for
    PER_MPI, each MPI's newest file)."""
    lines = ["| benchmark | what | verdicts | file |", "|---|---|---|---|"]
    for benchmark, what in SUMMARY.items():
        files = by_date(benchmark, results)
        path, data = files[-1]
        names = f"`bench/results/{path.name}`"
        if benchmark in PER_MPI:
            shown = _newest_per_mpi(files)
            verdicts = Counter(r["verdict"] for _, d in shown for r in d["rows"])
            names = ", ".join(f"`bench/results/{f.name}` ({_mpi(d)})" for f, d in shown)
        elif benchmark == "learning":
            verdicts = Counter(["passed" if data["verdict"]["passed"] else "not passed"])
        elif benchmark == "startup":
            verdicts = Counter(v["verdict"] for v in data["verdicts"])
        else:
            verdicts = Counter(r["verdict"] for r in data["rows"])
        said = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
        lines.append(f"| {benchmark} | {what} | {said} | {names} |")
    return "\n".join(lines) + "\n"


def _ci(stats: dict) -> str:
    ci = stats.get("ci95")
    return f"{ci[0]:.3f}–{ci[1]:.3f}" if ci else f"none (n = {stats['n']})"


def _gpu_parity_table(files: list[tuple[str, dict]]) -> str:
    """``bench/gpu_parity.py`` runs on a GPU: per file and configuration with at least one
    pair, each side's mean samples/s, the ratio to the target's reference (the plain loop,
    or the 3DGAN's 158 samples/s before) with its 95 % interval, and the verdict."""
    lines = ["| configuration | plain loop samples/s | train samples/s | ratio | of | "
             "95 % interval | pairs | target | verdict | file |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, data in files:
        for r in data["rows"]:
            if not r["ratio"]["n"]:
                continue
            mean = lambda v: sum(v) / len(v)  # noqa: E731
            of = "plain loop" if r["ratio_of"].startswith("hpcai / plain") else "158 samples/s"
            lines.append(f"| {r['key']} | {mean(r['plain_samples_per_s']):.0f} | "
                         f"{mean(r['hpcai_samples_per_s']):.0f} | {r['ratio']['mean']:.3f} | "
                         f"{of} | {_ci(r['ratio'])} | {r['ratio']['n']} | ≥ {r['target']:g} | "
                         f"{r['verdict']} | `{name}` |")
    p = files[-1][1]["provenance"]
    lines += ["", f"On {p.get('gpu')} (torch {p.get('torch')}, cuDNN {p.get('cudnn')}); "
              f"interval: {files[-1][1]['settings']['interval']}."]
    return "\n".join(lines) + "\n"


ALL_FILES = {"learning": _learning_table,   # blocks made from every file, not the newest
             "gpu_parity": _gpu_parity_table}


def render_table(data: dict, name: str) -> str:
    """The Markdown of one result file's rows (or profile) and provenance."""
    if data["benchmark"] == "startup":
        return _render_tail(_startup_lines(data), [], data, name)
    if not data["rows"] and data["benchmark"].startswith("profile"):
        return _render_tail(_profile_lines(data["trials"]), [], data, name)
    lines = ["| ratio | median | min–max | 95 % interval of the median | trials per side "
             "| target | verdict |", "|---|---|---|---|---|---|---|"]
    notes = []
    for row in data["rows"]:
        s = row["stats"]
        if s is None:
            cells = ["—", "—", "—", "0"]
        else:
            iv = (f"{_fmt(s['interval'][0])}–{_fmt(s['interval'][1])}" if s["interval"]
                  else f"none (n = {s['n']} too few)")
            cells = [_fmt(s["median"]), f"{_fmt(s['low'])}–{_fmt(s['high'])}", iv,
                     str(s["n"])]
        verdict = row["verdict"]
        if verdict == "missed":
            gap = s["median"] / row["target"] - 1
            verdict += f" (median {abs(gap):.0%} {'below' if gap < 0 else 'above'} the target)"
        target = "—" if row["target"] is None else f"{row['op']} {row['target']:g}"
        lines.append(f"| {row['label']} | " + " | ".join(cells) + f" | {target} | {verdict} |")
        if row["note"]:
            notes.append(f"- {row['label']}: {row['note']}")
    return _render_tail(lines, notes, data, name)


def _render_tail(lines: list[str], notes: list[str], data: dict, name: str) -> str:
    p = data["provenance"]
    load = (f"load average {p['load_average_at_start'][0]:.1f} at the start, "
            f"{p['load_average_at_end'][0]:.1f} at the end")
    settings = ", ".join(f"{k} {v}" for k, v in data["settings"].items())
    lines += [""] + notes + ([""] if notes else []) + [f"Settings: {settings}.", "",
        f"From `bench/results/{name}` (commit {str(p['git_commit'])[:10]}"
        f"{' + changes' if p['git_dirty'] else ''}, {p['date']}, {p['machine']}, "
        f"{p['cpus']} CPUs, {load})."]
    return "\n".join(lines) + "\n"


def render_readme(text: str, results: Path) -> str:
    """``text`` with every results block re-rendered from its files."""
    def block(m: re.Match) -> str:
        if m.group(2) == "summary":
            return m.group(1) + _summary_table(results) + m.group(4)
        files = by_date(m.group(2), results)
        if m.group(2) in ALL_FILES:
            body = ALL_FILES[m.group(2)]([(f.name, data) for f, data in files])
        elif m.group(2) in PER_MPI:
            body = "\n".join(f"**{_mpi(d)}**\n\n"
                             + render_table(d, f.name) for f, d in _newest_per_mpi(files))
        else:
            body = render_table(files[-1][1], files[-1][0].name)
        return m.group(1) + body + m.group(4)
    return BLOCK.sub(block, text)


def documents(repo: Path = REPO) -> list[Path]:
    """The documents that may hold results blocks: README.md and docs/*.md."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--results", default=str(REPO / "bench" / "results"))
    parser.add_argument("documents", nargs="*", type=Path,
                        help="default: README.md and docs/*.md")
    args = parser.parse_args()
    stale = []
    for doc in args.documents or documents():
        text = doc.read_text()
        rendered = render_readme(text, Path(args.results))
        if rendered == text:
            continue
        if args.check:
            stale.append(doc)
        else:
            doc.write_text(rendered)
    for doc in stale:
        print(f"{doc} differs from bench/results: run python bench/render.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
