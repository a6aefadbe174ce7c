"""Repeatability of ``hpcai-launch validate``: the healthy set-up 20 times, each negative
control 5 times, every run real (the controls are in ``testbed/validate_controls.py``).

Goal: 20/20 OK, and 5/5 FAIL naming its cause for every control. The runs are interleaved
(a round of each scenario, then the next round), so load from other work on the machine falls
on all of them alike. Prints the counts and the wall time, and writes every run's verdict,
exit code, ratios and problems with provenance (git commit, date, machine, MPI versions, the
image's manifest) to ``bench/results/validate_repeat-<hostname>.json``.

    python bench/validate_repeat.py [--image DIR] [--healthy 20] [--controls 5]

The image must hold this checkout's hpcai (``charliecloud/build-image.sh`` refreshes its
project layer in seconds); the ranks' working directory is a scratch directory under the
current one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "testbed"))

from validate_controls import CONTROLS, HEALTHY, missing, run_scenario  # noqa: E402

from common import first_line, loopback_env  # noqa: E402
from common import provenance as common_provenance  # noqa: E402

DEFAULT_IMAGE = Path(os.environ.get("HPCAI_IMAGE_DIR") or Path.home() / ".cache" / "hpcai"
                     / "images") / "hpcai-bookworm"


def image_env() -> dict[str, str]:
    """Loopback MPI, and nothing of this venv's library paths leaking into the container."""
    env = loopback_env(USER=os.environ.get("USER") or "root")
    for key in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(key, None)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', os.defpath)}"
    return env


def provenance(image: Path) -> dict:
    """bench/common.py's provenance, plus MPICH, Charliecloud and the image's manifest."""
    manifest = json.loads((image / "opt" / "hpcai" / "manifest.json").read_text())
    return dict(common_provenance(),
                mpich=first_line(["mpiexec.mpich", "--version"], "Version:"),
                charliecloud=first_line(["ch-run", "--version"]),
                image={"path": str(image), "mpi": manifest.get("mpi"),
                       "packages": manifest.get("packages"), "layers": manifest.get("layers")})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=str(DEFAULT_IMAGE))
    parser.add_argument("--healthy", type=int, default=20)
    parser.add_argument("--controls", type=int, default=5)
    parser.add_argument("--json", default=str(REPO / "bench" / "results" /
                                              f"validate_repeat-{socket.gethostname()}.json"))
    args = parser.parse_args()
    image = Path(args.image)
    env = image_env()
    wanted = {HEALTHY: args.healthy, **{c: args.controls for c in CONTROLS}}
    skipped = {name: why for name in wanted if (why := missing(name))}
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    runs: list[dict] = []
    start = time.monotonic()
    info = provenance(image)
    with tempfile.TemporaryDirectory(prefix=".bench-validate-", dir=os.getcwd()) as tmp:
        for round_ in range(max(wanted.values())):
            for name, count in wanted.items():
                if round_ >= count or name in skipped:
                    continue
                result = run_scenario(name, image, env, Path(tmp))
                runs.append({"scenario": name, "round": round_ + 1, "verdict": result.verdict,
                             "exit_code": result.code, "cause_named": result.cause_named(),
                             "seconds": round(result.seconds, 1), "ratios": result.ratios(),
                             "problems": (result.report or {}).get("problems", []),
                             "unverified": (result.report or {}).get("unverified", []),
                             "stderr_tail": result.stderr[-1000:] if not result.report
                             else ""})
                print(f"{name:15} {round_ + 1:2}: {result.verdict:10} exit {result.code} "
                      f"{result.seconds:5.1f} s  cause named: {result.cause_named()}  "
                      + " ".join(f"{k}:{v:.2f}" for k, v in result.ratios().items()),
                      flush=True)
    wall = time.monotonic() - start
    counts = {}
    for name, count in wanted.items():
        mine = [r for r in runs if r["scenario"] == name]
        goal = "OK" if name == HEALTHY else "FAIL"
        hits = sum(r["verdict"] == goal and r["cause_named"] for r in mine)
        counts[name] = {"goal": goal, "runs": len(mine), "as_expected": hits,
                        "skipped": skipped.get(name)}
    print(f"\nwall time {wall / 60:.1f} min; load average now "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for name, c in counts.items():
        note = f" (skipped: {c['skipped']})" if c["skipped"] else ""
        print(f"{name:15} {c['as_expected']}/{c['runs']} {c['goal']}"
              f"{' with the cause named' if c['goal'] == 'FAIL' else ''}{note}")
    info["load_average_at_end"] = os.getloadavg()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "validate_repeat", "provenance": info,
                               "wall_time_s": round(wall, 1), "counts": counts,
                               "runs": runs}, indent=1))
    print(f"written: {out}")
    met = all(c["as_expected"] == c["runs"] == wanted[n] for n, c in counts.items())
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
