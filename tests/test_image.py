"""The offline Charliecloud image (charliecloud/build-image.sh): build, manifest, MPI inside.

The build is cached outside the repository (``$HPCAI_IMAGE_DIR``, default
``~/.cache/hpcai/images``): the first session builds it (about 1.5 min here, up to 20 min on a
slow mirror), later sessions only check the layer hashes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, base_env
from rankcheck import assert_one_world, load_ranks

BUILD = REPO / "charliecloud" / "build-image.sh"
IMAGE_DIR = Path(os.environ.get("HPCAI_IMAGE_DIR") or Path.home() / ".cache" / "hpcai" / "images")
IMG = IMAGE_DIR / "hpcai-bookworm"
META = IMG / "opt" / "hpcai"
IMAGE_LIBMPI_DIR = "/usr/lib/x86_64-linux-gnu/"


def _which(cmd: str) -> str | None:
    return shutil.which(cmd) or shutil.which(cmd, path="/usr/sbin:/sbin")


_missing = [c for c in ("ch-run", "debootstrap") if _which(c) is None]
pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(bool(_missing), reason=f"{' and '.join(_missing)} not installed "
                       "(apt-get install charliecloud-runtime debootstrap; scripts/install.sh)"),
]
needs_openmpi = pytest.mark.skipif(shutil.which("mpirun.openmpi") is None,
                                   reason="Open MPI (mpirun.openmpi) not installed on the host")


def image_env(**extra: str) -> dict[str, str]:
    """Loopback MPI env for ch-run: nothing of the host venv or its libraries leaks in."""
    env = base_env(USER=os.environ.get("USER") or "root", **extra)
    for key in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(key, None)
    return env


def sh(argv: list[str], timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=image_env(**extra), capture_output=True, text=True,
                          timeout=timeout, check=False)


def horovod_wheel() -> str | None:
    """The wheel of this venv's Horovod (written by scripts/build-horovod.sh), if any."""
    import sys

    pointer = Path(sys.prefix) / ".hpcai-horovod-wheel"
    if pointer.is_file():
        wheel = pointer.read_text().strip()
        return wheel if Path(wheel).is_file() else None
    return None


def build() -> tuple[subprocess.CompletedProcess, float]:
    env = image_env(HPCAI_IMAGE_DIR=str(IMAGE_DIR))
    wheel = horovod_wheel()
    if wheel:   # the image gets Horovod too: unmodified Horovod scripts in the container
        env["HPCAI_IMAGE_HOROVOD_WHEEL"] = wheel
    env["PATH"] += ":/usr/sbin:/sbin"  # debootstrap
    t = time.monotonic()
    result = subprocess.run(["bash", str(BUILD)], env=env, capture_output=True, text=True,
                            timeout=20 * 60, check=False)
    return result, time.monotonic() - t


@pytest.fixture(scope="session")
def image() -> Path:
    """The built image (cached: only the first session pays for debootstrap and pip)."""
    if os.geteuid() != 0 and not (META / ".stamp-base").exists():
        pytest.skip("building the image needs root (debootstrap) and no built image exists")
    result, seconds = build()
    assert result.returncode == 0, (
        f"build-image.sh failed after {seconds:.0f} s\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    print(f"\nimage build (cached or not): {seconds:.1f} s\n{result.stdout[-600:]}")
    return IMG


def test_manifest(image):
    manifest = json.loads((image / "opt/hpcai/manifest.json").read_text())
    assert manifest["image"] == "hpcai-bookworm"
    assert manifest["build_date"]
    assert manifest["debian_release"] == "bookworm"
    assert manifest["glibc"] == "2.36"
    mpi = manifest["mpi"]
    assert mpi["family"] == "openmpi"
    assert mpi["soname"] == "libmpi.so.40"
    assert mpi["version"].startswith("4.1.")
    assert mpi["libmpi"].startswith(IMAGE_LIBMPI_DIR + "libmpi.so.40")
    assert (image / mpi["libmpi_real"].lstrip("/")).is_file()
    assert manifest["python"].startswith("3.11.")
    packages = manifest["packages"]
    assert packages["torch"].startswith("2.13.0")
    assert packages["mpi4py"] == "4.1.2"
    assert packages["numpy"] and packages["h5py"] and packages["hpcai"]
    assert manifest["host_mount"] == "/opt/hpcai/host"
    layers = manifest["layers"]
    for layer in ("base", "python", "project"):
        assert layers[layer] == (image / f"opt/hpcai/.stamp-{layer}").read_text().strip()


def test_mount_points(image):
    host = image / "opt/hpcai/host"
    assert host.is_dir() and not any(host.iterdir()), "the host-library mount point must be empty"
    for name in ("src", "data", "out", "work"):
        assert (image / "opt/hpcai" / name).is_dir()
    devices = [p for p in (image / "dev").rglob("*") if not p.is_dir()]
    assert not devices, f"device nodes left in the image: {devices}"


def test_imports_inside_the_image(image):
    result = sh(["ch-run", str(image), "--", "python3", "-c",
                 "import torch, mpi4py, h5py, hpcai.launcher.probe as p; "
                 "print(torch.__version__, torch.version.cuda, p.__file__)"])
    assert result.returncode == 0, result.stderr
    version, cuda, probe = result.stdout.split()
    assert version.startswith("2.13.0") and cuda == "None"
    # installed, not the repository (which is not even visible inside)
    assert probe.startswith("/usr/local/lib/python3.11/dist-packages/hpcai/"), probe


def test_second_build_is_cached(image):
    base_before = (image / "opt/hpcai/.stamp-base").read_text()
    base_mtime = (image / "opt/hpcai/.stamp-base").stat().st_mtime_ns
    result, _ = build()
    assert result.returncode == 0, result.stderr
    assert "base: up to date" in result.stdout and "python: up to date" in result.stdout
    assert (image / "opt/hpcai/.stamp-base").read_text() == base_before
    assert (image / "opt/hpcai/.stamp-base").stat().st_mtime_ns == base_mtime


def test_build_errors_are_reported(tmp_path):
    not_an_image = tmp_path / "notimage"
    not_an_image.mkdir()
    (not_an_image / "precious").write_text("keep me")
    result = subprocess.run(["bash", str(BUILD), "--out", str(not_an_image)], env=image_env(),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "error: " in result.stderr and "hint: " in result.stderr
    assert (not_an_image / "precious").read_text() == "keep me"
    result = subprocess.run(["bash", str(BUILD), "--bogus"], env=image_env(),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "error: unknown argument: --bogus" in result.stderr


MPIRUN_IN_IMAGE = ["mpirun.openmpi", "-n", "2", "--allow-run-as-root",
                   "-x", "OMPI_MCA_btl_vader_single_copy_mechanism=none"]


@needs_openmpi
def test_two_ranks_with_the_images_mpi(image, tmp_path):
    """Host mpirun starts 2 ch-run ranks; they form one world through the image's libmpi."""
    out = tmp_path / "out"
    out.mkdir()
    result = sh([*MPIRUN_IN_IMAGE, "ch-run", "-b", f"{out}:/opt/hpcai/out", str(image), "--",
                 "python3", "-m", "hpcai.launcher.probe", "--quiet", "--out", "/opt/hpcai/out"])
    assert result.returncode == 0, result.stdout + result.stderr
    records = load_ranks(out)
    assert sorted(r["rank"] for r in records) == [0, 1], records
    for r in records:
        assert r["size"] == 2 and r["allreduce_ok"], r
        assert r["mpi_library_version"].startswith("Open MPI v4.1"), r["mpi_library_version"]
        # /proc/self/maps inside the container: the image's own libmpi, no host binding
        assert r["libmpi"] and all(p.startswith(IMAGE_LIBMPI_DIR + "libmpi.so.40")
                                   for p in r["libmpi"]), r["libmpi"]


@needs_openmpi
def test_libmpi_is_the_images_file(image):
    """The host has a libmpi at the same path: compare inodes to tell the two apart."""
    code = ("from mpi4py import MPI\n"
            "for line in open('/proc/self/maps'):\n"
            "    f = line.split()\n"
            "    if len(f) == 6 and '/libmpi.so.40' in f[5]:\n"
            "        print(f[4], f[5]); break\n")
    result = sh(["ch-run", str(image), "--", "python3", "-c", code])
    assert result.returncode == 0, result.stderr
    inode, path = result.stdout.split()
    assert int(inode) == (image / path.lstrip("/")).stat().st_ino
    if Path(path).exists():
        assert int(inode) != Path(path).stat().st_ino, "mapped the host's libmpi"


@needs_openmpi
def test_hpcai_launch_inside_the_image(image, tmp_path):
    """`mpirun ch-run IMG -- hpcai-launch -- CMD`: the per-rank wrapper runs inside."""
    out = tmp_path / "out"
    out.mkdir()
    result = sh([*MPIRUN_IN_IMAGE, "ch-run", "-b", f"{out}:/opt/hpcai/out", str(image), "--",
                 "hpcai-launch", "--report-bindings", "--",
                 "python3", "-m", "hpcai.launcher.probe", "--quiet", "--out", "/opt/hpcai/out"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert_one_world(load_ranks(out), 2, IMAGE_LIBMPI_DIR + "libmpi.so.40")
