"""Achieved training FLOP/s against the measured GEMM peak, and weak scaling, for ResNet50
and the 3DGAN (real sizes), PyTorch, from real ``hpcai-launch ... -- train MODEL`` runs.

Each trial is one run of 2 epochs x ``--steps`` steps (batch 8 per rank, the engine's
defaults: channels-last, overlap); its numbers come from the second epoch's record (the
first carries warm-up). Three sides alternate (A B C C B A ...): 1 rank x 1 thread, 2 ranks
x 1 thread, and two 1-rank runs at once, each held to its own core with ``taskset``, which
exchange nothing. Rows:

- achieved GFLOP/s per rank ÷ the GEMM peak that rank measured in the same run (``torch.mm``
  probe, 1 thread), 1 rank x 1 thread: ResNet50 >= 0.8, 3DGAN >= 0.6;
- per-rank samples/s, 2 ranks x 1 thread ÷ 1 rank x 1 thread (target >= 0.95);
- reported, no target: per-rank samples/s of the two runs at once ÷ 1 rank (what sharing
  the machine leaves, the weak-scaling row's ceiling here), and 2 ranks ÷ the two runs at
  once (what the exchange costs beyond that).

Achieved FLOP are nominal: FlopCounterMode counts a convolution as the direct algorithm
would. Before the trials the bench measures three kernels on 1 thread (``kernel_rates``):
the trainer's ``torch.mm`` probe, the same GEMM through oneDNN (a 1x1 convolution), and a
3x3 convolution of ResNet50's size; their rates go into the JSON and the FLOP rows' notes.

    python bench/training_bench.py [--models resnet50,3dgan] [--trials 10] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import (Row, gan_data, loopback_env, print_rows, provenance, resolved,
                    run_until_resolved, write_result)

BATCH = {"resnet50": 8, "3dgan": 8}
PEAK_TARGET = {"resnet50": 0.8, "3dgan": 0.6}
WEAK_TARGET = 0.95


def _argv(model: str, ranks: int, steps: int, out: Path, workdir: Path) -> list[str]:
    argv = ["hpcai-launch", "-N", str(ranks), "--threads-per-rank", "1", "--",
            "train", model, "--epochs", "2", "--max-steps", str(steps),
            "--batch-size", str(BATCH[model]), "--out", str(out), "--eval-samples", "0",
            "--verify-every", "0"]
    return argv + (["--data", str(gan_data(workdir))] if model == "3dgan"
                   else ["--samples", "512"])


def _summary(model: str, ranks: int, out: Path) -> dict:
    """The second epoch's numbers of the run that wrote ``out``."""
    record = json.loads((out / "epochs.jsonl").read_text().splitlines()[-1])
    return {"model": model, "ranks": ranks, "threads": 1,
            "samples_per_s_per_rank": record["samples_per_s_per_rank"],
            "gflops_per_rank": record["gflops_per_rank"],
            "peak_gflops_per_rank": record["peak"]["gflops_per_rank"],
            "peak_source": record["peak"].get("source"),
            "step_s": record["epoch_time_s"] / record["steps"],
            **{f"{part}_s_per_step": record[f"{part}_s"] / record["steps"]
               for part in ("compute", "grad_sync", "data")}}


def _checked(argv: list[str], code: int, stderr: str) -> None:
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{stderr[-3000:]}")


def run_config(model: str, ranks: int, steps: int, workdir: Path, log: list) -> dict:
    """One ``train`` run of ``ranks`` x 1 thread; returns the second epoch's numbers."""
    out = workdir / f"{model}-{ranks}-{len(log)}"
    argv = _argv(model, ranks, steps, out, workdir)
    result = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                            timeout=1800)
    _checked(argv, result.returncode, result.stderr)
    summary = _summary(model, ranks, out)
    log.append(summary)
    print(f"  {model:9s} {ranks}x1: {summary['samples_per_s_per_rank']:.2f} samples/s/rank, "
          f"{summary['gflops_per_rank']:.1f} of {summary['peak_gflops_per_rank']:.1f} "
          "GFLOP/s", flush=True)
    return summary


def run_pair(model: str, steps: int, workdir: Path, log: list) -> dict:
    """Two 1-rank ``train`` runs at once, each held to its own core (``taskset``; the
    launcher places its rank on the CPUs it is allowed), with nothing exchanged between them:
    what sharing the machine alone leaves of the 1-rank speed. Returns their mean per-rank
    numbers."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    runs = []
    for cpu in cpus:
        out = workdir / f"{model}-pair{cpu}-{len(log)}"
        argv = ["taskset", "-c", str(cpu), *_argv(model, 1, steps, out, workdir)]
        runs.append((argv, out, subprocess.Popen(argv, env=loopback_env(), text=True,
                                                 stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE)))
    summaries = []
    for argv, out, proc in runs:
        _, stderr = proc.communicate(timeout=1800)
        _checked(argv, proc.returncode, stderr)
        summaries.append(_summary(model, 1, out))
    summary = {key: (sum(s[key] for s in summaries) / len(summaries)
                     if isinstance(summaries[0][key], float) else summaries[0][key])
               for key in summaries[0]}
    summary["ranks"], summary["pair"] = 2, True
    log.append(summary)
    print(f"  {model:9s} 2x(1x1) at once: {summary['samples_per_s_per_rank']:.2f} "
          "samples/s/rank", flush=True)
    return summary


PROBE = """
import json, time, torch
torch.set_num_threads(1)
def rate(fn, flop):
    fn()
    return round(flop / min(_time(fn) for _ in range(8)) / 1e9, 1)
def _time(fn):
    t = time.perf_counter(); fn(); return time.perf_counter() - t
n = 2048
a, b = torch.randn(n, n), torch.randn(n, n)
x = torch.randn(8, 256, 28, 28).to(memory_format=torch.channels_last)
conv = torch.nn.Conv2d(256, 256, 3, padding=1, bias=False).to(memory_format=torch.channels_last)
one = torch.nn.Conv2d(n, n, 1, bias=False).to(memory_format=torch.channels_last)
y = torch.randn(1, n, 32, 64).to(memory_format=torch.channels_last)
with torch.no_grad():
    print(json.dumps({
        "torch.mm 2048^3 (the trainer's peak probe)": rate(lambda: torch.mm(a, b), 2 * n**3),
        "1x1 convolution, channels-last, the same GEMM": rate(lambda: one(y), 2 * n**3),
        "3x3 convolution, 256 channels, 28x28, batch 8, channels-last (nominal FLOP)":
            rate(lambda: conv(x), 2 * 8 * 256 * 256 * 9 * 28 * 28)}))
"""


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def kernel_rates() -> dict:
    """Nominal GFLOP/s of three kernels on 1 thread: the trainer's GEMM probe, the same GEMM
    through oneDNN, and a ResNet50-sized 3x3 convolution counted as FlopCounterMode counts it
    (direct convolution). A 3x3 rate above the GEMM's means fewer operations than counted."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rows(model: str, t: dict, kernels: dict) -> list[Row]:
    """The rows of one model's trials ``t`` (1 rank, 2 ranks, two 1-rank runs at once)."""
    one, two = t[1], t[2]
    per_rank = {side: [r["samples_per_s_per_rank"] for r in t[side]] for side in t}
    return [
        Row.measured(f"flops-{model}", f"{model} achieved GFLOP/s ÷ measured GEMM "
                     "peak, 1 rank × 1 thread", ">=", PEAK_TARGET[model],
                     [r["gflops_per_rank"] for r in one],
                     [r["peak_gflops_per_rank"] for r in one],
                     note="nominal FLOP (direct convolution); kernel rates in the same "
                     "run, 1 thread: " + "; ".join(f"{k} {v} GFLOP/s"
                                                   for k, v in kernels.items())),
        Row.measured(f"weak-{model}", f"{model} per-rank samples/s, 2 ranks × 1 "
                     "thread ÷ 1 rank × 1 thread", ">=", WEAK_TARGET,
                     [r["samples_per_s_per_rank"] for r in two],
                     [r["samples_per_s_per_rank"] for r in one],
                     note="median s per step (mean over ranks), 1 rank → 2 ranks: "
                     + ", ".join(
                         f"{part} {_median([r[part + '_s_per_step'] for r in one]):.3f}"
                         f" → {_median([r[part + '_s_per_step'] for r in two]):.3f}"
                         for part in ("compute", "grad_sync", "data"))),
        Row.report(f"pair-{model}", f"{model} per-rank samples/s, two 1-rank runs at "
                   "once (one core each, no exchange) ÷ 1 rank × 1 thread",
                   per_rank["pair"], per_rank[1],
                   note="the ceiling of the weak-scaling row on this machine: what "
                   "two processes sharing it leave of one alone; median compute s per "
                   "step, 1 rank → two at once → 2 ranks: " + " → ".join(
                       f"{_median([r['compute_s_per_step'] for r in t[side]]):.3f}"
                       for side in (1, "pair", 2))),
        Row.report(f"exchange-{model}", f"{model} per-rank samples/s, 2 ranks × 1 "
                   "thread ÷ two 1-rank runs at once", per_rank[2], per_rank["pair"],
                   note="what the 2-rank job loses beyond sharing the machine: the "
                   "gradient exchange and the ranks waiting for each other"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,3dgan")
    parser.add_argument("--trials", type=int, default=None,
                        help="exactly this many trials per side (default: until resolved)")
    parser.add_argument("--min-trials", type=int, default=10)
    parser.add_argument("--max-trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    info = provenance()
    rows, log = [], []
    kernels = kernel_rates()
    print("kernel GFLOP/s, 1 thread:", kernels, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in args.models.split(","):
            sides = {r: (lambda r=r, m=model: run_config(m, r, args.steps, work, log))
                     for r in (1, 2)}
            sides["pair"] = lambda m=model: run_pair(m, args.steps, work, log)
            t = run_until_resolved(sides, lambda t, m=model: resolved(_rows(m, t, kernels)),
                                   args.trials, args.min_trials, args.max_trials)
            rows += _rows(model, t, kernels)
    print_rows(rows)
    path = write_result("training", info, rows, {"runs": log, "kernel_gflops": kernels},
                        {"batch_per_rank": BATCH, "steps_per_epoch": args.steps,
                         "epochs": 2, "counted": "second epoch", "trials": args.trials,
                         "min_trials": args.min_trials, "max_trials": args.max_trials,
                         "threads_per_rank": 1,
                         "flop_convention": "1 multiply-add = 2 FLOP, forward + backward "
                                            "as counted by FlopCounterMode"})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
