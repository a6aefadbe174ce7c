"""The TensorFlow path imports no torch: what a TensorFlow run reads of a checkpoint, with
torch blocked from import, and the control of that block.

Every process under the block (launcher and ranks) starts with a ``sitecustomize`` that
makes ``import torch`` fail as if torch were not installed. The Keras 3DGAN trains and
resumes under it in test_tf_training.py; the PyTorch run under the same block here is the
control that shows the block works.
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import blocked_env, run

pytestmark = pytest.mark.mpi
GAN = ["3dgan", "--generate", "32", "--batch-size", "2", "--peak-gflops", "50",
       "--eval-samples", "4", "--max-steps", "1"]
HALTED = "import of torch halted"   # Python's ImportError for sys.modules["torch"] = None


def _train(env: dict, *args: str):
    return run(["hpcai-launch", "-N", "2", "--", "train", *args], env, timeout=400)


def test_the_block_stops_a_pytorch_run_at_import_torch(tmp_path):
    """The control of the block that test_tf_training.py trains and resumes the TensorFlow
    3DGAN under: a PyTorch run under the same block stops at ``import torch``."""
    no_torch = blocked_env(tmp_path / "no-torch", "torch")
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
