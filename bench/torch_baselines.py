"""Step time and exposed gradient-sync time, PyTorch, 2 ranks x 1 thread: hpcai's engine
against the stock baselines a Horovod or DDP user would run, side by side in one run.

Each trial is a fresh ``hpcai-launch -N 2`` job of one side (hpcai's first runs synced
steps until its reducer has chosen its call size, the engine's start-up: ``_Tuner``, about
26 steps), then ``--warmup`` + ``--steps``
training steps of the same model, batch, optimiser (SGD) and synthetic data, each followed or
preceded (alternately) by the same step on an unwrapped copy of the model with no
communication. Per step the slower rank's time counts; a trial gives the median synced step
time and the median of (synced - local) per step pair: the gradient-sync time the side
exposes on top of the compute. Rank 0 also reports the CPU seconds of each of its threads
over the measured loop (``/proc/self/task``), which shows what a background thread costs.
Sides:

- ``hpcai``: the engine's ``GradAllreducer`` with its defaults (4 MiB buckets, overlap with
  backward, the MPI family's progress, mpi4py on the job's MPI), run as ``train`` runs it:
  with the environment it gives the engine (``allreduce.THREAD_ENV``) and backward through
  ``GradAllreducer.backward`` (the loss divided by the world size, so no pass divides the
  gradients);
- ``horovod``: ``hvd.DistributedOptimizer`` with Horovod's defaults (fusion buffer, cycle
  time, overlap with backward; no HOROVOD_* variable set), as Horovod's PyTorch examples
  use it;
- ``ddp``: ``DistributedDataParallel`` on gloo with its defaults (25 MiB buckets, overlap);
  ``ddp-<N>mb``: with ``bucket_cap_mb=N`` (the sweep, ``--ddp-buckets``);

All sides use the default (channels-first) memory format: Horovod 0.28.1 refuses
channels-last tensors ("Tensor is required to be contiguous" in broadcast and allreduce).
Trials alternate (A B C C B A ...), warm-up steps are excluded. Rows: step time hpcai ÷
horovod (target <= 0.9), and exposed sync hpcai ÷ best DDP (target <= 0.5): the wait for
gradients each side times inside its own step: hpcai's ``SyncStats.wait_s`` (the main
thread in the backward hooks' reductions and in ``synchronize``), DDP's from its last
parameter's gradient to backward's return (its reducer's wait for the buckets), Horovod's
from the last gradient to the end of ``DistributedOptimizer.synchronize()``; per step the
wait of the rank that had its gradients last (the least over the ranks: the other rank's
wait for that backward is load imbalance, not communication). A report row
gives, for scale, the synced − local step ratio (a difference of two step times, too noisy
to judge). The best DDP bucket size is the one with the least wait over ``--sweep-trials``
trials per size. Trials run in rounds until every judged row's
95 % interval lies on one side of its target (at least ``--min-trials``, at most
``--max-trials``); ``--trials N`` runs exactly N. Run it on a quiet machine.

    python bench/torch_baselines.py --sweep-trials 5 --min-trials 10 --max-trials 40 \\
        --json out.json
    python bench/torch_baselines.py --models resnet50 --trials 10 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

from pathlib import Path

from common import (RESULTS, Row, loopback_env, model_and_loss, print_rows, provenance,
                    resolved, write_result)


def _as_rank(side: str, model_name: str, args: argparse.Namespace) -> int:
    import copy

    import torch

    if side == "hpcai":   # the environment train gives the engine, before MPI starts
        from hpcai.training.allreduce import set_thread_env

        set_thread_env()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model, loss_fn = model_and_loss(model_name, args.batch_size, args.image_size)
    steps, warmup, port = args.steps, args.warmup, args.port
    plain = copy.deepcopy(model)          # the same step without any communication
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if side == "hpcai":
        from hpcai.training.allreduce import GradAllreducer, MpiTransport

        reducer = GradAllreducer(model, MpiTransport(comm))
    elif side == "horovod":
        import horovod.torch as hvd

        hvd.init()
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif side.startswith("ddp"):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=comm.rank, world_size=comm.size)
        kw = {"bucket_cap_mb": float(side[4:-2])} if side != "ddp" else {}
        model = torch.nn.parallel.DistributedDataParallel(model, **kw)

    # Each side's own wait for gradients inside the step, timed directly: hpcai's
    # SyncStats.wait_s (the main thread in the backward hooks' reductions and in
    # synchronize); DDP's and Horovod's from the last parameter's gradient (a
    # post-accumulate-grad hook, after their own hooks) to the end of the step's
    # communication (backward's return for DDP, whose reducer waits for its buckets in
    # backward's final callback; DistributedOptimizer.synchronize() for Horovod).
    last_grad = [0.0]
    waits: list[float] = []
    if side != "hpcai":
        inner = model.module if hasattr(model, "module") else model
        for p in inner.parameters():
            p.register_post_accumulate_grad_hook(
                lambda _p: last_grad.__setitem__(0, time.perf_counter()))

    def synced() -> None:
        if side == "hpcai":
            opt.zero_grad(set_to_none=False)   # gradients stay views into the buckets
            before = reducer.stats.wait_s
            reducer.backward(loss_fn(model))   # as train: the loss divided by the world size
            reducer.synchronize()
        else:
            opt.zero_grad()
            loss_fn(model).backward()
        if side == "horovod":
            opt.synchronize()
        if side != "hpcai":
            waits.append(time.perf_counter() - last_grad[0])
        if side == "horovod":
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        if side == "hpcai":
            waits.append(reducer.stats.wait_s - before)

    def local() -> None:
        # gradients kept allocated: the baseline step pays no allocation (and no page faults
        # of ~100 MB of fresh gradients), so no side's exposed sync hides under it
        plain_opt.zero_grad(set_to_none=False)
        loss_fn(plain).backward()
        plain_opt.step()

    tuning_steps = 0
    while side == "hpcai" and reducer.tuning and tuning_steps < 100:
        synced()   # the engine's first steps try call sizes (_Tuner): its start-up, not its step
        tuning_steps += 1
    times: dict[str, list[float]] = {"synced": [], "local": [], "wait": []}
    cpu_before = thread_cpu_s()
    for i in range(warmup + steps):   # synced and local steps alternate: A B B A ...
        for kind, step in ((("synced", synced), ("local", local)) if i % 2 == 0 else
                           (("local", local), ("synced", synced))):
            comm.Barrier()
            t0 = time.perf_counter()
            step()
            if i >= warmup:
                times[kind].append(time.perf_counter() - t0)
                if kind == "synced":
                    times["wait"].append(waits[-1])
    cpu_after = thread_cpu_s()
    main_tid = threading.get_native_id()
    threads = sorted(((("main" if tid == main_tid else name),
                       round(cpu - cpu_before.get(tid, (name, 0.0))[1], 2))
                      for tid, (name, cpu) in cpu_after.items()), key=lambda t: -t[1])
    # per step: the slower rank's step time; the wait of the rank that had its gradients
    # last (the least wait over the ranks), so that the other rank's wait for its backward
    # (load imbalance, not communication) is left out on every side alike
    slowest = {k: [(min if k == "wait" else max)(ts) for ts in zip(*comm.allgather(v))]
               for k, v in times.items()}
    if comm.rank == 0:
        print(json.dumps({"median_step_s": statistics.median(slowest["synced"]),
                          "median_local_s": statistics.median(slowest["local"]),
                          "exposed_sync_s": statistics.median(
                              a - b for a, b in zip(slowest["synced"], slowest["local"])),
                          "sync_wait_s": statistics.median(slowest["wait"]),
                          "steps_s": slowest, "threads": torch.get_num_threads(),
                          "tuning_steps": tuning_steps,
                          "rank0_thread_cpu_s": [t for t in threads if t[1] > 0]}))
    if side.startswith("ddp"):
        # gloo's threads and interpreter exit raced here: once SIGABRT in
        # ProcessGroupGloo::runLoop at exit, once (with destroy_process_group) a job that
        # never ended. The steps are measured; end the process without tearing gloo down.
        sys.stdout.flush()
        comm.Barrier()
        MPI.Finalize()
        os._exit(0)
    if side == "horovod":
        hvd.shutdown()
    return 0


def _rows(model: str, t: dict[str, list[dict]], ddp: str) -> list[Row]:
    """The rows of one model's trials ``t`` (each side's run records) against DDP ``ddp``."""
    step = {s: [r["median_step_s"] for r in v] for s, v in t.items()}
    exposed = {s: [r["exposed_sync_s"] for r in v] for s, v in t.items()}
    return [
        Row.measured(f"torch-{model}-step-horovod",
                     f"PyTorch {model} step time, hpcai ÷ Horovod DistributedOptimizer",
                     "<=", 0.9, step["hpcai"], step["horovod"]),
        Row.measured(f"torch-{model}-wait-ddp",
                     f"PyTorch {model} exposed sync per step (wait for gradients, timed "
                     f"inside the step), hpcai ÷ DDP gloo ({ddp})", "<=", 0.5,
                     [r["sync_wait_s"] for r in t["hpcai"]],
                     [r["sync_wait_s"] for r in t[ddp]],
                     note="hpcai: the main thread in the backward hooks' reductions and in "
                     "synchronize(); DDP: from the last parameter's gradient to "
                     "backward's return (its reducer's wait); per step the rank that had its "
                     "gradients last (the least wait over the ranks)"),
        Row.report(f"torch-{model}-sync-ddp",
                   f"PyTorch {model} synced − local step, hpcai ÷ DDP gloo ({ddp}), "
                   "for scale", exposed["hpcai"], exposed[ddp],
                   note="a synced step − the same step without communication, "
                   "alternating in the same job: the difference of two step times"),
    ]


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of this process, by thread id, with the
    thread's name (``/proc/self/task/*/stat``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{task}/stat").read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        fields = rest.split()
        out[int(task)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(side: str, model: str, args: argparse.Namespace, log: list) -> dict:
    """One trial: a fresh 2-rank job of ``side``; returns its record (median step time,
    median exposed sync time)."""
    argv = ["hpcai-launch", "-N", "2", "--threads-per-rank", "1", "--", sys.executable,
            __file__, "--rank", side, "--models", model, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
            "--image-size", str(args.image_size), "--port", str(_free_port())]
    for attempt in (1, 2):   # a failed job is recorded, and retried once
        out = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                             timeout=1200)
        if out.returncode == 0:
            break
        log.append({"side": side, "model": model, "failed": out.returncode,
                    "stderr_tail": out.stderr[-1500:]})
        print(f"  {model:8s} {side:10s} job failed (exit {out.returncode}), attempt {attempt}",
              flush=True)
    else:
        raise RuntimeError(f"{' '.join(argv)} failed twice:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    log.append({"side": side, "model": model, **result})
    print(f"  {model:8s} {side:10s} {result['median_step_s']:.3f} s/step, exposed sync "
          f"{result['exposed_sync_s'] * 1e3:7.1f} ms, wait timed inside the step "
          f"{result['sync_wait_s'] * 1e3:7.1f} ms", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50,3dgan")
    parser.add_argument("--trials", type=int, default=None,
                        help="exactly this many trials per side (default: until resolved)")
    parser.add_argument("--min-trials", type=int, default=10)
    parser.add_argument("--max-trials", type=int, default=40)
    parser.add_argument("--sweep-trials", type=int, default=5, help="per DDP bucket size")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ddp-buckets", default="5,100")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--image-size", type=int, default=112, help="ResNet50 input pixels")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the result JSON to this file (instead of bench/results/)")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return _as_rank(args.rank, args.models, args)
    from common import run_alternating, run_until_resolved

    info = provenance()
    rows, log = [], []
    for model in args.models.split(","):
        def side(name: str, model: str = model):
            return lambda: launch(name, model, args, log)
        # the DDP bucket sweep: default and each size, alternating; the best goes on
        sweep = ["ddp"] + [f"ddp-{b}mb" for b in args.ddp_buckets.split(",") if b]
        swept = run_alternating({s: side(s) for s in sweep}, args.sweep_trials, warmup=0)
        best_ddp = min(swept, key=lambda s: statistics.median(
            r["sync_wait_s"] for r in swept[s]))
        print(f"  {model}: best DDP setting (least wait for gradients) {best_ddp}",
              flush=True)
        sides = {s: side(s) for s in ("hpcai", "horovod", best_ddp)}
        t = run_until_resolved(sides, lambda t, m=model, d=best_ddp: resolved(_rows(m, t, d)),
                               args.trials, args.min_trials, args.max_trials)
        rows += _rows(model, t, best_ddp)
    print_rows(rows)
    path = write_result("torch_baselines", info, rows, {"runs": log},
                        {"batch_per_rank": args.batch_size, "resnet50_image": args.image_size,
                         "steps": args.steps, "warmup_steps": args.warmup,
                         "trials": args.trials, "min_trials": args.min_trials,
                         "max_trials": args.max_trials, "sweep_trials": args.sweep_trials,
                         "ranks": 2, "threads_per_rank": 1, "optimizer": "SGD momentum 0.9",
                         "horovod_env": {k: v for k, v in os.environ.items()
                                         if k.startswith("HOROVOD_")}},
                        out_dir=args.json.parent if args.json else RESULTS)
    if args.json:
        path = path.rename(args.json)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
