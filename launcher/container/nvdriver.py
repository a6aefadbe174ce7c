"""The host's NVIDIA driver: what a container needs of it for compute, and whether an image's
CUDA runtime can run on it.

:func:`gather` reads one machine (``root`` is ``/`` on a real host; tests point it at a tree):

- the kernel module's version, from ``/proc/driver/nvidia/version``;
- the user-space compute libraries of the driver (:data:`COMPUTE_LIBS`, the set that
  ``nvidia-container-cli list`` gives for the compute capability: libcuda, libnvidia-ml,
  libnvidia-ptxjitcompiler, libnvidia-nvvm and their siblings), each as the real file
  ``lib<name>.so.<driver version>`` found in the driver's library folders;
- the device nodes (``/dev/nvidiactl``, ``/dev/nvidia-uvm*``, ``/dev/nvidia<N>``) and the
  ``nvidia-smi`` binary.

:func:`check` is the pre-flight: a driver library of another version than the kernel
module is refused, and so is an image whose CUDA runtime (``libcudart.so.<major>``, its
version read from the file name or from the wheel's ``dist-info``) needs a newer driver than
the host's (:data:`MIN_DRIVER`, NVIDIA's minor-version-compatibility minimum per CUDA major).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import UserError

# The driver's user-space libraries for compute (nvidia-container-cli's "compute" and
# "utility" capabilities): each ships as lib<name>.so.<driver version>.
COMPUTE_LIBS = ("libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm",
                "libnvidia-gpucomp", "libcudadebugger", "libnvidia-allocator",
                "libnvidia-cfg", "libnvidia-opencl", "libnvidia-pkcs11",
                "libnvidia-pkcs11-openssl3")
# Without these a CUDA program cannot run at all.
REQUIRED_LIBS = ("libcuda", "libnvidia-ml")
UTILITY_BINARIES = ("nvidia-smi", "nvidia-debugdump")
# Where drivers put their libraries: distribution packages, the NVIDIA installer, and the
# container hosts' driver folder (e.g. /usr/local/nvidia on GPU clouds).
LIB_DIRS = ("usr/local/nvidia/lib64", "usr/local/nvidia/lib", "usr/lib/x86_64-linux-gnu",
            "usr/lib64", "usr/lib/aarch64-linux-gnu", "usr/lib")
BIN_DIRS = ("usr/local/nvidia/bin", "usr/bin", "usr/local/bin")
# Minimum Linux driver for each CUDA major under minor-version compatibility (NVIDIA's CUDA
# compatibility guide): a runtime of that major runs on any driver at or above it.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}

_MODULE_VERSION = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")
_DEVICE = re.compile(r"nvidia(\d+|ctl|-uvm|-uvm-tools)$")


@dataclass(frozen=True)
class DriverFile:
    """One file of the driver: where it is on the host, and its name for the loader."""

    path: str       # the real file
    name: str       # the name programs open: the soname (libcuda.so.1) or the binary's
    version: str = ""   # a library's driver version, from its file name


@dataclass(frozen=True)
class Driver:
    """What one host has of the NVIDIA driver."""

    module_version: str | None          # the kernel module's, None where none is loaded
    libs: tuple[DriverFile, ...]        # the compute libraries, real files
    devices: tuple[str, ...]            # /dev/nvidia* device nodes
    binaries: tuple[DriverFile, ...]    # nvidia-smi and friends

    @property
    def present(self) -> bool:
        return self.module_version is not None or bool(self.libs)

    def to_dict(self) -> dict:
        return {"module_version": self.module_version,
                "libs": [f.path for f in self.libs], "devices": list(self.devices),
                "binaries": [f.path for f in self.binaries]}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def module_version(root: Path) -> str | None:
    """The loaded kernel module's version, or None without /proc/driver/nvidia/version."""
    try:
        text = (root / "proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    match = _MODULE_VERSION.search(text)
    return match.group(1) if match else None


def _soname(lib: str) -> str:
    return f"{lib}.so.1"


def _find_libs(root: Path) -> list[DriverFile]:
    """Each compute library's real file, from the first folder of :data:`LIB_DIRS` that has
    one (the newest version there)."""
    found: dict[str, DriverFile] = {}
    for lib_dir in LIB_DIRS:
        for lib in COMPUTE_LIBS:
            if lib in found:
                continue
            candidates = []
            for path in glob.glob(str(root / lib_dir / f"{lib}.so.*.*")):
                version = path.rsplit(f"{lib}.so.", 1)[1]
                if re.fullmatch(r"\d+\.\d+(\.\d+)?", version) and not os.path.islink(path):
                    candidates.append((_version_tuple(version), path, version))
            if candidates:
                _, path, version = max(candidates)
                found[lib] = DriverFile(path, _soname(lib), version)
    return list(found.values())


def gather(root: Path | str = "/") -> Driver:
    """Read the driver of the machine under ``root``."""
    root = Path(root)
    libs = _find_libs(root)
    devices = tuple(sorted(str(Path("/dev") / p.name) for p in (root / "dev").glob("nvidia*")
                           if _DEVICE.match(p.name)))
    binaries = []
    for name in UTILITY_BINARIES:
        for bin_dir in BIN_DIRS:
            path = root / bin_dir / name
            if path.is_file():
                binaries.append(DriverFile(str(path), name))
                break
    return Driver(module_version(root), tuple(libs), devices, tuple(binaries))


@dataclass(frozen=True)
class CudaRuntime:
    """An image's CUDA runtime library and the version read from it."""

    path: str
    version: str          # "12.9.79", or "12" where only the soname says it


def _wheel_version(lib: Path) -> str | None:
    """The version of the pip wheel that installed ``lib`` (its dist-info's RECORD names it)."""
    site = lib.parents[3] if len(lib.parents) > 3 else None   # site/nvidia/<pkg>/lib/<lib>
    if site is None:
        return None
    relative = str(lib.relative_to(site))
    for record in sorted(site.glob("nvidia_cuda_runtime*.dist-info/RECORD")):
        if relative in record.read_text():
            return record.parent.name.removesuffix(".dist-info").split("-")[1]
    return None


def image_cuda_runtimes(image: Path | str) -> tuple[CudaRuntime, ...]:
    """The CUDA runtimes (``libcudart.so.<major>``) in an image directory."""
    image = Path(image)
    found = []
    patterns = ("usr/local/cuda*/lib64/libcudart.so.*", "usr/local/cuda*/targets/*/lib/libcudart.so.*",
                "usr/lib/*/libcudart.so.*", "usr/lib64/libcudart.so.*",
                "**/site-packages/nvidia/*/lib/libcudart.so.*")
    seen: set[str] = set()
    for pattern in patterns:
        for path in sorted(image.glob(pattern)):
            real = os.path.realpath(path)
            if real in seen or not path.is_file():
                continue
            seen.add(real)
            suffix = Path(real).name.split("libcudart.so.", 1)[1]
            version = (suffix if suffix.count(".") >= 1 else _wheel_version(Path(real))
                       or suffix)
            found.append(CudaRuntime(str(path), version))
    return tuple(found)


def check(driver: Driver, runtimes: tuple[CudaRuntime, ...] = ()) -> list[str]:
    """The pre-flight; raises UserError on the first refusal, returns notes otherwise."""
    notes: list[str] = []
    if not driver.present:
        return notes
    have = {f.name.split(".so")[0] for f in driver.libs}
    missing = [lib for lib in REQUIRED_LIBS if lib not in have]
    if missing:
        raise UserError(f"the host's NVIDIA driver has no {', '.join(missing)} in "
                        f"{', '.join('/' + d for d in LIB_DIRS[:3])}",
                        "install the driver's user-space libraries (the same version as the "
                        "kernel module), or run without --gpu-driver")
    if driver.module_version:
        other = [f for f in driver.libs if f.version != driver.module_version]
        if other:
            path, version = other[0].path, other[0].version
            raise UserError(f"driver library {path} is version {version} but the loaded "
                            f"kernel module is {driver.module_version}",
                            "the user-space driver and the kernel module must match: reboot "
                            "after a driver update, or point the site profile at the matching "
                            "libraries")
    host = driver.module_version or (driver.libs[0].version if driver.libs else None)
    for runtime in runtimes:
        major = int(runtime.version.split(".")[0])
        need = MIN_DRIVER.get(major)
        if host is None or need is None:
            notes.append(f"{runtime.path}: CUDA {runtime.version}, no minimum driver known")
            continue
        if _version_tuple(host) < need:
            raise UserError(f"the image's CUDA runtime {runtime.path} (CUDA {runtime.version}) "
                            f"needs NVIDIA driver {'.'.join(map(str, need))} or newer; the "
                            f"host's is {host}",
                            f"use an image built for CUDA {_newest_major(host)} or older, or "
                            "ask the site for a newer driver")
        notes.append(f"{runtime.path}: CUDA {runtime.version} runs on driver {host}")
    return notes


def _newest_major(host: str) -> int:
    ok = [major for major, need in MIN_DRIVER.items() if _version_tuple(host) >= need]
    return max(ok) if ok else min(MIN_DRIVER)
