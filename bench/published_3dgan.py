"""The papers' 3DGAN weak-scaling efficiencies on SuperMUC-NG, predicted from the machine's
public specification (issue 16). Nothing here is fitted to the published figures.

    python bench/published_3dgan.py [--tune bench/results/tune-<host>.json] [--out FILE]

Inputs, each with where it comes from:

- SuperMUC-NG thin node (LRZ's public specification): 2 x Intel Xeon Platinum 8174, 48 cores;
  26.9 PFLOP/s FP64 peak over 6,480 nodes = 4.15 TFLOP/s per node; AVX-512 doubles it for
  FP32: 8.30 TFLOP/s. Intel Omni-Path: 100 Gbit/s per link, about 1 us MPI latency; a fat
  tree, non-blocking within an island of 792 nodes (every run here fits in one island).
- The training step (measured here by ``hpcai-launch tune``, the JSON given): the 3DGAN's
  FLOPs per sample as the engine counts them, and its gradient allreduces per step (bytes
  and count: four optimiser steps per iteration).
- The fraction of peak the engine's 3DGAN step reaches on a CPU: measured here, one rank x
  all cores, against the engine's GEMM probe peak (``pct_of_peak`` of the epoch record);
  assumed the same on the Xeon 8174 at 12 threads per rank.
- Shared memory inside a node: the alpha-beta tune measured here (this host, not the Xeon).
- The per-rank batch: the papers do not state it. The engine's default (16) is the main
  column, 4 and 64 show how much the answer depends on it.

Published (seed-results.md): seconds per epoch and efficiency against 4 nodes, 4 ranks x 12
threads with the host Intel MPI, and 1 rank x 48 threads. Prints both, writes JSON to
``--out`` (default bench/results/published_3dgan.json).
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
from pathlib import Path

from common import gan_data, loopback_env, provenance

REPO = Path(__file__).resolve().parents[1]
NODE_FP32_PEAK = 2 * 26.9e15 / 6480          # FLOP/s per node
LATENCY_S = 1.0e-6
BANDWIDTH_BYTES_S = 100e9 / 8
NODES = (4, 8, 16, 32, 64, 128, 256, 512, 768)
PUBLISHED = {   # efficiency against 4 nodes, % (seed-results.md); 768: row marked inconsistent
    (4, 12): {4: 100.0, 8: 94.6, 16: 92.8, 32: 91.3, 64: 91.1, 128: 90.8, 256: 90.7,
              512: 90.4, 768: 89.9},
    (1, 48): {4: 100.0, 8: 99.6, 16: 95.1, 32: 94.4, 64: 94.0, 128: 95.9, 256: 97.5,
              512: 90.1},
}
BATCHES = (16, 4, 64)


def fraction_of_peak(work: Path) -> tuple[float, dict]:
    """The engine's 3DGAN: fraction of its GEMM probe's peak, 1 rank x all cores here."""
    from hpcai.perf.tune import physical_cores
    from hpcai.training.record import EpochRecord, OtherRecord

    data = gan_data(work, 64)
    out = work / "peak"
    cores = physical_cores()
    subprocess.run([sys.executable, "-m", "hpcai.launcher", "--ranks-per-node", "1",
                    "--threads-per-rank", str(cores), "--", "train", "3dgan", "--data",
                    str(data), "--batch-size", "16", "--epochs", "2", "--max-steps", "2",
                    "--eval-samples", "0", "--out", str(out)], check=True,
                   capture_output=True)
    records = []
    for line in (out / "epochs.jsonl").read_text().splitlines():
        try:
            records.append(EpochRecord.from_json(line))
        except OtherRecord:
            continue
    rec = records[-1]
    return rec.pct_of_peak / 100, {"pct_of_peak": rec.pct_of_peak, "peak": rec.peak.__dict__,
                                   "gflops_per_rank": rec.gflops_per_rank, "threads": cores}


def main() -> int:
    from hpcai.perf.model import LinkCost, predict_step, weak_efficiency
    from hpcai.perf.result import TuneResult

    parser = argparse.ArgumentParser(prog="bench/published_3dgan.py")
    parser.add_argument("--tune", default=str(REPO / "bench" / "results" /
                                              f"tune-{socket.gethostname()}.json"))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" /
                                             "published_3dgan.json"))
    ns = parser.parse_args()
    os.environ.update(loopback_env())
    info = provenance()
    tune = TuneResult.load(ns.tune)
    work = Path(tempfile.mkdtemp(prefix="bench-published-"))
    fraction, peak_run = fraction_of_peak(work)
    net = LinkCost.from_spec(LATENCY_S, BANDWIDTH_BYTES_S)
    rows = []
    for (ranks, threads), published in PUBLISHED.items():
        rate = NODE_FP32_PEAK / ranks * fraction                  # FLOP/s per rank
        for batch in BATCHES:
            steps = {n: predict_step(tune.flops_per_sample / rate, batch, tune.buckets, n,
                                     ranks, threads, tune.shm.cost, net) for n in NODES}
            for n in NODES:
                rows.append({"ranks": ranks, "threads": threads, "batch": batch, "nodes": n,
                             "predicted": 100 * weak_efficiency(steps[4], steps[n]),
                             "published": published.get(n),
                             "step_s": steps[n].step_s, "compute_s": steps[n].compute_s,
                             "comm_s": steps[n].comm_s, "algorithm": steps[n].algorithm})
    lines = [f"Fraction of peak measured here: {100 * fraction:.1f} % of the GEMM probe's "
             f"{peak_run['peak']['gflops_per_rank']:.4g} GFLOP/s ({peak_run['threads']} "
             f"threads); per-rank rate on SuperMUC-NG = {NODE_FP32_PEAK / 1e12:.2f} TFLOP/s "
             f"/ ranks x that. Gradient allreduces per step: {len(tune.buckets)} x "
             f"{tune.buckets[0] / 1e6:.2f} MB.", ""]
    for ranks, threads in PUBLISHED:
        lines += [f"{ranks} rank(s) x {threads} threads per node, efficiency against 4 nodes:",
                  "", "| nodes | published | predicted, batch 16 | batch 4 | batch 64 | "
                  "allreduce algorithm | step: compute + allreduce (batch 16) |",
                  "|---:|---:|---:|---:|---:|---|---|"]
        for n in NODES:
            sel = {r["batch"]: r for r in rows if (r["ranks"], r["threads"], r["nodes"]) ==
                   (ranks, threads, n)}
            pub = sel[16]["published"]
            lines.append(f"| {n} | {'-' if pub is None else f'{pub:.1f} %'} | "
                         f"{sel[16]['predicted']:.1f} % | {sel[4]['predicted']:.1f} % | "
                         f"{sel[64]['predicted']:.1f} % | {sel[16]['algorithm']} | "
                         f"{sel[16]['compute_s']:.3g} s + {1e3 * sel[16]['comm_s']:.3g} ms |")
        lines.append("")
    print("\n".join(lines))
    info["load_average_at_end"] = os.getloadavg()
    doc = {"benchmark": "published_3dgan", "provenance": info,
           "inputs": {"node_fp32_peak_flop_s": NODE_FP32_PEAK, "latency_s": LATENCY_S,
                      "bandwidth_bytes_s": BANDWIDTH_BYTES_S, "fraction_of_peak": fraction,
                      "peak_run": peak_run, "tune": Path(ns.tune).name,
                      "flops_per_sample": tune.flops_per_sample, "buckets": list(tune.buckets),
                      "shm": tune.shm.cost.__dict__},
           "rows": rows, "table": "\n".join(lines)}
    Path(ns.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {ns.out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
