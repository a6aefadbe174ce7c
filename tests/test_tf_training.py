"""TensorFlow/Keras 3DGAN and ResNet50 trained by the same engine, under hpcai-launch.

The shared 3DGAN run and its resume run with torch blocked from import in every process
(launcher and ranks; ``conftest.blocked_env``): the TensorFlow path imports no torch. The
control of the block is in test_tf_without_torch.py. The resume run averages with
``--comm horovod`` where Horovod is built for TensorFlow, and is then also the Horovod
TensorFlow test (the other Horovod tests are in test_horovod.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import base_env, blocked_env, run
from hpcai.training.config import horovod_built
from test_horovod import needs_hvd_tf
from test_tf_without_torch import HALTED

pytestmark = pytest.mark.mpi
PROGRAMS = Path(__file__).parent / "programs"
# physics validation on 2 held-out events (1 per rank): every record has its summary
GAN = ["3dgan", "--generate", "32", "--batch-size", "2", "--peak-gflops", "50",
       "--eval-samples", "4", "--validate-events", "2"]


def train(ranks: int, *args: str, env: dict | None = None, timeout: float = 400):
    return run(["hpcai-launch", "-N", str(ranks), "--", "train", *args], env or base_env(),
               timeout=timeout)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]


TF_GAN = [*GAN, "--framework", "tensorflow", "--max-steps", "1", "--verify-every", "1"]
LAST_CKPT = "ckpt-E0002-S000000.pt"   # the shared run's, after its second epoch


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> dict:
    """An environment in which ``import torch`` fails, as if torch were not installed."""
    return blocked_env(tmp_path_factory.mktemp("no-torch"), "torch")


@pytest.fixture(scope="module")
def tf_gan_run(tmp_path_factory, no_torch):
    """A 2-rank TensorFlow 3DGAN run of 2 epochs of one step each (a TensorFlow 3DGAN step
    takes 5-9 s on a core here), torch blocked, its output folder and its result: read by
    the records test and the export test, and copied and resumed by ``tf_gan_resumed``."""
    out = tmp_path_factory.mktemp("tf-gan") / "run"
    return out, train(2, *TF_GAN, "--epochs", "2", "--out", str(out), env=no_torch)


def test_keras_3dgan_two_ranks_writes_the_same_records_as_pytorch(tf_gan_run, tmp_path):
    """The TensorFlow run's records against a 1-rank PyTorch run's (a record's fields and
    the FLOP count do not depend on the number of ranks)."""
    import tensorflow as tf

    tf_out, result = tf_gan_run
    torch_out = tmp_path / "torch"
    assert result.returncode == 0, result.stderr[-3000:]
    assert HALTED not in result.stderr
    assert "3dgan (tensorflow) on 2 rank(s)" in result.stdout
    reference = train(1, *GAN, "--epochs", "1", "--max-steps", "1", "--out", str(torch_out))
    assert reference.returncode == 0, reference.stderr[-3000:]
    epochs, (torch_record,) = records(tf_out), records(torch_out)
    assert [r["epoch"] for r in epochs] == [0, 1]
    for r in epochs:
        assert set(r) == set(torch_record), set(r) ^ set(torch_record)
        assert set(r["losses"]) == set(torch_record["losses"])
        assert set(r["provenance"]) == set(torch_record["provenance"])
        assert r["framework"] == "tensorflow" and torch_record["framework"] == "pytorch"
        prov = r["provenance"]
        assert prov["framework_version"].startswith(f"tensorflow {tf.__version__}")
        assert prov["comm"] == "mpi" and prov["comm_version"].startswith("mpi4py ")
        assert prov["world_size"] == 2 and "libmpi" in prov["libmpi"]
        assert prov["threads_per_rank"] == 1   # TF's intra-op pool, from the placement plan
        assert r["steps"] == 1 and r["allreduce"]["calls"] > 0
        assert r["allreduce"]["bytes_per_rank"] > 2 * 4 * 900_000   # G's and D's, one step
        assert "analytically per Conv/Dense layer" in r["flop_convention"]
        assert all(np.isfinite(v) for v in r["losses"].values())
        assert r["eval"]["samples"] == 4 and r["eval"]["real_sum_over_f"] > 0
    # the analytic Keras count and PyTorch's FlopCounterMode agree on the same network
    assert epochs[0]["flops_per_sample"] == pytest.approx(torch_record["flops_per_sample"],
                                                          rel=0.02)
    assert epochs[1]["lr"] == pytest.approx(2e-3)
    ckpts = sorted(p.name for p in (tf_out / "checkpoints").iterdir())
    assert ckpts == ["ckpt-E0001-S000000.pt", LAST_CKPT]


# Horovod's TensorFlow ops are built here (else its test is skipped, with the reason)
HOROVOD = horovod_built("tensorflow")


@pytest.fixture(scope="module")
def tf_gan_resumed(tf_gan_run, no_torch, tmp_path_factory):
    """A copy of the shared 2-epoch run, resumed for a third epoch, torch blocked, from its
    checkpoint rewritten as an earlier version wrote it (``torch.save`` of NumPy arrays);
    with ``--comm horovod`` where Horovod is built for TensorFlow (the checkpoint holds no
    comm). Its output folder, the checkpoint resumed from, and the result."""
    import pickle

    import torch

    shared, first = tf_gan_run
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path_factory.mktemp("tf-gan-resumed") / "run"
    shutil.copytree(shared, out)
    ckpt = out / "checkpoints" / LAST_CKPT
    with open(ckpt, "rb") as handle:
        state = pickle.load(handle)
    torch.save(state, ckpt)
    comm = ["--comm", "horovod"] if HOROVOD else []
    again = train(2, *TF_GAN, *comm, "--epochs", "3", "--resume", "--out", str(out),
                  env=no_torch)
    return out, ckpt, again


def test_keras_resume_continues_from_the_checkpoint(tf_gan_resumed):
    out, ckpt, again = tf_gan_resumed
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt} at epoch 2 step 0" in again.stdout
    assert [r["epoch"] for r in records(out)] == [0, 1, 2]
    # a PyTorch run refuses the TensorFlow checkpoint (on 1 rank: the framework is checked
    # before the world size)
    wrong = train(1, *GAN, "--epochs", "4", "--max-steps", "1", "--resume", "--out", str(out))
    assert wrong.returncode == 2 and "written by tensorflow" in wrong.stderr
    assert "hint:" in wrong.stderr


@needs_hvd_tf
def test_comm_horovod_tensorflow_trains_and_keeps_replicas_identical(tf_gan_resumed):
    """The resumed epoch of the shared run, averaged by horovod.tensorflow, the replicas
    compared after its step (``--verify-every 1``: a difference fails the run)."""
    out, _, result = tf_gan_resumed
    assert result.returncode == 0, result.stderr[-3000:]
    record = records(out)[-1]
    assert record["epoch"] == 2 and record["framework"] == "tensorflow"
    assert record["provenance"]["comm"] == "horovod"
    assert record["provenance"]["comm_version"] == "horovod 0.28.1"
    assert record["allreduce"]["calls"] == 4   # D, D, G, G in its step, one grouped call each


def test_keras_resnet50_two_ranks_blocking_sync(tmp_path):
    out = tmp_path / "run"
    result = train(2, "resnet50", "--framework", "tensorflow", "--samples", "4",
                   "--batch-size", "2", "--image-size", "32", "--classes", "10",
                   "--epochs", "1", "--no-overlap", "--peak-gflops", "50",
                   "--eval-samples", "0", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    (r,) = records(out)
    assert r["model"] == "resnet50" and r["framework"] == "tensorflow" and r["steps"] == 1
    assert r["allreduce"]["overlap"] is False and r["grad_sync_s"] > 0
    # keras.applications.ResNet50 (conv biases): 23.5 M weights to average at 10 classes
    assert r["allreduce"]["bytes_per_rank"] > 4 * 23_000_000


def _updates(path: Path) -> np.ndarray:
    saved = dict(np.load(path))
    names = sorted(k for k in saved if not k.startswith("init."))
    assert len(names) >= 14
    return np.concatenate([(saved[k] - saved[f"init.{k}"]).ravel().astype(np.float64)
                           for k in names])


# the engine averages a gradient list whatever the layers' data format: channels-first
# (XLA-compiled convolutions, 15 s more per process) is the model's own test
# (test_keras_model.py), not a variant here
KERAS_D_VARIANTS = [(), ("--blocking",)]


@pytest.fixture(scope="module")
def keras_d_runs(tmp_path_factory) -> tuple[Path, object]:
    """The 2 steps of keras_dp_equivalence.py for every variant, in one 2-rank hpcai-launch
    job (one TensorFlow import per rank for all): the 2-rank runs, the control (2 ranks
    without averaging), then the 1-rank references, variant I on rank I alone
    (``--alone``, ``MPI.COMM_SELF``). The files: ``one-I.npz``, ``two-I.npz`` for
    variant I, and ``alone.npz``."""
    assert len(KERAS_D_VARIANTS) <= 2, "one 1-rank reference per rank of the job"
    folder = tmp_path_factory.mktemp("keras-d")
    runs = [[str(folder / f"two-{i}.npz"), *extra] for i, extra in enumerate(KERAS_D_VARIANTS)]
    runs.append([str(folder / "alone.npz"), "--no-average"])
    runs += [[str(folder / f"one-{i}.npz"), *extra, "--alone", str(i)]
             for i, extra in enumerate(KERAS_D_VARIANTS)]
    spec = folder / "runs.json"
    spec.write_text(json.dumps(runs))
    return folder, run(["hpcai-launch", "-N", "2", "--", sys.executable,
                        str(PROGRAMS / "keras_dp_equivalence.py"), "--each", str(spec)],
                       base_env(), timeout=300 + 60 * len(runs))


def _keras_d_run(keras_d_runs, name: str) -> np.ndarray:
    folder, result = keras_d_runs
    assert result.returncode == 0, f"the job: {result.stderr[-3000:]}"
    return _updates(folder / name)


@pytest.mark.parametrize("extra", KERAS_D_VARIANTS)
def test_keras_discriminator_two_ranks_equal_one_rank_with_twice_the_batch(extra,
                                                                            keras_d_runs):
    """2 SGD steps of the Keras D; compared: the weight updates of all variables together.

    Tolerance: |update(2 x b) - update(1 x 2b)| <= 1e-2 |update(1 x 2b)|. TensorFlow's CPU
    convolutions sum in an order that depends on the batch size and on how many CPUs the
    process may use: with no MPI at all, the same run on 1 or 2 CPUs differs by up to
    2.5e-3 (channels-first, XLA) and 3e-4 (channels-last, oneDNN); float64 is not an option
    (TF has no float64 AvgPool3D on the CPU). The control - the same 2-rank run without
    averaging - is off by about 0.5, far outside.
    """
    i = KERAS_D_VARIANTS.index(extra)
    what = " ".join(extra) or "overlap, channels-last"
    one = _keras_d_run(keras_d_runs, f"one-{i}.npz")
    two = _keras_d_run(keras_d_runs, f"two-{i}.npz")
    rel = np.linalg.norm(two - one) / np.linalg.norm(one)
    assert rel <= 1e-2, f"{what}: updates differ by {rel:.3g} (relative)"
    if not extra:
        alone = _keras_d_run(keras_d_runs, "alone.npz")
        control = np.linalg.norm(alone - one) / np.linalg.norm(one)
        assert control > 0.1, f"{what}: the control should fail the comparison, got {control:.3g}"


def _blocking(tmp_path: Path, *modules: str) -> dict:
    """An environment in which ``modules`` cannot be imported (as if not installed)."""
    return blocked_env(tmp_path / ("blocked-" + "-".join(modules)), *modules)


@pytest.mark.parametrize("case", ["no-tensorflow", "no-horovod-tf", "no-horovod-torch",
                                  "gloo-with-tf", "tf-resnet-tiny"])
def test_framework_and_comm_bad_input(case, tmp_path):
    out = tmp_path / "out"
    args, env, expect = {
        "no-tensorflow": (["--framework", "tensorflow"], _blocking(tmp_path, "tensorflow"),
                          "--framework tensorflow, but tensorflow cannot be imported"),
        "no-horovod-tf": (["--framework", "tensorflow", "--comm", "horovod"],
                          _blocking(tmp_path, "horovod"),
                          "--comm horovod, but horovod.tensorflow cannot be imported"),
        "no-horovod-torch": (["--comm", "horovod"], _blocking(tmp_path, "horovod"),
                             "--comm horovod, but horovod.torch cannot be imported"),
        "gloo-with-tf": (["--framework", "tensorflow", "--comm", "gloo"], base_env(),
                         "--comm gloo is torch.distributed's backend"),
        "tf-resnet-tiny": (["--framework", "tensorflow"], base_env(),
                           "resnet-tiny has no TensorFlow version"),
    }[case]
    model = ["resnet-tiny"] if case == "tf-resnet-tiny" else GAN
    result = train(2, *model, *args, "--out", str(out), env=env, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    assert result.stderr.count("error: ") == 1 and "hint: " in result.stderr
    assert expect in result.stderr, result.stderr
    assert not out.exists(), "something was written before the error"


def test_export_refuses_a_tensorflow_checkpoint(tf_gan_run):
    out, result = tf_gan_run
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = out / "checkpoints" / LAST_CKPT
    refused = run(["hpcai-launch", "export-onnx", str(ckpt), "--model", "3dgan"], base_env())
    assert refused.returncode == 2, refused.stderr
    assert "written by `train --framework tensorflow`" in refused.stderr
    assert "hint: train with --framework pytorch" in refused.stderr
