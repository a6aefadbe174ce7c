"""ONNX export of a trained model, validated against the framework.

    hpcai-launch export-onnx OUT/checkpoints/ckpt-E0002-S000000.pt --model 3dgan [--out G.onnx]

Loads a training checkpoint (PyTorch, written by ``train``), exports the 3DGAN generator or
the ResNet with a dynamic batch axis (``torch.onnx.export(dynamo=True)``); a 3DGAN trained
with ``--generator-ema`` exports its generator weight average unless ``--raw-generator``; one
trained with ``--validate-bn standing`` exports its trained generator with the standing
BatchNorm statistics its validation judged (measured again, on the same fixed inputs). It
runs the same inputs - batches of 1 and 3 - through PyTorch and ONNX Runtime and compares the
outputs:
|onnx - torch| <= 1e-4 + 1e-4 x max|torch| per batch, else the export is deleted and the
command fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..core.cli import Parser
from ..core.errors import UserError

from . import checkpoint

ATOL, RTOL = 1e-4, 1e-4
MODELS = ("3dgan", "resnet50", "resnet-tiny")


def load_checkpoint(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist",
                        "give a file from OUT/checkpoints/ of a training run")
    try:
        state = checkpoint.read(path)
    except Exception as exc:  # noqa: BLE001 - anything unreadable is the user's file
        raise UserError(f"{path} is not a PyTorch checkpoint ({type(exc).__name__}: {exc})",
                        "export-onnx reads checkpoints written by `train` (PyTorch); "
                        "TensorFlow checkpoints are not supported here") from exc
    if not isinstance(state, dict) or "modules" not in state or "model" not in state:
        raise UserError(f"{path} is not an hpcai training checkpoint",
                        "give a file from OUT/checkpoints/ of a `train` run")
    if state.get("framework", "pytorch") != "pytorch":
        raise UserError(f"{path} was written by `train --framework {state['framework']}`; "
                        "export-onnx exports the PyTorch models",
                        "train with --framework pytorch (the default) and export that "
                        "checkpoint; for Keras models use tf2onnx on a saved Keras model")
    return state


def build(state: dict, model: str, raw_generator: bool = False):
    """(the module to export, an example input, which weights): the checkpoint's weights,
    for a 3DGAN with a generator average (``--generator-ema``) that average unless
    ``raw_generator``; the trained generator of a run with ``--validate-bn standing`` gets
    the standing statistics its validation used (``tasks.standing_inputs`` on the CPU: a run
    on a GPU drew its inputs there, so its statistics differ by that draw)."""
    import torch

    from ..models import gan3d, resnet

    if state["model"] != model:
        raise UserError(f"the checkpoint is of model {state['model']!r}, not {model!r}",
                        f"use --model {state['model']}")
    config = state.get("config", {})
    average = state.get("extra", {}).get("generator_average")
    if raw_generator and average is None:
        raise UserError("--raw-generator, but the checkpoint has no generator average: its "
                        "generator is the trained weights already",
                        "leave --raw-generator out (it is for runs with --generator-ema)")
    weights = "the trained weights"
    if model == "3dgan":
        net = gan3d.Generator(bn_axis=config.get("bn_axis", "channels"))
        if average is not None and not raw_generator:   # its weights and their statistics
            net.load_state_dict(average["module"])
            weights = (f"the generator weight average (decay {average['decay']:g}, "
                       f"{average['updates']} steps)")
        else:
            net.load_state_dict(state["modules"]["generator"])
            if config.get("validate_bn") == "standing":
                from .averaging import standing_statistics
                from .tasks import standing_inputs

                standing_statistics(net, standing_inputs(int(config["batch_size"]),
                                                         torch.device("cpu")))
                weights = ("the trained weights, with standing BatchNorm statistics "
                           "(--validate-bn standing)")
        example = torch.randn(2, gan3d.LATENT)
        scale = float(config.get("cell_scale", 1.0))
        if scale != 1.0:                       # the exported generator writes GeV
            net = gan3d.InGeV(net, scale)
    else:
        factory = resnet.resnet50 if model == "resnet50" else resnet.resnet_tiny
        net = factory(num_classes=config.get("classes", 1000))
        net.load_state_dict(state["modules"]["net"])
        size = config.get("image_size", 224)
        example = torch.randn(2, 3, size, size)
    return net.eval().to(memory_format=torch.contiguous_format), example, weights


def export(net, example, out: Path) -> None:
    import torch

    batch = torch.export.Dim("batch", min=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(net, (example,), str(out), dynamic_shapes=({0: batch},), dynamo=True,
                      external_data=False, verbose=False)   # one self-contained file


def compare(net, example, out: Path) -> dict:
    """Run batches of 1 and 3 through torch and ONNX Runtime; the worst differences."""
    import numpy as np
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    report = {"atol": ATOL, "rtol": RTOL, "batches": []}
    generator = torch.Generator().manual_seed(7)
    for n in (1, 3):
        x = torch.randn((n, *example.shape[1:]), generator=generator)
        with torch.no_grad():
            expected = net(x).numpy()
        got = session.run(None, {name: x.numpy()})[0]
        diff = float(np.max(np.abs(got - expected)))
        bound = ATOL + RTOL * float(np.max(np.abs(expected)))
        report["batches"].append({"batch": n, "shape": list(got.shape), "max_abs_diff": diff,
                                  "bound": bound, "ok": got.shape == expected.shape
                                  and diff <= bound})
    report["ok"] = all(b["ok"] for b in report["batches"])
    return report


def main(argv: list[str]) -> int:
    p = Parser(prog="hpcai-launch export-onnx", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--out", help="ONNX file (default: next to the checkpoint)")
    p.add_argument("--raw-generator", action="store_true",
                   help="3dgan trained with --generator-ema: export the trained generator "
                        "weights, not their average")
    ns = p.parse_args(argv)
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise UserError(f"onnxruntime cannot be imported ({exc})",
                        "pip install onnx onnxruntime onnxscript (see requirements.txt)") from exc
    path = Path(ns.checkpoint)
    state = load_checkpoint(path)
    net, example, weights = build(state, ns.model, ns.raw_generator)
    out = Path(ns.out) if ns.out else path.with_suffix(f".{ns.model}.onnx")
    export(net, example, out)
    report = {"weights": weights, **compare(net, example, out)}
    for b in report["batches"]:
        print(f"batch {b['batch']}: output {b['shape']}, max |onnx - torch| "
              f"{b['max_abs_diff']:.3g} (bound {b['bound']:.3g}) {'OK' if b['ok'] else 'FAIL'}")
    if not report["ok"]:
        out.unlink(missing_ok=True)
        print("error: ONNX Runtime disagrees with PyTorch; export removed", file=sys.stderr)
        return 1
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out} ({weights}, dynamic batch axis), validated with onnxruntime")
    return 0
