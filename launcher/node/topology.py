"""Node topology: sockets, NUMA domains, cores and hardware threads.

Three sources, one value type:
- :func:`from_sysfs` reads the running machine (``/sys/devices/system``), optionally only the
  CPUs this process may use (:func:`allowed_cpus`: its affinity, or inside a rank its
  cgroup's cpuset);
- :func:`from_hwloc_xml` reads ``lstopo --of xml`` output (real or synthetic);
- :func:`synthetic` builds a regular node from a description such as
  ``"pack:2 numa:2 core:12 pu:2"`` (hwloc's synthetic syntax), for tests and planning.
"""

from __future__ import annotations

import os
from ...core.record import record

from ...core.errors import UserError


@record
class AllowedCpus:
    """The CPUs a launch may plan on, and where that set came from."""

    cpus: frozenset[int]
    source: str


@record
class Core:
    """One physical core; ``pus[0]`` is its first hardware thread."""

    socket: int
    numa: int
    pus: tuple[int, ...]


@record
class Topology:
    """A node's cores, ordered by NUMA domain then first hardware thread."""

    cores: tuple[Core, ...]
    source: str
    within: AllowedCpus | None = None   # the CPU set a machine was read within, where it
                                        # left some online CPUs out

    def __post_init__(self) -> None:
        if not self.cores:
            raise UserError(f"topology from {self.source} has no cores",
                            "check --topology, or that /sys/devices/system/cpu is readable")

    @property
    def numa_domains(self) -> tuple[int, ...]:
        return tuple(sorted({c.numa for c in self.cores}))

    @property
    def sockets(self) -> tuple[int, ...]:
        return tuple(sorted({c.socket for c in self.cores}))

    @property
    def threads_per_core(self) -> int:
        return max(len(c.pus) for c in self.cores)

    @property
    def n_pus(self) -> int:
        return sum(len(c.pus) for c in self.cores)

    def cores_in(self, numa: int) -> tuple[Core, ...]:
        return tuple(c for c in self.cores if c.numa == numa)

    def describe(self) -> str:
        return (f"{len(self.sockets)} socket(s) x {len(self.numa_domains)} NUMA domain(s) x "
                f"{len(self.cores)} cores x {self.threads_per_core} hw thread(s)/core "
                f"[{self.source}{self._within()}]")

    def _within(self) -> str:
        if self.within is None:
            return ""
        return f", cpus {format_cpulist(self.within.cpus)} ({self.within.source})"

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "sockets": len(self.sockets),
            "numa_domains": len(self.numa_domains),
            "cores": len(self.cores),
            "threads_per_core": self.threads_per_core,
        }


def _sorted_cores(cores: list[Core]) -> tuple[Core, ...]:
    return tuple(sorted(cores, key=lambda c: (c.numa, c.pus[0])))


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a Linux CPU list such as ``"0-3,8,10-11"``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return tuple(sorted(set(cpus)))


def format_cpulist(cpus: tuple[int, ...] | list[int] | set[int]) -> str:
    """Inverse of :func:`parse_cpulist`: ``(0,1,2,5)`` -> ``"0-2,5"``."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


def from_sysfs(root: str | os.PathLike = "/sys/devices/system",
               allowed: AllowedCpus | None = None) -> Topology:
    """Read the topology of the running machine from sysfs; with ``allowed``, only its CPUs
    (a core with none of its hardware threads allowed is left out)."""
    root = os.fspath(root)
    try:
        online = parse_cpulist(_read(os.path.join(root, "cpu", "online")))
    except OSError as exc:
        raise UserError(f"cannot read CPU topology from {root}: {exc}",
                        "pass --topology FILE.xml (lstopo-no-graphics --of xml)") from exc
    within = None
    if allowed is not None and not set(online) <= allowed.cpus:
        kept = tuple(c for c in online if c in allowed.cpus)
        if not kept:
            raise UserError(f"none of the CPUs of {allowed.source} "
                            f"({format_cpulist(allowed.cpus)}) is online "
                            f"({format_cpulist(online)})",
                            "check the job's CPU allocation (taskset, numactl, Slurm)")
        within, online = AllowedCpus(frozenset(kept), allowed.source), kept
    numa_of = numa_of_cpus(root)
    groups: dict[tuple[int, int], list[int]] = {}
    for cpu in online:
        topo = os.path.join(root, "cpu", f"cpu{cpu}", "topology")
        package = _read_int(os.path.join(topo, "physical_package_id"), 0)
        core_id = _read_int(os.path.join(topo, "core_id"), cpu)
        groups.setdefault((package, core_id), []).append(cpu)
    cores = [Core(socket=max(pkg, 0), numa=numa_of.get(min(pus), 0), pus=tuple(sorted(pus)))
             for (pkg, _), pus in groups.items()]
    return Topology(_sorted_cores(cores), source="sysfs", within=within)


def numa_of_cpus(root: str | os.PathLike = "/sys/devices/system") -> dict[int, int]:
    """{CPU: NUMA node} from ``node/node<N>/cpulist``; empty where sysfs has no NUMA nodes."""
    numa_of: dict[int, int] = {}
    nodes = os.path.join(root, "node")
    try:
        names = sorted(n for n in os.listdir(nodes) if n[:4] == "node" and n[4:].isdigit())
    except OSError:
        names = []
    for name in names:
        for cpu in parse_cpulist(_read(os.path.join(nodes, name, "cpulist"))):
            numa_of[cpu] = int(name[4:])
    return numa_of


ALLOWED_ENV = "HPCAI_ALLOWED_CPUS"   # "HOST:CPULIST": the set the launch planned within


def allowed_cpus(in_rank: bool, env: dict[str, str] | None = None, hostname: str = "",
                 cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                 self_cgroup: str | os.PathLike = "/proc/self/cgroup") -> AllowedCpus | None:
    """The CPUs of this node that the job may use; None where nothing restricts them.

    Before any rank starts (``in_rank`` False) it is this process's affinity: ``taskset``,
    ``numactl`` or a Slurm cgroup narrow it. A rank's own affinity may already be its slot
    (srun ``--cpu-bind``, mpirun's binding), so a rank plans within its cgroup's cpuset
    (cgroup v2 ``cpuset.cpus.effective``, v1 ``cpuset.effective_cpus``: what Slurm's
    task/cgroup gave the step on this node) and, on the launching host, within the set
    the launch planned in (``HPCAI_ALLOWED_CPUS``, which :func:`allowed_env` writes)."""
    if not in_rank:
        return AllowedCpus(frozenset(os.sched_getaffinity(0)), "this process's CPU affinity")
    sets = []
    found = _cgroup_cpuset(os.fspath(cgroup_root), os.fspath(self_cgroup))
    if found is not None:
        sets.append(AllowedCpus(found[0], f"cgroup cpuset {found[1]}"))
    host, _, cpus = (env or {}).get(ALLOWED_ENV, "").rpartition(":")
    if host == hostname and cpus:
        sets.append(AllowedCpus(frozenset(parse_cpulist(cpus)),
                                f"the launch's CPU set on {host}, {ALLOWED_ENV}"))
    if not sets:
        return None
    return AllowedCpus(frozenset.intersection(*(a.cpus for a in sets)),
                       " and ".join(a.source for a in sets))


def allowed_env(topology: Topology, hostname: str) -> dict[str, str]:
    """What the ranks need to plan within the CPU set this launch planned within: nothing
    when the whole machine was planned."""
    if topology.within is None:
        return {}
    return {ALLOWED_ENV: f"{hostname}:{format_cpulist(topology.within.cpus)}"}


def _cgroup_cpuset(root: str, self_cgroup: str) -> tuple[frozenset[int], str] | None:
    try:
        lines = _read(self_cgroup).splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        relative = path.lstrip("/")
        if controllers == "":                         # v2: one unified hierarchy
            candidate = os.path.join(root, relative, "cpuset.cpus.effective")
        elif "cpuset" in controllers.split(","):      # v1: the cpuset controller's tree
            candidate = os.path.join(root, "cpuset", relative, "cpuset.effective_cpus")
        else:
            continue
        try:
            text = _read(candidate).strip()
        except OSError:
            continue
        if text:
            return frozenset(parse_cpulist(text)), candidate
    return None


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _read_int(path: str, default: int) -> int:
    try:
        return int(_read(path).strip())
    except (OSError, ValueError):
        return default


def _hwloc_cpuset(text: str) -> set[int]:
    """Parse an hwloc bitmap such as ``0x0000ffff`` or ``0xffffffff,0x00000001``."""
    words = [w[2:] if w.startswith("0x") else w for w in text.split(",")]
    value = int("".join(w.rjust(8, "0") for w in words) or "0", 16)
    return {bit for bit in range(value.bit_length()) if value >> bit & 1}


def from_hwloc_xml(path: str | os.PathLike) -> Topology:
    """Read an ``lstopo --of xml`` file (hwloc 1.x or 2.x layout)."""
    import xml.etree.ElementTree as ET   # here: most launches read sysfs, not XML
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError) as exc:
        raise UserError(f"cannot read hwloc XML topology {path}: {exc}",
                        "create it with: lstopo-no-graphics --of xml > node.xml") from exc
    package_of: dict[int, int] = {}
    numa_of: dict[int, int] = {}
    cores: list[tuple[int, ...]] = []
    for obj in tree.iter("object"):
        kind = obj.get("type")
        cpuset = _hwloc_cpuset(obj.get("cpuset", "0x0"))
        index = int(obj.get("os_index", "0"))
        if kind in ("Package", "Socket"):
            package_of.update({cpu: index for cpu in cpuset})
        elif kind == "NUMANode":
            numa_of.update({cpu: index for cpu in cpuset})
        elif kind == "Core":
            pus = tuple(sorted(int(pu.get("os_index", "0"))
                               for pu in obj.iter("object") if pu.get("type") == "PU"))
            cores.append(pus or tuple(sorted(cpuset)))
    built = [Core(socket=package_of.get(p[0], 0), numa=numa_of.get(p[0], 0), pus=p)
             for p in cores if p]
    return Topology(_sorted_cores(built), source=f"hwloc:{os.path.basename(path)}")


_SYNTHETIC_KEYS = {"pack": "pack", "package": "pack", "socket": "pack",
                   "numa": "numa", "node": "numa", "core": "core", "pu": "pu"}


def synthetic(description: str) -> Topology:
    """Build a regular node from hwloc-style text, e.g. ``"pack:2 numa:2 core:12 pu:2"``.

    ``core`` counts cores per NUMA domain. Hardware threads are numbered the Linux way:
    the k-th thread of core c is PU ``c + k * total_cores``.
    """
    counts = {"pack": 1, "numa": 1, "core": 1, "pu": 1}
    for token in description.split():
        key, _, value = token.partition(":")
        if key.lower() not in _SYNTHETIC_KEYS or not value.isdigit() or int(value) < 1:
            raise UserError(f"bad synthetic topology token {token!r} in {description!r}",
                            "use e.g. 'pack:2 numa:2 core:12 pu:2' (counts per parent level)")
        counts[_SYNTHETIC_KEYS[key.lower()]] = int(value)
    total = counts["pack"] * counts["numa"] * counts["core"]
    cores: list[Core] = []
    for c in range(total):
        numa = c // counts["core"]
        cores.append(Core(socket=numa // counts["numa"], numa=numa,
                          pus=tuple(c + k * total for k in range(counts["pu"]))))
    return Topology(tuple(cores), source=f"synthetic:{description}")


def load(spec: str | None, allowed: AllowedCpus | None = None) -> Topology:
    """Resolve ``--topology``: None (this machine, within ``allowed``), an XML path, or
    synthetic text."""
    if not spec:
        return from_sysfs(allowed=allowed)
    if spec.startswith("synthetic:"):
        return synthetic(spec.split(":", 1)[1])
    if ":" in spec and not os.path.exists(spec):
        return synthetic(spec)
    return from_hwloc_xml(spec)
