"""How much an ``MPI_Allreduce`` slows down when work runs between calls, 2 ranks.

The target rows of ``allreduce_bw`` compare a training step's exchange with raw calls made
back to back. An engine always does some work between two exchanges (its hooks and
``synchronize``), so this measures the ceiling that work sets, whoever does it. One float32
buffer on transparent huge pages (``hostmem.huge_zeros``) of the 3DGAN's gradient bytes
(``--bytes``), reduced in place in one call, as the engine reduces it when the whole arena
is its fastest call size. Sides: the calls back to back, and the calls each
after ``g`` µs of busy work in Python on every rank (``--gaps``), and after the engine's
own work for one 3DGAN exchange (its backward hooks and ``synchronize`` with a transport
that sends nothing, timed apart), beside that work back to back. A trial repeats the
exchange until it lasts about ``--trial-ms``; the sides alternate (A B C .. C B A), the first
round is warm-up. Each launch is a fresh 2-rank job (``--runs`` launches; the intervals count
launches as the units that vary, ``common.launch_stats``).

Reported rows (no target), per gap: back to back ÷ (the exchange after the gap, the gap
left out), how much slower the call itself got; and back to back ÷ (gap + exchange), the
most an engine with that much work per exchange can reach in ``allreduce_bw``'s rows; and
the engine's work back to back ÷ the same work right after an exchange, and the exchange
back to back ÷ (that work, then the exchange).

    python bench/call_gap.py --mpi openmpi            (bench/results/)
    python bench/call_gap.py --mpi mpich --runs 6 --gaps 0.5,2,5,10,20,40
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import (RESULTS, Row, alternating_order, loopback_env, print_rows, provenance,
                    write_result)

BACK_TO_BACK = "back to back"
WORK_ALONE = "the engine's own work, back to back"
AFTER_WORK = "after the engine's own work"
WORK_AFTER = "the engine's own work, right after an exchange"   # AFTER_WORK's work part


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _as_rank(args: argparse.Namespace) -> int:
    import numpy as np

    from hpcai.training.allreduce import mpi_family, set_thread_env
    from hpcai.training.hostmem import huge_zeros

    set_thread_env()   # the environment train gives the engine, before MPI starts
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = args.bytes // 4
    start = (np.random.default_rng(comm.rank).standard_normal(n) * 2.0**-100).astype(np.float32)
    buf = huge_zeros(n, np.float32)
    buf[:] = start

    def exchange() -> None:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def after(gap_s: float):
        def run() -> None:
            _spin(gap_s)
            exchange()
        return run

    # the engine's own work for one 3DGAN exchange: its hooks and synchronize, with a
    # transport that sends nothing (allreduce_bw's diagnostic side)
    import torch

    from allreduce_bw import _Idle
    from hpcai.models import gan3d
    from hpcai.training.allreduce import GradAllreducer

    torch.set_num_threads(1)
    model = torch.nn.ModuleList([gan3d.Generator(), gan3d.Discriminator()])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    idle = GradAllreducer(model, _Idle(), call_mb=1e6)
    in_work = [0.0]   # this trial's seconds in the work, where it runs after an exchange

    def work() -> None:
        idle.replay_backward()
        idle.synchronize()

    def after_work() -> None:
        t0 = time.perf_counter()
        work()
        in_work[0] += time.perf_counter() - t0
        exchange()

    gaps = [float(g) for g in args.gaps.split(",") if g]
    sides = {BACK_TO_BACK: exchange, **{_side(g): after(g * 1e-6) for g in gaps},
             WORK_ALONE: work, AFTER_WORK: after_work}
    calls = 1

    def timed(fn) -> float:
        """Seconds per exchange over ``calls`` of them, the slower rank's."""
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / calls

    one = min(timed(exchange) for _ in range(3))   # warm-up, and the trial's length
    buf[:] = start
    calls = comm.bcast(max(1, min(32, round(args.trial_ms / 1e3 / one))), root=0)
    values: dict[str, list[float]] = {s: [] for s in [*sides, WORK_AFTER]}
    for s in sides:   # warm-up round
        timed(sides[s])
    buf[:] = start   # the sums double the values: back to small normal floats
    while len(values[BACK_TO_BACK]) < args.trials:
        for s in alternating_order(list(sides), 2):
            in_work[0] = 0.0
            values[s].append(timed(sides[s]))
            if s == AFTER_WORK:   # the work's part, the slower rank's
                values[WORK_AFTER].append(comm.allreduce(in_work[0], op=MPI.MAX) / calls)
        buf[:] = start
    hooks = len(idle._hooks)   # backward hooks that run per exchange
    idle.close()
    if comm.rank == 0:
        print(json.dumps({"family": mpi_family(), "call_bytes": n * 4,
                          "calls_per_trial": calls, "engine_hooks": hooks,
                          "seconds": values}))
    return 0


def _side(gap_us: float) -> str:
    return f"after {gap_us:g} us of work"


def _rows(runs: list[dict], gaps: list[float]) -> list[Row]:
    rows = []
    for g in gaps:
        side = _side(g)
        rows.append(Row.across_runs(
            f"call-gap-{g:g}us-call", f"the exchange back to back ÷ the exchange after {g:g} µs "
            f"of work (the work left out)", "", None,
            [(r["seconds"][BACK_TO_BACK], [t - g * 1e-6 for t in r["seconds"][side]])
             for r in runs]))
        rows.append(Row.across_runs(
            f"call-gap-{g:g}us-ceiling", f"the exchange back to back ÷ ({g:g} µs of work, then "
            f"the exchange): the most an engine with that much work per exchange reaches",
            "", None, [(r["seconds"][BACK_TO_BACK], r["seconds"][side]) for r in runs]))
    rows.append(Row.across_runs(
        "call-gap-engine-work", "the engine's own work for one 3DGAN exchange "
        f"({runs[0].get('engine_hooks', '?')} backward hook(s) and synchronize, a transport "
        "that sends nothing): back to back ÷ right after an exchange", "", None,
        [(r["seconds"][WORK_ALONE], r["seconds"][WORK_AFTER]) for r in runs]))
    rows.append(Row.across_runs(
        "call-gap-engine-ceiling", "the exchange back to back ÷ (the engine's own work, then "
        "the exchange)", "", None,
        [(r["seconds"][BACK_TO_BACK], r["seconds"][AFTER_WORK]) for r in runs]))
    return rows


def _gan_bytes() -> int:
    import torch

    from hpcai.models import gan3d

    model = torch.nn.ModuleList([gan3d.Generator(), gan3d.Discriminator()])
    return sum(p.numel() * 4 for p in model.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=0,
                        help="buffer bytes (default: the 3DGAN's gradient set)")
    parser.add_argument("--gaps", default="2,5,10,20,40", help="µs of work before a call")
    parser.add_argument("--trials", type=int, default=20, help="trials per side in one launch")
    parser.add_argument("--runs", type=int, default=6, help="launches (fresh 2-rank jobs)")
    parser.add_argument("--trial-ms", type=float, default=20.0,
                        help="a trial repeats the exchange until it lasts about this long")
    parser.add_argument("--mpi", default="auto", help="hpcai-launch --mpi (the MPI to run on)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    if any(v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
        return _as_rank(args)
    info = provenance()
    nbytes = args.bytes or _gan_bytes()
    argv = ["hpcai-launch", "-N", "2", "--threads-per-rank", "1", "--mpi", args.mpi, "--",
            sys.executable, __file__, "--bytes", str(nbytes), "--gaps", args.gaps,
            "--trials", str(args.trials), "--trial-ms", str(args.trial_ms)]
    gaps = [float(g) for g in args.gaps.split(",") if g]
    runs: list[dict] = []
    for i in range(args.runs):
        out = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                             timeout=1800)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"launch {i + 1}: back to back "
              f"{sorted(runs[-1]['seconds'][BACK_TO_BACK])[args.trials // 2] * 1e3:.3f} ms",
              flush=True)
    rows = _rows(runs, gaps)
    print_rows(rows)
    settings = {"ranks": 2, "threads_per_rank": 1, "mpi": args.mpi,
                "family": runs[0]["family"], "bytes": nbytes,
                "call_bytes": runs[0]["call_bytes"], "gaps_us": gaps,
                "trials_per_launch": args.trials, "launches": len(runs),
                "trial_ms": args.trial_ms, "warmup_rounds": 1,
                "work": "a Python loop on time.perf_counter for the gap, on every rank",
                "calls_per_trial": [r["calls_per_trial"] for r in runs]}
    path = write_result("call_gap", info, rows, {"launches": runs}, settings,
                        out_dir=args.results)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
