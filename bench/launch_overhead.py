"""Launch overhead: hpcai-launch against bare mpirun, side by side in one run.

Each trial starts 2 ranks of the same tiny program. The program records the wall-clock time
at which it is alive. "Time to all ranks alive" is the latest rank's timestamp minus the
moment the launcher was started. The baseline is Open MPI's mpirun with the binding that
hpcai-launch plans on this machine (``--map-by ppr:2:numa:PE=1 --bind-to core``). Sides
alternate (A B C C B A ...), ``--trials`` each, after one warm-up run of each. Row: the
seconds hpcai-launch adds, per trial (target <= 0.1 s, interval included). A third side, one
Python process of the program started directly (it marks both ranks alive), is the floor of
what any Python launcher adds; its median is in the row's note. The times of all sides are
in the JSON.

    python bench/launch_overhead.py [--trials 20]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Row, loopback_env, print_rows, provenance, run_alternating, write_result

ALIVE = ("import os, sys, time; "
         "r = os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('PMI_RANK', '0')); "
         "open(os.path.join(sys.argv[1], r), 'w').write(repr(time.time()))")
TARGET_EXTRA_S = 0.1
RANKS = 2
ALIVE_ALL = ("import os, sys, time; "      # one process that marks every rank alive
             f"[open(os.path.join(sys.argv[1], str(r)), 'w').write(repr(time.time())) "
             f"for r in range({RANKS})]")


def time_to_alive(argv: list[str], out: Path, env: dict[str, str]) -> float:
    for f in out.iterdir():
        f.unlink()
    start = time.time()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, timeout=120)
    stamps = [float((out / str(r)).read_text()) for r in range(RANKS)]
    return max(stamps) - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    mpirun = shutil.which("mpirun.openmpi") or shutil.which("mpirun")
    hpcai = shutil.which("hpcai-launch")
    if not mpirun or not hpcai:
        print("error: needs mpirun.openmpi and hpcai-launch on PATH\n"
              "hint: run ./setup.sh, then source scripts/env.sh", file=sys.stderr)
        return 2
    if args.trials < 1:
        print(f"error: --trials must be at least 1, got {args.trials}\n"
              "hint: give the number of runs per side (default 20)", file=sys.stderr)
        return 2
    info = provenance()
    env = loopback_env()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        program = [sys.executable, "-c", ALIVE, str(out)]
        bare = [mpirun, "-n", str(RANKS), "--allow-run-as-root", "--map-by", "ppr:2:numa:PE=1",
                "--bind-to", "core", *program]
        ours = [hpcai, "--mpirun", mpirun, "--ranks-per-node", str(RANKS), "--", *program]
        python = [sys.executable, "-c", ALIVE_ALL, str(out)]
        times = run_alternating({"hpcai-launch": lambda: time_to_alive(ours, out, env),
                                 "bare mpirun": lambda: time_to_alive(bare, out, env),
                                 "one python": lambda: time_to_alive(python, out, env)},
                                args.trials)
    a, b = times["hpcai-launch"], times["bare mpirun"]
    note = (f"median time to all ranks alive: hpcai-launch {statistics.median(a):.3f} s, "
            f"bare mpirun {statistics.median(b):.3f} s; one Python process of the program "
            f"alone: {statistics.median(times['one python']):.3f} s")
    rows = [Row.measured_difference(
        "launch-extra-s", "seconds to all 2 ranks alive, hpcai-launch − bare mpirun", "<=",
        TARGET_EXTRA_S, a, b, note)]
    print_rows(rows)
    settings = {"ranks": RANKS, "launcher": mpirun, "bare binding": "ppr:2:numa:PE=1 core",
                "trials per side": args.trials}
    path = write_result("launch_overhead", info, rows, {k: v for k, v in times.items()},
                        settings)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
