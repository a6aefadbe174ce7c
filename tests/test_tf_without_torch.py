"""The TensorFlow path imports no torch: Keras 3DGAN training with torch blocked from import.

Every process of these runs (launcher and ranks) starts with a ``sitecustomize`` that makes
``import torch`` fail as if torch were not installed; the PyTorch run under the same block is
the control that shows the block works.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

from conftest import blocked_env, run

pytestmark = pytest.mark.mpi
GAN = ["3dgan", "--generate", "32", "--batch-size", "2", "--peak-gflops", "50",
       "--eval-samples", "4", "--max-steps", "1"]
HALTED = "import of torch halted"   # Python's ImportError for sys.modules["torch"] = None


def _train(env: dict, *args: str):
    return run(["hpcai-launch", "-N", "2", "--", "train", *args], env, timeout=400)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]


def test_tensorflow_trains_and_resumes_without_torch(tmp_path):
    no_torch = blocked_env(tmp_path / "no-torch", "torch")
    out = tmp_path / "tf"
    first = _train(no_torch, *GAN, "--framework", "tensorflow", "--epochs", "1",
                   "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    assert HALTED not in first.stderr
    (record,) = _records(out)
    assert record["framework"] == "tensorflow" and record["steps"] == 1
    assert record["eval"]["samples"] == 4 and record["allreduce"]["calls"] > 0

    # an earlier version's TensorFlow checkpoint (torch.save of NumPy arrays) resumes too
    (ckpt,) = sorted((out / "checkpoints").glob("ckpt-*.pt"))
    with open(ckpt, "rb") as handle:
        state = pickle.load(handle)
    torch.save(state, ckpt)

    again = _train(no_torch, *GAN, "--framework", "tensorflow", "--epochs", "2", "--resume",
                   "--out", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt} at epoch 1 step 0" in again.stdout
    assert [r["epoch"] for r in _records(out)] == [0, 1]

    # the control: under the same block, a PyTorch run stops at `import torch`
    control = _train(no_torch, *GAN, "--epochs", "1", "--out", str(tmp_path / "torch"))
    assert control.returncode != 0 and HALTED in control.stderr, control.stderr[-3000:]


def test_a_pytorch_checkpoint_is_read_without_torch(tmp_path):
    """What a TensorFlow run needs to refuse a PyTorch checkpoint: who wrote it."""
    path = tmp_path / "ckpt-E0001-S000000.pt"
    torch.save({"framework": "pytorch", "model": "3dgan", "world_size": 2,
                "modules": {"generator": torch.nn.Linear(2, 2).state_dict()}}, path)
    script = ("import sys\n"
              "from hpcai.training import checkpoint\n"
              "state = checkpoint.read_without_torch(sys.argv[1])\n"
              "print(state['framework'], state['model'], state['world_size'],\n"
              "      sorted(state['modules']['generator'].items()))\n")
    no_torch = blocked_env(tmp_path / "no-torch", "torch")
    result = run([sys.executable, "-c", script, str(path)], no_torch)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["pytorch", "3dgan", "2", "[('bias',", "None),",
                                     "('weight',", "None)]"]
    control = run([sys.executable, "-c", "import torch", str(path)], no_torch)
    assert control.returncode != 0 and HALTED in control.stderr
