"""The host's NVIDIA driver in the container plan (``--gpu-driver``), without a GPU.

Real parts: hpcai-launch's own option parsing, fact gathering, pre-flight and ``--dry-run``
(run as a program), the CUDA runtime wheels of ``tests/test_gpu_driver.py`` inside the
image, and the staging into the content-addressed cache. Fakes, because no package provides
them: the driver tree (``fake_driver``: a compiled stand-in libcuda, the kernel module's
``/proc`` line, ``/dev/nvidia*`` as empty files), read under ``HPCAI_DRIVER_ROOT``, which
only tests set; the image is a directory with a manifest and nothing to run; NCCL and its
network plugin are compiled stand-ins (no NCCL wheel is installed here); the
``singularity`` binary is a script that is never started (``--dry-run``).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpcai.launcher.container import hostlibs, nvdriver
from hpcai.launcher.job.site import SiteProfile

from test_gpu_driver import CUDART, _compile_lib, fake_driver

VERSION = "580.159.03"


def _image(tmp_path: Path, *wheels: str) -> Path:
    image = tmp_path / "img"
    (image / "opt/hpcai/host").mkdir(parents=True)
    (image / "opt/hpcai/work").mkdir(parents=True)
    (image / "opt/hpcai/manifest.json").write_text(json.dumps({"glibc": "2.36", "mpi": None}))
    (image / "bin").mkdir()
    (image / "bin/true").touch()
    (image / "usr/bin").mkdir(parents=True)         # ch-run's read-only helper, as a name
    (image / "usr/bin/python3").touch(mode=0o755)
    helper = image / "usr/lib/python3/dist-packages/hpcai/launcher/readonly.py"
    helper.parent.mkdir(parents=True)
    helper.touch()
    for wheel in wheels:
        shutil.copytree(CUDART / wheel, image / "usr/lib/python3/site-packages",
                        dirs_exist_ok=True)
    return image


def _launch(tmp_path: Path, image: Path, *args: str, root: Path | None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "singularity"
    fake.write_text("#!/bin/sh\nexit 99\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "USER": "u",
           "HPCAI_CACHE": str(tmp_path / "cache")}
    for name in ("HPCAI_DRIVER_ROOT", "HPCAI_CONTAINER", "HPCAI_SITE", "SLURM_JOB_ID"):
        env.pop(name, None)
    if root is not None:
        env["HPCAI_DRIVER_ROOT"] = str(root)
    return subprocess.run([sys.executable, "-m", "hpcai.launcher", "--container", str(image),
                           "--no-bind-host-mpi", *args, "--dry-run", "--", "/bin/true"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_dry_run_shows_the_driver_files_devices_and_why(tmp_path):
    host = tmp_path / "host"
    lib_dir = fake_driver(host)
    image = _image(tmp_path, "cu12")
    done = _launch(tmp_path, image, "--runtime", "singularity", root=host)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"GPU driver: --gpu-driver auto: the host has one under {host}; kernel module " \
           f"{VERSION}, 3 compute libraries, 3 device node(s)" in out
    assert "runs on driver 580.159.03" in out          # the pre-flight's note on the image
    assert (f"/opt/hpcai/host/lib/libcuda.so.{VERSION} <- {lib_dir}/libcuda.so.{VERSION} "
            "(read-only, staged; libcuda.so.1 links to it)") in out
    assert f"/opt/hpcai/host/lib/bin/nvidia-smi <- {host}/usr/bin/nvidia-smi" in out
    assert f"/dev/nvidia0 <- {host}/dev/nvidia0 (device node, bound read-write" in out
    assert "/dev/nvidia-modeset" not in out               # graphics, not compute
    planned = json.loads(_launch(tmp_path, image, "--runtime", "singularity", "--json",
                                 root=host).stdout)["container"]["gpu_driver"]
    assert planned["device_binds"] == [f"{host}/dev/{n}:/dev/{n}"      # read-write: no :ro
                                       for n in ("nvidia-uvm", "nvidia0", "nvidiactl")]
    assert planned["module_version"] == VERSION
    assert not (tmp_path / "cache").exists(), "a dry run copies nothing"
    # ch-run binds the host's whole /dev: no device bind, and the plan says why
    ch = _launch(tmp_path, image, "--runtime", "charliecloud", root=host)
    assert ch.returncode == 0, ch.stderr
    assert "/dev/nvidia-uvm, /dev/nvidia0, /dev/nvidiactl: in the host's /dev, which " \
           "charliecloud binds whole" in ch.stdout
    assert ":/dev/nvidia0" not in ch.stdout
    # the controls: --gpu-driver off, and this machine (no driver) bind none of it
    for args, root in ((("--gpu-driver", "off"), host), ((), None)):
        plain = _launch(tmp_path, image, "--runtime", "singularity", *args, root=root)
        assert plain.returncode == 0, plain.stderr
        assert "GPU driver" not in plain.stdout and "nvidia" not in plain.stdout


@pytest.mark.parametrize("case, message", [
    ("module", f"is version 575.57.08 but the loaded kernel module is {VERSION}"),
    ("cuda13", r"CUDA 13.5.37) needs NVIDIA driver 580.65.6 or newer; the host's is 550"),
    ("none", "--gpu-driver on, but this host has no NVIDIA driver under"),
])
def test_a_driver_the_image_cannot_use_stops_before_any_rank(tmp_path, case, message):
    host = tmp_path / "host"
    if case == "module":
        fake_driver(host, lib_version="575.57.08", module=VERSION)
    elif case == "cuda13":
        fake_driver(host, lib_version="550.90.07", module="550.90.07")
    else:
        host.mkdir()
    image = _image(tmp_path, "cu13" if case == "cuda13" else "cu12")
    done = _launch(tmp_path, image, "--runtime", "singularity", "--gpu-driver", "on",
                   root=host)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: " in done.stderr and message in done.stderr
    assert "\nhint: " in done.stderr and done.stdout == ""


def test_staged_driver_keeps_its_real_names_links_its_sonames_and_is_read_only(tmp_path):
    fake_driver(tmp_path / "host")
    files, notes = hostlibs.driver_files(nvdriver.gather(tmp_path / "host"))
    assert notes == []
    staged = hostlibs.stage(files, tmp_path / "cache") / "lib"
    real = staged / f"libcuda.so.{VERSION}"
    assert os.readlink(staged / "libcuda.so.1") == real.name
    assert stat.S_IMODE(real.stat().st_mode) == 0o444
    assert stat.S_IMODE((staged / "bin/nvidia-smi").stat().st_mode) == 0o555
    # the fake libnvidia-ml is a copy of the fake libcuda (soname libcuda.so.1): the
    # driver's own name for it is used, never a clash with libcuda's
    assert os.readlink(staged / "libnvidia-ml.so.1") == f"libnvidia-ml.so.{VERSION}"


def test_site_nccl_and_its_net_plugin_replace_the_search_paths(tmp_path):
    nccl_dir = tmp_path / "nccl"
    nccl_dir.mkdir()
    nccl = _compile_lib("int ncclGetVersion(int *v) { *v = 22703; return 0; }\n",
                        nccl_dir / "libnccl.so.2.27.3", "libnccl.so.2")
    plugin = _compile_lib("int ncclNetPlugin_v8;\n", nccl_dir / "libnccl-net-ofi.so",
                          "libnccl-net-ofi.so")
    site = SiteProfile.from_dict({"nccl": [str(nccl), str(plugin)]}, "site.toml")
    fake_driver(tmp_path / "host")
    driver, _ = hostlibs.driver_files(nvdriver.gather(tmp_path / "host"))
    libs = hostlibs.collect(None, [], set(), site, driver=driver)
    named = {lib.name: lib for lib in libs}
    assert named["libnccl.so.2"].path == str(nccl) and named["libnccl.so.2"].role == "accelerator"
    assert "libnccl-net-ofi.so" in named and f"libcuda.so.{VERSION}" in named
    assert hostlibs.binding_env("/opt/hpcai/host", libs)["NCCL_NET_PLUGIN"] == "ofi"
    # the control: without the profile's entry neither is bound, nor is the plugin named
    bare = hostlibs.collect(None, [], set(), None, driver=driver)
    assert {lib.name for lib in bare}.isdisjoint({"libnccl.so.2", "libnccl-net-ofi.so"})
    assert "NCCL_NET_PLUGIN" not in hostlibs.binding_env("/opt/hpcai/host", bare)
