"""ONNX export of trained checkpoints: ONNX Runtime recomputed against PyTorch here.

The test does not read the comparison that ``export-onnx`` writes: it loads the exported file
with onnxruntime and the checkpoint with torch itself, runs both on inputs of its own (batch
sizes 1, 3 and 5; the exporter checks 1 and 3), and compares. The control: the same model
with one weight tensor scaled by 1 % must fail the same comparison.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import base_env, run
from hpcai.models import gan3d, resnet

ATOL, RTOL = 1e-4, 1e-4    # |onnx - torch| <= ATOL + RTOL x max|torch|, as the README says


def _checkpoint(tmp_path: Path, *train_args: str) -> Path:
    out = tmp_path / "run"
    result = run(["hpcai-launch", "-N", "1", "--", "train", *train_args, "--epochs", "1",
                  "--max-steps", "1", "--peak-gflops", "50", "--eval-samples", "0",
                  "--out", str(out)], base_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (ckpt,) = sorted((out / "checkpoints").glob("ckpt-*.pt"))
    return ckpt


def _torch_model(ckpt: Path, model: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The trained network, built from the checkpoint by this test, and its input shape."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["model"] == model
    if model == "3dgan":
        net = gan3d.Generator()
        net.load_state_dict(state["modules"]["generator"])
        return net.eval(), (gan3d.LATENT,)
    net = resnet.resnet50(num_classes=state["config"]["classes"])
    net.load_state_dict(state["modules"]["net"])
    size = state["config"]["image_size"]
    return net.eval(), (3, size, size)


def _excess(session: ort.InferenceSession, net: torch.nn.Module, x: np.ndarray) -> float:
    """max|onnx - torch| / (ATOL + RTOL x max|torch|): at most 1 when they agree."""
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    assert got.shape == expected.shape
    return float(np.max(np.abs(got - expected))) / (ATOL + RTOL * float(np.max(np.abs(expected))))


RESNET50 = ("resnet50", "--samples", "2", "--batch-size", "2", "--image-size", "64")
# cern2019: the generator as trained (no cell scale, its moving statistics); no physics
# validation, which export does not read
GAN3D = ("3dgan", "--generate", "8", "--batch-size", "2", "--recipe", "cern2019",
         "--validate-events", "0")


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory):
    """:func:`_checkpoint` once per set of training arguments in this module (the tests
    only read the checkpoint)."""
    made: dict[tuple[str, ...], Path] = {}

    def get(*train_args: str) -> Path:
        if train_args not in made:
            made[train_args] = _checkpoint(tmp_path_factory.mktemp("ckpt"), *train_args)
        return made[train_args]
    return get


@pytest.mark.parametrize("model,args", [("3dgan", GAN3D), ("resnet50", RESNET50)])
def test_export_matches_the_framework(model, args, checkpoint_of, tmp_path):
    ckpt = checkpoint_of(*args)
    onnx_file = tmp_path / f"{model}.onnx"
    result = run(["hpcai-launch", "export-onnx", str(ckpt), "--model", model, "--out",
                  str(onnx_file)], base_env(), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    assert isinstance(session.get_inputs()[0].shape[0], str)   # the batch axis is dynamic
    net, shape = _torch_model(ckpt, model)
    perturbed = copy.deepcopy(net)
    with torch.no_grad():
        next(p for p in perturbed.parameters() if p.dim() > 1).mul_(1.01)
    rng = np.random.default_rng(11)
    for x in (rng.standard_normal((n, *shape)).astype(np.float32) for n in (1, 3, 5)):
        excess = _excess(session, net, x)
        assert excess <= 1, f"batch {len(x)}: |onnx - torch| is {excess:.3g} x the bound"
        control = _excess(session, perturbed, x)
        assert control > 10, f"batch {len(x)}: the perturbed model passes ({control:.3g})"


def test_export_bad_input(checkpoint_of, tmp_path):
    ckpt = checkpoint_of(*RESNET50)       # the checkpoint of the test above
    wrong = run(["hpcai-launch", "export-onnx", str(ckpt), "--model", "3dgan"], base_env())
    assert wrong.returncode == 2 and "is of model 'resnet50'" in wrong.stderr
    assert "hint: use --model resnet50" in wrong.stderr
    other = tmp_path / "keras.weights.h5"
    other.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    foreign = run(["hpcai-launch", "export-onnx", str(other), "--model", "3dgan"], base_env())
    assert foreign.returncode == 2 and "not a PyTorch checkpoint" in foreign.stderr
    assert "hint:" in foreign.stderr


def test_export_of_a_cell_scaled_depth_bn_generator_writes_gev(tmp_path):
    """A generator trained with ``--cell-scale 100 --bn-axis depth`` exports with its own
    BatchNorm layout and its showers in GeV: ONNX matches the checkpoint's generator ÷ 100.
    Control: the generator's raw output (GeV x 100) fails the same comparison."""
    ckpt = _checkpoint(tmp_path, "3dgan", "--generate", "8", "--batch-size", "2",
                       "--recipe", "cern2019", "--cell-scale", "100", "--bn-axis", "depth",
                       "--validate-events", "0")
    onnx_file = tmp_path / "g.onnx"
    result = run(["hpcai-launch", "export-onnx", str(ckpt), "--model", "3dgan", "--out",
                  str(onnx_file)], base_env(), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    raw = gan3d.Generator(bn_axis="depth")
    raw.load_state_dict(state["modules"]["generator"])
    raw.eval()

    class InGeV(torch.nn.Module):
        def forward(self, latent):
            return raw(latent) / 100.0

    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(5).standard_normal((3, gan3d.LATENT)).astype(np.float32)
    assert _excess(session, InGeV(), x) <= 1
    assert _excess(session, raw, x) > 10


def _steps(out: Path, steps: int, *flags: str) -> tuple[Path, dict]:
    """A 1-rank 3DGAN run of ``steps`` steps with ``--recipe cern2019`` (no cell scale, moving
    statistics) and ``flags``: its checkpoint and what it holds."""
    result = run(["hpcai-launch", "-N", "1", "--", "train", "3dgan", "--generate", "8",
                  "--batch-size", "2", "--epochs", "1", "--max-steps", str(steps),
                  "--recipe", "cern2019", *flags,
                  "--peak-gflops", "50", "--eval-samples", "0", "--validate-events", "0",
                  "--out", str(out)], base_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (ckpt,) = sorted((out / "checkpoints").glob("ckpt-*.pt"))
    return ckpt, torch.load(ckpt, map_location="cpu", weights_only=True)


def test_export_of_a_generator_average_and_of_the_raw_generator(checkpoint_of, tmp_path):
    """``--generator-ema``: export-onnx exports the average (what physics validation judged),
    and with ``--raw-generator`` the trained weights; each ONNX file matches its own
    generator, built here from the checkpoint, and fails against the other (the control).
    Two steps: the average of two differs from the last weights. A checkpoint without an
    average (the 3DGAN one above) refuses ``--raw-generator``."""
    ckpt, state = _steps(tmp_path / "run", 2, "--generator-ema", "0.5")
    raw = gan3d.Generator()
    raw.load_state_dict(state["modules"]["generator"])
    average = gan3d.Generator()
    saved = state["extra"]["generator_average"]
    assert saved["updates"] == 2 and saved["decay"] == 0.5
    average.load_state_dict(saved["module"])   # the averaged weights and their statistics
    x = np.random.default_rng(9).standard_normal((3, gan3d.LATENT)).astype(np.float32)
    for flags, mine, other in (([], average, raw), (["--raw-generator"], raw, average)):
        onnx_file = tmp_path / f"g{len(flags)}.onnx"
        done = run(["hpcai-launch", "export-onnx", str(ckpt), "--model", "3dgan", "--out",
                    str(onnx_file), *flags], base_env(), timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr[-2000:]
        said = "the trained weights" if flags else "the generator weight average (decay 0.5, 2"
        assert said in done.stdout
        session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
        assert _excess(session, mine.eval(), x) <= 1
        assert _excess(session, other.eval(), x) > 10
    plain = checkpoint_of(*GAN3D)
    refused = run(["hpcai-launch", "export-onnx", str(plain), "--model", "3dgan",
                   "--raw-generator"], base_env())
    assert refused.returncode == 2 and "the checkpoint has no generator average" in refused.stderr
    assert "hint: leave --raw-generator out" in refused.stderr


def test_export_of_a_standing_run_carries_the_statistics_its_validation_used(tmp_path):
    """``--validate-bn standing``: export-onnx exports the trained weights with BatchNorm
    statistics measured for them on the validation's fixed inputs, and says so; the ONNX
    file matches that generator, built here, and fails against the same weights with their
    moving statistics (the control)."""
    from hpcai.training.averaging import standing_statistics
    from hpcai.training.tasks import standing_inputs

    ckpt, state = _steps(tmp_path / "run", 1, "--validate-bn", "standing")
    moving = gan3d.Generator()
    moving.load_state_dict(state["modules"]["generator"])
    standing = gan3d.Generator()
    standing.load_state_dict(state["modules"]["generator"])
    standing_statistics(standing, standing_inputs(2, torch.device("cpu")))
    onnx_file = tmp_path / "g.onnx"
    done = run(["hpcai-launch", "export-onnx", str(ckpt), "--model", "3dgan", "--out",
                str(onnx_file)], base_env(), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "with standing BatchNorm statistics (--validate-bn standing)" in done.stdout
    x = np.random.default_rng(9).standard_normal((3, gan3d.LATENT)).astype(np.float32)
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    assert _excess(session, standing.eval(), x) <= 1
    assert _excess(session, moving.eval(), x) > 10
