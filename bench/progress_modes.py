"""The engine's progress strategies in training, per MPI family: ``thread`` against ``hook``.

``training/allreduce.py`` chooses per MPI family how a bucket's blocking calls are made
(``PROGRESS``): by the backward hooks themselves (``hook``), or by a communication thread
while backward goes on (``thread``). This benchmark is the measurement behind that choice.

Per MPI (``--mpi``, default Open MPI, MPICH and Intel MPI), ``--runs`` fresh 2-rank jobs,
1 core per rank (``hpcai-launch -N 2 --threads-per-rank 1``), per model
(``common.model_and_loss``: ResNet50 at ``--image-size`` px and the 3DGAN's generator and
discriminator, batch ``--batch-size`` per rank, SGD with momentum):
two copies of the model, one per strategy, each with its own ``GradAllreducer`` with the
engine's defaults otherwise, and both with the environment ``train`` gives the engine
(``allreduce.THREAD_ENV``: the waiting calls of Open MPI and Intel MPI yield the core).
Their training steps alternate (A B B A ...): first until neither reducer is trying call
sizes any more, plus ``--warmup`` pairs, then ``--steps`` measured pairs. Per step: the
slower rank's step time, and the main thread's wait for gradients (``SyncStats.wait_s``) of
the rank that had its gradients last (the least over the ranks). A row pools the per-step
ratios of all jobs; its 95 % interval counts the jobs as the units that vary
(``common.launch_stats``): which strategy is faster changed from one job to the next of the
same MPI here. Rows, per MPI and model:

- step time, thread ÷ hook, target <= 1.03: the thread may cost at most 3 % of a step;
- main thread's wait for gradients, thread ÷ hook (report).

A family's rows choose ``thread`` only when every step-time row is met (the thread shown to
cost no step time), else ``hook``; at the end it prints that choice beside the one
``PROGRESS`` holds. Run it on a quiet machine.

    python bench/progress_modes.py                      (bench/results/)
    python bench/progress_modes.py --mpi openmpi,mpich --models resnet50 --runs 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (RESULTS, Row, launch_stats, loopback_env, model_and_loss, print_rows,
                    provenance, write_result)

MODES = ("hook", "thread")
TARGET = 1.03


def _as_rank(args: argparse.Namespace) -> int:
    import copy

    import torch

    from hpcai.training.allreduce import GradAllreducer, MpiTransport, set_thread_env

    set_thread_env()   # as train sets it, before MPI starts
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = {}
    for name in args.models.split(","):
        torch.manual_seed(0)
        model, loss_fn = model_and_loss(name, args.batch_size, args.image_size)
        sides = {}
        for mode in MODES:
            m = copy.deepcopy(model)
            reducer = GradAllreducer(m, MpiTransport(comm), progress=mode)
            sides[mode] = (m, reducer, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
        used = {mode: sides[mode][1].progress for mode in MODES}

        def step(mode: str) -> tuple[float, float]:
            m, reducer, opt = sides[mode]
            comm.Barrier()
            start, before = time.perf_counter(), reducer.stats.wait_s
            opt.zero_grad(set_to_none=False)
            reducer.backward(loss_fn(m))
            reducer.synchronize()
            opt.step()
            return time.perf_counter() - start, reducer.stats.wait_s - before

        pairs = 0
        while True:   # until both have chosen their call size (the same count on all ranks)
            for mode in (MODES if pairs % 2 == 0 else MODES[::-1]):
                step(mode)
            pairs += 1
            if not any(sides[mode][1].tuning for mode in MODES):
                break
        times = {mode: {"step": [], "wait": []} for mode in MODES}
        for i in range(args.warmup + args.steps):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                took, waited = step(mode)
                if i >= args.warmup:
                    times[mode]["step"].append(took)
                    times[mode]["wait"].append(waited)
        gathered = comm.gather(times)
        if comm.rank == 0:
            out[name] = {
                "progress_used": used, "tuning_pairs": pairs,
                "call_bytes": {mode: [s.chunk * s.flat.element_size()
                                      for s in sides[mode][1].streams] for mode in MODES},
                **{mode: {"step_s": [max(v) for v in zip(*(g[mode]["step"] for g in gathered))],
                          "wait_s": [min(v) for v in zip(*(g[mode]["wait"] for g in gathered))]}
                   for mode in MODES}}
        for mode in MODES:
            sides[mode][1].close()
    if comm.rank == 0:
        print(json.dumps({"family": MpiTransport(comm).family, "models": out}))
    return 0


def launch(mpi: str, args: argparse.Namespace) -> dict:
    argv = ["hpcai-launch", "--mpi", mpi, "-N", "2", "--threads-per-rank", "1", "--",
            sys.executable, __file__, "--rank", "--models", args.models,
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch-size", str(args.batch_size), "--image-size", str(args.image_size)]
    out = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                         timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mpi", default="openmpi,mpich,intel",
                        help="hpcai-launch --mpi values, comma-separated")
    parser.add_argument("--models", default="resnet50,3dgan")
    parser.add_argument("--runs", type=int, default=4, help="jobs per MPI")
    parser.add_argument("--steps", type=int, default=12, help="measured pairs per model and job")
    parser.add_argument("--warmup", type=int, default=2, help="pairs after the size trials")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--image-size", type=int, default=112, help="ResNet50 input pixels")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the result here (default: bench/results/ only)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return _as_rank(args)

    from hpcai.training.allreduce import PROGRESS

    info = provenance()
    rows, trials, chosen = [], {}, {}
    for mpi in args.mpi.split(","):
        jobs = []
        for run in range(args.runs):
            print(f"{mpi}: 2-rank job {run + 1} of {args.runs}, models {args.models}",
                  flush=True)
            jobs.append(launch(mpi, args))
        family = jobs[0]["family"]
        trials[mpi] = jobs
        ok = []
        for name in args.models.split(","):
            runs = [job["models"][name] for job in jobs]

            def median(mode: str, key: str) -> float:
                return statistics.median(x for t in runs for x in t[mode][key])
            note = (f"medians: hook {median('hook', 'step_s'):.3f} s/step, wait "
                    f"{median('hook', 'wait_s') * 1e3:.1f} ms; thread "
                    f"{median('thread', 'step_s'):.3f} s/step, wait "
                    f"{median('thread', 'wait_s') * 1e3:.1f} ms; call bytes per job "
                    f"{[t['call_bytes'] for t in runs]}")
            label = f"{mpi} {name}"
            step_row = Row.across_runs(
                f"{mpi}-{name}-step", f"{label} step time, thread ÷ hook", "<=", TARGET,
                [(t["thread"]["step_s"], t["hook"]["step_s"]) for t in runs], note)
            waits = [[a / b for a, b in zip(t["thread"]["wait_s"], t["hook"]["wait_s"])]
                     for t in runs]
            rows += [step_row, Row(f"{mpi}-{name}-wait", f"{label} main thread's wait for "
                                   "gradients, thread ÷ hook", "", None,
                                   launch_stats(waits), "report")]
            ok.append(step_row.verdict)
        chosen[family] = "thread" if all(v == "met" for v in ok) else "hook"
    print_rows(rows)
    for family, mode in chosen.items():
        print(f"{family}: the rows choose {mode!r}; allreduce.PROGRESS holds "
              f"{PROGRESS.get(family)!r}", flush=True)
    settings = {"ranks": 2, "threads_per_rank": 1, "models": args.models,
                "batch_per_rank": args.batch_size, "resnet50_image": args.image_size,
                "jobs_per_mpi": args.runs, "steps": args.steps, "warmup_pairs": args.warmup,
                "optimizer": "SGD momentum 0.9",
                "chosen": chosen, "progress_table": dict(PROGRESS)}
    path = write_result("progress_modes", info, rows, trials, settings, args.results)
    if args.json:
        args.json.write_text(path.read_text())
    print(f"written: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
