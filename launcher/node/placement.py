"""Placement planner: which CPUs each local rank gets, and the threading env it needs.

Ranks are spread evenly over NUMA domains. With ``k`` ranks per domain each rank gets a
contiguous block of the domain's cores; with fewer ranks than domains each rank spans whole
domains; anything else falls back to contiguous blocks of the node's cores in NUMA order.
"""

from __future__ import annotations

from ...core.record import record

from ...core.errors import UserError
from .topology import Core, Topology, format_cpulist


@record
class RankSlot:
    """Where one local rank runs."""

    local_rank: int
    numa: tuple[int, ...]
    sockets: tuple[int, ...]
    cpus: tuple[int, ...]
    threads: int

    @property
    def cpulist(self) -> str:
        return format_cpulist(self.cpus)

    @property
    def mask(self) -> str:
        return hex(sum(1 << c for c in self.cpus))


@record
class Placement:
    """The per-node layout: every local rank's slot, plus how it was derived."""

    ranks_per_node: int
    threads_per_rank: int
    cores_per_rank: int
    hyperthreads: bool
    oversubscribed: bool
    layout: str  # "per-numa", "spanning" or "flat"
    ranks_per_numa: int
    slots: tuple[RankSlot, ...]

    def slot(self, local_rank: int) -> RankSlot:
        return self.slots[local_rank]


def plan_placement(topology: Topology, *, ranks_per_node: int | None = None,
                   ranks_per_numa: int | None = None, threads_per_rank: int | None = None,
                   hyperthreads: bool = False, oversubscribe: bool = False) -> Placement:
    """Compute every local rank's CPUs. Pure; raises :class:`UserError` on bad input."""
    domains = topology.numa_domains
    n = _ranks_per_node(len(domains), ranks_per_node, ranks_per_numa)
    if threads_per_rank is not None and threads_per_rank < 1:
        raise UserError(f"--threads-per-rank must be at least 1, got {threads_per_rank}",
                        "leave it out to use all cores of each rank's share of the node")
    blocks, layout, per_numa = _blocks(topology, n)
    pus_per_core = topology.threads_per_core if hyperthreads else 1
    available = min(len(b) for b in blocks)
    if threads_per_rank is None:
        cores_needed = max(available, 1)
        threads = cores_needed * pus_per_core
    else:
        threads = threads_per_rank
        cores_needed = -(-threads // pus_per_core)
    oversubscribed = cores_needed > available
    if oversubscribed and not oversubscribe:   # a NUMA block too small counts too
        total = len(topology.cores)
        raise oversubscription_error(n, cores_needed, total,
                                     f"the node has {total} ({topology.describe()})",
                                     threads_per_core=pus_per_core)
    slots = []
    for rank, block in enumerate(blocks):
        cores = _take(block, topology.cores, rank, cores_needed, oversubscribed)
        cpus = tuple(sorted(pu for c in cores for pu in c.pus[:pus_per_core]))
        slots.append(RankSlot(local_rank=rank,
                              numa=tuple(sorted({c.numa for c in cores})),
                              sockets=tuple(sorted({c.socket for c in cores})),
                              cpus=cpus, threads=threads))
    return Placement(ranks_per_node=n, threads_per_rank=threads, cores_per_rank=cores_needed,
                     hyperthreads=hyperthreads and topology.threads_per_core > 1,
                     oversubscribed=oversubscribed, layout=layout, ranks_per_numa=per_numa,
                     slots=tuple(slots))


def check_fits(ranks: int, cores_per_rank: int, cores: int, where: str, *,
               oversubscribe: bool = False) -> bool:
    """Do ``ranks`` x ``cores_per_rank`` fit into ``cores``? True when they do not but
    ``oversubscribe`` allows it; :func:`oversubscription_error` when it does not."""
    if ranks * cores_per_rank <= cores:
        return False
    if oversubscribe:
        return True
    raise oversubscription_error(ranks, cores_per_rank, cores, where)


def oversubscription_error(ranks: int, cores_per_rank: int, cores: int, where: str, *,
                           threads_per_core: int = 1) -> UserError:
    """The one wording for too many cores asked of a node (placement, sbatch, sweep).
    ``where`` ends the message: "the node has 2 (...)", "nodes of site lrz have 48"."""
    best = cores // ranks * threads_per_core
    fix = (f"use --threads-per-rank {best} or fewer" if best >= 1
           else f"use at most {cores} ranks per node")
    return UserError(f"{ranks} ranks x {cores_per_rank} cores each need "
                     f"{ranks * cores_per_rank} cores, but {where}",
                     f"{fix}, lower --ranks-per-node, or pass --oversubscribe to share cores")


def _ranks_per_node(n_domains: int, ranks_per_node: int | None,
                    ranks_per_numa: int | None) -> int:
    if ranks_per_numa is not None:
        if ranks_per_numa < 1:
            raise UserError(f"--ranks-per-numa must be at least 1, got {ranks_per_numa}",
                            "give a positive number of ranks per NUMA domain")
        derived = ranks_per_numa * n_domains
        if ranks_per_node is not None and ranks_per_node != derived:
            raise UserError(
                f"--ranks-per-node {ranks_per_node} contradicts --ranks-per-numa "
                f"{ranks_per_numa} on a node with {n_domains} NUMA domains ({derived} ranks)",
                "give only one of --ranks-per-node and --ranks-per-numa")
        return derived
    if ranks_per_node is None:
        return 1
    if ranks_per_node < 1:
        raise UserError(f"--ranks-per-node must be at least 1, got {ranks_per_node}",
                        "give the number of MPI ranks to start on each node")
    return ranks_per_node


def _blocks(topology: Topology, n: int) -> tuple[list[list[Core]], str, int]:
    """Split the node's cores into one block per rank."""
    domains = topology.numa_domains
    d = len(domains)
    if n % d == 0:
        k = n // d
        blocks = []
        for numa in domains:
            cores = list(topology.cores_in(numa))
            size = len(cores) // k
            blocks.extend(cores[i * size:(i + 1) * size] for i in range(k))
        return blocks, "per-numa", k
    if d % n == 0:
        span = d // n
        return ([[c for numa in domains[i * span:(i + 1) * span] for c in topology.cores_in(numa)]
                 for i in range(n)], "spanning", 0)
    cores = list(topology.cores)
    size = len(cores) // n
    return [cores[i * size:(i + 1) * size] for i in range(n)], "flat", 0


def _take(block: list[Core], all_cores: tuple[Core, ...], rank: int, count: int,
          oversubscribed: bool) -> list[Core]:
    if not oversubscribed:
        return block[:count]
    if block:
        return block
    return [all_cores[rank % len(all_cores)]]


def thread_env(slot: RankSlot, hyperthreads: bool) -> dict[str, str]:
    """OpenMP / MKL / framework threading variables for one rank."""
    threads = str(slot.threads)
    return {
        "OMP_NUM_THREADS": threads,
        "OMP_PLACES": "threads" if hyperthreads else "cores",
        "OMP_PROC_BIND": "close",
        "KMP_AFFINITY": "granularity=fine,compact,1,0",
        "KMP_BLOCKTIME": "1",
        "MKL_NUM_THREADS": threads,
        "TF_NUM_INTRAOP_THREADS": threads,
        "TF_NUM_INTEROP_THREADS": "1",
        "HPCAI_INTRA_OP_THREADS": threads,
        "HPCAI_INTER_OP_THREADS": "1",
        "HPCAI_CPUS": slot.cpulist,
    }
