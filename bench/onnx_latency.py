"""ONNX Runtime against PyTorch inference latency, side by side in one run (a report, no
target).

The 3DGAN generator (batch 16) and ResNet50 (batch 1, 224 x 224), freshly initialised and
exported with hpcai's exporter (``hpcai.training.export``), run on the CPU with the same
number of threads on both sides (``--threads``). Each trial is one inference call. The sides
alternate (A B B A ...), ``--trials`` calls each, after one warm-up call of each. Row per
model: the latency ratio ONNX Runtime ÷ PyTorch, paired trial by trial.

    python bench/onnx_latency.py [--threads 2] [--trials 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import Row, print_rows, provenance, run_alternating, write_result


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    import onnxruntime as ort
    import torch

    from hpcai.models import gan3d, resnet
    from hpcai.training.export import export

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trials", type=int, default=30)
    args = parser.parse_args()
    if args.threads < 1 or args.trials < 1:
        print(f"error: --threads and --trials must be at least 1, got {args.threads} and "
              f"{args.trials}\nhint: leave them out for 2 threads and 30 trials",
              file=sys.stderr)
        return 2
    info = provenance()
    torch.set_num_threads(args.threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    cases = {"3dgan-generator": (gan3d.Generator().eval(), torch.randn(16, gan3d.LATENT)),
             "resnet50": (resnet.resnet50().eval(), torch.randn(1, 3, 224, 224))}
    rows, trials = [], {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for name, (net, x) in cases.items():
            path = Path(tmp) / f"{name}.onnx"
            export(net, x, path)
            session = ort.InferenceSession(str(path), options,
                                           providers=["CPUExecutionProvider"])
            feed = {session.get_inputs()[0].name: x.numpy()}
            times = run_alternating({"onnxruntime": lambda: timed(lambda: session.run(None, feed)),
                                     "torch": lambda: timed(lambda: net(x))}, args.trials)
            a, b = times["onnxruntime"], times["torch"]
            rows.append(Row.report(
                f"onnx-{name}", f"{name} batch {x.shape[0]} latency, ONNX Runtime ÷ PyTorch",
                a, b, f"medians: ONNX Runtime {statistics.median(a) * 1e3:.1f} ms, PyTorch "
                      f"{statistics.median(b) * 1e3:.1f} ms"))
            trials[name] = times
    print_rows(rows)
    settings = {"threads per side": args.threads, "trials per side": args.trials,
                "onnxruntime": ort.__version__, "device": "cpu"}
    path = write_result("onnx_latency", info, rows, trials, settings)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
