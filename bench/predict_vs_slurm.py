"""``predict`` against a measured sweep on the private Slurm's fake nodes (issue 16).

    python bench/predict_vs_slurm.py [--steps 3] [--budget 120] [--out FILE]

1. ``hpcai-launch tune`` on this host (3DGAN, batch 4 per rank; compute, buckets, memory,
   shared-memory and TCP allreduce): its JSON is kept beside ``--out`` as ``tune-<host>.json``
   (``tune-<rest>.json`` for an ``--out`` named ``predict_vs_slurm-<rest>.json``).
2. A private Slurm (testbed/localcluster.py) with 4 fake nodes of this one host; the network
   between fake nodes is measured there: ``hpcai.perf.probe`` under ``srun -N 2`` (one rank
   per node, TCP as the cluster sets ``OMPI_MCA_btl=self,tcp``), alpha-beta fitted to it.
   The same probe on 4 nodes is recorded too (not used: 4 ranks on 2 cores).
3. ``hpcai-launch sweep --nodes N --ranks-per-node 1 --threads-per-rank 1`` on the fake
   nodes for N = 1, 2, 4, one sweep after the other (one sweep of 1,2,4 would run its 1- and
   2-node points at the same time, on the same pinned core), 2 epochs of ``--steps`` steps
   per point; the points are gathered into one results directory.
4. ``hpcai-launch predict --topology shared-host`` with the measured network and the sweep
   overlaid; PASS when every node count's predicted samples/s is within 15 % of the
   measured one.

Writes JSON with provenance (load average included) to ``--out`` (default
bench/results/predict_vs_slurm-<host>.json) and the prediction's files into the directory
of the same name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import gan_data, loopback_env, provenance

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "testbed"))
BATCH = 4
SIZES = "1024,8192,65536,524288,4194304"
UNSET = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
         "NODE_RANK", "MPI4PY_MPIABI", "HPCAI_RANKS_PER_NODE", "HPCAI_THREADS_PER_RANK",
         "HPCAI_LAUNCHER", "HPCAI_MPI", "HPCAI_MPIRUN", "HPCAI_TOPOLOGY")


def checked(done: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if done.returncode != 0:
        raise SystemExit(f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    return done


def main() -> int:
    from localcluster import LocalCluster
    from hpcai.perf.model import AllreduceSample, fit_link

    parser = argparse.ArgumentParser(prog="bench/predict_vs_slurm.py")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" /
                                             f"predict_vs_slurm-{socket.gethostname()}.json"))
    ns = parser.parse_args()
    os.environ.update(loopback_env())
    info = provenance()
    start = time.monotonic()
    results_dir = Path(ns.out).parent
    work = Path(tempfile.mkdtemp(prefix="bench-predict-"))
    data = gan_data(work, 64)
    train = ["train", "3dgan", "--data", str(data), "--batch-size", str(BATCH)]
    stem = Path(ns.out).stem                 # predict_vs_slurm-<host>[-run]: names its files
    tune_json = results_dir / f"tune-{stem.removeprefix('predict_vs_slurm-')}.json"
    done = checked(subprocess.run(
        [sys.executable, "-m", "hpcai.launcher", "tune", "--budget", str(ns.budget),
         "--steps", str(ns.steps), "--json", str(tune_json), "--", *train],
        capture_output=True, text=True), "tune")
    print(done.stdout, end="", flush=True)
    env = {"PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
           "HPCAI_CACHE": str(work / "cache")}
    with LocalCluster(fake_nodes=4, cpus_per_node=2) as cluster:
        def run(argv: list[str], timeout: float = 1200) -> subprocess.CompletedProcess:
            return cluster.run(argv, timeout=timeout, env=env, unset=UNSET, cwd=str(work))

        probes = {}
        for nodes in (2, 4):
            out = work / f"probe-N{nodes}.json"
            checked(run(["srun", "-N", str(nodes), "--ntasks-per-node", "1", "--mpi=pmix",
                         "hpcai-launch", "--ranks-per-node", "1", "--", sys.executable, "-m",
                         "hpcai.perf.probe", "--sizes", SIZES, "--repeats", "10", "--out",
                         str(out)], 600), f"probe on {nodes} fake nodes")
            probes[nodes] = json.loads(out.read_text())
        link = fit_link([AllreduceSample(2, int(n), float(s))
                         for n, s, _ in probes[2]["samples"]])
        print(f"network between fake nodes (srun -N 2, TCP): alpha {link.alpha_s * 1e6:.3g} "
              f"us, bandwidth {link.bandwidth_bytes_s * 8 / 1e9:.3g} Gbit/s", flush=True)
        # One sweep per node count, one after another: a single sweep submits every point
        # at once and Slurm runs the 1- and 2-node points side by side on the fake nodes,
        # whose ranks are all pinned to the same core of this host.
        results = work / "sweep"
        results.mkdir()
        for nodes in (1, 2, 4):
            part = work / f"sweep-N{nodes}"
            checked(run(["hpcai-launch", "sweep", "--nodes", str(nodes), "--ranks-per-node",
                         "1", "--threads-per-rank", "1", "--cores-per-node", "2", "--time",
                         "00:15:00", "--results", str(part), "--wait-timeout", "1500", "--",
                         *train, "--epochs", "2", "--max-steps", str(ns.steps),
                         "--eval-samples", "0", "--peak-gflops", "1"], 1600),
                    f"sweep on {nodes} node(s)")
            for point in part.glob("N*-R*-T*-rep*"):
                point.rename(results / point.name)
    pred_dir = results_dir / stem
    done = checked(subprocess.run(
        [sys.executable, "-m", "hpcai.launcher", "predict", "--tune", str(tune_json),
         "--nodes", "1,2,4", "-N", "1", "-t", "1", "--latency-us", repr(link.alpha_s * 1e6),
         "--bandwidth-gbit-s", repr(link.bandwidth_bytes_s * 8 / 1e9),
         "--topology", "shared-host", "--sweep", str(results), "--out", str(pred_dir)],
        capture_output=True, text=True), "predict")
    print(done.stdout, end="")
    prediction = json.loads((pred_dir / "prediction.json").read_text())
    errors = [c["error"] for c in prediction["comparison"]]
    tuned = next(c["samples_per_s"] for c in json.loads(tune_json.read_text())["compute"]
                 if (c["ranks"], c["threads"]) == (1, 1))
    drift = prediction["comparison"][0]["measured_samples_per_s"] / tuned
    print(f"same layout (1 x 1), tune on the host vs the sweep's 1-node point: {tuned:.4g} vs "
          f"{prediction['comparison'][0]['measured_samples_per_s']:.4g} samples/s "
          f"(x{drift:.2f}: the machine's load between the two)")
    verdict = "PASS" if len(errors) == 3 and all(abs(e) <= 0.15 for e in errors) else "FAIL"
    print("predicted vs measured samples/s: " + ", ".join(
        f"{c['nodes']} node(s) {100 * c['error']:+.1f} %" for c in prediction["comparison"])
        + f" -> {verdict} (within 15 %)")
    info["load_average_at_end"] = os.getloadavg()
    doc = {"benchmark": "predict_vs_slurm", "provenance": info,
           "wall_time_s": round(time.monotonic() - start, 1),
           "setup": {"model": "3dgan", "batch_per_rank": BATCH, "steps": ns.steps,
                     "fake_nodes": 4, "layout": "1 rank x 1 thread per node"},
           "network_measured": {"alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte,
                                "probes": probes},
           "tune_json": tune_json.name, "comparison": prediction["comparison"],
           "same_layout_tune_vs_sweep": {"tune": tuned, "sweep_1_node": tuned * drift,
                                         "ratio": drift},
           "steps": prediction["steps"], "verdict": verdict}
    Path(ns.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {ns.out}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
