"""Container overhead, side by side in one run: the same 3DGAN training, 2 ranks, bare on
the host and inside Charliecloud with the host MPI bound in, with the same interpreter.

Each trial is one run of 2 epochs x ``--steps`` steps from the same generated data; the
second epoch's samples/s and the peak RSS per rank count. Sides alternate (A B B A ...),
``--trials`` each (default 10), after one warm-up run of each. Rows: throughput container ÷
bare (target >= 0.99, interval included) and peak RSS per rank container ÷ bare (<= 1.01).

Both sides run the image's own ``python3``: inside ch-run as ``/usr/bin/python3``, bare as
``IMAGE/usr/bin/python3``, which finds its standard library and packages (torch, numpy,
mpi4py, hpcai) under the image's ``/usr`` from its own location. So both sides execute the
same files, and the host's glibc is byte-identical to the image's here (checked, recorded).
What differs is only what the container adds: the mount namespace and the bound host
libraries. Before the trials the bench fingerprints the interpreter each side runs (file
identity and sha256 of the executable, versions, module paths relative to ``sys.prefix``)
and stops unless the two agree; the control, this venv's Python, must not agree.

    python bench/container_overhead.py [--image DIR] [--trials 10] [--steps 4]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import (Row, loopback_env, print_rows, provenance, resolved, run_until_resolved,
                    write_result)

DEFAULT_IMAGE = Path.home() / ".cache" / "hpcai" / "images" / "hpcai-bookworm"


FINGERPRINT = """
import hashlib, json, os, sys
import h5py, hpcai, mpi4py, numpy, torch
exe = os.path.realpath(sys.executable)
st = os.stat(exe)
rel = lambda m: os.path.relpath(os.path.realpath(m.__file__), os.path.realpath(sys.prefix))
print(json.dumps({"executable_sha256": hashlib.sha256(open(exe, "rb").read()).hexdigest(),
                  "executable_file": [st.st_dev, st.st_ino], "version": sys.version,
                  "modules": {m.__name__: [getattr(m, "__version__", None), rel(m)]
                              for m in (h5py, hpcai, mpi4py, numpy, torch)}}))
"""


def fingerprint(container: str | None, python: str) -> dict:
    """What interpreter and packages a side's ranks get (one rank, the same launcher)."""
    argv = ["hpcai-launch", "-N", "1"] + (["--container", container] if container else [])
    argv += ["--", python, "-c", FINGERPRINT]
    result = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:-1])} -c FINGERPRINT\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _env() -> dict[str, str]:
    env = loopback_env(USER=os.environ.get("USER", "root"))
    env.pop("PYTHONPATH", None)   # the image's packages on both sides, nobody else's
    return env


def glibc(root: str) -> dict:
    """The banner and sha256 of ``root``'s libc.so.6 (an executable that prints its
    version)."""
    lib = Path(root) / "lib/x86_64-linux-gnu/libc.so.6"
    banner = subprocess.run([str(lib)], capture_output=True, text=True).stdout.splitlines()[0]
    return {"banner": banner, "sha256": hashlib.sha256(lib.read_bytes()).hexdigest()}


def one_run(container: str | None, data: Path, out: Path, steps: int, python: str) -> dict:
    argv = ["hpcai-launch", "-N", "2"]
    if container:
        argv += ["--container", container]
    argv += ["--", python, "-m", "hpcai.training", "3dgan", "--data", os.path.relpath(data),
             "--epochs", "2", "--max-steps", str(steps), "--batch-size", "8",
             "--eval-samples", "0", "--peak-gflops", "90", "--out", os.path.relpath(out)]
    result = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}\n{result.stderr[-3000:]}")
    record = json.loads((out / "epochs.jsonl").read_text().splitlines()[-1])
    return {"samples_per_s": record["samples_per_s"],
            "max_rss_mb_per_rank": record["max_rss_mb_per_rank"],
            "libmpi": record["provenance"]["libmpi"]}


def _rows(t: dict[str, list[dict]], libc: dict) -> list[Row]:
    """The two target rows of the trials ``t`` (each side's run records)."""
    def of(side: str, key: str) -> list[float]:
        return [r[key] for r in t[side]]
    return [Row.measured("container-throughput", "3DGAN samples/s, ch-run with host MPI ÷ "
                         "bare", ">=", 0.99, of("container", "samples_per_s"),
                         of("bare", "samples_per_s"),
                         note="both sides run the image's python3 and packages (fingerprints "
                         "agree; glibc " + ("byte-identical" if libc["host"] == libc["image"]
                                             else "differs") + ")"),
            Row.measured("container-rss", "peak RSS per rank, ch-run ÷ bare", "<=", 1.01,
                         of("container", "max_rss_mb_per_rank"),
                         of("bare", "max_rss_mb_per_rank"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=str(DEFAULT_IMAGE))
    parser.add_argument("--trials", type=int, default=None,
                        help="exactly this many trials per side (default: until resolved)")
    parser.add_argument("--min-trials", type=int, default=20)
    parser.add_argument("--max-trials", type=int, default=40)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    info = provenance()
    log: list = []
    image_python = str(Path(args.image) / "usr/bin/python3")
    prints = {"bare, image's python3": fingerprint(None, image_python),
              "ch-run, image's python3": fingerprint(args.image, "python3"),
              "control: bare, this venv's python": fingerprint(None, sys.executable)}
    same = prints["bare, image's python3"] == prints["ch-run, image's python3"]
    control = prints["control: bare, this venv's python"] == prints["bare, image's python3"]
    libc = {"host": glibc("/"), "image": glibc(args.image)}
    print(f"interpreter fingerprints: bare and ch-run {'agree' if same else 'DIFFER'}; "
          f"control (this venv's python) {'agrees (broken check)' if control else 'differs'}; "
          f"glibc {'identical' if libc['host'] == libc['image'] else 'differs'}", flush=True)
    if not same or control:
        print(json.dumps(prints, indent=1), file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".bench-") as tmp:
        work = Path(tmp)
        os.chdir(work)   # bound into the container as its working directory
        data = work / "data"
        subprocess.run([sys.executable, "-m", "hpcai.training.showers", "generate", "--out",
                        str(data), "--files", "1", "--events", "256"], check=True,
                       capture_output=True)

        def side(kind: str):
            def run() -> dict:
                container, python = ((args.image, "python3") if kind == "container"
                                     else (None, image_python))
                r = one_run(container, data, work / f"{kind}-{len(log)}", args.steps, python)
                log.append({"side": kind, **r})
                print(f"  {kind:9s} {r['samples_per_s']:.3f} samples/s, peak RSS "
                      f"{r['max_rss_mb_per_rank']:.0f} MiB/rank, libmpi {r['libmpi']}",
                      flush=True)
                return r
            return run
        t = run_until_resolved({"container": side("container"), "bare": side("bare")},
                               lambda t: resolved(_rows(t, libc)), args.trials,
                               args.min_trials, args.max_trials, warmup=1)
    rows = _rows(t, libc)
    print_rows(rows)
    path = write_result("container_overhead", info, rows,
                        {"runs": log, "interpreter_fingerprints": prints, "glibc": libc},
                        {"image": args.image, "trials": args.trials,
                         "min_trials": args.min_trials, "max_trials": args.max_trials,
                         "steps": args.steps,
                         "ranks": 2, "batch_per_rank": 8,
                         "interpreter": "the image's python3 on both sides"})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
