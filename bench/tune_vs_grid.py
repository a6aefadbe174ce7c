"""tune's first choice against the best layout of the whole grid, measured (issue 16).

    python bench/tune_vs_grid.py [--budget 120] [--trials 3] [--steps 3] [--out FILE]

Runs ``hpcai-launch tune`` on the 3DGAN (batch 4 per rank, generated showers), then measures
every layout ranks x threads <= cores of this node ``--trials`` times, alternating the order
of the layouts between trials (forward, backward, ...), each trial 2 epochs of ``--steps``
steps with the second epoch counted (samples/s per node = ranks x batch x steps / epoch
time). Prints per layout the trials, median and spread, tune's choice, the best median, and
their ratio; PASS when tune's choice reaches at least 95 % of the best median. Writes JSON
with provenance (load average included: on a shared machine the spread says how much to
trust the figures) to ``--out`` (default bench/results/tune_vs_grid-<host>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import gan_data, loopback_env, provenance

REPO = Path(__file__).resolve().parents[1]
BATCH = 4


def measure(train: list[str], ranks: int, threads: int, steps: int, out: Path) -> float:
    from hpcai.perf.tune import train_once
    rec = train_once(train, ranks, threads, steps, out, 900.0)
    return ranks * BATCH * rec.steps / rec.epoch_time_s


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/tune_vs_grid.py")
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" /
                                             f"tune_vs_grid-{socket.gethostname()}.json"))
    ns = parser.parse_args()
    os.environ.update(loopback_env())
    info = provenance()
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-tune-"))
    data = gan_data(work, 64)
    train = ["train", "3dgan", "--data", str(data), "--batch-size", str(BATCH)]
    tune_json = work / "tune.json"
    done = subprocess.run([sys.executable, "-m", "hpcai.launcher", "tune", "--budget",
                           str(ns.budget), "--steps", str(ns.steps), "--no-net", "--json",
                           str(tune_json), "--", *train], capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    tune = json.loads(tune_json.read_text())
    choice = (tune["ranking"][0]["ranks"], tune["ranking"][0]["threads"])
    from hpcai.perf.tune import candidates, physical_cores
    grid = candidates(physical_cores(), 1 << 30)
    trials: dict[tuple[int, int], list[float]] = {g: [] for g in grid}
    for k in range(ns.trials):
        order = grid if k % 2 == 0 else list(reversed(grid))
        for r, t in order:
            rate = measure(train, r, t, ns.steps, work / f"t{k}-r{r}t{t}")
            trials[(r, t)].append(rate)
            print(f"trial {k}: {r} x {t}: {rate:.4g} samples/s per node", flush=True)
    medians = {g: statistics.median(v) for g, v in trials.items()}
    best = max(medians, key=medians.get)
    ratio = medians[choice] / medians[best]
    verdict = "PASS" if ratio >= 0.95 else "FAIL"
    print(f"{ns.trials} trials per layout, order alternating:")
    for g, values in trials.items():
        print(f"  {g[0]} rank(s) x {g[1]} thread(s): median {medians[g]:.4g}, spread "
              f"{min(values):.4g}..{max(values):.4g}, trials "
              + ", ".join(f"{v:.4g}" for v in values))
    print(f"tune's choice {choice[0]} x {choice[1]}: {medians[choice]:.4g}; best measured "
          f"{best[0]} x {best[1]}: {medians[best]:.4g}; ratio {ratio:.3f} -> {verdict} "
          "(>= 0.95)")
    info["load_average_at_end"] = os.getloadavg()
    doc = {"benchmark": "tune_vs_grid", "provenance": info,
           "wall_time_s": round(time.monotonic() - start, 1),
           "setup": {"model": "3dgan", "batch_per_rank": BATCH, "steps": ns.steps,
                     "budget_s": ns.budget, "trials": ns.trials},
           "tune": {"choice": list(choice), "ranking": tune["ranking"],
                    "provenance": tune["provenance"]},
           "grid": [{"ranks": g[0], "threads": g[1], "trials": v, "median": medians[g]}
                    for g, v in trials.items()],
           "best": list(best), "ratio": ratio, "verdict": verdict}
    Path(ns.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {ns.out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
