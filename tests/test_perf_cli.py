"""hpcai-launch tune and predict: the commands, on synthetic tune results and one real tune."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcai.core.errors import UserError
from hpcai.launcher.cli import main
from hpcai.perf.model import AllreduceSample, LinkCost, allreduce
from hpcai.perf.result import Layout, Link, TuneResult
from hpcai.perf.tune import layouts_to_measure, rank_layouts

SHM = LinkCost(2e-6, 1e-10)
MB = 2**20


def synthetic_tune(memory_bytes: int = 64 * 2**30) -> TuneResult:
    """4 cores; s/sample = (0.01 + 0.04/T) * (1 + 0.2 (r-1)); 1 GiB per rank."""
    def s(r, t):
        return (0.01 + 0.04 / t) * (1 + 0.2 * (r - 1))
    layouts = tuple(Layout(r, t, s(r, t), 2**30, r / s(r, t))
                    for r, t in ((1, 4), (1, 1), (2, 2), (4, 1)))
    samples = [AllreduceSample(p, n, allreduce(n, 1, p, SHM, SHM).seconds)
               for p in (2, 3, 4) for n in (1024, 65536, 4 * MB)]
    return TuneResult(model="3dgan", command=("train", "3dgan"), batch_per_rank=8,
                      epoch_samples=1024, cores=4, memory_bytes=memory_bytes,
                      flops_per_sample=1e9, buckets=(4 * MB, 4 * MB), compute=layouts,
                      shm=Link.fitted(samples), net=Link.fitted(samples),
                      provenance={"synthetic": True})


def test_tune_result_round_trips_and_ranks_layouts(tmp_path):
    tune = synthetic_tune()
    path = tmp_path / "tune.json"
    path.write_text(tune.to_json())
    back = TuneResult.load(path)
    assert back == tune
    assert back.shm.cost.alpha_s == pytest.approx(2e-6)
    choices = rank_layouts(back, 4)
    assert len(choices) == 4 + 2 + 1 + 1       # r x t <= 4
    best = choices[0]
    # closed form: 1 x 4 -> 8 / (8 * 0.02) = 50; 2 x 2 -> 16 / (8 * 0.03 * 1.2 + 2 rings)
    one = next(c for c in choices if (c.ranks, c.threads) == (1, 4))
    assert one.samples_per_s == pytest.approx(50.0) and one.comm_s == 0
    assert one.measured_samples_per_s == pytest.approx(1 / 0.02)
    rings = 2 * (2 * 2e-6 + 4 * MB * 1e-10)
    assert (best.ranks, best.threads) == (2, 2)
    assert best.samples_per_s == pytest.approx(16 / (8 * 0.036 + rings))
    assert "compute-bound" in best.reason


def test_tune_drops_layouts_that_do_not_fit_in_memory():
    choices = rank_layouts(synthetic_tune(memory_bytes=int(2.5 * 2**30)), 4)
    assert [c.fits for c in choices] == [True] * 6 + [False] * 2   # r = 3, 4 do not fit
    assert all(c.reason.startswith("memory:") for c in choices if not c.fits)
    assert layouts_to_measure(4, 8) == [(1, 4), (1, 1), (2, 2), (4, 1), (1, 2), (1, 3)]


def test_predict_writes_report_table_and_plot(tmp_path, capsys):
    path = tmp_path / "tune.json"
    path.write_text(synthetic_tune().to_json())
    out = tmp_path / "pred"
    assert main(["predict", "--tune", str(path), "--nodes", "1,2,4,1024", "-N", "1", "-t",
                 "4", "--latency-us", "1", "--bandwidth-gbit-s", "100", "--out",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 1024 | 1 | 4 |" in text and "ring" in text
    doc = json.loads((out / "prediction.json").read_text())
    steps = {s["nodes"]: s for s in doc["steps"]}
    net = LinkCost.from_spec(1e-6, 100e9 / 8)
    ring = 2 * allreduce(4 * MB, 1024, 1, SHM, net).seconds
    assert steps[1024]["comm_s"] == pytest.approx(ring)
    assert steps[1024]["compute_s"] == pytest.approx(8 * 0.02)
    eff = {r["nodes"]: r["efficiency"] for r in doc["rows"]}
    assert eff[1024] == pytest.approx(0.16 / (0.16 + ring))
    assert (out / "prediction.png").read_bytes()[:4] == b"\x89PNG"


def _point(results: Path, nodes: int, samples_per_s: float, epoch_s: float) -> None:
    from hpcai.launcher.batch.points import Point, PointRecord
    from hpcai.training.record import AllreduceTotals, EpochRecord, Peak, Provenance
    pdir = results / f"N{nodes}-R1-T4-rep0"
    pdir.mkdir(parents=True)
    pdir.joinpath("point.json").write_text(
        PointRecord(Point(nodes, 1, 4, 0, "weak"), "done").to_json())
    prov = Provenance(nodes, 1, 4, None, "pytorch", "2", "mpi", "4", "Open MPI", None,
                      ("n1",), "abc", "2")
    rec = EpochRecord("3dgan", "pytorch", 0, 10, 0, epoch_s, epoch_s, 0.0, 0.0, 0.0, 0.0,
                      80, samples_per_s / nodes, samples_per_s, 1e9, "", 1.0, 1.0,
                      Peak(1.0, "given"), 1.0, 1e-3, {}, AllreduceTotals(0, 0, True, 4.0),
                      100.0, prov)
    pdir.joinpath("epochs.jsonl").write_text(rec.to_json() + "\n")


def test_predict_overlays_a_sweep_and_compares(tmp_path, capsys):
    path = tmp_path / "tune.json"
    path.write_text(synthetic_tune().to_json())
    results = tmp_path / "sweep"
    _point(results, 1, 50.0, 20.0)
    _point(results, 2, 80.0, 12.0)        # measured efficiency 80 %
    assert main(["predict", "--tune", str(path), "--nodes", "1,2", "-N", "1", "-t", "4",
                 "--tune-network", "--sweep", str(results), "--out",
                 str(tmp_path / "p")]) == 0
    doc = json.loads((tmp_path / "p" / "prediction.json").read_text())
    two = doc["comparison"][1]
    assert two["measured_efficiency"] == pytest.approx(0.8)
    assert two["measured_samples_per_s"] == 80.0
    assert math.isclose(two["error"], two["predicted_samples_per_s"] / 80.0 - 1)
    assert "Predicted against measured" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--nodes", "1,2"], "no network description"),
    (["--nodes", "1,x", "--tune-network"], "--nodes must be a list"),
    (["--nodes", "1", "--tune-network", "--latency-us", "1"], "two network descriptions"),
    (["--nodes", "1", "--latency-us", "1"], "go together"),
    (["--nodes", "1", "--tune-network", "--ranks-per-node", "65", "--threads-per-rank", "1"],
     "do not fit"),
])
def test_predict_user_errors(tmp_path, capsys, args, message):
    path = tmp_path / "tune.json"
    path.write_text(synthetic_tune().to_json())
    assert main(["predict", "--tune", str(path), "--out", str(tmp_path / "p"), *args]) == 2
    assert not (tmp_path / "p").exists()
    err = capsys.readouterr().err
    assert "error:" in err and message in err and "hint:" in err


def test_predict_and_tune_refuse_bad_inputs(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": 1}')
    assert main(["predict", "--tune", str(bad), "--nodes", "1", "--tune-network"]) == 2
    assert "malformed" in capsys.readouterr().err
    site = tmp_path / "site.toml"
    site.write_text('[network]\nlatency_us = -1\nbandwidth_gbit_s = 100\n')
    good = tmp_path / "tune.json"
    good.write_text(synthetic_tune().to_json())
    assert main(["predict", "--tune", str(good), "--nodes", "1", "--site", str(site)]) == 2
    assert "network.latency_us must be a positive number" in capsys.readouterr().err
    assert main(["tune", "--", "ls"]) == 2
    assert "not 'ls'" in capsys.readouterr().err
    assert main(["tune"]) == 2
    assert "after --" in capsys.readouterr().err
    assert main(["tune", "--budget", "0", "--", "train", "resnet-tiny"]) == 2
    assert main(["tune", "--json", str(tmp_path / "no" / "t.json"), "--", "train",
                 "resnet-tiny"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_site_profile_network_is_read(tmp_path):
    from hpcai.launcher.job.site import NetworkSpec, SiteProfile
    site = tmp_path / "s.toml"
    site.write_text('memory_per_node_gb = 96\n[network]\nlatency_us = 1.0\n'
                    'bandwidth_gbit_s = 100\ntopology = "fat-tree"\n')
    profile = SiteProfile.load(site)
    assert profile.network == NetworkSpec(1.0, 100.0, "fat-tree")
    assert profile.memory_per_node_gb == 96.0
    for text, message in (('[network]\nlatency_us = 1\nbandwidth_gbit_s = 1\ntopology = "ring"',
                           "network.topology must be one of"),
                          ('[network]\nlatency_us = 1', "needs latency_us and bandwidth_gbit_s"),
                          ('memory_per_node_gb = "lots"', "must be a number")):
        site.write_text(text + "\n")
        with pytest.raises(UserError, match=message) as caught:
            SiteProfile.load(site)
        assert caught.value.hint.startswith("for example")


def test_tune_measures_a_real_training_and_predicts_it(tmp_path):
    """One real tune (resnet-tiny, tiny images, no TCP probe, --verify): the layouts the fit
    needs measured, the top three run again and compared. Negative control: a training that
    fails makes tune fail with error/hint, exit 2, and write nothing."""
    out = tmp_path / "tune.json"
    train = ["train", "resnet-tiny", "--image-size", "16", "--classes", "4", "--batch-size",
             "4", "--samples", "64"]
    env = {**os.environ, "HPCAI_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "hpcai.launcher", "tune", "--budget", "60",
                           "--steps", "2", "--no-net", "--max-ranks", "2", "--verify",
                           "--json", str(out), "--", *train], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["links"]["net"] is None and doc["buckets"] and doc["flops_per_sample"] > 0
    assert {(c["ranks"], c["threads"]) for c in doc["compute"]} >= {(1, 1), (2, 1)}
    assert "sbatch line: hpcai-launch sbatch" in done.stdout
    assert doc["provenance"]["loadavg"]
    assert len(doc["verify"]) == min(3, len(doc["ranking"]))
    assert all(v["measured"] > 0 and v["predicted"] > 0 for v in doc["verify"])
    assert "verify: predicted vs measured" in done.stdout
    failed = subprocess.run([sys.executable, "-m", "hpcai.launcher", "tune", "--budget", "30",
                             "--no-net", "--json", str(tmp_path / "x.json"), "--", "train",
                             "3dgan", "--data", str(tmp_path / "nothing")],
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert "error: training at 1 rank(s)" in failed.stderr and "hint:" in failed.stderr
    assert not (tmp_path / "x.json").exists()


def test_tune_generates_showers_once_instead_of_per_layout():
    from hpcai.perf.tune import strip_generate
    assert strip_generate(["train", "3dgan", "--generate", "256", "--batch-size", "4"]) == (
        ["train", "3dgan", "--batch-size", "4"], 256)
    assert strip_generate(["train", "3dgan", "--generate=64"]) == (["train", "3dgan"], 64)
    assert strip_generate(["train", "resnet50"]) == (["train", "resnet50"], 0)
