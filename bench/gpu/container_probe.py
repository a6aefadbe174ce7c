"""A CUDA probe inside a ch-run container, with and without the host driver bound.

Builds a minimal image directory (the ``cudaprobe`` binary and the glibc family the driver
needs, nothing of CUDA), stages the host driver's compute libraries that :func:`hpcai.launcher.nvdriver.gather`
finds (copies, mode 0444, with their sonames as links) and runs the probe twice with ch-run:
``--no-driver`` (the control: the image has no libcuda, so the probe must fail) and with the
staged folder bound at ``/opt/hpcai/host`` on ``LD_LIBRARY_PATH`` (the host's /dev is ch-run's
own). Prints one JSON object with both runs; exit 0 when the bound run passed and the control
failed. ch-run binds read-write and this image has no python3 for hpcai's read-only helper,
so the staged copies are read-only by file mode only.

    python3 bench/gpu/container_probe.py --probe PATH/cudaprobe [--ch-run PATH] [--root /]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the checkout's parent
from hpcai.launcher.container import nvdriver  # noqa: E402

MOUNT = "/opt/hpcai/host"


def _needed(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    paths = []
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            paths.append(path)
    return paths


def build_image(probe: str, image: Path) -> None:
    for sub in ("bin", "dev", "proc", "sys", "tmp", "etc", "home", MOUNT.lstrip("/")):
        (image / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(probe, image / "bin" / "cudaprobe")
    libc = next(lib for lib in _needed(probe) if "/libc.so" in lib)
    # the glibc family the driver's libraries need (libm, libdl, libpthread, librt)
    family = [str(Path(libc).parent / n) for n in ("libm.so.6", "libdl.so.2",
                                                    "libpthread.so.0", "librt.so.1")]
    for lib in [*_needed(probe), *[f for f in family if os.path.exists(f)]]:
        target = image / lib.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(lib), target)
    (image / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (image / "etc" / "group").write_text("root:x:0:\n")


def stage(driver: nvdriver.Driver, where: Path) -> list[str]:
    names = []
    for f in driver.libs:
        real = where / Path(f.path).name
        shutil.copy2(f.path, real)
        real.chmod(0o444)
        (where / f.name).symlink_to(real.name)
        names.append(f.path)
    return names


def run(ch_run: str, image: Path, env: dict[str, str], binds: list[str],
        inner_path: str | None) -> dict:
    """ch-run's own LD_LIBRARY_PATH is ``env``'s; the probe's is set inside (or unset)."""
    inside = ([f"--set-env=LD_LIBRARY_PATH={inner_path}"] if inner_path
              else ["--unset-env=LD_LIBRARY_PATH"])
    argv = [ch_run, *inside, *[a for b in binds for a in ("-b", b)], str(image), "--",
            "/bin/cudaprobe"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report = {"stdout": done.stdout[-500:]}
    return {"argv": argv, "rc": done.returncode, "stderr": done.stderr[-500:], **report}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", required=True, help="the built cudaprobe binary")
    parser.add_argument("--ch-run", default=shutil.which("ch-run") or "ch-run")
    parser.add_argument("--root", default="/", help="where the host driver is read")
    parser.add_argument("--ch-lib", default=None,
                        help="a folder of libraries ch-run itself needs (its .deb's "
                             "dependencies unpacked beside it)")
    args = parser.parse_args(argv)
    driver = nvdriver.gather(args.root)
    notes = nvdriver.check(driver)
    with tempfile.TemporaryDirectory() as tmp:
        image, staged = Path(tmp, "img"), Path(tmp, "stage")
        staged.mkdir()
        build_image(args.probe, image)
        staged_files = stage(driver, staged)
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        env.setdefault("USER", "root")
        if args.ch_lib:
            env["LD_LIBRARY_PATH"] = args.ch_lib
        control = run(args.ch_run, image, env, [], None)
        bound = run(args.ch_run, image, env, [f"{staged}:{MOUNT}"], MOUNT)
    ok = bound["rc"] == 0 and control["rc"] != 0
    print(json.dumps({"driver": driver.to_dict(), "check": notes, "staged": staged_files,
                      "no_driver": control, "driver_bound": bound,
                      "verdict": "PASS" if ok else "FAIL"}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
