"""A node's NVIDIA GPUs: PCI address, UUID, NUMA node, model, and the NICs beside each.

Two sources, one value type (:class:`GpuSet`):
- :func:`from_host` reads the running machine: NVIDIA functions (vendor ``0x10de``, class
  ``0x0302`` 3D or ``0x0300`` VGA) under ``/sys/bus/pci/devices``, their ``numa_node``, the
  driver's ``/proc/driver/nvidia/gpus/<pci>/information`` (``Model:``, ``GPU UUID:``,
  ``Bus Location:``), and the network devices (``/sys/class/net/*/device``,
  ``/sys/class/infiniband/*/device``) whose resolved PCI path has the GPU's PCI root
  (``pciDDDD:BB``). The roots are parameters, so tests point them at a tree of their own.
- :func:`synthetic` builds the GPUs of another machine from text, as ``--topology`` does
  for CPUs: ``"gpu:4 numa:0,0,1,1 nic:mlx5_0@0+1,mlx5_1@2+3 model:A100"``.

GPUs are indexed in PCI bus order, the order of ``nvidia-smi`` and of CUDA with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
"""

from __future__ import annotations

import os
import re
from ...core.record import record

from ...core.errors import UserError

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0302", "0x0300")   # 3D controller (compute GPUs), VGA controller


@record
class Gpu:
    """One GPU of a node."""

    index: int                  # in PCI bus order
    pci: str                    # "0000:17:00.0"
    numa: int                   # -1: the firmware does not say
    model: str
    uuid: str | None = None     # None where the driver's procfs entry is not readable
    nics: tuple[str, ...] = ()  # network devices on the same PCI root

    def to_dict(self) -> dict:
        return {"index": self.index, "pci": self.pci, "numa": self.numa, "model": self.model,
                "uuid": self.uuid, "nics": list(self.nics)}


@record
class GpuSet:
    """A node's GPUs, and where they were read from."""

    gpus: tuple[Gpu, ...]
    source: str                 # "host" or "synthetic:<text>"

    @property
    def synthetic(self) -> bool:
        return self.source.startswith("synthetic:")

    def describe(self) -> str:
        if not self.gpus:
            return f"no GPU [{self.source}]"
        models = sorted({g.model for g in self.gpus})
        numa = ",".join(str(g.numa) if g.numa >= 0 else "?" for g in self.gpus)
        nics = len({n for g in self.gpus for n in g.nics})
        return (f"{len(self.gpus)} x {'/'.join(models)}, NUMA {numa}, {nics} NIC(s) "
                f"[{self.source}]")

    def to_dict(self) -> dict:
        return {"source": self.source, "gpus": [g.to_dict() for g in self.gpus]}


NONE = GpuSet((), "none")


# --- the running machine -----------------------------------------------------------------

def from_host(sys_root: str | os.PathLike = "/sys", proc_root: str | os.PathLike = "/proc") -> GpuSet:
    """The NVIDIA GPUs of this machine; an empty set where there are none (or no sysfs)."""
    sys_root, proc_root = os.fspath(sys_root), os.fspath(proc_root)
    info = _driver_info(os.path.join(proc_root, "driver", "nvidia", "gpus"))
    pci_dir = os.path.join(sys_root, "bus", "pci", "devices")
    found: dict[str, str | None] = {}
    for entry in _listdir(pci_dir):
        device = os.path.join(pci_dir, entry)
        if (_read(os.path.join(device, "vendor")) == NVIDIA_VENDOR
                and _read(os.path.join(device, "class"))[:6] in GPU_CLASSES):
            found[_norm_pci(entry)] = device
    for pci in info:                          # the driver's list, where sysfs lacks one
        found.setdefault(pci, None)
    nics = _nics_by_root(sys_root)
    gpus = []
    for index, pci in enumerate(sorted(found)):
        device = found[pci]
        fields = info.get(pci, {})
        numa = numa_of_pci(pci, sys_root) if device is not None else -1
        root = _pci_root(device) if device is not None else None
        gpus.append(Gpu(index=index, pci=pci, numa=numa,
                        model=fields.get("Model", "NVIDIA GPU"),
                        uuid=fields.get("GPU UUID"),
                        nics=tuple(nics.get(root, ())) if root else ()))
    return GpuSet(tuple(gpus), "host")


def numa_of_pci(pci: str, sys_root: str | os.PathLike = "/sys") -> int:
    """The NUMA node of a PCI device, in either the driver's (``00000000:3B:00.0``) or
    sysfs's form of its address; -1 where sysfs does not say."""
    return max(_read_int(os.path.join(sys_root, "bus", "pci", "devices", _norm_pci(pci),
                                      "numa_node"), -1), -1)


def _driver_info(gpus_dir: str) -> dict[str, dict[str, str]]:
    """``/proc/driver/nvidia/gpus/*/information`` as {pci: {field: value}}."""
    out: dict[str, dict[str, str]] = {}
    for entry in _listdir(gpus_dir):
        text = _read(os.path.join(gpus_dir, entry, "information"), strip=False)
        fields = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        pci = _norm_pci(fields.get("Bus Location") or entry)
        out[pci] = fields
    return out


def _nics_by_root(sys_root: str) -> dict[str, list[str]]:
    """{PCI root: NIC names}: one name per PCI function, the InfiniBand name (what NCCL_IB_HCA
    takes) where the function has one, else the network interface's."""
    by_function: dict[str, tuple[str, str]] = {}
    for cls in ("infiniband", "net"):          # infiniband first: its name wins
        base = os.path.join(sys_root, "class", cls)
        for name in _listdir(base):
            link = os.path.join(base, name, "device")
            if not os.path.exists(link):
                continue                       # virtual interfaces have no device
            resolved = os.path.realpath(link)
            root = _pci_root(resolved)
            if root is not None:
                by_function.setdefault(os.path.basename(resolved), (root, name))
    out: dict[str, list[str]] = {}
    for root, name in sorted(by_function.values()):
        out.setdefault(root, []).append(name)
    return out


_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")


def _pci_root(device: str) -> str | None:
    """The ``pciDDDD:BB`` host bridge a PCI device's resolved sysfs path starts from."""
    for part in os.path.realpath(device).split(os.sep):
        if _ROOT.match(part):
            return part
    return None


def _norm_pci(text: str) -> str:
    """``"00000000:17:00.0"`` (the driver's form) -> ``"0000:17:00.0"``, lower case."""
    text = text.strip().lower()
    domain, sep, rest = text.partition(":")
    return f"{int(domain, 16):04x}:{rest}" if sep and re.fullmatch(r"[0-9a-f]+", domain) \
        else text


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _read(path: str, strip: bool = True) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text.strip() if strip else text


def _read_int(path: str, default: int) -> int:
    try:
        return int(_read(path))
    except ValueError:
        return default


# --- synthetic ---------------------------------------------------------------------------

EXAMPLE = "gpu:4 numa:0,0,1,1 nic:mlx5_0@0+1,mlx5_1@2+3 model:A100"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def synthetic(description: str) -> GpuSet:
    """GPUs from text: ``gpu:N`` (required), ``numa:`` one NUMA node per GPU (default all 0),
    ``nic:NAME@G[+G...]`` NICs and the GPUs whose PCI root each shares, ``model:NAME``."""
    def bad(what: str) -> UserError:
        return UserError(f"bad --gpus {description!r}: {what}",
                         f"use e.g. --gpus '{EXAMPLE}' (gpu count, then optionally one NUMA "
                         "node per GPU, NICs @ the GPUs beside them, a model name), or "
                         "--gpus none")

    values: dict[str, str] = {}
    for token in description.split():
        key, sep, value = token.partition(":")
        if key not in ("gpu", "numa", "nic", "model") or not sep or not value:
            raise bad(f"unknown or empty token {token!r}")
        if key in values:
            raise bad(f"{key}: given twice")
        values[key] = value
    if "gpu" not in values:
        raise bad("no gpu:N")
    if not values["gpu"].isdigit() or int(values["gpu"]) < 1:
        raise bad(f"gpu:{values['gpu']} is not a count of at least 1")
    count = int(values["gpu"])
    numa = [0] * count
    if "numa" in values:
        parts = values["numa"].split(",")
        if not all(p.isdigit() for p in parts):
            raise bad(f"numa:{values['numa']} is not a list of NUMA node numbers")
        if len(parts) != count:
            raise bad(f"numa: gives {len(parts)} node(s) for {count} GPU(s)")
        numa = [int(p) for p in parts]
    nics: list[list[str]] = [[] for _ in range(count)]
    for item in values.get("nic", "").split(",") if "nic" in values else []:
        name, sep, where = item.partition("@")
        if not _NAME.match(name) or not sep:
            raise bad(f"NIC {item!r} is not NAME@GPU[+GPU...]")
        for g in where.split("+"):
            if not g.isdigit() or int(g) >= count:
                raise bad(f"NIC {item!r}: {g!r} is not a GPU index below {count}")
            if name in nics[int(g)]:
                raise bad(f"NIC {name} named twice for GPU {g}")
            nics[int(g)].append(name)
    model = values.get("model", "synthetic")
    if not _NAME.match(model):
        raise bad(f"model:{model} has characters other than letters, digits, _ . -")
    gpus = tuple(Gpu(index=i, pci=f"0000:{0x10 + i:02x}:00.0", numa=numa[i], model=model,
                     uuid=None, nics=tuple(nics[i])) for i in range(count))
    return GpuSet(gpus, f"synthetic:{description}")


def load(spec: str | None, *, planning_other_machine: bool = False,
         sys_root: str | os.PathLike = "/sys", proc_root: str | os.PathLike = "/proc") -> GpuSet:
    """Resolve ``--gpus``: ``"none"``, synthetic text, or (None) this machine's GPUs, except
    when the CPU topology is another machine's (``planning_other_machine``): then none."""
    if spec is not None and spec.strip() == "none":
        return NONE
    if spec:
        return synthetic(spec)
    if planning_other_machine:
        return GpuSet((), "none: --topology is another machine's; give --gpus too")
    return from_host(sys_root, proc_root)
