"""Training runs for real under hpcai-launch: records, checkpoints, bad input (faults:
test_faults.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import SHARED_CORES, base_env, run
from hpcai.training.record import EpochRecord
from jobs import train

pytestmark = pytest.mark.mpi
TINY = ["resnet-tiny", "--image-size", "32", "--classes", "10", "--batch-size", "4",
        "--verify-every", "5"]


def records(out: Path, name: str = "epochs.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def test_3dgan_two_ranks_on_generated_data(tmp_path):
    out = tmp_path / "run"
    result = train(2, "3dgan", "--generate", "64", "--epochs", "2", "--batch-size", "2",
                   "--max-steps", "2", "--out", str(out), "--verify-every", "1",
                   "--validate-events", "16", "--eval-samples", "4",
                   "--device", "cpu",   # controls of the refusals
                   "--loss-weights", "8,0.2,0.1",
                   # train sets SHARED_CORES itself; the peak is measured (the GEMM probe)
                   env=base_env(HPCAI_PEAK_GFLOPS=None, **dict.fromkeys(SHARED_CORES)))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1"]
    for line in lines:   # short: the rest is in epochs.jsonl
        assert len(line) < 160 and "% of fp32 peak" in line and "worst sum/E" in line, line
        assert "GFLOP/s" not in line and "profile_distance" not in line, line
    assert "recipe learning (--batch-size given)," in result.stdout   # said at the start
    # Open MPI's default: a communication thread, its waits yielding (train sets it)
    assert "comm mpi (thread progress)," in result.stdout
    epochs = records(out)
    assert [r["epoch"] for r in epochs] == [0, 1]
    for line in (out / "epochs.jsonl").read_text().splitlines():   # the typed record reads it
        assert json.loads(EpochRecord.from_json(line).to_json()) == json.loads(line)
    for r in epochs:
        assert len(r) == 31 and r["version"] == 1   # 27, eval, physics and the two below
        assert (r["precision"], r["memory_format"]) == ("fp32", "channels_last")
        assert set(r["physics"]) >= {"profile_distance_z", "sampling_fraction_worst_rel_diff",
                                     "aux_mape_real", "aux_mape_gen", "hits_worst_rel_diff"}
        assert r["physics"]["events"] == 16   # of the 64 in the held-out file
        assert r["steps"] == 2 and r["samples_per_rank"] == 4
        assert r["epoch_time_s"] > 0 and r["samples_per_s"] > 0
        assert r["compute_s"] > 0 and r["comm_s"] >= 0 and r["data_s"] >= 0
        # D real 3x1.57 + D fake (0.51 + 3x1.57) + 2 x G (3x0.51 + 2x1.57) ~ 19.3 GFLOP
        assert 17e9 < r["flops_per_sample"] < 22e9
        assert "2 FLOP" in r["flop_convention"] and "3DGAN" in r["flop_convention"]
        assert r["gflops_total"] == pytest.approx(2 * r["gflops_per_rank"], rel=1e-3)
        assert r["peak"]["gflops_per_rank"] > 0
        assert r["peak"]["source"].startswith("measured: fp32 GEMM 2048^3")
        prov = r["provenance"]
        assert prov["world_size"] == 2 and prov["ranks_per_node"] == 2
        assert "libmpi" in (prov["libmpi"] or "") and prov["mpi_library_version"]
        assert prov["git_revision"]
        assert set(r["losses"]) >= {"d_real", "d_fake", "g", "g1_aux"}
        assert all(np.isfinite(v) for v in r["losses"].values())
    # the recipe's 2e-4, scaled linearly by 2 ranks; its step decay starts after 80 % of
    # the 4 steps, so no step of this run has it
    assert r["lr"] == pytest.approx(4e-4)
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["ckpt-E0001-S000000.pt", "ckpt-E0002-S000000.pt"]
    # 64 training events in one file, and one held-out file of its own seed, sorted last
    assert sorted(p.name for p in (out / "data").glob("Ele_*.h5")) == [
        "Ele_1001234_0.h5", "Ele_1234_0.h5"]
    assert "16 of 64 held-out events (Ele_1001234_0.h5)" in result.stdout
    assert "physics plots drawn at the stop" not in result.stdout   # drawn at the last one
    doc = json.loads((out / "physics.json").read_text())
    assert [v["epoch"] for v in doc["validations"]] == [0, 1]
    assert [v["summary"] for v in doc["validations"]] == [r["physics"] for r in epochs]
    for name in ("physics-profiles.png", "physics-sampling-fraction.png",
                 "physics-metrics.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resnet_records_and_lr_warmup(tmp_path):
    """Also: the MPI calls made by the backward hooks (``--allreduce-progress hook``), said
    at the start, with the replicas compared every 5 steps (the 3DGAN run above, with the
    default, is the control of the start line)."""
    out = tmp_path / "run"
    result = train(2, *TINY, "--samples", "64", "--epochs", "2", "--warmup-epochs", "1",
                   "--lr", "0.01", "--out", str(out), "--bn", "average",
                   "--allreduce-progress", "hook")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "comm mpi (hook progress)," in result.stdout
    epochs = records(out)
    assert [r["steps"] for r in epochs] == [8, 8]
    assert epochs[0]["lr"] < 0.02 and epochs[1]["lr"] == pytest.approx(0.02)
    assert epochs[0]["allreduce"]["calls"] > 0
    # the peak the test rig gives (HPCAI_PEAK_GFLOPS=50), not measured
    assert epochs[0]["peak"] == {"gflops_per_rank": 50.0,
                                 "source": "given: --peak-gflops or $HPCAI_PEAK_GFLOPS"}


def _h5(path: Path, ecal_shape=(4, 25, 25, 25), target_cols=2, ecal_name="ECAL"):
    with h5py.File(path, "w") as f:
        f.create_dataset(ecal_name, data=np.zeros(ecal_shape, dtype="f4"))
        f.create_dataset("target", data=np.ones((ecal_shape[0], target_cols), dtype="f4"))


@pytest.mark.parametrize("case", ["missing-ecal", "wrong-shape", "empty-dir", "unwritable-out",
                                  "peak-not-a-number"])
def test_bad_input_stops_before_training_with_a_hint(case, tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    env = base_env()
    if case == "peak-not-a-number":
        _h5(data / "Ele_1_1.h5")
        env["HPCAI_PEAK_GFLOPS"] = "fast"
    if case == "missing-ecal":
        _h5(data / "Ele_1_1.h5", ecal_name="HCAL")
    elif case == "wrong-shape":
        _h5(data / "Ele_1_1.h5", ecal_shape=(4, 25, 25, 20))
    elif case == "unwritable-out":
        _h5(data / "Ele_1_1.h5")
        out = Path("/proc/hpcai-test/out")
    result = train(2, "3dgan", "--data", str(data), "--out", str(out), timeout=120, env=env)
    assert result.returncode == 2, (result.stdout, result.stderr)
    err = result.stderr
    assert err.count("error: ") == 1 and "hint: " in err, err
    assert {"missing-ecal": "ECAL", "wrong-shape": "(4, 25, 25, 20)", "empty-dir": "no .h5",
            "unwritable-out": "not writable",
            "peak-not-a-number": "HPCAI_PEAK_GFLOPS='fast' is not a positive"}[case] in err, err
    assert "hpcai-train:" not in result.stdout
    if case != "unwritable-out":
        assert not out.exists(), "something was written before the error"


def test_gloo_baseline_trains_and_says_so(tmp_path):
    out = tmp_path / "run"
    result = train(2, *TINY, "--samples", "32", "--epochs", "1", "--comm", "gloo",
                   "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = records(out)
    assert record["provenance"]["comm"] == "gloo" and record["steps"] == 4
    assert record["grad_sync_s"] > 0


def test_initial_weights_are_broadcast_and_proven_identical(tmp_path):
    script = tmp_path / "init.py"
    script.write_text(
        "import torch\n"
        "from mpi4py import MPI\n"
        "from hpcai.models.gan3d import Generator\n"
        "from hpcai.training.replicas import verify, ReplicaDivergence\n"
        "from hpcai.training.torch_trainer import broadcast_state, module_arrays\n"
        "comm = MPI.COMM_WORLD\n"
        "G = Generator(rng=torch.Generator().manual_seed(100 + comm.rank))\n"
        "try:\n"
        "    verify(module_arrays([G]), comm, exact=True)\n"
        "    print('undetected', flush=True)\n"
        "except ReplicaDivergence:\n"
        "    print('different before broadcast', flush=True)\n"
        "broadcast_state([G], comm)\n"
        "verify(module_arrays([G]), comm, exact=True)\n"
        "print('identical after broadcast', flush=True)\n")
    result = run(["hpcai-launch", "-N", "2", "--", "python", str(script)], base_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("different before broadcast") == 2
    assert result.stdout.count("identical after broadcast") == 2


@pytest.mark.parametrize("spin", [False, True])
def test_ranks_waiting_for_rank_0_sleep_instead_of_polling(spin):
    """The waits on rank 0's serial work (data generation, plots, evaluation, records,
    checkpoint writes) are ``waits.idle_barrier``: rank 1, waiting 1 s for rank 0, tests the
    barrier at most once per sleep, the sleeps growing from 0.1 ms to 10 ms (about 100 tests
    in a second). The control, the same barrier tested without sleeping (``sleep(0)``),
    must fail the same bound: about 16,000 tests on the idle VM, 461 in a loaded full suite."""
    from hpcai.training.waits import FIRST_SLEEP_S, MAX_SLEEP_S

    program = Path(__file__).parent / "programs" / "idle_wait.py"
    result = run(["hpcai-launch", "-N", "2", "--", "python", str(program),
                  *(["--spin"] if spin else [])], base_env(), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"rank 1 tests (\d+) wait ([\d.]+) cpu", result.stdout)
    assert found, result.stdout
    tests, wait = int(found[1]), float(found[2])
    assert wait >= 0.9, result.stdout   # rank 0 slept 1 s first
    # each test but the first follows a sleep of at least min(0.1 ms x 2^k, 10 ms)
    doublings = math.ceil(math.log2(MAX_SLEEP_S / FIRST_SLEEP_S))
    bound = 1 + doublings + wait / MAX_SLEEP_S
    assert (tests > bound) if spin else (tests <= bound), (tests, bound, result.stdout)
