"""Where the ranks of a benchmark spend their time: py-spy samples (``--native --threads
--idle``) of one 2-rank job per side of ``bench/torch_baselines.py``, or of one short
``bench/allreduce_bw.py`` run, reduced to the share of samples per leaf frame and per thread,
written with provenance to ``bench/results/``.

    python bench/profile_sides.py [--model resnet50] [--sides hpcai,horovod,ddp] [--steps 4]
    python bench/profile_sides.py --allreduce [--steps 4]

Needs ``py-spy`` (PyPI) on PATH and permission to ptrace the ranks (root, or
``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import loopback_env, provenance, write_result

HERE = Path(__file__).resolve().parent
TOP = 12


def summarize(raw: str) -> dict:
    """Shares of samples: by thread name and by leaf frame (function and file), ranks only
    (the launcher and mpirun processes are dropped)."""
    threads: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or "_as_rank" not in stack:
            continue
        n = int(count)
        total += n
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        threads[thread.split(" (")[0] + (" (main)" if "_as_rank" in stack else "")] += n
        leaves[frames[-1]] += n
    return {"samples": total,
            "threads": {k: round(v / total, 3) for k, v in threads.most_common(TOP)},
            "leaf_frames": {k: round(v / total, 3) for k, v in leaves.most_common(TOP)}}


def profile(side: str, command: list[str], work: Path) -> dict:
    """py-spy of ``command`` and every process it starts; the ranks' samples summarized."""
    out = work / f"{side}.txt"
    argv = [shutil.which("py-spy") or "py-spy", "record", "--subprocesses", "--native",
            "--threads", "--idle", "--rate", "50", "--format", "raw", "-o", str(out), "--",
            *command]
    result = subprocess.run(argv, env=loopback_env(), capture_output=True, text=True,
                            timeout=1800)
    if result.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    summary = summarize(out.read_text())
    print(f"{side}: {summary['samples']} samples", flush=True)
    for k, v in list(summary["threads"].items())[:6]:
        print(f"  thread {v:6.1%} {k}")
    for k, v in list(summary["leaf_frames"].items())[:8]:
        print(f"  leaf   {v:6.1%} {k}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--sides", default="hpcai,horovod,ddp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--allreduce", action="store_true",
                        help="profile bench/allreduce_bw.py (--steps trials) instead")
    args = parser.parse_args()
    if not shutil.which("py-spy"):
        print("error: py-spy is not on PATH\nhint: pip install py-spy", file=sys.stderr)
        return 2
    info = provenance()
    tmp = tempfile.mkdtemp(prefix="profile-")
    launch = ["hpcai-launch", "-N", "2", "--threads-per-rank", "1", "--", sys.executable]
    if args.allreduce:
        commands = {"allreduce_bw": [sys.executable, str(HERE / "allreduce_bw.py"),
                                     "--trials", str(args.steps), "--results", tmp]}
    else:
        commands = {s: [*launch, str(HERE / "torch_baselines.py"), "--rank", s, "--models",
                        args.model, "--steps", str(args.steps), "--warmup", "1",
                        "--port", "29533"] for s in args.sides.split(",")}
    profiles = {s: profile(s, argv, Path(tmp)) for s, argv in commands.items()}
    shutil.rmtree(tmp)
    name = "profile_allreduce" if args.allreduce else "profile_sides"
    path = write_result(name, info, [], profiles,
                        {"target": "allreduce_bw.py" if args.allreduce else args.model,
                         "steps_or_trials": args.steps, "warmup_steps": 1,
                         "sampler": "py-spy record --native --threads --idle --rate 50"})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
