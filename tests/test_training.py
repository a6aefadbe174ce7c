"""Training runs for real under hpcai-launch: records, checkpoints, faults, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import base_env, run
from hpcai.training.record import EpochRecord

pytestmark = pytest.mark.mpi
TINY = ["resnet-tiny", "--image-size", "32", "--classes", "10", "--batch-size", "4",
        "--peak-gflops", "50", "--verify-every", "5"]


def train(ranks: int, *args: str, env: dict | None = None, timeout: float = 300):
    return run(["hpcai-launch", "-N", str(ranks), "--", "train", *args], env or base_env(),
               timeout=timeout)


def records(out: Path, name: str = "epochs.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def test_3dgan_two_ranks_on_generated_data(tmp_path):
    out = tmp_path / "run"
    result = train(2, "3dgan", "--generate", "64", "--epochs", "2", "--batch-size", "2",
                   "--max-steps", "2", "--out", str(out), "--verify-every", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("epoch ") >= 2 and "GFLOP/s" in result.stdout
    epochs = records(out)
    assert [r["epoch"] for r in epochs] == [0, 1]
    for line in (out / "epochs.jsonl").read_text().splitlines():   # the typed record reads it
        assert json.loads(EpochRecord.from_json(line).to_json()) == json.loads(line)
    for r in epochs:
        assert len(r) == 28 and r["version"] == 1   # 27 keys and eval
        assert r["steps"] == 2 and r["samples_per_rank"] == 4
        assert r["epoch_time_s"] > 0 and r["samples_per_s"] > 0
        assert r["compute_s"] > 0 and r["comm_s"] >= 0 and r["data_s"] >= 0
        # D real 3x1.57 + D fake (0.51 + 3x1.57) + 2 x G (3x0.51 + 2x1.57) ~ 19.3 GFLOP
        assert 17e9 < r["flops_per_sample"] < 22e9
        assert "2 FLOP" in r["flop_convention"] and "3DGAN" in r["flop_convention"]
        assert r["gflops_total"] == pytest.approx(2 * r["gflops_per_rank"], rel=1e-3)
        assert r["peak"]["gflops_per_rank"] > 0 and "GEMM" in r["peak"]["source"]
        prov = r["provenance"]
        assert prov["world_size"] == 2 and prov["ranks_per_node"] == 2
        assert "libmpi" in (prov["libmpi"] or "") and prov["mpi_library_version"]
        assert prov["git_revision"]
        assert set(r["losses"]) >= {"d_real", "d_fake", "g", "g1_aux"}
        assert all(np.isfinite(v) for v in r["losses"].values())
    assert r["lr"] == pytest.approx(2e-3)  # linear scaling of 1e-3 by 2 ranks
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["ckpt-E0001-S000000.pt", "ckpt-E0002-S000000.pt"]
    assert len(list((out / "data").glob("Ele_*.h5"))) == 1


def test_resnet_records_and_lr_warmup(tmp_path):
    out = tmp_path / "run"
    result = train(2, *TINY, "--samples", "64", "--epochs", "2", "--warmup-epochs", "1",
                   "--lr", "0.01", "--out", str(out), "--bn", "average")
    assert result.returncode == 0, result.stderr[-3000:]
    epochs = records(out)
    assert [r["steps"] for r in epochs] == [8, 8]
    assert epochs[0]["lr"] < 0.02 and epochs[1]["lr"] == pytest.approx(0.02)
    assert epochs[0]["allreduce"]["calls"] > 0


def _rank_pids(tag: str) -> dict[int, int]:
    """PIDs of the ranks this test started (tagged env), by rank."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"HPCAI_TEST_TAG={tag}".encode() in env and b"train" in cmd \
                and b"hpcai.launcher" not in cmd and b"mpirun" not in cmd:
            for item in env:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(entry.name)
    return found


def _start(out: Path, *args: str, tag: str):
    log = open(out.parent / f"{out.name}.log", "w")
    proc = subprocess.Popen(["hpcai-launch", "-N", "2", "--", "train", *args,
                             "--out", str(out)], env=base_env(HPCAI_TEST_TAG=tag),
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, Path(log.name)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


LONG = [*TINY, "--samples", "4096", "--epochs", "3", "--checkpoint-every", "0"]


def test_killed_rank_ends_the_job_promptly_and_is_named(tmp_path):
    tag = uuid.uuid4().hex
    proc, log = _start(tmp_path / "run", *LONG, tag=tag)
    try:
        _wait_for(lambda: "hpcai-train:" in log.read_text(), 120, "training start")
        pids = _wait_for(lambda: (p := _rank_pids(tag)) and len(p) == 2 and p, 30, "ranks")
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        code = proc.wait(timeout=30)
        assert time.monotonic() - killed_at < 30
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code != 0
    assert "rank 1" in text, text[-2000:]


def test_exception_on_one_rank_aborts_all_with_root_cause(tmp_path):
    env = base_env(HPCAI_INJECT_FAULT="1:3")
    start = time.monotonic()
    result = train(2, *LONG, "--out", str(tmp_path / "run"), env=env, timeout=120)
    assert result.returncode != 0
    assert time.monotonic() - start < 90
    err = result.stderr
    assert "error: hpcai-train: rank 1 of 2 on" in err and "injected fault" in err, err[-3000:]
    assert "Traceback" in err and "MPI_ABORT" in err.upper()


def test_sigterm_checkpoints_and_resume_continues_the_same_losses(tmp_path):
    args = [*TINY, "--samples", "2048", "--epochs", "2"]
    reference = tmp_path / "reference"
    result = train(2, *args, "--out", str(reference))
    assert result.returncode == 0, result.stderr[-2000:]

    out, tag = tmp_path / "preempted", uuid.uuid4().hex
    proc, log = _start(out, *args, tag=tag)
    try:
        _wait_for(lambda: "hpcai-train:" in log.read_text(), 120, "training start")
        pids = _wait_for(lambda: (p := _rank_pids(tag)) and len(p) == 2 and p, 30, "ranks")
        time.sleep(1.0)
        for pid in pids.values():   # what Slurm does: the signal goes to every task
            os.kill(pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 75, text[-2000:]
    assert "preempted by signal" in text and "--resume" in text
    ckpts = list((out / "checkpoints").glob("ckpt-*.pt"))
    assert ckpts, "no checkpoint written on SIGTERM"
    assert not list((out / "checkpoints").glob(".*tmp*")), "temporary file left behind"
    done_before = len(records(out, "steps.jsonl"))
    assert 0 < done_before < 2 * 256, "signal did not arrive mid-run"

    result = train(2, *args, "--out", str(out), "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stdout
    ref = {(s["epoch"], s["step"]): s for s in records(reference, "steps.jsonl")}
    got = records(out, "steps.jsonl")
    keys = [(s["epoch"], s["step"]) for s in got]
    assert len(keys) == len(set(keys)) == len(ref), "steps repeated or missing across resume"
    for s in got:
        r = ref[(s["epoch"], s["step"])]
        assert s["loss"] == pytest.approx(r["loss"], rel=1e-4, abs=1e-6), (s, r)


def _h5(path: Path, ecal_shape=(4, 25, 25, 25), target_cols=2, ecal_name="ECAL"):
    with h5py.File(path, "w") as f:
        f.create_dataset(ecal_name, data=np.zeros(ecal_shape, dtype="f4"))
        f.create_dataset("target", data=np.ones((ecal_shape[0], target_cols), dtype="f4"))


@pytest.mark.parametrize("case", ["missing-ecal", "wrong-shape", "empty-dir", "unwritable-out"])
def test_bad_input_stops_before_training_with_a_hint(case, tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    if case == "missing-ecal":
        _h5(data / "Ele_1_1.h5", ecal_name="HCAL")
    elif case == "wrong-shape":
        _h5(data / "Ele_1_1.h5", ecal_shape=(4, 25, 25, 20))
    elif case == "unwritable-out":
        _h5(data / "Ele_1_1.h5")
        out = Path("/proc/hpcai-test/out")
    result = train(2, "3dgan", "--data", str(data), "--out", str(out), timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    err = result.stderr
    assert err.count("error: ") == 1 and "hint: " in err, err
    assert {"missing-ecal": "ECAL", "wrong-shape": "(4, 25, 25, 20)", "empty-dir": "no .h5",
            "unwritable-out": "not writable"}[case] in err, err
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
