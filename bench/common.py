"""Shared by the benchmarks: loopback MPI, generated data, alternating trials, ratio
statistics, and the one JSON writer (with provenance) every benchmark uses.

A result file is ``bench/results/<benchmark>-<host>-<UTC date>.json`` (one per machine and
run, committed); ``bench/render.py`` renders the README's tables from the newest file of each
benchmark, and ``tests/test_readme_results.py`` fails when the two disagree.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PACKAGES = ("torch", "numpy", "mpi4py", "horovod", "tensorflow-cpu", "keras", "tf-keras",
            "h5py")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "TF_USE_LEGACY_KERAS")


def loopback_env(**extra: str) -> dict[str, str]:
    """This process's environment with Open MPI and UCX pinned to ``lo``."""
    return dict(os.environ, OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo",
                UCX_NET_DEVICES="lo", **extra)


def gan_data(workdir: Path, events: int = 1024) -> Path:
    """One file of generated 3DGAN showers under ``workdir`` (made once, then reused)."""
    data = workdir / "gan-data"
    if not data.exists():
        subprocess.run([sys.executable, "-m", "hpcai.training.showers", "generate", "--out",
                        str(data), "--files", "1", "--events", str(events)], check=True,
                       capture_output=True)
    return data


def model_and_loss(name: str, batch: int, image: int):
    """A model of the PyTorch benchmarks and its loss on fixed synthetic data, batch
    ``batch``: ``resnet50`` (ImageNet-shaped ``image`` px, 1000 classes) or the 3DGAN's
    generator and discriminator, one forward/backward through both."""
    import torch

    from hpcai.models import gan3d, resnet

    if name == "resnet50":
        model = resnet.resnet50()
        x = torch.randn(batch, 3, image, image)
        y = torch.randint(0, 1000, (batch,))

        def loss_fn(m):
            return torch.nn.functional.cross_entropy(m(x), y)
        return model, loss_fn

    class GanPair(torch.nn.Module):
        """Generator and discriminator, one forward/backward through both."""

        def __init__(self) -> None:
            super().__init__()
            self.G = gan3d.Generator()
            self.D = gan3d.Discriminator()

        def forward(self, z):
            return sum(o.float().mean() for o in self.D(self.G(z)))

    z = torch.randn(batch, gan3d.Generator().latent)
    return GanPair(), lambda m: m(z)


# -- trials ------------------------------------------------------------------------------
def alternating_order(sides: Sequence[str], trials: int) -> list[str]:
    """``trials`` runs of every side in palindromic rounds (A B B A ..., A B C C B A ...),
    so a drift in machine load falls on all sides alike."""
    order: list[str] = []
    for i in range(trials):
        order += list(sides) if i % 2 == 0 else list(reversed(sides))
    return order


def run_alternating(sides: dict[str, Callable[[], float]], trials: int,
                    warmup: int = 1) -> dict[str, list[float]]:
    """Call every side ``warmup`` times (discarded), then ``trials`` times in
    :func:`alternating_order`; returns each side's measured values in order."""
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    values: dict[str, list[float]] = {name: [] for name in sides}
    for name in alternating_order(list(sides), trials):
        values[name].append(sides[name]())
    return values


def run_until_resolved(sides: dict[str, Callable[[], object]],
                       resolved: Callable[[dict[str, list]], bool], trials: int | None,
                       min_trials: int, max_trials: int, warmup: int = 0) -> dict[str, list]:
    """After ``warmup`` uncounted calls of every side: exactly ``trials`` alternating rounds
    when given; else rounds in pairs (so every pair stays palindromic) until
    ``resolved(values)`` after at least ``min_trials``, or ``max_trials`` are reached."""
    if trials is not None:
        return run_alternating(sides, trials, warmup=warmup)
    values = run_alternating(sides, min(2, max_trials), warmup=warmup)
    first = next(iter(sides))
    while len(values[first]) < max_trials and (
            len(values[first]) < min_trials or not resolved(values)):
        for name, more in run_alternating(sides, 2, warmup=0).items():
            values[name] += more
    return values


def resolved(rows: Sequence["Row"]) -> bool:
    """Whether every row with a target has its 95 % interval on one side of it."""
    return all(row.verdict != "unresolved" for row in rows if row.target is not None)


@dataclass(frozen=True)
class RatioStats:
    """Per-trial ratios A_i / B_i (the i-th trial of each side, paired in run order), or other
    paired values (:meth:`of_values`, e.g. differences):
    their median, min/max, and a distribution-free interval for the median (order
    statistics; ``interval`` is None when ``n`` is too small for 95 %)."""

    n: int
    median: float
    low: float
    high: float
    interval: tuple[float, float] | None
    coverage: float

    @classmethod
    def of(cls, a: Sequence[float], b: Sequence[float]) -> "RatioStats":
        return cls.of_values([x / y for x, y in zip(a, b)])

    @classmethod
    def of_values(cls, values: Sequence[float]) -> "RatioStats":
        """The same statistics of per-trial values already paired (e.g. differences)."""
        ordered = sorted(values)
        n = len(ordered)
        if n == 0:
            raise ValueError("no trials")
        k, coverage = _median_interval_rank(n)
        interval = (ordered[k - 1], ordered[n - k]) if k else None
        return cls(n=n, median=statistics.median(ordered), low=ordered[0], high=ordered[-1],
                   interval=interval, coverage=coverage)


def launch_stats(runs: Sequence[Sequence[float]], resamples: int = 4000,
                 level: float = 0.95) -> RatioStats:
    """The statistics of values pooled over several launches (``runs``: one list per
    launch), with an interval for the pooled median that counts the launches as the units
    that vary: a two-stage bootstrap (launches drawn with replacement, then each drawn
    launch's own values), percentile interval, fixed seed. Values within one launch share
    its placement and memory, so an interval over the pooled values alone can be narrower
    than the spread between launches."""
    pooled = RatioStats.of_values([x for run in runs for x in run])
    if len(runs) < 3:
        return RatioStats(pooled.n, pooled.median, pooled.low, pooled.high, None, 0.0)
    rng = random.Random(0)
    medians = []
    for _ in range(resamples):
        drawn = [x for run in rng.choices(runs, k=len(runs))
                 for x in rng.choices(run, k=len(run))]
        medians.append(statistics.median(drawn))
    medians.sort()
    tail = (1 - level) / 2
    interval = (medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1])
    return RatioStats(pooled.n, pooled.median, pooled.low, pooled.high, interval, level)


def _median_interval_rank(n: int, level: float = 0.95) -> tuple[int, float]:
    """The largest k with [x_(k), x_(n+1-k)] covering the median with probability >= level,
    and that coverage; (0, coverage of [min, max]) when even that is below level."""
    def below(k: int) -> float:   # P(Binomial(n, 1/2) <= k - 1)
        return sum(math.comb(n, i) for i in range(k)) / 2 ** n
    best = 0
    for k in range(1, n // 2 + 1):
        if 1 - 2 * below(k) >= level:
            best = k
    return best, round(1 - 2 * below(max(best, 1)), 4)


def verdict(stats: RatioStats, op: str, target: float) -> str:
    """'met' only when the whole interval meets the target, 'missed' when the whole
    interval misses it, else 'unresolved' (also when there is no 95 % interval)."""
    if stats.interval is None:
        return "unresolved"
    lo, hi = stats.interval
    ok = (lambda x: x <= target) if op == "<=" else (lambda x: x >= target)
    if ok(lo) and ok(hi):
        return "met"
    if not ok(lo) and not ok(hi):
        return "missed"
    return "unresolved"


@dataclass(frozen=True)
class Row:
    """One target row of a benchmark: the ratio measured, its target and verdict."""

    key: str
    label: str
    op: str
    target: float | None    # None: a reported ratio with no target (verdict "report")
    stats: RatioStats | None
    verdict: str
    note: str = ""

    @classmethod
    def measured(cls, key: str, label: str, op: str, target: float, a: Sequence[float],
                 b: Sequence[float], note: str = "") -> "Row":
        """The row of ratios a_i / b_i; 'invalid' when a baseline b_i is not positive (a
        difference of two noisy times can be), as no ratio then means anything."""
        stats = RatioStats.of(a, b)
        bad = sum(x <= 0 for x in b)
        if bad:
            why = f"the baseline was <= 0 in {bad} of {len(b)} trials"
            return cls(key, label, op, target, stats, "invalid",
                       f"{note}; {why}" if note else why)
        return cls(key, label, op, target, stats, verdict(stats, op, target), note)

    @classmethod
    def across_runs(cls, key: str, label: str, op: str, target: float | None,
                    runs: Sequence[tuple[Sequence[float], Sequence[float]]],
                    note: str = "") -> "Row":
        """The row of ratios a_i / b_i over several independent launches (``runs``: one
        ``(a, b)`` per launch): the pooled median, judged on the interval of
        :func:`launch_stats`, which counts the spread between launches (``target`` None: a
        reported row, not judged). The note lists the launches' medians."""
        ratios = [[x / y for x, y in zip(a, b)] for a, b in runs]
        stats = launch_stats(ratios)
        each = "median ratio per launch: " + ", ".join(
            f"{statistics.median(r):.3f}" for r in ratios)
        judged = "report" if target is None else verdict(stats, op, target)
        return cls(key, label, op, target, stats, judged, f"{note}; {each}" if note else each)

    @classmethod
    def report(cls, key: str, label: str, a: Sequence[float], b: Sequence[float],
               note: str = "") -> "Row":
        """The row of ratios a_i / b_i that no target judges."""
        return cls(key, label, "", None, RatioStats.of(a, b), "report", note)

    @classmethod
    def measured_difference(cls, key: str, label: str, op: str, target: float,
                            a: Sequence[float], b: Sequence[float], note: str = "") -> "Row":
        """The row of differences a_i - b_i (an absolute target, e.g. seconds added)."""
        stats = RatioStats.of_values([x - y for x, y in zip(a, b)])
        return cls(key, label, op, target, stats, verdict(stats, op, target), note)

    @classmethod
    def not_measured(cls, key: str, label: str, op: str, target: float, why: str) -> "Row":
        return cls(key, label, op, target, None, "not measured", why)


# -- provenance and the JSON writer ------------------------------------------------------
def first_line(argv: list[str], containing: str = "") -> str | None:
    """The first output line of ``argv`` containing ``containing``; None when not installed."""
    if not shutil.which(argv[0]):
        return None
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    lines = [ln.strip() for ln in (out.stdout or out.stderr).splitlines() if containing in ln]
    return lines[0] if lines else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance() -> dict:
    """Where and on what a result was measured (load average taken now: call it at the
    start of a run; :func:`write_result` adds the load at the end)."""
    if os.environ.get("HPCAI_GIT_COMMIT"):   # a copy of the tree without .git names it
        commit, dirty = os.environ["HPCAI_GIT_COMMIT"], os.environ.get("HPCAI_GIT_DIRTY", "")
    else:
        commit = first_line(["git", "-C", str(REPO), "rev-parse", "HEAD"])
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, check=False).stdout.strip()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines()
                  if ln.startswith("model name")), platform.processor())
    return {
        "git_commit": commit, "git_dirty": bool(dirty),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "machine": model, "cpus": os.cpu_count(),
        "kernel": platform.release(), "python": platform.python_version(),
        "python_executable": sys.executable,
        "open_mpi": first_line(["mpirun.openmpi", "--version"]),
        "gpus": first_line(["nvidia-smi", "-L"]),
        "threads_env": {k: os.environ.get(k) for k in THREAD_VARS},
        "packages": {p: _version(p) for p in PACKAGES},
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def result_name(benchmark: str, info: dict) -> str:
    """``<benchmark>-<host>-<UTC date>.json`` of a run with provenance ``info``."""
    stamp = info["date"].replace(":", "").replace("-", "").split("+")[0]
    return f"{benchmark}-{info['host']}-{stamp}.json"


def write_result(benchmark: str, info: dict, rows: Sequence[Row], trials: dict,
                 settings: dict, out_dir: Path = RESULTS) -> Path:
    """Write ``<benchmark>-<host>-<date>.json``: provenance (``info`` from
    :func:`provenance` plus the load average now), the settings, the target rows and every
    trial; returns the path."""
    info = dict(info, load_average_at_end=[round(x, 2) for x in os.getloadavg()])
    path = out_dir / result_name(benchmark, info)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_result({"benchmark": benchmark, "provenance": info,
                                 "settings": settings, "rows": [asdict(r) for r in rows],
                                 "trials": rounded(trials)}))
    return path


TRIAL_DIGITS = 6   # significant digits kept of a trial's value: far below any trial's noise


def rounded(value):
    """``value`` with every float rounded to :data:`TRIAL_DIGITS` significant digits."""
    if isinstance(value, float):
        return float(f"{value:.{TRIAL_DIGITS}g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    return value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def dump_result(data: dict) -> str:
    """A result file's text: JSON indented by one, each list of numbers on one line."""
    def text(value, depth: int) -> str:
        pad, end = "\n" + " " * (depth + 1), "\n" + " " * depth
        if isinstance(value, dict) and value:
            items = (json.dumps(k if isinstance(k, str) else json.dumps(k)) + ": "
                     + text(v, depth + 1) for k, v in value.items())
            return "{" + pad + ("," + pad).join(items) + end + "}"
        if isinstance(value, (list, tuple)) and not all(map(_is_number, value)):
            return "[" + pad + ("," + pad).join(text(v, depth + 1) for v in value) + end + "]"
        return json.dumps(value)   # a scalar, an empty container, or a list of numbers
    return text(data, 0) + "\n"


def print_rows(rows: Sequence[Row]) -> None:
    for r in rows:
        if r.stats is None:
            print(f"{r.label}: not measured ({r.note})")
            continue
        s = r.stats
        iv = (f"[{s.interval[0]:.3f}, {s.interval[1]:.3f}] ({s.coverage:.1%})"
              if s.interval else f"none (n={s.n}: [min,max] covers {s.coverage:.1%})")
        target = f"target {r.op} {r.target}" if r.target is not None else "no target"
        print(f"{r.label}: median {s.median:.3f} (min {s.low:.3f}, max {s.high:.3f}), "
              f"interval {iv}, {target}: {r.verdict}"
              + (f"; {r.note}" if r.note else ""), flush=True)
