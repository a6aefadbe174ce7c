"""ONNX export of trained checkpoints: ONNX Runtime recomputed against PyTorch here.

The test does not read the comparison that ``export-onnx`` writes: it loads the exported file
with onnxruntime and the checkpoint with torch itself, runs both on inputs of its own (batch
sizes 1, 3 and 5; the exporter checks 1 and 3), and compares. The control: the same model
with one weight tensor scaled by 1 % must fail the same comparison.

The ResNet-50 and the plain 3DGAN exports are ``hpcai-launch export-onnx`` processes; the two
exports of one checkpoint share a process (``programs/export_onnx_several.py``: the same
command lines, imported once), and the refusals, which stop before exporting, run that
command line in this process (``hpcai.launcher.cli.main``: its exit status and stderr).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import base_env, run
from hpcai.launcher import cli
from hpcai.models import gan3d, resnet

ATOL, RTOL = 1e-4, 1e-4    # |onnx - torch| <= ATOL + RTOL x max|torch|, as the README says
SEVERAL = Path(__file__).parent / "programs" / "export_onnx_several.py"


def _checkpoint(tmp_path: Path, *train_args: str) -> Path:
    """The checkpoint of a bare 1-rank ``train`` of one step."""
    out = tmp_path / "run"
    result = run(["train", *train_args, "--epochs", "1",
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


def _session(onnx_file: Path) -> ort.InferenceSession:
    """ONNX Runtime on one thread (tiny batches gain nothing from more, whose spinning costs
    CPU on a busy machine)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])


def _refused(capsys, *argv: str) -> str:
    """``hpcai-launch export-onnx ARGV`` run here: it must exit 2; what it said on stderr."""
    capsys.readouterr()
    assert cli.main(["export-onnx", *argv]) == 2
    return capsys.readouterr().err


def _excess_over(got: np.ndarray, expected: np.ndarray) -> float:
    """max|got - expected| / (ATOL + RTOL x max|expected|): at most 1 when they agree."""
    assert got.shape == expected.shape
    return float(np.max(np.abs(got - expected))) / _bound(expected)


def _bound(expected: np.ndarray) -> float:
    return ATOL + RTOL * float(np.max(np.abs(expected)))


def _excess(session: ort.InferenceSession, net: torch.nn.Module, x: np.ndarray) -> float:
    """:func:`_excess_over` of the ONNX file's output on ``x`` and ``net``'s."""
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    return _excess_over(got, expected)


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
    session = _session(onnx_file)
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


def test_export_bad_input(checkpoint_of, tmp_path, capsys):
    ckpt = checkpoint_of(*RESNET50)       # the checkpoint of the test above
    wrong = _refused(capsys, str(ckpt), "--model", "3dgan")
    assert "is of model 'resnet50'" in wrong
    assert "hint: use --model resnet50" in wrong
    other = tmp_path / "keras.weights.h5"
    other.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    foreign = _refused(capsys, str(other), "--model", "3dgan")
    assert "not a PyTorch checkpoint" in foreign
    assert "hint:" in foreign


def _steps(out: Path, steps: int, *flags: str) -> tuple[Path, dict]:
    """A bare 1-rank 3DGAN run of ``steps`` steps with ``--recipe cern2019`` (no cell scale,
    moving statistics) and ``flags``: its checkpoint and what it holds."""
    result = run(["train", "3dgan", "--generate", "8",
                  "--batch-size", "2", "--epochs", "1", "--max-steps", str(steps),
                  "--recipe", "cern2019", *flags,
                  "--peak-gflops", "50", "--eval-samples", "0", "--validate-events", "0",
                  "--out", str(out)], base_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (ckpt,) = sorted((out / "checkpoints").glob("ckpt-*.pt"))
    return ckpt, torch.load(ckpt, map_location="cpu", weights_only=True)


# One 3DGAN run with every option that changes what export-onnx writes: the networks see GeV
# x 100, BatchNorm is per calorimeter layer, a generator weight average is kept and the
# trained generator is validated with standing statistics. Two steps: the average of two
# differs from the last weights.
TUNED = ("--cell-scale", "100", "--bn-axis", "depth", "--generator-ema", "0.5",
         "--validate-bn", "standing")
LATENTS = np.random.default_rng(9).standard_normal((3, gan3d.LATENT)).astype(np.float32)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The run of :data:`TUNED` (1 rank, 2 steps, ``--recipe cern2019``) and its two
    exports, the default one and the one with ``--raw-generator``: what the checkpoint
    holds, what each export printed and computed on :data:`LATENTS`, and what the run's
    generators, built here from the checkpoint, compute on them in their own units (GeV x
    100): the average, and the trained weights with their moving and with standing
    statistics."""
    from hpcai.training.averaging import standing_statistics
    from hpcai.training.tasks import standing_inputs

    tmp = tmp_path_factory.mktemp("tuned")
    ckpt, state = _steps(tmp / "run", 2, *TUNED)
    nets = {name: gan3d.Generator(bn_axis="depth") for name in ("average", "moving", "standing")}
    nets["average"].load_state_dict(state["extra"]["generator_average"]["module"])
    nets["moving"].load_state_dict(state["modules"]["generator"])
    nets["standing"].load_state_dict(state["modules"]["generator"])
    standing_statistics(nets["standing"], standing_inputs(2, torch.device("cpu")))
    with torch.no_grad():
        torch_out = {name: net.eval()(torch.from_numpy(LATENTS)).numpy()
                     for name, net in nets.items()}
    flags = {"default": [], "raw": ["--raw-generator"]}
    argv = [a for name, more in flags.items() for a in (
        "::", str(ckpt), "--model", "3dgan", "--out", str(tmp / f"{name}.onnx"), *more)]
    done = run([sys.executable, str(SEVERAL), *argv[1:]], base_env(), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    exports = {}
    said_lines = [line for line in done.stdout.splitlines() if line.startswith('{"rc"')]
    for name, line in zip(flags, said_lines, strict=True):
        said = json.loads(line)
        assert said["rc"] == 0, said
        session = _session(tmp / f"{name}.onnx")
        (got,) = session.run(None, {session.get_inputs()[0].name: LATENTS})
        exports[name] = (said["stdout"], got)
    return {"state": state, "torch": torch_out, "exports": exports}


def test_export_of_a_cell_scaled_depth_bn_generator_writes_gev(tuned):
    """A generator trained with ``--cell-scale 100 --bn-axis depth`` exports with its own
    BatchNorm layout (the checkpoint's weights load only into a per-layer generator) and its
    showers in GeV: each ONNX file matches its generator ÷ 100. Control: that generator's
    raw output (GeV x 100) fails the same comparison."""
    assert tuned["state"]["config"]["bn_axis"] == "depth"
    for export, mine in (("default", "average"), ("raw", "standing")):
        got = tuned["exports"][export][1]
        assert _excess_over(got, tuned["torch"][mine] / 100.0) <= 1
        assert _excess_over(got, tuned["torch"][mine]) > 10


def test_export_of_a_generator_average_and_of_the_raw_generator(tuned, checkpoint_of, capsys):
    """``--generator-ema``: export-onnx exports the average (what physics validation judged),
    and with ``--raw-generator`` the trained weights; each ONNX file matches its own
    generator, built here from the checkpoint, and fails against the other (the control).
    A checkpoint without an average (the 3DGAN one above) refuses ``--raw-generator``."""
    saved = tuned["state"]["extra"]["generator_average"]
    assert saved["updates"] == 2 and saved["decay"] == 0.5
    average, trained = (tuned["torch"][k] / 100.0 for k in ("average", "standing"))
    for export, said, mine, other in (
            ("default", "the generator weight average (decay 0.5, 2", average, trained),
            ("raw", "the trained weights", trained, average)):
        stdout, got = tuned["exports"][export]
        assert said in stdout
        assert _excess_over(got, mine) <= 1
        assert _excess_over(got, other) > 10
    refused = _refused(capsys, str(checkpoint_of(*GAN3D)), "--model", "3dgan",
                       "--raw-generator")
    assert "the checkpoint has no generator average" in refused
    assert "hint: leave --raw-generator out" in refused


def test_export_of_a_standing_run_carries_the_statistics_its_validation_used(tuned):
    """``--validate-bn standing``: export-onnx exports the trained weights with BatchNorm
    statistics measured for them on the validation's fixed inputs, and says so; the ONNX
    file matches that generator, built here, and fails against the same weights with their
    moving statistics (the control). The run keeps an average, so its trained weights are
    the ``--raw-generator`` export; :func:`hpcai.training.export.build` of the same
    checkpoint without the average picks that generator by default (the same outputs, and
    not those of the moving statistics)."""
    from hpcai.training import export

    stdout, got = tuned["exports"]["raw"]
    assert "with standing BatchNorm statistics (--validate-bn standing)" in stdout
    standing, moving = (tuned["torch"][k] / 100.0 for k in ("standing", "moving"))
    assert _excess_over(got, standing) <= 1
    assert _excess_over(got, moving) > 10
    state = copy.deepcopy(tuned["state"])
    del state["extra"]["generator_average"]
    net, _, weights = export.build(state, "3dgan")
    assert "with standing BatchNorm statistics (--validate-bn standing)" in weights
    with torch.no_grad():
        built = net(torch.from_numpy(LATENTS)).numpy()
    assert np.max(np.abs(built - standing)) <= 1e-3 * _bound(standing)
    assert np.max(np.abs(built - moving)) > 10 * _bound(moving)
