"""Container overhead, side by side in one run: the same 3DGAN training, 2 ranks, bare on
the host and inside Charliecloud with the host MPI bound in.

Alternates bare and container runs (``--repeat``, default 2 each), each 2 epochs of
``--max-steps`` steps from the same generated data; compares the second epoch's samples/s
(best run of each) and the peak RSS per rank. Targets: throughput container/bare >= 0.99,
peak RSS container/bare <= 1.01 (the seed: 1968 vs 1973 img/s, 331.29 vs 331.33 GB free).

    python bench/container_overhead.py [--image ~/.cache/hpcai/images/hpcai-bookworm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import loopback_env

DEFAULT_IMAGE = Path.home() / ".cache" / "hpcai" / "images" / "hpcai-bookworm"


def one_run(container: str | None, data: Path, out: Path, steps: int, python: str) -> dict:
    argv = ["hpcai-launch", "-N", "2"]
    if container:
        argv += ["--container", container]
    argv += ["--", python, "-m", "hpcai.training", "3dgan", "--data", os.path.relpath(data),
             "--epochs", "2", "--max-steps", str(steps), "--batch-size", "8",
             "--eval-samples", "0", "--peak-gflops", "90", "--out", os.path.relpath(out)]
    env = loopback_env(USER=os.environ.get("USER", "root"))
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}\n{result.stderr[-3000:]}")
    record = json.loads((out / "epochs.jsonl").read_text().splitlines()[-1])
    return {"samples_per_s": record["samples_per_s"],
            "max_rss_mb_per_rank": record["max_rss_mb_per_rank"],
            "libmpi": record["provenance"]["libmpi"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=str(DEFAULT_IMAGE))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default="bench/results/container_overhead.json")
    args = parser.parse_args()
    json_path = Path(args.json).resolve()
    with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".bench-") as tmp:
        work = Path(tmp)
        os.chdir(work)   # bound into the container as its working directory
        data = work / "data"
        subprocess.run([sys.executable, "-m", "hpcai.training.showers", "generate", "--out",
                        str(data), "--files", "1", "--events", "256"], check=True,
                       capture_output=True)
        runs: dict[str, list[dict]] = {"bare": [], "container": []}
        for i in range(args.repeat):
            runs["bare"].append(one_run(None, data, work / f"bare-{i}", args.steps,
                                        sys.executable))
            runs["container"].append(one_run(args.image, data, work / f"ch-{i}", args.steps,
                                             "python3"))
            for kind in runs:
                r = runs[kind][-1]
                print(f"  {kind:9s} {r['samples_per_s']:.3f} samples/s, peak RSS "
                      f"{r['max_rss_mb_per_rank']:.0f} MiB/rank, libmpi {r['libmpi']}",
                      flush=True)
    best = {k: max(v, key=lambda r: r["samples_per_s"]) for k, v in runs.items()}
    throughput = best["container"]["samples_per_s"] / best["bare"]["samples_per_s"]
    rss = (min(r["max_rss_mb_per_rank"] for r in runs["container"]) /
           min(r["max_rss_mb_per_rank"] for r in runs["bare"]))
    print(f"throughput container/bare {throughput:.3f} (target >= 0.99); "
          f"peak RSS container/bare {rss:.3f} (target <= 1.01)")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"runs": runs, "throughput_ratio": throughput,
                                     "rss_ratio": rss, "targets": {"throughput": 0.99,
                                                                   "rss": 1.01}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
