"""Launch overhead: hpcai-launch vs bare mpirun, side by side in one run.

For each trial both launchers start 2 ranks of the same tiny program, which records the
wall-clock time at which it is alive. "Time to all ranks alive" is the latest rank's
timestamp minus the moment the launcher was started. Trials alternate between the two so
machine noise hits both alike. Prints the medians, their ratio and difference, and writes
JSON. Target: hpcai-launch adds at most 0.3 s.

    python bench/launch_overhead.py [--trials 15] [--json bench/results/launch_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import loopback_env

ALIVE = ("import os, sys, time; "
         "r = os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('PMI_RANK', '0')); "
         "open(os.path.join(sys.argv[1], r), 'w').write(repr(time.time()))")
TARGET_EXTRA_S = 0.3


def time_to_alive(argv: list[str], out: Path, env: dict[str, str], ranks: int) -> float:
    for f in out.iterdir():
        f.unlink()
    start = time.time()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, timeout=120)
    stamps = [float((out / str(r)).read_text()) for r in range(ranks)]
    return max(stamps) - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--json", default="bench/results/launch_overhead.json")
    args = parser.parse_args()
    mpirun = shutil.which("mpirun.openmpi") or shutil.which("mpirun")
    hpcai = shutil.which("hpcai-launch")
    if not mpirun or not hpcai:
        print("error: needs mpirun.openmpi and hpcai-launch on PATH\n"
              "hint: run ./setup.sh, then source scripts/env.sh", file=sys.stderr)
        return 2
    env = loopback_env()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        program = [sys.executable, "-c", ALIVE, str(out)]
        bare = [mpirun, "-n", "2", "--allow-run-as-root", "--map-by", "ppr:2:numa:PE=1",
                "--bind-to", "core", *program]
        ours = [hpcai, "--mpirun", mpirun, "--ranks-per-node", "2", "--", *program]
        time_to_alive(bare, out, env, 2)  # warm caches
        time_to_alive(ours, out, env, 2)
        samples: dict[str, list[float]] = {"bare": [], "hpcai": []}
        for _ in range(args.trials):
            samples["bare"].append(time_to_alive(bare, out, env, 2))
            samples["hpcai"].append(time_to_alive(ours, out, env, 2))
    bare_s = statistics.median(samples["bare"])
    ours_s = statistics.median(samples["hpcai"])
    result = {
        "benchmark": "launch_overhead", "ranks": 2, "trials": args.trials,
        "median_bare_mpirun_s": round(bare_s, 4), "median_hpcai_launch_s": round(ours_s, 4),
        "ratio": round(ours_s / bare_s, 3), "extra_s": round(ours_s - bare_s, 4),
        "target_extra_s": TARGET_EXTRA_S, "meets_target": ours_s - bare_s <= TARGET_EXTRA_S,
        "samples": samples,
    }
    print(f"time to all 2 ranks alive (median of {args.trials}): bare mpirun {bare_s:.3f} s, "
          f"hpcai-launch {ours_s:.3f} s")
    print(f"ratio {result['ratio']:.2f}x, extra {result['extra_s']:+.3f} s "
          f"(target <= {TARGET_EXTRA_S} s: {'met' if result['meets_target'] else 'MISSED'})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
