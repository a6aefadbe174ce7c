"""Which CUDA driver does this process really use, and does it reach a GPU?

:func:`probe` loads ``libcuda.so.1`` as a CUDA program would (the loader's search path, or
a path given), calls ``cuInit``, counts the devices and reads the first one's name and UUID,
then asks ``dladdr`` which file defines ``cuInit`` (as :mod:`.libmpi` does for ``MPI_Init``).
:func:`verdict` says whether that file is the host driver's: a real ``libcuda.so.<version>``
whose version equals the loaded kernel module's (``/proc/driver/nvidia/version``). A CUDA
toolkit's stub ``libcuda.so`` answers ``cuInit`` with CUDA_ERROR_STUB_LIBRARY (34) and fails.
The NCCL version comes from ``ncclGetVersion`` of the ``libnccl.so.2`` found the same way.

``python -m hpcai.launcher.gpuprobe`` prints the report as JSON and exits 1 on FAIL.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .container import nvdriver
from .mpi.libmpi import _DlInfo, _libc

CUDA_ERROR_STUB_LIBRARY = 34
CUDA_ERROR_NO_DEVICE = 100


@dataclass(frozen=True)
class GpuProbe:
    """One process's view of the CUDA driver."""

    libcuda: str | None         # the file that defines cuInit (dladdr), symlinks resolved
    init_status: int | None     # cuInit's return code; None where libcuda did not load
    load_error: str | None
    driver_api: int | None      # cuDriverGetVersion, e.g. 13000
    devices: int
    name: str | None
    uuid: str | None            # GPU-xxxxxxxx-xxxx-..., as nvidia-smi -L writes it
    nccl: str | None            # "2.27.3", where a libnccl.so.2 loaded
    visible: str | None         # CUDA_VISIBLE_DEVICES as this process saw it


def _uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _defining_file(handle: ctypes.CDLL, symbol: str) -> str | None:
    info = _DlInfo()
    address = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p)
    if _libc().dladdr(address, ctypes.byref(info)) and info.dli_fname:
        return os.path.realpath(os.fsdecode(info.dli_fname))
    return None


def nccl_version(path: str = "libnccl.so.2") -> str | None:
    """``ncclGetVersion`` of the NCCL the loader finds, or None."""
    try:
        nccl = ctypes.CDLL(path)
    except OSError:
        return None
    code = ctypes.c_int()
    if nccl.ncclGetVersion(ctypes.byref(code)) != 0:
        return None
    v = code.value   # 2.x: major*10000 + minor*100 + patch
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def probe(libcuda: str = "libcuda.so.1", nccl: str = "libnccl.so.2") -> GpuProbe:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        cuda = ctypes.CDLL(libcuda)
    except OSError as exc:
        return GpuProbe(None, None, str(exc), None, 0, None, None, nccl_version(nccl), visible)
    where = _defining_file(cuda, "cuInit")
    status = cuda.cuInit(0)
    api, count, name, uuid = ctypes.c_int(), ctypes.c_int(), None, None
    cuda.cuDriverGetVersion(ctypes.byref(api))
    if status == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value:
        device = ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(device), 0) == 0:
            buf = ctypes.create_string_buffer(256)
            if cuda.cuDeviceGetName(buf, 256, device) == 0:
                name = buf.value.decode()
            raw = ctypes.create_string_buffer(16)
            get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
            if get_uuid(raw, device) == 0:
                uuid = _uuid_text(raw.raw)
    return GpuProbe(where, status, None, api.value or None, count.value, name, uuid,
                    nccl_version(nccl), visible)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str


def verdict(result: GpuProbe, driver: nvdriver.Driver) -> Verdict:
    """PASS when cuInit succeeded in the host driver's own libcuda and a GPU answered."""
    if result.libcuda is None:
        return Verdict(False, f"no libcuda.so.1 could be loaded ({result.load_error})")
    if result.init_status == CUDA_ERROR_STUB_LIBRARY:
        return Verdict(False, f"{result.libcuda} is a stub library (cuInit returned 34): the "
                              "host driver is not in this process's library path")
    if result.init_status != 0:
        return Verdict(False, f"cuInit returned {result.init_status} in {result.libcuda}")
    if not result.devices:
        return Verdict(False, "cuInit succeeded but no GPU is visible")
    match = re.search(r"libcuda\.so\.(\d+\.\d+(?:\.\d+)?)$", result.libcuda)
    if match is None:
        return Verdict(False, f"{result.libcuda} is not a driver's libcuda.so.<version>")
    if driver.module_version and match.group(1) != driver.module_version:
        return Verdict(False, f"{result.libcuda} is version {match.group(1)}, the kernel "
                              f"module {driver.module_version}")
    return Verdict(True, f"cuInit in {result.libcuda} (kernel module "
                         f"{driver.module_version or 'not readable'}), {result.devices} GPU(s)")


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m hpcai.launcher.gpuprobe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--libcuda", default="libcuda.so.1", help="library to load")
    parser.add_argument("--nccl", default="libnccl.so.2", help="NCCL library to load")
    parser.add_argument("--root", default="/", help="where /proc/driver/nvidia is read")
    args = parser.parse_args(argv)
    result = probe(args.libcuda, args.nccl)
    judged = verdict(result, nvdriver.gather(Path(args.root)))
    print(json.dumps({**asdict(result), "verdict": "PASS" if judged.ok else "FAIL",
                      "reason": judged.reason}, indent=1))
    return 0 if judged.ok else 1


if __name__ == "__main__":
    sys.exit(main())
