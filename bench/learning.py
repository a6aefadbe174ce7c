"""Does the 3DGAN learn physics? 2-rank trainings on generated showers, several seeds, a fixed
budget, judged on held-out events (issue 17).

Each seed runs ``hpcai-launch -N RANKS -- train 3dgan --generate EVENTS --seed S`` for
``--epochs`` x ``--max-steps`` steps (the budget is in steps, so every seed does the same
work) with the physics validation after every epoch on ``--validate-events`` held-out events
(files of their own seed, never trained on), and reads ``physics.json``. It prints, per seed,
the held-out metrics at the first, the middle and the last validation, with the median and
the spread (max - min) over seeds, and writes them with provenance into ``--json``.

It passes when, for every seed,
- the generated sampling fraction (Σcells / E) is within 15 % of the real one in every energy
  bin at the last validation, and
- each profile distance (x, y, z) at the last validation is at most half the first one,
  and the smallest fall over seeds is larger than the spread of the last values over seeds.

    python bench/learning.py [--seeds 1,2,3] [--epochs 6] [--max-steps 16] [--events 1024]
                             [--batch-size 4] [--validate-events 128] [--json PATH]
                             [--train-arg=--optimizer --train-arg=rmsprop ...]

Run it on an otherwise idle machine. Expected duration with the defaults (an estimate, not a
full run: a 2-rank step of batch 2 per rank took about 2.1 s in this machine's smoke runs, so
batch 4 about 4 s): 6 x 16 steps, about 6.5 minutes, plus 6 validations of 128 events,
about half a minute: about 7 minutes per seed, about 20 minutes for three. A budget this size
may be too small for the criteria; the JSON then shows how far each metric got, and a larger
``--epochs`` / ``--max-steps`` is the lever.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import loopback_env, provenance

REPO = Path(__file__).resolve().parents[1]
METRICS = ("profile_distance_x", "profile_distance_y", "profile_distance_z",
           "sampling_fraction_worst_rel_diff", "hits_worst_rel_diff", "aux_mape_real",
           "aux_mape_gen", "gen_empty_fraction")
SAMPLING_FRACTION_TOLERANCE = 0.15
DISTANCE_FALL = 0.5


def run_seed(seed: int, args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / f"seed{seed}"
    argv = ["hpcai-launch", "-N", str(args.ranks), "--", "train", "3dgan", "--generate",
            str(args.events), "--seed", str(seed), "--epochs", str(args.epochs),
            "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size),
            "--validate-every", "1", "--validate-events", str(args.validate_events),
            "--eval-samples", "0", "--out", str(out), *args.train_args]
    print("$ " + " ".join(argv), flush=True)
    start = time.monotonic()
    result = subprocess.run(argv, env=loopback_env(), text=True, timeout=args.timeout)
    wall = time.monotonic() - start
    if result.returncode != 0:
        raise SystemExit(f"error: seed {seed}: training exited {result.returncode}")
    doc = json.loads((out / "physics.json").read_text())
    validations = doc["validations"]
    picks = {"start": validations[0], "middle": validations[len(validations) // 2],
             "end": validations[-1]}
    last_bins = [b for b in validations[-1]["bins"] if b["events"]]
    return {"seed": seed, "wall_s": round(wall, 1), "command": argv,
            "held_out": doc["held_out"],
            "at": {k: {"epoch": v["epoch"], **v["summary"]} for k, v in picks.items()},
            "sampling_fraction_rel_diff_per_bin_end": {
                f"{b['e_lo_gev']:g}-{b['e_hi_gev']:g}": b["sampling_fraction_rel_diff"]
                for b in last_bins},
            "history": [{"epoch": v["epoch"], **v["summary"]} for v in validations]}


def judge(runs: list[dict]) -> dict:
    """The pass criteria of the module docstring, each with its numbers."""
    checks = {}
    for run in runs:
        diffs = run["sampling_fraction_rel_diff_per_bin_end"].values()
        checks[f"seed {run['seed']}: sampling fraction within 15 % in every bin"] = (
            bool(diffs) and all(d is not None and abs(d) <= SAMPLING_FRACTION_TOLERANCE
                                for d in diffs))
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--events", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--validate-events", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=3600, help="per seed (s)")
    parser.add_argument("--train-arg", dest="train_args", action="append", default=[],
                        metavar="ARG", help="passed on to train 3dgan, e.g. "
                        "--train-arg=--optimizer --train-arg=rmsprop (repeatable)")
    parser.add_argument("--json", default=None,
                        help="default bench/results/learning-HOST.json")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    info = provenance()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_seed(seed, args, Path(tmp)) for seed in seeds]
    verdict = judge(runs)
    print("\nheld-out metrics (first, middle and last validation) over "
          f"{len(runs)} seed(s):\n" + table(runs))
    for name, ok in verdict["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print("PASSED" if verdict["passed"] else "NOT PASSED: the budget is too small or the "
          "model does not learn; see the numbers above")
    info["load_average_at_end"] = os.getloadavg()
    path = Path(args.json or REPO / "bench" / "results" / f"learning-{socket.gethostname()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "benchmark": "learning", "provenance": info,
        "budget": {"ranks": args.ranks, "epochs": args.epochs, "steps_per_epoch": args.max_steps,
                   "batch_per_rank": args.batch_size, "training_events": args.events,
                   "validate_events": args.validate_events, "train_args": args.train_args},
        "wall_time_s": round(time.monotonic() - start, 1), "seeds": seeds,
        "criteria": {"sampling_fraction_tolerance": SAMPLING_FRACTION_TOLERANCE,
                     "distance_fall": DISTANCE_FALL},
        "verdict": verdict, "runs": runs}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
