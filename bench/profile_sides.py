"""Where the ranks of a benchmark spend their time: py-spy samples (``--native --threads
--idle``, one py-spy per rank) of one 2-rank job per side of ``bench/torch_baselines.py``, or
of the ranks of one short ``bench/allreduce_bw.py`` run, reduced to the share of samples per
leaf frame and per thread, written with provenance to ``bench/results/``.

    python bench/profile_sides.py [--model resnet50] [--sides hpcai,horovod,ddp] [--steps 4]
                                  [--image-size 112]
    python bench/profile_sides.py --allreduce [--steps 4]

Needs ``py-spy`` (PyPI) on PATH and permission to ptrace the ranks (root, or
``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import loopback_env, provenance, write_result

HERE = Path(__file__).resolve().parent
TOP = 12


def _category(frames: list[str]) -> str:
    stack = ";".join(frames)
    if "_as_rank" in stack:
        for step in ("synced", "local"):
            if f".<locals>.{step} (" in stack:
                return f"main thread: {step} step"
        if ".synchronize (" in stack:   # allreduce_bw.py: the engine's fused buckets
            return "main thread: engine synchronize"
        if ".<locals>.run (" in stack:           # allreduce_bw.py: raw MPI_Allreduce calls
            return "main thread: raw MPI_Allreduce"
        return "main thread: set-up (imports, model, init)"
    for lib in ("horovod", "gloo", "c10d", "mca_", "libmpi", "libgomp", "mkl"):
        if lib in stack:
            return f"other thread: {lib}"
    return "other thread"


def summarize(raw: str) -> dict:
    """Shares of the ranks' samples by category (main thread in the synced step, in the
    local step, in set-up; other threads by the library they run in) and the top leaf
    frames of the synced step and of the other threads."""
    cats: collections.Counter = collections.Counter()
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        cat = _category(frames)
        cats[cat] += n
        if cat.startswith(("main thread: synced", "main thread: engine", "main thread: raw",
                           "other thread")):
            leaves[cat][frames[-1][:160]] += n
    return {"samples": total,
            "categories": {k: round(v / total, 3) for k, v in cats.most_common()},
            "leaf_frames": {c: {k: round(v / total, 3) for k, v in ctr.most_common(TOP)}
                            for c, ctr in leaves.items()}}


def profile(side: str, command: list[str], work: Path) -> dict:
    """py-spy of each rank of a 2-rank job of ``command``; the samples summarized."""
    out = work / side
    out.mkdir()
    argv = ["hpcai-launch", "-N", "2", "--threads-per-rank", "1", "--", sys.executable,
            __file__, "--wrap-rank", str(out), "--", sys.executable, *command]
    result = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                            timeout=1800)
    files = sorted(out.glob("rank*.txt"))
    if result.returncode != 0 or not files:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    summary = summarize("\n".join(f.read_text() for f in files))
    records = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
    if records:   # torch_baselines (py-spy prints after it): rank 0's CPU per thread
        summary["rank0_thread_cpu_s"] = json.loads(records[-1]).get("rank0_thread_cpu_s")
    print(f"{side}: {summary['samples']} samples", flush=True)
    for k, v in summary["categories"].items():
        print(f"  {v:6.1%} {k}")
    for cat, top in summary["leaf_frames"].items():
        for k, v in list(top.items())[:5]:
            print(f"    {v:6.1%} {cat}: {k}")
    return summary


def wrap_rank(out: str, command: list[str]) -> int:
    """Run as a rank: exec py-spy recording ``command`` into ``out/rank<N>.txt``."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))
    os.execvp("py-spy", ["py-spy", "record", "--native", "--threads", "--idle", "--rate",
                         "50", "--format", "raw", "-o", f"{out}/rank{rank}.txt", "--",
                         *command])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--sides", default="hpcai,horovod,ddp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=112, help="ResNet50 input pixels")
    parser.add_argument("--allreduce", action="store_true",
                        help="profile bench/allreduce_bw.py (--steps trials) instead")
    parser.add_argument("--wrap-rank", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.wrap_rank:
        return wrap_rank(args.wrap_rank, args.command)
    if not shutil.which("py-spy"):
        print("error: py-spy is not on PATH\nhint: pip install py-spy", file=sys.stderr)
        return 2
    info = provenance()
    tmp = tempfile.mkdtemp(prefix="profile-")
    if args.allreduce:
        commands = {"allreduce_bw": [str(HERE / "allreduce_bw.py"), "--trials",
                                     str(args.steps)]}
    else:
        commands = {s: [str(HERE / "torch_baselines.py"), "--rank", s, "--models",
                        args.model, "--steps", str(args.steps), "--warmup", "1",
                        "--image-size", str(args.image_size),
                        "--port", "29533"] for s in args.sides.split(",")}
    profiles = {s: profile(s, argv, Path(tmp)) for s, argv in commands.items()}
    shutil.rmtree(tmp)
    name = "profile_allreduce" if args.allreduce else "profile_sides"
    path = write_result(name, info, [], profiles,
                        {"target": "allreduce_bw.py" if args.allreduce else args.model,
                         "resnet50_image": args.image_size, "batch_per_rank": 8,
                         "steps_or_trials": args.steps, "warmup_steps": 1,
                         "sampler": "py-spy record --native --threads --idle --rate 50"})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
