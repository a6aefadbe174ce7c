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

The 3DGAN (``--models``): Horovod ships no 3DGAN script, so both sides are ``train 3dgan
--framework tensorflow`` on the same generated showers, the engine (``--comm mpi``) against
``--comm horovod`` (``horovod.tensorflow.grouped_allreduce``, op=Average, Horovod's fusion
and cycle defaults, no HOROVOD_* variable set), one warm-up pair first.

Both at batch 8 per rank, 224 px, SGD. The two sides' ResNet50s are different Keras
implementations (Keras 3 vs tf.keras 2) and hpcai's step includes its data pipeline, so the
ratio compares what a user of either gets, not the allreduce alone.

    python bench/tf_baselines.py --horovod-script PATH [--models resnet50,3dgan] [--trials 10]
        [--steps 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import (Row, gan_data, loopback_env, print_rows, provenance, run_alternating,
                    write_result)

BATCH = 8
TARGET = 0.9


def run_train(model: str, comm: str, steps: int, work: Path, log: list) -> float:
    """One ``train MODEL --framework tensorflow --comm COMM`` job; the second epoch's time
    per step."""
    out = work / f"{model}-{comm}-{len(log)}"
    argv = ["hpcai-launch", "-N", "2", "--threads-per-rank", "1", "--", "train", model,
            "--framework", "tensorflow", "--comm", comm, "--epochs", "2", "--max-steps",
            str(steps), "--batch-size", str(BATCH), "--out", str(out), "--eval-samples", "0",
            "--verify-every", "0"]
    argv += ["--data", str(gan_data(work))] if model == "3dgan" else ["--samples", "256"]
    result = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    record = json.loads((out / "epochs.jsonl").read_text().splitlines()[-1])
    step = record["epoch_time_s"] / record["steps"]
    log.append({"side": f"{model} {comm}", "step_s": step})
    print(f"  {model:8s} train --comm {comm:7s} {step:.3f} s/step", flush=True)
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
    parser.add_argument("--models", default="resnet50,3dgan")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    info = provenance()
    log: list = []
    script = args.horovod_script.resolve()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "resnet50" in args.models:
            t = run_alternating({"hpcai": lambda: run_train("resnet50", "mpi", args.steps,
                                                            work, log),
                                 "horovod": lambda: run_horovod(script, args.steps, log)},
                                args.trials, warmup=0)
            rows.append(Row.measured(
                "tf-resnet50-step-horovod", "TensorFlow resnet50 step time, hpcai ÷ "
                "Horovod's tensorflow2_synthetic_benchmark.py", "<=", TARGET,
                t["hpcai"], t["horovod"],
                note="Keras 3 (hpcai) vs tf-keras 2 (Horovod's script) ResNet50"))
        if "3dgan" in args.models:
            t = run_alternating({"hpcai": lambda: run_train("3dgan", "mpi", args.steps,
                                                            work, log),
                                 "horovod": lambda: run_train("3dgan", "horovod", args.steps,
                                                              work, log)},
                                args.trials, warmup=1)
            rows.append(Row.measured(
                "tf-3dgan-step-horovod", "TensorFlow 3dgan step time, hpcai ÷ Horovod "
                "grouped_allreduce (op=Average)", "<=", TARGET, t["hpcai"], t["horovod"],
                note="Horovod ships no 3DGAN script: the same Keras 3DGAN and training loop, "
                "its gradients averaged by horovod.tensorflow.grouped_allreduce with Horovod's "
                "defaults (train --comm horovod) instead of the engine"))
    print_rows(rows)
    path = write_result("tf_baselines", info, rows, {"runs": log},
                        {"batch_per_rank": BATCH, "image": 224, "steps": args.steps,
                         "trials": args.trials, "ranks": 2, "threads_per_rank": 1,
                         "horovod_script": args.horovod_script.name,
                         "horovod_script_sha256": hashlib.sha256(script.read_bytes()).hexdigest()})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
