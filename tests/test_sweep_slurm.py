"""Sweeps and preemption on a real Slurm (munged + slurmctld + 2 fake slurmd nodes)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_slurm import _cluster, fake_nodes, pytestmark, run  # noqa: F401 - fixture, marks

# the physics validation and its plots are not what these tests read (test_physics.py)
TINY_GAN = ["train", "3dgan", "--epochs", "2", "--batch-size", "1", "--max-steps", "2",
            "--eval-samples", "0", "--validate-events", "0", "--peak-gflops", "50"]


@pytest.fixture(scope="module")
def showers(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("showers")
    subprocess.run([sys.executable, "-m", "hpcai.training.showers", "generate", "--out",
                    str(data), "--files", "1", "--events", "64"], check=True,
                   capture_output=True)
    return data


def test_sweep_on_slurm_collects_every_point_and_plots(fake_nodes, showers, tmp_path):
    """A sweep over the node count as Slurm jobs: every point's job runs, its records are
    collected, and the scaling table and plot are drawn. (The ranks-per-node axis of a
    sweep is tests/test_sbatch.py's, without a scheduler.)"""
    results = tmp_path / "results"
    result = run(fake_nodes, ["hpcai-launch", "sweep", "--nodes", "1,2", "--ranks-per-node",
                              "1", "--threads-per-rank", "1", "--cores-per-node", "2",
                              "--time", "00:10:00", "--results", str(results),
                              "--wait-timeout", "600", "--", *TINY_GAN, "--data",
                              str(showers)], timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    points = sorted(p.parent.name for p in results.glob("*/point.json"))
    assert points == ["N1-R1-T1-rep0", "N2-R1-T1-rep0"]
    for name in points:
        meta = json.loads((results / name / "point.json").read_text())
        assert meta["status"] == "done", (name, meta,
                                          list((results / name).glob("slurm-*.out")))
        last = json.loads((results / name / "epochs.jsonl").read_text().splitlines()[-1])
        world = meta["nodes"] * meta["ranks_per_node"]
        assert last["provenance"]["world_size"] == world
        assert last["epoch_time_s"] > 0 and last["samples_per_s"] > 0
    table = json.loads((results / "scaling.json").read_text())
    assert table and (results / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "N1-R1" not in result.stderr or "warning" not in result.stderr


@pytest.mark.parametrize("scancel, signum", [(["--signal=USR1"], signal.SIGUSR1),
                                             ([], signal.SIGTERM)],
                         ids=["warning-USR1", "scancel"])
def test_preemption_signal_checkpoints_and_resubmission_resumes(scancel, signum, fake_nodes,
                                                                 tmp_path):
    """The job script's warning signal (``scancel --signal=USR1``, what ``--signal=USR1@120``
    sends) and a plain ``scancel`` (SIGTERM to every step and the batch shell, SIGKILL after
    KillWait, 5 s in this cluster) both leave a checkpoint mid-run, and the same script
    submitted again resumes without repeating or losing a step."""
    out = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    command = ["train", "resnet-tiny", "--image-size", "32", "--classes", "10",
               "--batch-size", "4", "--samples", "2048", "--epochs", "2", "--peak-gflops",
               "50", "--out", str(out)]
    made = run(fake_nodes, ["hpcai-launch", "sbatch", "--nodes", "1", "-N", "2",
                            "--threads-per-rank", "1", "--time", "00:10:00", "--output",
                            str(tmp_path / "slurm-%j.out"), "--script", str(script),
                            "--submit", "--", *command], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    job = made.stdout.strip()
    log = tmp_path / f"slurm-{job}.out"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (log.exists() and "hpcai-train:" in log.read_text()):
        time.sleep(0.2)
    assert log.exists() and "hpcai-train:" in log.read_text(), "training did not start"
    time.sleep(1.0)
    signalled = run(fake_nodes, ["scancel", *scancel, job])
    assert signalled.returncode == 0, signalled.stderr
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        queued = run(fake_nodes, ["squeue", "-h", "-j", job])
        if not queued.stdout.strip():
            break
        time.sleep(0.5)
    checkpoints = list((out / "checkpoints").glob("ckpt-*.pt"))
    assert checkpoints, log.read_text()[-3000:]
    # the checkpoint is the signal's, not an epoch's end
    assert f"preempted by signal {int(signum)}: checkpoint" in log.read_text(), \
        log.read_text()[-3000:]
    steps_before = len((out / "steps.jsonl").read_text().splitlines())
    assert 0 < steps_before < 2 * 256, "the signal did not arrive mid-run"

    again = run(fake_nodes, ["sbatch", "--parsable", "--wait", str(script)], timeout=600,
                cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    second = tmp_path / f"slurm-{again.stdout.strip().split(';')[0]}.out"
    text = second.read_text()
    assert "resumed from" in text, text[-3000:]
    epochs = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    assert epochs[-1]["epoch"] == 1
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    keys = [(s["epoch"], s["step"]) for s in steps]
    assert len(keys) == len(set(keys)) == 2 * 256, "steps repeated or lost across preemption"
