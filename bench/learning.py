"""Does the 3DGAN learn physics? 2-rank trainings on generated showers, several seeds, a fixed
budget, judged on held-out events (issue 17).

Each seed runs ``hpcai-launch -N RANKS -- train 3dgan --generate EVENTS --seed S`` for
``--epochs`` x ``--max-steps`` steps (the budget is in steps, so every seed does the same
work) with the physics validation after every epoch on ``--validate-events`` held-out events
(files of their own seed, never trained on), ``--validate-draws`` generated showers each, and
reads ``physics.json``. It prints, per seed,
the held-out metrics at the first, the middle and the last validation, with the median and
the spread (max - min) over seeds, and writes them with provenance into ``--json``.

It passes when, for every seed,
- the generated sampling fraction (Σcells / E) is within 15 % of the real one in every energy
  bin at the last validation, and
- each profile distance (x, y, z) at the last validation is at most half the first one,
  and the smallest fall over seeds is larger than the spread of the last values over seeds,
- and at most half the generated showers are empty at the last validation (an empty shower's
  relative profile distance is 1, so a generator that dies from a start at 2 "halves" it).

    python bench/learning.py [--seeds 1,2,3] [--epochs 6] [--max-steps 16] [--events 1024]
                             [--batch-size 4] [--validate-events 128]
                             [--validate-draws 1] [--json PATH]
                             [--train-arg=--optimizer --train-arg=rmsprop ...]
                             [--launch-arg=ARG ...] [--jobs N] [--workdir DIR]

With a constant learning rate the JSON's ``budgets`` also says, for every validation, whether
the criteria would have held had the runs stopped there (a shorter run is the longer run's
first steps exactly), so one long run measures the budget the criteria need.

With ``--train-arg=--generator-ema --train-arg=D`` the verdict judges the generator's weight
average, and the JSON's ``raw_generator`` judges the raw generator of the same runs, event for
event: the control that says whether the average made the difference.

A seed whose generator has died (every generated shower empty in ``--stop-dead``
validations in a row, default 2) is stopped early (SIGUSR1, see ``preempt``) and fails: the
output ReLU then passes no gradient. The JSON is rewritten after every seed (``complete``
false until all ran). A seed whose training fails (a non-zero exit, ``--timeout``) ends the
benchmark: the seeds queued behind it are not started, and with ``--jobs`` above 1 the running
ones are stopped at a checkpoint (``Stopped``); a seed that finishes meanwhile is kept.

With ``--train-arg=--resume`` a seed continues its run directory (``--workdir``) from its last
checkpoint, and a finished seed is read back at once, so a budget longer than one sitting is
spread over several invocations. ``wall_time_s`` and ``provenance`` are then the last
invocation's; each run also says what its ``epochs.jsonl`` holds from all of them:
``epochs_before`` (epochs already recorded when this invocation started), ``epoch_time_s_sum``
(training time summed over the recorded epochs: no validation, no start-up; a stopped epoch
counts only its resumed part) and ``epochs_by_revision`` (the commit each epoch ran).

Run it on an otherwise idle machine. Measured on 2-core VMs: a 2-rank step takes about 1 s
at batch 4 per rank and 4.1-4.6 s at batch 16, plus a few seconds per validation; the defaults
(6 x 16 steps of batch 4) take about 2.5 minutes per seed. A budget this size may be too
small for the criteria; the JSON then shows how far each metric got, and a larger
``--epochs`` / ``--max-steps`` / ``--batch-size`` is the lever. On a GPU
(``--train-arg=--device --train-arg=cuda``, ``--jobs 3``; ``bench/gpu_learning.sh``) three
seeds sharing one H200 took about 0.6 s per step each at batch 16.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from pathlib import Path

from common import loopback_env, provenance

REPO = Path(__file__).resolve().parents[1]
METRICS = ("profile_distance_x", "profile_distance_y", "profile_distance_z",
           "sampling_fraction_worst_rel_diff", "hits_worst_rel_diff", "aux_mape_real",
           "aux_mape_gen", "gen_empty_fraction")
SAMPLING_FRACTION_TOLERANCE = 0.15
DISTANCE_FALL = 0.5
ALIVE_EMPTY = 0.5   # at most this share of generated showers empty: an empty shower's
                    # profile distance is 1, so a dying generator can "halve" a distance


class Stopped(SystemExit):
    """A seed stopped at a checkpoint because another seed failed."""


def preempt(proc: subprocess.Popen) -> None:
    """Stop a seed's job as a preemption does: the ranks checkpoint and exit. SIGUSR1 (the
    trainer treats it as SIGTERM), which every MPI's launcher passes on to the ranks as it
    is; SIGTERM reaches them through ``hpcai-launch``'s relay (tests/test_signals.py)."""
    proc.send_signal(signal.SIGUSR1)
    proc.wait(timeout=300)


def run_seed(seed: int, args: argparse.Namespace, workdir: Path,
             stop: threading.Event | None = None) -> dict:
    """Train one seed and read its result. ``stop`` set (another seed failed): the job is
    preempted (a checkpoint, then exit) and the seed fails."""
    out = workdir / f"seed{seed}"
    argv = ["hpcai-launch", "-N", str(args.ranks), *args.launch_args, "--", "train", "3dgan",
            "--generate",
            str(args.events), "--seed", str(seed), "--epochs", str(args.epochs),
            "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size),
            "--validate-every", "1", "--validate-events", str(args.validate_events),
            "--validate-draws", str(args.validate_draws),
            "--eval-samples", "0", "--out", str(out), *args.train_args]
    print("$ " + " ".join(argv), flush=True)
    before = len(epoch_records(out))
    start = time.monotonic()
    dead_at = None
    deadline_hit = False
    proc = subprocess.Popen(argv, env=loopback_env(), text=True)
    try:
        while proc.poll() is None:
            if args.timeout and time.monotonic() - start > args.timeout:
                preempt(proc)
                raise SystemExit(f"error: seed {seed}: no result within {args.timeout:.0f} s\n"
                                 "hint: raise --timeout (0: none), or run again with "
                                 "--train-arg=--resume to continue from its checkpoint")
            if args.deadline and time.monotonic() - start > args.deadline:
                print(f"seed {seed}: --deadline {args.deadline:.0f} s reached, stopping it "
                      "(SIGUSR1: a checkpoint, then exit)", flush=True)
                deadline_hit = True
                preempt(proc)
                break
            if stop is not None and stop.is_set():
                print(f"seed {seed}: another seed failed, stopping this one (SIGUSR1: a "
                      "checkpoint, then exit)", flush=True)
                preempt(proc)
                raise Stopped(f"error: seed {seed}: stopped at a checkpoint because another "
                              "seed failed")
            dead_at = dead_epoch(out / "physics.json", args.stop_dead)
            if dead_at is not None:
                print(f"seed {seed}: every generated shower empty in {args.stop_dead} "
                      f"validations in a row (epoch {dead_at}): the output ReLU passes no "
                      "gradient, stopping this seed", flush=True)
                preempt(proc)
                break
            if stop is not None:
                stop.wait(5)
            else:
                time.sleep(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - start
    if proc.returncode != 0 and dead_at is None and not deadline_hit:
        raise SystemExit(f"error: seed {seed}: training exited {proc.returncode}")
    if deadline_hit and not (out / "physics.json").exists():   # before its first validation
        raise SystemExit(f"error: seed {seed}: --deadline {args.deadline:.0f} s reached before "
                         "its first validation: no result\nhint: raise --deadline, or run again "
                         "with --train-arg=--resume to continue from its checkpoint")
    doc = json.loads((out / "physics.json").read_text())
    validations = doc["validations"]
    records = epoch_records(out)
    run = {"seed": seed, "wall_s": round(wall, 1), "command": argv,
           "stopped_dead_at_epoch": dead_at, "stopped_at_deadline": deadline_hit,
           # --max-steps, or fewer: the data's (a resumed epoch's record has its rest)
           "steps_per_epoch": records[0]["first_step"] + records[0]["steps"],
           "held_out": doc["held_out"], **recorded_time(records, before),
           **judged_side(validations)}
    if all(v.get("others") for v in validations):   # --generator-ema: the raw one beside
        run["raw"] = judged_side([v["others"][0] for v in validations])
    return run


def settle(futures: dict, failure) -> tuple[list[int], list[int], list[int], list[dict]]:
    """After ``failure`` (a future), the other seeds, all ended: those not started, those
    stopped at a checkpoint (``Stopped``), those that failed too, and the runs that
    finished."""
    dropped, halted, failed, finished = [], [], [], []
    for f, seed in futures.items():
        if f is failure:
            continue
        exc = None if f.cancelled() else f.exception()
        if isinstance(exc, Stopped):
            halted.append(seed)
        elif exc is not None:
            failed.append(seed)
        elif f.cancelled() or f.result() is None:
            dropped.append(seed)
        else:
            finished.append(f.result())
    return dropped, halted, failed, finished


def epoch_records(out: Path) -> list[dict]:
    """The run directory's ``epochs.jsonl`` records (none before its first epoch)."""
    path = out / "epochs.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def recorded_time(records: list[dict], before: int) -> dict:
    """What a seed's epoch records say about every invocation that trained it."""
    revisions = Counter(str(r.get("provenance", {}).get("git_revision")) for r in records)
    return {"epochs_before": before,
            "epoch_time_s_sum": round(sum(r["epoch_time_s"] for r in records), 1),
            "epochs_by_revision": dict(revisions)}


def judged_side(validations: list[dict]) -> dict:
    """What the verdict reads of one generator's validations (``physics.json`` entries):
    the generator judged, the summaries at the first, middle and last validation, the
    last one's bins and the whole history."""
    picks = {"start": validations[0], "middle": validations[len(validations) // 2],
             "end": validations[-1]}
    last_bins = [b for b in validations[-1]["bins"] if b["events"]]
    return {"generator": validations[-1].get("generator", "raw"),
            "at": {k: {"epoch": v["epoch"], **v["summary"]} for k, v in picks.items()},
            "sampling_fraction_rel_diff_per_bin_end": {
                bin_label(b): b["sampling_fraction_rel_diff"] for b in last_bins},
            "end_bins": [end_bin(b) for b in last_bins],
            "history": [{"epoch": v["epoch"], **v["summary"],
                         "sampling_fraction_rel_diff_per_bin": per_bin(v)}
                        for v in validations]}


def raw_side(runs: list[dict]) -> list[dict] | None:
    """The runs as judged on the raw generator (the control of a ``--generator-ema`` run:
    the same steps without the average), or None when not every run has one."""
    if not runs or not all("raw" in r for r in runs):
        return None
    return [{**{k: v for k, v in r.items() if k != "raw"}, **r["raw"]} for r in runs]


def per_bin(validation: dict) -> dict[str, float | None]:
    """The generated/real - 1 sampling fraction of every energy bin that has events."""
    return {bin_label(b): b["sampling_fraction_rel_diff"] for b in validation["bins"]
            if b["events"]}


def bin_label(b: dict) -> str:
    """A physics.json energy bin as the benchmark names it: "10-100" (GeV)."""
    return f"{b['e_lo_gev']:g}-{b['e_hi_gev']:g}"


def end_bin(b: dict) -> dict:
    """One energy bin of the last validation, real against generated: the mean sampling
    fraction, its event-to-event spread (standard deviation / mean) and the hit count, and
    the standard error of generated/real - 1 (None in files older than it)."""
    def spread(side: dict) -> float | None:
        mean, std = side["sampling_fraction"], side["sampling_fraction_std"]
        return round(std / mean, 4) if mean and std is not None else None
    return {"bin_gev": bin_label(b), "events": b["events"],
            "sampling_fraction_rel_se": b.get("sampling_fraction_rel_se"),
            **{f"{key}_{name}": value for name in ("real", "gen") for key, value in (
                ("sampling_fraction", b[name]["sampling_fraction"]),
                ("sampling_fraction_spread", spread(b[name])),
                ("hits", b[name]["hits"]))}}


def dead_epoch(physics: Path, last: int) -> int | None:
    """The epoch of the last validation if the ``last`` validations in a row generated only
    empty showers (``gen_empty_fraction`` 1), else None; 0 turns the check off."""
    if last <= 0 or not physics.exists():
        return None
    try:
        validations = json.loads(physics.read_text())["validations"]
    except (ValueError, KeyError):
        return None  # being rewritten; the next poll reads it whole
    tail = validations[-last:]
    if len(tail) == last and all(v["summary"].get("gen_empty_fraction") == 1 for v in tail):
        return tail[-1]["epoch"]
    return None


def judge(runs: list[dict]) -> dict:
    """The pass criteria of the module docstring, each with its numbers."""
    checks = {}
    for run in runs:
        diffs = run["sampling_fraction_rel_diff_per_bin_end"].values()
        checks[f"seed {run['seed']}: sampling fraction within 15 % in every bin"] = (
            bool(diffs) and all(d is not None and abs(d) <= SAMPLING_FRACTION_TOLERANCE
                                for d in diffs))
        empty = run["at"]["end"].get("gen_empty_fraction")
        checks[f"seed {run['seed']}: generator alive at the end (empty showers {empty})"] = (
            empty is not None and empty <= ALIVE_EMPTY)
    for axis in "xyz":
        key = f"profile_distance_{axis}"
        first = [r["at"]["start"].get(key) for r in runs]
        last = [r["at"]["end"].get(key) for r in runs]
        if None in first or None in last:
            checks[f"{key}: measured for every seed"] = False
            continue
        for run, a, b in zip(runs, first, last):
            checks[f"seed {run['seed']}: {key} fell by half ({a:.3g} -> {b:.3g})"] = (
                b <= DISTANCE_FALL * a)
        falls = [a - b for a, b in zip(first, last)]
        spread = max(last) - min(last)
        checks[f"{key}: smallest fall {min(falls):.3g} > seed spread {spread:.3g}"] = (
            min(falls) > spread)
    return {"checks": checks, "passed": all(checks.values())}


def rule_at_last(run: dict, last: int = 4) -> list[dict]:
    """The 15 % rule at each of ``run``'s last ``last`` validations: the epoch, the
    BatchNorm statistics the generator was judged with (the run's ``generator``), the worst
    bin's relative difference and whether every bin was within the tolerance."""
    rows = []
    for h in run["history"][-last:]:
        diffs = list(h["sampling_fraction_rel_diff_per_bin"].values())
        known = [abs(d) for d in diffs if d is not None]
        rows.append({"epoch": h["epoch"], "statistics": run.get("generator", "raw"),
                     "worst_bin_rel_diff": round(max(known), 4) if known else None,
                     "within": bool(diffs) and len(known) == len(diffs)
                     and max(known) <= SAMPLING_FRACTION_TOLERANCE})
    return rows


def ended_at(run: dict, k: int) -> dict:
    """``run`` as if it had stopped after its validation ``k`` (0-based): history, start,
    middle and end points cut there (``end_bins``, of the real last validation, dropped
    when that is cut off), the raw generator's side too. With a constant learning rate a
    shorter run is this run's first steps, step for step (deterministic), so one long run
    measures every shorter budget."""
    cut = _cut(run, k)
    if "raw" in run:
        cut["raw"] = _cut(run["raw"], k)
    if k + 1 < len(run["history"]):
        cut["cut_after_epoch"] = run["history"][k]["epoch"]
    return cut


def _cut(side: dict, k: int) -> dict:
    """One generator's side (history, start, middle and end points) up to validation ``k``,
    without the last validation's ``end_bins`` when that is cut off."""
    history = side["history"][:k + 1]
    end = history[-1]
    at = {"start": history[0], "middle": history[len(history) // 2], "end": end}
    cut = {**side, "history": history,
           "at": {p: {key: v for key, v in h.items()
                      if key != "sampling_fraction_rel_diff_per_bin"} for p, h in at.items()},
           "sampling_fraction_rel_diff_per_bin_end": end["sampling_fraction_rel_diff_per_bin"]}
    if k + 1 < len(side["history"]):
        cut.pop("end_bins", None)
    return cut


def budgets(runs: list[dict], steps_per_epoch: int) -> dict | None:
    """The verdict had the runs stopped after each validation (up to the last one every
    seed reached): the steps at every validation that passes, the first such, and the share
    of the validations from there on that pass (None for runs without per-bin history)."""
    if not runs or any("sampling_fraction_rel_diff_per_bin" not in h
                       for r in runs for h in r["history"]):
        return None
    common = min(len(r["history"]) for r in runs)
    epochs = [h["epoch"] for h in runs[0]["history"][:common]]
    passing = [epoch for k, epoch in enumerate(epochs)
               if judge([ended_at(r, k) for r in runs])["passed"]]
    first = passing[0] if passing else None
    later = [e for e in epochs if first is not None and e >= first]
    return {"steps_per_epoch": steps_per_epoch, "validations": len(epochs),
            "passing_steps": [(e + 1) * steps_per_epoch for e in passing],
            "first_passing_steps": None if first is None else (first + 1) * steps_per_epoch,
            "passing_share_from_first": (round(len(passing) / len(later), 3) if later
                                         else None)}


def constant_rate(args: argparse.Namespace) -> bool:
    """No learning-rate decay in the training's settings (the recipe's, or a --lr-decay
    given): a decay depends on the whole run's length, so a shorter run is not a prefix of a
    longer one."""
    from hpcai.training.config import parse

    return parse(["3dgan", "--generate", "1", *args.train_args]).lr_decay == "none"


def table(runs: list[dict]) -> str:
    lines = [f"{'metric':34s} {'point':6s} " + " ".join(f"seed {r['seed']:<5d}" for r in runs)
             + "   median   spread"]
    for key in METRICS:
        for point in ("start", "middle", "end"):
            values = [r["at"][point].get(key) for r in runs]
            known = [v for v in values if v is not None]
            cells = " ".join(f"{v:10.4g}" if v is not None else f"{'-':>10s}" for v in values)
            stats = (f" {statistics.median(known):8.4g} {max(known) - min(known):8.4g}"
                     if known else "")
            lines.append(f"{key:34s} {point:6s} {cells}{stats}")
    return "\n".join(lines)


def steps_per_epoch(args: argparse.Namespace, runs: list[dict]) -> int:
    """The steps each epoch really ran (the data caps --max-steps), where the runs say."""
    return runs[0].get("steps_per_epoch", args.max_steps) if runs else args.max_steps


def epochs_run(args: argparse.Namespace, runs: list[dict]) -> int:
    """--epochs, or the validations (one per epoch) all seeds reached before a deadline."""
    if any(r.get("stopped_at_deadline") for r in runs):
        return min(len(r["history"]) for r in runs)
    return args.epochs


def write(path: Path, args: argparse.Namespace, info: dict, seeds: list[int],
          runs: list[dict], start: float) -> None:
    """The JSON so far: ``complete`` is false until every seed has run; verdict on those."""
    info["load_average_at_end"] = os.getloadavg()
    steps = steps_per_epoch(args, runs)
    path.write_text(json.dumps({
        "benchmark": "learning", "provenance": info,
        "budget": {"ranks": args.ranks, "epochs": epochs_run(args, runs),
                   "epochs_option": args.epochs, "steps_per_epoch": steps,
                   "max_steps_option": args.max_steps, "deadline_s": args.deadline,
                   "batch_per_rank": args.batch_size, "training_events": args.events,
                   "validate_events": args.validate_events,
                   "validate_draws": args.validate_draws, "train_args": args.train_args,
                   "stop_dead": args.stop_dead, "launch_args": args.launch_args,
                   "jobs": args.jobs},
        "wall_time_s": round(time.monotonic() - start, 1), "seeds": seeds,
        "complete": len(runs) == len(seeds),
        "criteria": {"sampling_fraction_tolerance": SAMPLING_FRACTION_TOLERANCE,
                     "distance_fall": DISTANCE_FALL, "alive_max_empty": ALIVE_EMPTY},
        "verdict": judge(runs),
        "budgets": budgets(runs, steps) if constant_rate(args) else None,
        "rule_at_last_validations": {str(r["seed"]): rule_at_last(r) for r in runs
                                     if all("sampling_fraction_rel_diff_per_bin" in h
                                            for h in r["history"])},
        **control(runs, steps, args),
        "runs": runs}, indent=1) + "\n")


def control(runs: list[dict], steps: int, args: argparse.Namespace) -> dict:
    """With ``--generator-ema``: the verdict and budgets of the same runs judged on the raw
    generator, which the average must beat to have made the difference."""
    raw = raw_side(runs)
    if raw is None:
        return {}
    return {"raw_generator": {"verdict": judge(raw),
                              "budgets": budgets(raw, steps) if constant_rate(args) else None}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--events", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--validate-events", type=int, default=128)
    parser.add_argument("--validate-draws", type=int, default=1,
                        help="generated showers per held-out event (train --validate-draws)")
    parser.add_argument("--timeout", type=float, default=0,
                        help="per seed (s); 0 (default): none, a hung rank is ended by "
                        "train's stall watchdog")
    parser.add_argument("--train-arg", dest="train_args", action="append", default=[],
                        metavar="ARG", help="passed on to train 3dgan, e.g. "
                        "--train-arg=--optimizer --train-arg=rmsprop (repeatable)")
    parser.add_argument("--stop-dead", type=int, default=2, metavar="K",
                        help="stop a seed after K validations in a row with every generated "
                        "shower empty (0: never); the seed then fails")
    parser.add_argument("--deadline", type=float, default=0, metavar="S",
                        help="stop each seed (SIGUSR1: a checkpoint) after S seconds and judge "
                        "every seed at the last validation all of them reached (0: run every "
                        "epoch)")
    parser.add_argument("--launch-arg", dest="launch_args", action="append", default=[],
                        metavar="ARG", help="passed on to hpcai-launch, e.g. "
                        "--launch-arg=--threads-per-rank --launch-arg=2 (repeatable)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="seeds trained at once (for a machine with cores or a GPU to "
                        "spare; train's --device cuda shares the GPU)")
    parser.add_argument("--workdir", default=None,
                        help="keep each seed's run directory (physics.json, PNGs) here "
                        "(default: a temporary directory, removed)")
    parser.add_argument("--json", default=None,
                        help="default bench/results/learning-HOST.json")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    info = provenance()
    start = time.monotonic()
    path = Path(args.json or REPO / "bench" / "results" / f"learning-{socket.gethostname()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        workdir = (Path(args.workdir) if args.workdir
                   else Path(stack.enter_context(tempfile.TemporaryDirectory())))
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=max(1, args.jobs)))
        stop = threading.Event()

        def attempt(seed: int) -> dict | None:
            """Run ``seed`` unless another failed (then None: not started); a failure stops
            the others at once, from its own thread, before that takes up another seed."""
            if stop.is_set():
                return None
            try:
                return run_seed(seed, args, workdir, stop)
            except BaseException:
                stop.set()
                raise

        futures = {pool.submit(attempt, seed): seed for seed in seeds}
        for done in as_completed(futures):
            try:
                run = done.result()
            except BaseException:
                # a seed that failed ends the benchmark: the seeds not yet started are not
                # started (the pool would run them, for hours, into a result never written)
                # and the running ones stop at a checkpoint
                stop.set()
                for f in futures:
                    f.cancel()
                wait(futures)
                # the root cause: a seed stopped because of it may have ended first
                done = next((f for f in futures if not f.cancelled()
                             and f.exception() is not None
                             and not isinstance(f.exception(), Stopped)), done)
                dropped, halted, failed, finished = settle(futures, done)
                known = {r["seed"] for r in runs}
                runs += [r for r in finished if r["seed"] not in known]
                if len(runs) > len(known):   # done while the others stopped: kept
                    runs.sort(key=lambda r: seeds.index(r["seed"]))
                    write(path, args, info, seeds, runs, start)
                told = [f"seeds {seeds_} {what}" for seeds_, what in
                        ((dropped, "not started"), (halted, "stopped at a checkpoint"),
                         (failed, "failed too")) if seeds_]
                if told:
                    print(f"seed {futures[done]} failed: {', '.join(told)}; rerun with "
                          "--workdir and --train-arg=--resume to continue every seed from its "
                          "last checkpoint", flush=True)
                raise done.exception()
            if run is None:   # not started: the failure behind it comes next
                continue
            runs.append(run)
            runs.sort(key=lambda r: seeds.index(r["seed"]))
            write(path, args, info, seeds, runs, start)  # an interrupted run keeps its seeds
    if any(r["stopped_at_deadline"] for r in runs):
        common = min(len(r["history"]) for r in runs)
        runs = [ended_at(r, common - 1) for r in runs]
        write(path, args, info, seeds, runs, start)
    verdict = judge(runs)
    print("\nheld-out metrics (first, middle and last validation) over "
          f"{len(runs)} seed(s):\n" + table(runs))
    for name, ok in verdict["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print("PASSED" if verdict["passed"] else "NOT PASSED: the budget is too small or the "
          "model does not learn; see the numbers above")
    steps = steps_per_epoch(args, runs)
    shorter = budgets(runs, steps) if constant_rate(args) else None
    if shorter is not None:
        print(f"stopped after each validation, the criteria hold at steps "
              f"{shorter['passing_steps'] or 'none'}; first {shorter['first_passing_steps']}, "
              f"then in {shorter['passing_share_from_first']} of the later validations")
    raw = control(runs, steps, args).get("raw_generator")
    if raw is not None:
        print(f"control, the same runs judged on the raw generator: "
              f"{'PASSED' if raw['verdict']['passed'] else 'NOT PASSED'}"
              + (f"; criteria hold at steps {raw['budgets']['passing_steps'] or 'none'}"
                 if raw["budgets"] else ""))
    print(f"wrote {path}")   # after the last seed, complete
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
