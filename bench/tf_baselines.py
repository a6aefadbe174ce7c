"""TensorFlow step time, 2 ranks x 1 thread: hpcai's engine against Horovod's own
TensorFlow 2 synthetic benchmark, run unmodified as its users bring it.

Horovod's ``examples/tensorflow2/tensorflow2_synthetic_benchmark.py`` (not shipped here:
pass its path) uses ``tf.keras.applications`` and fails under Keras 3 (``'Variable' object
has no attribute 'ref'``); with the ``tf-keras`` package installed and
``TF_USE_LEGACY_KERAS=1`` its ``tf.keras`` is Keras 2 and it runs. hpcai's own path imports
``keras`` (Keras 3) directly and is unaffected by the variable.

Sides, alternating (A B B A ...), each trial a fresh 2-rank job:

- ``hpcai``: ``train resnet50 --framework tensorflow`` (Keras 3 ResNet50, engine defaults),
  2 epochs x ``--steps`` steps, the second epoch's time per step;
- ``horovod``: the upstream script with ``hvd.DistributedGradientTape`` (Horovod's defaults),
  ``--num-warmup-batches 1 --num-batches-per-iter STEPS --num-iters 1``; step time = batch /
  its "Img/sec per CPU".

Both at batch 8 per rank, 224 px, SGD. The two sides' ResNet50s are different Keras
implementations (Keras 3 vs tf.keras 2) and hpcai's step includes its data pipeline, so the
ratio compares what a user of either gets, not the allreduce alone.

    python bench/tf_baselines.py --horovod-script PATH [--trials 10] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import Row, loopback_env, print_rows, provenance, run_alternating, write_result

BATCH = 8
TARGET = 0.9


def run_hpcai(steps: int, work: Path, log: list) -> float:
    out = work / f"hpcai-{len(log)}"
    argv = ["hpcai-launch", "-N", "2", "--threads-per-rank", "1", "--", "train", "resnet50",
            "--framework", "tensorflow", "--epochs", "2", "--max-steps", str(steps),
            "--batch-size", str(BATCH), "--samples", "256", "--out", str(out),
            "--eval-samples", "0", "--verify-every", "0"]
    result = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    record = json.loads((out / "epochs.jsonl").read_text().splitlines()[-1])
    step = record["epoch_time_s"] / record["steps"]
    log.append({"side": "hpcai", "step_s": step})
    print(f"  hpcai   {step:.3f} s/step", flush=True)
    return step


def run_horovod(script: Path, steps: int, log: list) -> float:
    argv = ["hpcai-launch", "-N", "2", "--threads-per-rank", "1", "--", sys.executable,
            str(script), "--no-cuda", "--batch-size", str(BATCH), "--num-warmup-batches", "1",
            "--num-batches-per-iter", str(steps), "--num-iters", "1"]
    result = subprocess.run(argv, env=loopback_env(TF_USE_LEGACY_KERAS="1"),
                            capture_output=True, text=True, timeout=1800)
    found = re.search(r"Img/sec per CPU: ([\d.]+)", result.stdout)
    if result.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    step = BATCH / float(found.group(1))
    log.append({"side": "horovod", "step_s": step})
    print(f"  horovod {step:.3f} s/step", flush=True)
    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horovod-script", required=True, type=Path,
                        help="Horovod's examples/tensorflow2/tensorflow2_synthetic_benchmark.py")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    info = provenance()
    log: list = []
    with tempfile.TemporaryDirectory() as tmp:
        t = run_alternating({"hpcai": lambda: run_hpcai(args.steps, Path(tmp), log),
                             "horovod": lambda: run_horovod(args.horovod_script.resolve(),
                                                            args.steps, log)},
                            args.trials, warmup=0)
    rows = [Row.measured("tf-resnet50-step-horovod", "TensorFlow resnet50 step time, hpcai ÷ "
                         "Horovod's tensorflow2_synthetic_benchmark.py", "<=", TARGET,
                         t["hpcai"], t["horovod"],
                         note="Keras 3 (hpcai) vs tf-keras 2 (Horovod's script) ResNet50"),
            Row.not_measured("tf-3dgan-step-horovod", "TensorFlow 3dgan step time, hpcai ÷ "
                             "Horovod", "<=", TARGET,
                             "Horovod ships no 3DGAN script to run as users bring it")]
    print_rows(rows)
    path = write_result("tf_baselines", info, rows, {"runs": log},
                        {"batch_per_rank": BATCH, "image": 224, "steps": args.steps,
                         "trials": args.trials, "ranks": 2, "threads_per_rank": 1,
                         "horovod_script": args.horovod_script.name})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
