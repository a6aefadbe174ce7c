"""Data-parallel equivalence on a GPU (``train --device cuda``'s allreduce through host copies):
the weight update of 2 ranks x b equals that of 1 rank x 2b, and the control (2 ranks, no
averaging) must fail the same comparison. The same programme and tolerances as
``tests/test_engine.py``, which runs them on the CPU in the suite; this runs where a GPU is.

    python bench/gpu_equivalence.py [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import loopback_env, provenance

REPO = Path(__file__).resolve().parents[1]
PROGRAM = REPO / "tests" / "programs" / "dp_equivalence.py"
sys.path.insert(0, str(REPO / "testbed"))

import dp_updates  # noqa: E402  (the suite's reading and comparison of the updates)

MODELS = ("mlp", "gan-d")   # float32, as trained; the suite's tolerances (dp_updates.TOL)


def updates(ranks: int, model: str, out: Path, device: str, *extra: str) -> dict:
    argv = ["hpcai-launch", "-N", str(ranks), "--", sys.executable, str(PROGRAM), model,
            str(out), "--device", device, *extra]
    result = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                            timeout=300, check=False)
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(argv)} exited {result.returncode}:\n"
                         f"{result.stderr[-3000:]}")
    return dp_updates.updates(out)


def worst(ref: dict, other: dict) -> float:
    return dp_updates.worst(ref, other)[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for model in MODELS:
            tol = dp_updates.TOL[model]
            one = updates(1, model, Path(tmp) / f"{model}-1.npz", args.device)
            two = updates(2, model, Path(tmp) / f"{model}-2.npz", args.device)
            alone = updates(2, model, Path(tmp) / f"{model}-c.npz", args.device, "--no-average")
            again = updates(1, model, Path(tmp) / f"{model}-1b.npz", args.device)
            row = {"model": model, "tolerance": tol, "two_ranks": worst(one, two),
                   "control_no_average": worst(one, alone),
                   "one_rank_twice": worst(one, again)}   # the device's own run-to-run noise
            row["passed"] = row["two_ranks"] <= tol < row["control_no_average"]
            ok &= row["passed"]
            rows.append(row)
            print(f"{'ok  ' if row['passed'] else 'FAIL'} {model} on {args.device}: 2 ranks "
                  f"differ by {row['two_ranks']:.3g} (<= {tol:g}); the control by "
                  f"{row['control_no_average']:.3g} (must be > {tol:g}); 1 rank run twice "
                  f"differs by {row['one_rank_twice']:.3g}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "gpu_equivalence",
                                               "provenance": provenance(),
                                               "device": args.device, "rows": rows,
                                               "passed": ok}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
