"""Why the engine's own work runs slower right after an exchange: the same work after a pass
over the memory an exchange moves, one process, no MPI.

``call_gap`` shows the engine's work for one 3DGAN exchange (its backward hook and
``synchronize``, a transport that sends nothing) taking two to three times longer right
after an ``MPI_Allreduce`` than back to back. This repeats that work, on one core, (a) back
to back, (b) after a busy spin, and (c) after ``np.add`` over two float32 buffers of the
3DGAN's gradient bytes on transparent huge pages (``hostmem.huge_zeros``), what a 2-rank
shared-memory exchange reads and writes; the spin lasts as long as the pass. A trial is the
median of ``--repeat`` timings of the work, each after its side's prelude; the sides
alternate (A B C D D C B A ...), ``--trials`` each after a warm-up round. A fourth side
times only the part of that work that reads every parameter's ``.grad`` (``_replaced``: is
each gradient still its view into the arena?), after the pass. Reported rows, no target:
back to back ÷ after the spin, back to back ÷ after the pass, and that read ÷ the whole work,
both after the pass.

    python bench/work_after_pass.py            (bench/results/)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from common import RESULTS, Row, print_rows, provenance, run_alternating, write_result

BACK_TO_BACK = "back to back"
AFTER_SPIN = "after a spin as long as the pass"
AFTER_PASS = "after a pass over the exchange's bytes"
CHECK_AFTER_PASS = "the gradient read alone, after a pass over the exchange's bytes"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30, help="trials per side")
    parser.add_argument("--repeat", type=int, default=50, help="timings in one trial")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    if args.trials < 2 or args.repeat < 1:
        print("error: --trials must be at least 2 and --repeat at least 1\n"
              "hint: the defaults are 30 and 50", file=sys.stderr)
        return 2
    import numpy as np
    import torch

    from allreduce_bw import _Idle
    from call_gap import _gan_bytes
    from hpcai.models import gan3d
    from hpcai.training.allreduce import GradAllreducer, _replaced
    from hpcai.training.hostmem import huge_zeros

    info = provenance()
    torch.set_num_threads(1)
    model = torch.nn.ModuleList([gan3d.Generator(), gan3d.Discriminator()])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    engine = GradAllreducer(model, _Idle(), call_mb=1e6)
    nbytes = _gan_bytes()
    a, b = huge_zeros(nbytes // 4, np.float32), huge_zeros(nbytes // 4, np.float32)

    def work() -> None:
        engine.replay_backward()
        engine.synchronize()

    def memory_pass() -> None:
        np.add(a, b, out=a)

    for _ in range(20):
        memory_pass()
    start = time.perf_counter()
    for _ in range(50):
        memory_pass()
    pass_s = (time.perf_counter() - start) / 50

    def spin() -> None:
        end = time.perf_counter() + pass_s
        while time.perf_counter() < end:
            pass

    bucket = engine._solo[0]

    def check() -> None:
        _replaced(bucket)

    def side(prelude, timed=work):
        def trial() -> float:
            times = []
            for _ in range(args.repeat):
                if prelude is not None:
                    prelude()
                t0 = time.perf_counter()
                timed()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        return trial

    for _ in range(200):
        work()
    values = run_alternating({BACK_TO_BACK: side(None), AFTER_SPIN: side(spin),
                              AFTER_PASS: side(memory_pass),
                              CHECK_AFTER_PASS: side(memory_pass, check)}, args.trials)
    engine.close()
    us = {k: f"{statistics.median(v) * 1e6:.1f} µs" for k, v in values.items()}
    note = (f"medians of the work: back to back {us[BACK_TO_BACK]}, after the spin "
            f"{us[AFTER_SPIN]}, after the pass {us[AFTER_PASS]}; the gradient read alone "
            f"after the pass {us[CHECK_AFTER_PASS]}; the pass took "
            f"{pass_s * 1e6:.0f} µs")
    what = (f"the engine's own work for one 3DGAN exchange ({len(engine._hooks)} backward "
            "hook(s) and synchronize, a transport that sends nothing)")
    rows = [Row.report("work-after-spin", f"{what}: back to back ÷ after a busy spin",
                       values[BACK_TO_BACK], values[AFTER_SPIN], note),
            Row.report("work-after-pass", f"{what}: back to back ÷ after a pass over the "
                       f"exchange's {nbytes / 1e6:.1f} MB (np.add of two buffers)",
                       values[BACK_TO_BACK], values[AFTER_PASS], note),
            Row.report("read-share-after-pass", f"after a pass: reading every parameter's "
                       f".grad ({len(bucket.params)} parameters, is each still its view?) ÷ "
                       "the whole work", values[CHECK_AFTER_PASS], values[AFTER_PASS], note)]
    print_rows(rows)
    settings = {"trials": args.trials, "repeat": args.repeat, "bytes": nbytes,
                "pass_us": round(pass_s * 1e6, 1), "threads": 1}
    path = write_result("work_after_pass", info, rows, values, settings, args.results)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
