"""ONNX Runtime vs PyTorch inference latency, side by side (report, no target).

3DGAN generator (batch 16) and ResNet50 (batch 1, 224x224), freshly initialised, exported
with hpcai's exporter; median of 10 after warm-up, same thread count for both.

    python bench/onnx_latency.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def median_s(fn, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    import onnxruntime as ort
    import torch

    from hpcai.models import gan3d, resnet
    from hpcai.training.export import export

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="bench/results/onnx_latency.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    cases = {"3dgan-generator": (gan3d.Generator().eval(), torch.randn(16, gan3d.LATENT)),
             "resnet50": (resnet.resnet50().eval(), torch.randn(1, 3, 224, 224))}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (net, x) in cases.items():
            path = Path(tmp) / f"{name}.onnx"
            export(net, x, path)
            session = ort.InferenceSession(str(path), options,
                                           providers=["CPUExecutionProvider"])
            feed = {session.get_inputs()[0].name: x.numpy()}
            with torch.no_grad():
                native = median_s(lambda: net(x))
            onnx = median_s(lambda: session.run(None, feed))
            results[name] = {"batch": x.shape[0], "torch_s": native, "onnxruntime_s": onnx,
                             "ratio_onnx_over_torch": onnx / native}
            print(f"{name:16s} batch {x.shape[0]:2d}: torch {native * 1e3:8.1f} ms, "
                  f"onnxruntime {onnx * 1e3:8.1f} ms, ratio {onnx / native:.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"threads": args.threads, "results": results},
                                          indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
