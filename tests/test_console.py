"""What rank 0 prints while training (training/console.py): an epoch line under 160 characters
that keeps epoch, time, samples/s, % of peak, the main losses and the worst physics bin, and
progress inside a long epoch; ``hpcai-launch report RUN_DIR`` shows the full record."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from conftest import base_env, run
from hpcai.training.console import (LINE_LIMIT, Progress, epoch_line, progress_every,
                                    worst_bin)
from hpcai.training.physics import BinResult, Validation
from hpcai.training.record import AllreduceTotals, EpochRecord, Peak, Provenance
from jobs import train

GAN_LOSSES = ("d_fake", "d_fake_aux", "d_fake_bce", "d_fake_ecal", "d_real", "d_real_aux",
              "d_real_bce", "d_real_ecal", "g", "g1", "g1_aux", "g1_bce", "g1_ecal", "g2",
              "g2_aux", "g2_bce", "g2_ecal")
PHYSICS = ("profile_distance_x", "profile_distance_y", "profile_distance_z",
           "sampling_fraction_worst_rel_diff", "hits_worst_rel_diff", "aux_mape_real",
           "aux_mape_gen", "gen_empty_fraction")


def record(model: str, losses: dict, big: float, physics: dict | None = None) -> EpochRecord:
    """An epoch record whose measurements are all ``big`` (a count or time is never
    negative; the losses and metrics given may be)."""
    prov = Provenance(4096, 64, 64, "0-63", "pytorch", "2.13.0+cpu", "mpi", "mpi4py 4.1.2",
                      "Open MPI v4.1.4" * 5, "/usr/lib/libmpi.so.40", ("node",) * 9, "abc",
                      "2.13.0")
    return EpochRecord(model=model, framework="pytorch", epoch=99999, steps=99999,
                       first_step=0, epoch_time_s=big, compute_s=big, comm_s=big,
                       grad_sync_s=big, grad_sync_imbalance_s=big, data_s=big,
                       samples_per_rank=10**9, samples_per_s_per_rank=big, samples_per_s=big,
                       flops_per_sample=big, flop_convention="x" * 200, gflops_per_rank=big,
                       gflops_total=big, peak=Peak(big, "y" * 200), pct_of_peak=big, lr=big,
                       losses=losses, allreduce=AllreduceTotals(10**12, 10**6, True, big),
                       max_rss_mb_per_rank=big, provenance=prov,
                       eval={"samples": 32.0, "aux_rel_error": big}, physics=physics)


def validation(diffs: list[float | None]) -> Validation:
    edges = (10, 100, 200, 300, 400, 500)
    bins = tuple(BinResult(e_lo_gev=lo, e_hi_gev=hi, events=10, real=None, gen=None,
                           profile_distance=(None, None, None), sampling_fraction_rel_diff=d,
                           hits_rel_diff=None)
                 for lo, hi, d in zip(edges, edges[1:], diffs))
    return Validation(epoch=0, events=50, threshold_gev=1e-6, bins=bins, aux_mape_real=None,
                      aux_mape_gen=None, gen_empty_fraction=0.0)


@pytest.mark.parametrize("big", [1.23456789e15, 123456.789, 0.000123456])
def test_the_epoch_line_stays_under_the_limit(big):
    """The widest numbers, with every 3DGAN loss and physics metric in the record (the
    3DGAN with validation, its judge the weight average) and a ResNet50's."""
    gan = record("3dgan", {k: -big for k in GAN_LOSSES}, big, {k: big for k in PHYSICS})
    words = worst_bin(validation([big / 2, 0.0, None, big, -big]))   # 400-500 GeV
    line = epoch_line(gan, ("g", "d_real", "d_fake"), words, "avg")
    assert len(line) < LINE_LIMIT, (len(line), line)
    resnet = record("resnet50", {"loss": -big, "accuracy": -big}, big)
    line = epoch_line(resnet, ("loss", "accuracy"))
    assert len(line) < LINE_LIMIT, (len(line), line)
    for text in ("epoch 99999:", "samples/s", "% of fp32 peak", "loss ", "accuracy "):
        assert text in line


def test_the_epoch_line_keeps_what_a_person_watches():
    gan = record("3dgan", {k: 0.5 for k in GAN_LOSSES}, 12.5, {k: 0.25 for k in PHYSICS})
    line = epoch_line(gan, ("g", "d_real", "d_fake"),
                      worst_bin(validation([0.05, -0.138, None, 0.1, 0.02])))
    assert line == ("epoch 99999: 12.5 s, 12.5 samples/s, 12.5% of fp32 peak | g 0.5 d_real 0.5 "
                    "d_fake 0.5 | worst sum/E 100-200 GeV -13.8%")
    # what it leaves to epochs.jsonl
    for omitted in ("GFLOP", "compute", "g1_aux", "aux_rel_error", "profile_distance"):
        assert omitted not in line
    assert worst_bin(validation([None] * 5)) == "worst sum/E -"


def test_progress_lines_without_a_terminal():
    out = io.StringIO()
    progress = Progress(3, 125, out=out, tty=False)
    for done in range(1, 126):
        progress.step(done)
    progress.clear()
    lines = out.getvalue().splitlines()
    assert progress.every == 13 and len(lines) == 9    # steps 13, 26, ..., 117
    assert lines[0].startswith("hpcai-train: epoch 3 step 13/125 (")
    assert "\r" not in out.getvalue()
    # a short epoch prints none; the environment variable sets the interval (0: none)
    assert progress_every(16, {}) == 0 and progress_every(20, {}) == 2
    assert progress_every(16, {"HPCAI_PROGRESS_EVERY": "4"}) == 4
    assert progress_every(1000, {"HPCAI_PROGRESS_EVERY": "0"}) == 0


def test_progress_counter_on_a_terminal():
    out, now = io.StringIO(), [0.0]
    progress = Progress(0, 50, out=out, tty=True, clock=lambda: now[0])
    for done in range(1, 50):
        now[0] += 0.3
        progress.step(done)
    shown = out.getvalue()
    assert "\n" not in shown and shown.count("\r") == 24   # redrawn at most every 0.5 s
    assert shown.rsplit("\r", 1)[1].startswith("epoch 0: step 48/50, 14 s")
    progress.clear()
    assert out.getvalue().endswith("\r") and progress.width == 0


@pytest.mark.mpi
def test_a_long_epoch_prints_progress_and_report_shows_the_whole_record(tmp_path: Path):
    """40 steps in one epoch: progress lines at every 4th step (the ranks' stderr is not a
    terminal); the epoch line is short, and ``hpcai-launch report`` shows fields it leaves
    out (the time split, every loss)."""
    out = tmp_path / "run"
    result = train(1, "resnet-tiny", "--image-size", "32", "--classes", "10", "--batch-size",
                   "2", "--samples", "80", "--epochs", "1", "--peak-gflops", "50",
                   "--eval-samples", "0", "--verify-every", "0", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    progress = [line for line in result.stdout.splitlines() if " step " in line]
    assert [line.split()[4] for line in progress] == [f"{k}/40" for k in range(4, 40, 4)]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("epoch 0:")]
    assert len(line) < LINE_LIMIT and "loss " in line and "compute" not in line
    report = run(["hpcai-launch", "report", str(out)], base_env())
    assert report.returncode == 0, report.stderr
    fields = {row.split()[0] for row in report.stdout.splitlines() if row and row[0].isalpha()}
    assert {"compute_s", "comm_s", "data_s", "gflops_total", "losses.loss",
            "provenance.git_revision", "max_rss_mb_per_rank"} <= fields
    assert "compute_s" not in result.stdout
    record = json.loads((out / "epochs.jsonl").read_text())
    assert f"{record['compute_s']:.6g}" in report.stdout


def test_report_of_a_run_directory_names_a_bad_line(tmp_path: Path):
    """A line that is not an epoch record is a warning, the rest are shown; none readable
    is error/hint, exit 2."""
    good = record("resnet50", {"loss": 1.5, "accuracy": 0.25}, 2.0)
    (tmp_path / "epochs.jsonl").write_text(good.to_json() + "\nnot json\n")
    result = run(["hpcai-launch", "report", str(tmp_path)], base_env())
    assert result.returncode == 0, result.stderr
    assert "epochs.jsonl:2: not JSON" in result.stderr and "losses.accuracy" in result.stdout
    (tmp_path / "epochs.jsonl").write_text("not json\n")
    result = run(["hpcai-launch", "report", str(tmp_path)], base_env())
    assert result.returncode == 2 and "error: no readable epoch record" in result.stderr
    assert "hint: " in result.stderr
