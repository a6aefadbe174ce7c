"""validate's GPU section: what each rank's GPU is, whose driver it runs on, how near it sits.

In the rank (:func:`rank_gpu`, run by ``python -m hpcai.launcher.probe --gpu``):
:func:`.gpuprobe.probe` (the libcuda that defines ``cuInit``, by ``dladdr``; the first
visible GPU's UUID and PCI address; the NCCL version), the GPU's NUMA node
(``/sys/bus/pci/devices/<address>/numa_node``) and the NUMA nodes of the rank's CPUs
(``/sys/devices/system/node/node<N>/cpulist``). Where two or more ranks of a node have
different GPUs, :func:`nccl_allreduce` times an NCCL allreduce with torch.distributed (only
where torch with CUDA imports; else the record says why it was not measured).

On the host (:func:`check`): a rank that loaded a libcuda passes only in the host driver's
own ``libcuda.so.<kernel module version>`` from a host path (:func:`.gpuprobe.verdict`; a
stub answers cuInit with 34 and fails); a rank with no libcuda fails only where the plan
binds the driver; a GPU on another NUMA node than the rank's CPUs fails; an allreduce below
the floor fails. Where no rank sees a GPU and none is bound, the section says "no GPU" and
fails nothing.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from . import gpuprobe
from .container import nvdriver
from .node import gpus, topology
from .node.topology import format_cpulist

ALLREDUCE_BYTES = 64 << 20
# Bus bandwidth floor (GB/s) of the NCCL allreduce: a quarter of PCIe 4.0 x16 (~25 GB/s
# per direction); NCCL over NVLink or PCIe peer-to-peer is far above it, and a path through
# sockets is below it.
DEFAULT_NCCL_FLOOR_GBS = 6.0


def numa_of_cpus(cpus, sysfs: str | os.PathLike = "/sys") -> tuple[int, ...]:
    """The NUMA nodes that hold any of ``cpus``."""
    try:
        numa_of = topology.numa_of_cpus(Path(sysfs) / "devices" / "system")
    except (OSError, ValueError):
        return ()
    return tuple(sorted({numa_of[c] for c in cpus if c in numa_of}))


@dataclass(frozen=True)
class RankGpu:
    """One rank's GPU, as the probe writes it (``ProbeRecord.gpu``)."""

    probe: dict                       # gpuprobe.GpuProbe, as a dict
    gpu_numa: int | None
    cpu_numa: tuple[int, ...]
    allreduce_gbs: float | None = None
    allreduce_note: str = ""

    @classmethod
    def from_dict(cls, data: dict) -> "RankGpu":
        return cls(**{**data, "cpu_numa": tuple(data.get("cpu_numa", ()))})

    @property
    def result(self) -> gpuprobe.GpuProbe:
        return gpuprobe.GpuProbe(**self.probe)


def rank_gpu(cpus, sysfs: str | os.PathLike = "/sys") -> RankGpu:
    result = gpuprobe.probe()
    numa = gpus.numa_of_pci(result.pci_bus_id, sysfs) if result.pci_bus_id else -1
    gpu_numa = numa if numa >= 0 else None
    return RankGpu(asdict(result), gpu_numa, numa_of_cpus(cpus, sysfs))


def nccl_allreduce(comm, gpu: RankGpu, host: str,
                   nbytes: int = ALLREDUCE_BYTES) -> tuple[float | None, str]:
    """(bus bandwidth in GB/s, note) of an NCCL allreduce over the world, every rank on its
    first visible GPU; collective over ``comm`` (mpi4py). Measured only where some node has
    two or more ranks on different GPUs, and torch with CUDA imports on every rank."""
    uuids = comm.allgather((host, gpu.result.uuid))
    per_node: dict[str, set] = {}
    for h, uuid in uuids:
        per_node.setdefault(h, set()).add(uuid)
    if any(uuid is None for _, uuid in uuids) or max(len(u) for u in per_node.values()) < 2:
        return None, "not measured: no node has two or more ranks on different GPUs"
    try:
        import torch
        import torch.distributed as dist
        ready = bool(torch.cuda.is_available())
    except ImportError:
        ready = False
    if not all(comm.allgather(ready)):
        return None, "not measured: torch with CUDA is not importable on every rank"
    import socket
    import time
    address = comm.bcast((socket.gethostname(), _free_port()) if comm.Get_rank() == 0
                         else None, root=0)
    rank, size = comm.Get_rank(), comm.Get_size()
    dist.init_process_group("nccl", init_method=f"tcp://{address[0]}:{address[1]}",
                            rank=rank, world_size=size)
    try:
        torch.cuda.set_device(0)
        data = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
        for _ in range(3):
            dist.all_reduce(data)
        torch.cuda.synchronize()
        runs = 10
        start = time.perf_counter()
        for _ in range(runs):
            dist.all_reduce(data)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / runs
    finally:
        dist.destroy_process_group()
    bus = nbytes * 2 * (size - 1) / size / seconds / 1e9
    return bus, f"{_mib(nbytes)} allreduce over {size} ranks: bus bandwidth {bus:.1f} GB/s"


def _mib(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class GpuExpectation:
    """What the plan says of GPUs."""

    bound: bool                        # the plan binds the host's driver
    module_version: str | None         # the host's kernel module (None: no driver loaded)
    floor_gbs: float = DEFAULT_NCCL_FLOOR_GBS


def check(ranks: list[tuple[int, str, RankGpu | None]], want: GpuExpectation,
          from_host: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """(report lines, problems) for ``(rank, host, gpu)`` of every rank; ``from_host``
    says whether a path inside the container holds host files."""
    driver = nvdriver.Driver(want.module_version, (), (), ())
    lines: list[str] = []
    problems: list[str] = []
    seen = False
    for rank, host, gpu in sorted(ranks, key=lambda x: x[0]):
        who = f"rank {rank} on {host}"
        if gpu is None:
            if want.bound:
                problems.append(f"{who} reported no GPU probe (the image's hpcai has none)")
            continue
        r = gpu.result
        if r.libcuda is None and not want.bound:
            continue
        seen = True
        judged = gpuprobe.verdict(r, driver)
        if not judged.ok:
            problems.append(f"{who}: GPU check: {judged.reason}")
        elif not from_host(r.libcuda):
            problems.append(f"{who}: GPU check: {r.libcuda} is the image's, not the host "
                            "driver's")
        if gpu.gpu_numa is not None and gpu.cpu_numa and gpu.gpu_numa not in gpu.cpu_numa:
            problems.append(f"{who}: GPU {r.uuid} ({r.pci_bus_id}) is on NUMA node "
                            f"{gpu.gpu_numa}, the rank's CPUs on NUMA node(s) "
                            f"{format_cpulist(gpu.cpu_numa)}: pinned to a far GPU")
        lines.append(f"  {who}: {r.uuid or 'no GPU'} ({r.name or '-'}, NUMA "
                     f"{'-' if gpu.gpu_numa is None else gpu.gpu_numa}, CPUs on NUMA "
                     f"{format_cpulist(gpu.cpu_numa) or '-'}), libcuda {r.libcuda or '-'}, "
                     f"NCCL {r.nccl or 'not loaded'}")
    if not seen:
        return ["GPU: no GPU (no rank loaded a libcuda, and the plan binds no driver)"], []
    measured = [g for _, _, g in ranks if g is not None and g.allreduce_gbs is not None]
    notes = {g.allreduce_note for _, _, g in ranks if g is not None and g.allreduce_note}
    if measured:
        worst = min(g.allreduce_gbs for g in measured)
        lines.append(f"  NCCL allreduce: {'; '.join(sorted(notes))} (floor "
                     f"{want.floor_gbs:g} GB/s)")
        if worst < want.floor_gbs:
            problems.append(f"NCCL allreduce bus bandwidth {worst:.1f} GB/s is below the "
                            f"floor {want.floor_gbs:g} GB/s")
    else:
        lines.append(f"  NCCL allreduce: {'; '.join(sorted(notes)) or 'not measured'}")
    return [f"GPU (driver {want.module_version or 'not loaded'}, "
            f"{'bound' if want.bound else 'not bound'}):", *lines], problems
