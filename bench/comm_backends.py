"""Gradient averaging backends side by side in one run: ours (mpi) vs Horovod vs gloo.

For ResNet50 and the 3DGAN, in PyTorch and in TensorFlow, each configuration is a real
``hpcai-launch -N 2 -- train MODEL --comm C --no-overlap`` run of 2 epochs x ``--steps``
steps; the numbers come from the second epoch's record (the first carries tracing and
warm-up). Blocking mode for every backend, so that each one's sync time splits the same
way: a barrier (the wait for the slower rank: load imbalance, not the backend's doing), then
the allreduce itself.

- ``mpi``: hpcai's fused buckets over mpi4py (the host MPI);
- ``horovod``: PyTorch: Horovod's allreduce on the same buckets; TensorFlow:
  ``horovod.tensorflow.grouped_allreduce`` of the gradient list (Horovod's own fusion);
- ``gloo``: torch.distributed gloo, the transport DDP uses on CPUs (PyTorch only).

Targets: ours no slower than Horovod (allreduce time and step time ratio <= 1.0) and
<= 0.5 x gloo's allreduce time. Configurations are run in rounds (all backends once per
round, interleaved) and the best round of each is kept, so slow phases of a shared machine
hit all backends alike.

    python bench/comm_backends.py [--frameworks pytorch,tensorflow] [--models resnet50,3dgan]
                                  [--steps 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import gan_data, loopback_env

from hpcai.training.config import horovod_built

BATCH = {"resnet50": 8, "3dgan": 8}
EXTRA = {"resnet50": ["--samples", "256", "--image-size", "112"], "3dgan": []}


def available(comm: str, framework: str) -> bool:
    if comm == "gloo":
        return framework == "pytorch"
    if comm == "horovod":
        return horovod_built("torch" if framework == "pytorch" else "tensorflow")
    return True


def run_config(framework: str, model: str, comm: str, steps: int, workdir: Path,
               data: Path) -> dict:
    out = workdir / f"{framework}-{model}-{comm}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    argv = ["hpcai-launch", "-N", "2", "--", "train", model, "--framework", framework,
            "--epochs", "2", "--max-steps", str(steps), "--batch-size", str(BATCH[model]),
            "--comm", comm, "--no-overlap", "--out", str(out), "--eval-samples", "0",
            "--verify-every", "0", "--peak-gflops", "100", *EXTRA[model]]
    if model == "3dgan":
        argv += ["--data", str(data)]
    result = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    record = json.loads((out / "epochs.jsonl").read_text().splitlines()[-1])
    n = record["steps"]
    return {
        "framework": framework, "model": model, "comm": comm,
        "comm_version": record["provenance"]["comm_version"],
        "step_s": record["epoch_time_s"] / n,
        "grad_sync_s_per_step": record["grad_sync_s"] / n,
        "allreduce_s_per_step": (record["grad_sync_s"] - record["grad_sync_imbalance_s"]) / n,
        "bytes_per_step": record["allreduce"]["bytes_per_rank"] / n,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="pytorch,tensorflow")
    parser.add_argument("--models", default="resnet50,3dgan")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="bench/results/comm_backends.json")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = gan_data(work, events=256)
        for framework in args.frameworks.split(","):
            for model in args.models.split(","):
                comms = [c for c in ("mpi", "horovod", "gloo") if available(c, framework)]
                missing = [c for c in ("horovod", "gloo") if c not in comms]
                best: dict[str, dict] = {}
                for _ in range(args.rounds):
                    for comm in comms:
                        r = run_config(framework, model, comm, args.steps, work, data)
                        if comm not in best or r["allreduce_s_per_step"] < \
                                best[comm]["allreduce_s_per_step"]:
                            best[comm] = r
                key = f"{framework}/{model}"
                print(f"{key} ({best['mpi']['bytes_per_step'] / 2**20:.1f} MiB reduced per "
                      f"step; best of {args.rounds} round(s)):", flush=True)
                for comm, r in best.items():
                    print(f"  {comm:8s} {r['comm_version']:16s} step {r['step_s']:.3f} s, "
                          f"sync {r['grad_sync_s_per_step'] * 1e3:7.1f} ms/step, of which "
                          f"allreduce {r['allreduce_s_per_step'] * 1e3:7.1f}", flush=True)
                entry = {"runs": best, "not_available": missing}
                ours = best["mpi"]
                if "horovod" in best:
                    hv = best["horovod"]
                    entry["allreduce_ratio_mpi_over_horovod"] = round(
                        ours["allreduce_s_per_step"] / hv["allreduce_s_per_step"], 3)
                    entry["step_ratio_mpi_over_horovod"] = round(
                        ours["step_s"] / hv["step_s"], 3)
                if "gloo" in best:
                    entry["allreduce_ratio_mpi_over_gloo"] = round(
                        ours["allreduce_s_per_step"] / best["gloo"]["allreduce_s_per_step"], 3)
                ratios = ", ".join(f"{k.replace('_ratio_', ' ').replace('_over_', '/')} {v:.2f}"
                                   for k, v in entry.items() if k.endswith(("horovod", "gloo"))
                                   and isinstance(v, float))
                print(f"  => {ratios or 'nothing to compare'} (targets: vs horovod <= 1.0, "
                      f"allreduce vs gloo <= 0.5)"
                      + (f"; not available: {', '.join(missing)}" if missing else ""),
                      flush=True)
                results[key] = entry
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
