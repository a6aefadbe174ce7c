"""Reliability: a 16-rank sweep point (4 fake Slurm nodes x 4 ranks) runs to completion
5 times out of 5.

Starts a private Slurm (munged, slurmctld, 4 slurmd as fake nodes n1..n4 with 4 CPUs each,
all on this machine and 127.0.0.1), runs ``hpcai-launch sweep --nodes 4 --ranks-per-node 4
--repeat 5`` of a short ResNet training (the ranks share this machine's 2 cores:
``--oversubscribe``), and counts the points that finished. Stops the daemons.

    python bench/slurm_16rank.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "testbed"))

from localcluster import LocalCluster  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "slurm_16rank.json"))
    args = parser.parse_args()
    json_path = Path(args.json).resolve()
    venv_bin = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(fake_nodes=4, cpus_per_node=4) as cluster:
        results = Path(tmp) / "results"
        env = {"PATH": f"{venv_bin}:{os.environ.get('PATH', os.defpath)}",
               "MASTER_ADDR": "127.0.0.1"}
        start = time.monotonic()
        done = cluster.run(
            ["hpcai-launch", "sweep", "--nodes", "4", "--ranks-per-node", "4",
             "--threads-per-rank", "1", "--cores-per-node", "4", "--oversubscribe",
             "--repeat", str(args.repeat), "--time", "00:20:00", "--results", str(results),
             "--wait-timeout", "3000", "--", "train", "resnet-tiny", "--image-size", "32",
             "--classes", "10", "--samples", "256", "--batch-size", "4", "--epochs", "2",
             "--peak-gflops", "50"], timeout=3600, env=env, cwd=tmp)
        seconds = time.monotonic() - start
        statuses = {p.parent.name: json.loads(p.read_text())["status"]
                    for p in sorted(results.glob("*/point.json"))}
    finished = sum(1 for s in statuses.values() if s == "done")
    print(done.stdout[-2000:])
    print(f"16-rank point on 4 fake nodes: {finished} of {args.repeat} runs completed "
          f"({seconds:.0f} s); statuses {statuses}")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"completed": finished, "runs": args.repeat,
                                     "statuses": statuses, "seconds": seconds}, indent=1))
    return 0 if finished == args.repeat else 1


if __name__ == "__main__":
    sys.exit(main())
