"""ONNX export of trained checkpoints, checked against onnxruntime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import base_env, run

pytest.importorskip("onnxruntime")


def _checkpoint(tmp_path: Path, *train_args: str) -> Path:
    out = tmp_path / "run"
    result = run(["hpcai-launch", "-N", "1", "--", "train", *train_args, "--epochs", "1",
                  "--max-steps", "1", "--peak-gflops", "50", "--eval-samples", "0",
                  "--out", str(out)], base_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (ckpt,) = sorted((out / "checkpoints").glob("ckpt-*.pt"))
    return ckpt


@pytest.mark.parametrize("model,args", [
    ("3dgan", ("3dgan", "--generate", "8", "--batch-size", "2")),
    ("resnet50", ("resnet50", "--samples", "2", "--batch-size", "2", "--image-size", "64")),
])
def test_export_matches_the_framework(model, args, tmp_path):
    ckpt = _checkpoint(tmp_path, *args)
    onnx_file = tmp_path / f"{model}.onnx"
    result = run(["hpcai-launch", "export-onnx", str(ckpt), "--model", model, "--out",
                  str(onnx_file)], base_env(), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert onnx_file.stat().st_size > 100_000
    report = json.loads(onnx_file.with_suffix(".json").read_text())
    assert report["ok"] and [b["batch"] for b in report["batches"]] == [1, 3]
    assert all(b["max_abs_diff"] <= b["bound"] for b in report["batches"])
    expected = {"3dgan": [3, 1, 25, 25, 25], "resnet50": [3, 1000]}[model]
    assert report["batches"][1]["shape"] == expected   # the batch axis is dynamic


def test_export_bad_input(tmp_path):
    ckpt = _checkpoint(tmp_path, "resnet-tiny", "--samples", "8", "--batch-size", "4",
                       "--image-size", "32", "--classes", "10")
    wrong = run(["hpcai-launch", "export-onnx", str(ckpt), "--model", "3dgan"], base_env())
    assert wrong.returncode == 2 and "is of model 'resnet-tiny'" in wrong.stderr
    assert "hint: use --model resnet-tiny" in wrong.stderr
    other = tmp_path / "keras.weights.h5"
    other.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    foreign = run(["hpcai-launch", "export-onnx", str(other), "--model", "3dgan"], base_env())
    assert foreign.returncode == 2 and "not a PyTorch checkpoint" in foreign.stderr
    assert "hint:" in foreign.stderr
