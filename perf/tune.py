"""hpcai-launch tune: measure this node, then say how many ranks and threads to run.

    hpcai-launch tune [--budget 180] [--steps 3] [--max-ranks R] [--json tune.json]
                      [--no-net] [--verify] -- train MODEL [train options]

Measured, within ``--budget`` seconds (the layouts the fit needs first, the rest while time
is left; what did not fit is named):

- compute: the model's real training step under ``hpcai-launch`` (2 epochs of ``--steps``
  steps; the second epoch counts) at 1 rank x 1 and x all threads, then more ranks sharing
  the node; seconds per sample = (epoch time - gradient communication) / samples per rank;
- gradient buckets: bytes and count of the step's allreduces, from a multi-rank run's record;
- memory: the largest resident set per rank;
- communication: ``MPI_Allreduce`` times at several sizes (``hpcai.perf.probe``) on 2..R
  ranks, through shared memory and through TCP (``net``: ``OMPI_MCA_btl=self,tcp``,
  ``UCX_TLS=tcp,self``), each fitted to alpha-beta (:func:`hpcai.perf.model.fit_link`).

Then every layout ranks x threads <= cores is predicted (:mod:`hpcai.perf.model`), those
that do not fit in memory are dropped, and the best are printed with their reason, an
``sbatch`` line and a site-profile fragment. ``--verify`` runs the top three for real.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.cli import Parser, run_main, split_command
from ..core.errors import UserError
from ..training.record import EpochRecord, OtherRecord
from .model import AllreduceSample, allreduce, fits_memory
from .result import Layout, Link, TuneResult

DEFAULT_BUDGET_S = 180.0
PROBE_SIZES = (1024, 8192, 65536, 524288)
NET_ENV = {"OMPI_MCA_btl": "self,tcp", "UCX_TLS": "tcp,self"}


@dataclass(frozen=True)
class Choice:
    """One layout on one node, predicted."""

    ranks: int
    threads: int
    samples_per_s: float          # per node
    compute_s: float              # per step
    comm_s: float                 # per step
    algorithm: str
    fits: bool
    reason: str
    measured_samples_per_s: float | None = None


def _parser() -> Parser:
    p = Parser(prog="hpcai-launch tune",
               description="Measure this node and rank ranks-per-node x threads layouts.")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds for all measurements (default {DEFAULT_BUDGET_S:g})")
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout (default 3)")
    p.add_argument("--max-ranks", type=int, default=None,
                   help="most ranks per node to try (default: the cores)")
    p.add_argument("--json", default="tune.json", help="where to write the result")
    p.add_argument("--no-net", action="store_true",
                   help="skip the TCP allreduce probe (no network parameters measured)")
    p.add_argument("--verify", action="store_true", help="run the top three for real")
    p.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    return p


def physical_cores() -> int:
    """Cores (not hardware threads) this process may use."""
    from ..launcher.node.topology import allowed_cpus, from_sysfs

    return len(from_sysfs(allowed=allowed_cpus(in_rank=False)).cores)


def memory_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise UserError("cannot read MemAvailable from /proc/meminfo", "tune runs on Linux only")


def layouts_to_measure(cores: int, max_ranks: int) -> list[tuple[int, int]]:
    """The fit's needs first: 1 x all threads, 1 x 1, then r x cores/r for r = 2, 4, ...;
    then the remaining thread counts of one rank."""
    order = [(1, cores), (1, 1)]
    r = 2
    while r <= min(cores, max_ranks):
        order.append((r, cores // r))
        r *= 2
    order += [(1, t) for t in range(2, cores)]
    seen, out = set(), []
    for item in order:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def candidates(cores: int, max_ranks: int) -> list[tuple[int, int]]:
    return [(r, t) for r in range(1, min(cores, max_ranks) + 1) for t in range(1, cores // r + 1)]


def _launcher(ranks: int, threads: int) -> list[str]:
    """``hpcai-launch`` with this shape, up to and including ``--`` (Options.to_argv)."""
    from ..launcher.planning.options import Options
    shape = Options(command=(), ranks_per_node=ranks, threads_per_rank=threads)
    return [sys.executable, "-m", "hpcai.launcher", *shape.to_argv()]


def _run(argv: list[str], env: dict[str, str] | None, timeout: float, what: str) -> None:
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"{what} took longer than {timeout:.0f} s",
                        "give tune a larger --budget or fewer --steps") from None
    if done.returncode != 0:
        raise UserError(f"{what} failed (exit {done.returncode}): "
                        f"{(done.stderr or done.stdout).strip()[-800:]}",
                        "run the same training under hpcai-launch by hand to see why")


def train_once(train: list[str], ranks: int, threads: int, steps: int, out: Path,
               timeout: float) -> EpochRecord:
    """Two epochs of ``steps`` steps at this layout; the second epoch's record."""
    argv = _launcher(ranks, threads) + train + [
        "--epochs", "2", "--max-steps", str(steps), "--out", str(out), "--eval-samples", "0",
        "--peak-gflops", "1", "--checkpoint-every", "0", "--keep", "1"]
    _run(argv, None, timeout, f"training at {ranks} rank(s) x {threads} thread(s)")
    records = []
    for line in (out / "epochs.jsonl").read_text(encoding="utf-8").splitlines():
        try:
            records.append(EpochRecord.from_json(line))
        except OtherRecord:
            continue
    return records[-1]


def _layout(record: EpochRecord, ranks: int, threads: int, batch: int) -> Layout:
    per_rank = record.steps * batch
    return Layout(ranks, threads, (record.epoch_time_s - record.comm_s) / per_rank,
                  record.max_rss_mb_per_rank * 2**20, ranks * per_rank / record.epoch_time_s)


def probe(ranks: int, sizes: list[int], env: dict[str, str] | None, out: Path,
          timeout: float, repeats: int) -> list[AllreduceSample]:
    argv = _launcher(ranks, 1) + [sys.executable, "-m", "hpcai.perf.probe", "--sizes",
                                  ",".join(map(str, sizes)), "--repeats", str(repeats),
                                  "--out", str(out)]
    _run(argv, env, timeout, f"allreduce probe on {ranks} ranks")
    doc = json.loads(out.read_text(encoding="utf-8"))
    return [AllreduceSample(doc["ranks"], int(n), float(med)) for n, med, _ in doc["samples"]]


def strip_generate(train: list[str]) -> tuple[list[str], int]:
    """``train`` without ``--generate N`` / ``--generate=N``, and N (0 if absent)."""
    out, events, skip = [], 0, False
    for i, arg in enumerate(train):
        if skip:
            skip = False
        elif arg == "--generate":
            events, skip = int(train[i + 1]), True
        elif arg.startswith("--generate="):
            events = int(arg.split("=", 1)[1])
        else:
            out.append(arg)
    return out, events


def rank_layouts(result: TuneResult, max_ranks: int) -> list[Choice]:
    """Every layout on one node, best predicted samples/s first; those that do not fit in
    memory last."""
    fit = result.compute_fit()
    measured = {(c.ranks, c.threads): c for c in result.compute}
    batch = result.batch_per_rank
    choices = []
    for r, t in candidates(result.cores, max_ranks):
        compute = fit.s_per_sample(t, r) * batch
        costs = [allreduce(n, 1, r, result.shm.cost, result.shm.cost) for n in result.buckets]
        comm = sum(c.seconds for c in costs)
        names = sorted({c.algorithm for c in costs if c.algorithm != "none"}) or ["none"]
        mem = result.mem_bytes_per_rank()
        fits = fits_memory(mem, r, result.memory_bytes)
        if not fits:
            reason = (f"memory: {r} x {mem / 2**30:.2f} GiB > "
                      f"{result.memory_bytes / 2**30:.1f} GiB available")
        elif comm > compute:
            share = 100 * comm / (compute + comm)
            reason = f"communication-bound (allreduce {share:.1f} % of step)"
        else:
            reason = (f"compute-bound (allreduce {100 * comm / (compute + comm):.1f} % of "
                      f"step)")
        known = measured.get((r, t))
        choices.append(Choice(r, t, r * batch / (compute + comm), compute, comm,
                              ", ".join(names), fits, reason,
                              known and known.samples_per_s))
    choices.sort(key=lambda c: (not c.fits, -c.samples_per_s))
    return choices


def render(choices: list[Choice], top: int) -> str:
    lines = ["| rank | ranks/node | threads | predicted samples/s/node | measured in tune "
             "| step compute (s) | allreduce (s) | algorithm | reason |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for i, c in enumerate(choices[:top], 1):
        seen = "-" if c.measured_samples_per_s is None else f"{c.measured_samples_per_s:.4g}"
        lines.append(f"| {i} | {c.ranks} | {c.threads} | {c.samples_per_s:.4g} | {seen} | "
                     f"{c.compute_s:.4g} | {c.comm_s:.3g} | {c.algorithm} | {c.reason} |")
    return "\n".join(lines)


def paste_lines(best: Choice, train: list[str], result: TuneResult) -> list[str]:
    link = result.net or result.shm
    return [
        "sbatch line: hpcai-launch sbatch --nodes N --ranks-per-node "
        f"{best.ranks} --threads-per-rank {best.threads} -- {' '.join(train)}",
        "site-profile fragment:",
        f"cores_per_node = {result.cores}",
        f"memory_per_node_gb = {result.memory_bytes / 1e9:.1f}",
        "[network]   # measured here by tune (" + ("TCP" if result.net else "shared memory")
        + "); replace with the site's fabric",
        f"latency_us = {link.cost.alpha_s * 1e6:.3g}",
        f"bandwidth_gbit_s = {link.cost.bandwidth_bytes_s * 8 / 1e9:.3g}",
        'topology = "fat-tree"',
    ]


def measure(train: list[str], cfg, budget: float, steps: int, max_ranks: int, net: bool,
            work: Path) -> tuple[TuneResult, list[str], list[str]]:
    """Run the measurements; (result, what was skipped for lack of budget, the training
    command as run: ``--generate`` replaced by data generated once in ``work``)."""
    user_train = list(train)
    start = time.monotonic()
    cores = physical_cores()
    if cores < 2:
        raise UserError("tune needs at least 2 cores to measure ranks sharing a node",
                        "run it on a compute node (inside an allocation)")
    train, events = strip_generate(train)
    if events:
        data = work / "data"
        _run([sys.executable, "-m", "hpcai.training.showers", "generate", "--out", str(data),
              "--files", "1", "--events", str(events)], None, budget, "generating showers")
        train = train + ["--data", str(data)]
    epoch_samples = events or (cfg.samples if cfg.model != "3dgan" else None)
    skipped, layouts, records = [], [], {}
    for r, t in layouts_to_measure(cores, max_ranks):
        left = budget - (time.monotonic() - start)
        if len(layouts) >= 3 and left < 0.4 * budget:
            skipped.append(f"{r} rank(s) x {t} thread(s)")
            continue
        rec = train_once(train, r, t, steps, work / f"r{r}t{t}", max(left, 120.0))
        records[(r, t)] = rec
        layouts.append(_layout(rec, r, t, cfg.batch_size))
    multi = [rec for (r, _), rec in records.items() if r > 1]
    if not multi or not multi[0].allreduce.calls:
        raise UserError("no multi-rank run recorded gradient allreduces",
                        "tune needs 2 ranks on this node; check --max-ranks")
    rec = multi[0]
    calls = rec.allreduce.calls / rec.steps
    buckets = tuple([round(rec.allreduce.bytes_per_rank / rec.allreduce.calls)]
                    * round(calls))
    sizes = sorted(set(PROBE_SIZES) | {max(buckets)})
    links = {}
    for name, env in (("shm", None), ("net", {**os.environ, **NET_ENV})):
        if name == "net" and not net:
            continue
        samples = []
        for r in range(2, min(cores, max_ranks) + 1):
            samples += probe(r, sizes, env, work / f"probe-{name}-{r}.json", 120.0, 10)
        links[name] = Link.fitted(samples)
    result = TuneResult(
        model=cfg.model, command=tuple(user_train), batch_per_rank=cfg.batch_size,
        epoch_samples=epoch_samples, cores=cores, memory_bytes=memory_available(),
        flops_per_sample=rec.flops_per_sample, buckets=buckets, compute=tuple(layouts),
        shm=links["shm"], net=links.get("net"),
        provenance={"host": platform.node(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "loadavg": list(os.getloadavg()), "budget_s": budget,
                    "elapsed_s": round(time.monotonic() - start, 1), "steps": steps,
                    "git_revision": rec.provenance.git_revision,
                    "mpi": rec.provenance.mpi_library_version, "skipped": skipped})
    return result, skipped, train


def verify(choices: list[Choice], train: list[str], steps: int, batch: int,
           work: Path) -> list[tuple[Choice, float]]:
    """Run the top three (that fit) for real: (choice, measured samples/s per node)."""
    out = []
    for c in [c for c in choices if c.fits][:3]:
        rec = train_once(train, c.ranks, c.threads, steps, work / f"verify-r{c.ranks}t{c.threads}",
                         600.0)
        out.append((c, c.ranks * batch * rec.steps / rec.epoch_time_s))
    return out


def run(argv: list[str]) -> int:
    from ..training.config import check_command

    head, train = split_command(argv)
    ns = _parser().parse_args(head)
    if not train:
        raise UserError("tune needs the training command after --",
                        "e.g. hpcai-launch tune -- train 3dgan --generate 256")
    cfg = check_command(train)
    if cfg is None:
        raise UserError(f"tune measures hpcai's training, not {train[0]!r}",
                        "give a train command: hpcai-launch tune -- train 3dgan --generate 256")
    for name, value in (("--budget", ns.budget), ("--steps", ns.steps), ("--top", ns.top)):
        if not value > 0:
            raise UserError(f"{name} must be positive, got {value}", f"e.g. {name} 3")
    if ns.max_ranks is not None and ns.max_ranks < 2:
        raise UserError(f"--max-ranks must be at least 2, got {ns.max_ranks}",
                        "tune needs 2 ranks to measure ranks sharing the node")
    json_path = Path(ns.json)
    if not json_path.parent.is_dir():
        raise UserError(f"--json {json_path}: directory {json_path.parent} does not exist",
                        "give a path in an existing directory")
    max_ranks = ns.max_ranks or 1 << 30
    work = Path(tempfile.mkdtemp(prefix="hpcai-tune-"))
    try:
        result, skipped, as_run = measure(list(train), cfg, ns.budget, ns.steps, max_ranks,
                                  not ns.no_net, work)
        choices = rank_layouts(result, max_ranks)
        print(f"hpcai-launch tune: {cfg.model}, batch {cfg.batch_size}/rank, "
              f"{result.cores} cores, {len(result.compute)} layouts measured in "
              f"{result.provenance['elapsed_s']} s (load average "
              f"{result.provenance['loadavg'][0]:.2f})")
        if skipped:
            print("not measured (budget): " + ", ".join(skipped) + "; predicted by the model")
        print(render(choices, ns.top))
        print("\n".join(paste_lines(choices[0], list(train), result)))
        doc = json.loads(result.to_json())
        doc["ranking"] = [c.__dict__ for c in choices]
        if ns.verify:
            checked = verify(choices, as_run, ns.steps, cfg.batch_size, work)
            doc["verify"] = []
            print("verify: predicted vs measured samples/s per node")
            for c, seen in checked:
                print(f"  {c.ranks} x {c.threads}: predicted {c.samples_per_s:.4g}, measured "
                      f"{seen:.4g} ({100 * (c.samples_per_s / seen - 1):+.1f} %)")
                doc["verify"].append({"ranks": c.ranks, "threads": c.threads,
                                      "predicted": c.samples_per_s, "measured": seen})
        json_path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, argv)
