"""The host NVIDIA driver for containers (launcher/container/nvdriver.py), the CUDA driver probe
(launcher/gpuprobe.py) and the ch-run probe (bench/gpu/container_probe.py), without a GPU.

Real parts: the CUDA runtime trees are PyPI's nvidia-cuda-runtime wheels (CUDA 12.9 and
13.5, installed by scripts/install.sh under the venv's opt/cudart), and ch-run is
Charliecloud's. Fakes, because no package provides them: the kernel module's
/proc/driver/nvidia/version, the /dev/nvidia* nodes (empty files) and the driver's libcuda,
compiled here from a few lines of C that answer cuInit, cuDeviceGetCount and friends (one
that answers cuInit with CUDA_ERROR_STUB_LIBRARY stands for a toolkit's stub). On the lent
H200, bench/gpu/device.sh runs the same probes against the real driver.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcai.core.errors import UserError
from hpcai.launcher import gpuprobe
from hpcai.launcher.container import nvdriver

REPO = Path(__file__).resolve().parent.parent
CUDART = Path(sys.executable).parent.parent / "opt" / "cudart"

FAKE_LIBCUDA = r"""
#include <string.h>
int cuInit(unsigned flags) { (void)flags; return INIT_STATUS; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDeviceGet(int *d, int i) { *d = i; return 0; }
int cuDeviceGetName(char *s, int n, int d) { (void)d; strncpy(s, "Fake H200", n); return 0; }
int cuDeviceGetUuid(unsigned char *u, int d) { (void)d; for (int i = 0; i < 16; i++) u[i] = i; return 0; }
"""


def _compile_lib(source: str, out: Path, soname: str, *defines: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f"-Wl,-soname,{soname}", *defines,
                    "-o", str(out), str(src)], check=True)
    src.unlink()
    return out


def fake_driver(root: Path, lib_version: str = "580.159.03",
                module: str | None = "580.159.03", init_status: int = 0) -> Path:
    """A host tree with the driver's compute libraries, devices and kernel module version."""
    lib_dir = root / "usr/lib/x86_64-linux-gnu"
    lib_dir.mkdir(parents=True, exist_ok=True)
    real = _compile_lib(FAKE_LIBCUDA, lib_dir / f"libcuda.so.{lib_version}", "libcuda.so.1",
                        f"-DINIT_STATUS={init_status}")
    (lib_dir / "libcuda.so.1").symlink_to(real.name)
    shutil.copy(real, lib_dir / f"libnvidia-ml.so.{lib_version}")
    shutil.copy(real, lib_dir / f"libnvidia-ptxjitcompiler.so.{lib_version}")
    (root / "dev").mkdir(exist_ok=True)
    for node in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-modeset", "null"):
        (root / "dev" / node).touch()
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    (root / "usr/bin/nvidia-smi").write_text("#!/bin/sh\n")
    if module:
        (root / "proc/driver/nvidia").mkdir(parents=True)
        (root / "proc/driver/nvidia/version").write_text(
            f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {module}  Release "
            "Build  (dvs-builder@U16-I3-B13-4-3)  Tue Oct  7 2025\nGCC version:  gcc 12\n")
    return lib_dir


def test_gather_lists_the_compute_files_devices_and_binary(tmp_path):
    fake_driver(tmp_path)
    driver = nvdriver.gather(tmp_path)
    assert driver.module_version == "580.159.03"
    assert {f.name for f in driver.libs} == {"libcuda.so.1", "libnvidia-ml.so.1",
                                             "libnvidia-ptxjitcompiler.so.1"}
    assert all(f.path.endswith(".so.580.159.03") for f in driver.libs)
    assert driver.devices == ("/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl")
    assert [b.name for b in driver.binaries] == ["nvidia-smi"]
    assert nvdriver.check(driver) == []


def test_no_driver_is_not_an_error(tmp_path):
    driver = nvdriver.gather(tmp_path)
    assert not driver.present and nvdriver.check(driver) == []


def test_a_driver_library_of_another_version_than_the_module_is_refused(tmp_path):
    fake_driver(tmp_path, lib_version="575.57.08", module="580.159.03")
    with pytest.raises(UserError, match="575.57.08 but the loaded kernel module is 580.159.03"):
        nvdriver.check(nvdriver.gather(tmp_path))


def _image_with(tmp_path: Path, *wheels: str) -> Path:
    image = tmp_path / "img"
    site = image / "usr/lib/python3/site-packages"
    for wheel in wheels:
        shutil.copytree(CUDART / wheel, site, dirs_exist_ok=True)
    return image


def test_cuda_runtime_versions_are_read_from_the_real_wheels(tmp_path):
    runtimes = nvdriver.image_cuda_runtimes(_image_with(tmp_path, "cu12", "cu13"))
    assert sorted(r.version for r in runtimes) == ["12.9.79", "13.5.37"]


def test_an_image_needing_a_newer_driver_is_refused(tmp_path):
    fake_driver(tmp_path / "host", lib_version="550.90.07", module="550.90.07")
    driver = nvdriver.gather(tmp_path / "host")
    cu13 = nvdriver.image_cuda_runtimes(_image_with(tmp_path / "a", "cu13"))
    with pytest.raises(UserError, match=r"CUDA 13.5.37\) needs NVIDIA driver 580.65.6"):
        nvdriver.check(driver, cu13)
    # the control: the same driver runs a CUDA 12 image
    cu12 = nvdriver.image_cuda_runtimes(_image_with(tmp_path / "b", "cu12"))
    assert "runs on driver 550.90.07" in nvdriver.check(driver, cu12)[0]


def test_probe_without_a_driver_fails():
    result = gpuprobe.probe(libcuda="libcuda.so.1")
    if result.libcuda is not None:
        pytest.skip("this machine has a CUDA driver")
    judged = gpuprobe.verdict(result, nvdriver.gather("/"))
    assert not judged.ok and "no libcuda.so.1" in judged.reason


def test_probe_passes_in_the_drivers_libcuda_and_fails_in_a_stub(tmp_path):
    lib_dir = fake_driver(tmp_path / "host")
    driver = nvdriver.gather(tmp_path / "host")
    result = gpuprobe.probe(libcuda=str(lib_dir / "libcuda.so.1"))
    assert result.libcuda == str(lib_dir / "libcuda.so.580.159.03")
    assert result.uuid == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert gpuprobe.verdict(result, driver).ok
    stub_dir = fake_driver(tmp_path / "stub", init_status=gpuprobe.CUDA_ERROR_STUB_LIBRARY)
    stub = gpuprobe.probe(libcuda=str(stub_dir / "libcuda.so.1"))
    judged = gpuprobe.verdict(stub, driver)
    assert not judged.ok and "stub library" in judged.reason
    # a libcuda of another version than the kernel module's fails too
    other = fake_driver(tmp_path / "other", lib_version="575.57.08")
    judged = gpuprobe.verdict(gpuprobe.probe(libcuda=str(other / "libcuda.so.1")), driver)
    assert not judged.ok and "575.57.08, the kernel module 580.159.03" in judged.reason


@pytest.mark.container
def test_ch_run_probe_reaches_the_driver_only_when_it_is_bound(tmp_path):
    fake_driver(tmp_path / "host")
    probe = tmp_path / "cudaprobe"
    subprocess.run(["gcc", "-O2", "-o", str(probe), str(REPO / "bench/gpu/cudaprobe.c")],
                   check=True)
    done = subprocess.run([sys.executable, str(REPO / "bench/gpu/container_probe.py"),
                           "--probe", str(probe), "--root", str(tmp_path / "host")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "USER": os.environ.get("USER", "root")})
    report = json.loads(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["verdict"] == "PASS"
    assert report["driver_bound"]["devices"] == 1
    assert report["driver_bound"]["libcuda"] == "/opt/hpcai/host/libcuda.so.580.159.03"
    # the control: the image alone has no libcuda
    assert report["no_driver"]["rc"] == 1 and report["no_driver"]["libcuda"] is None
