"""GPU placement: which GPU(s) each local rank gets, and the environment that says so.

Pure. The CPU placement (:mod:`.placement`) comes first; then each rank, in local rank
order, takes the free GPU(s) on the NUMA domain(s) of its cores, lowest index first, and a
GPU of another NUMA domain only where none is left there (the plan then names it FAR and
warns). ``g`` GPUs and ``n`` ranks per node fit when ``n`` divides ``g`` (each rank gets
``g / n`` GPUs) or, with ``--share-gpus``, when ``g`` divides ``n`` (``n / g`` ranks per GPU).

How a rank is told its GPU (``visible``):
- ``per-rank``: ``CUDA_VISIBLE_DEVICES`` lists only the rank's GPUs (by index, with
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that indices are PCI order) and
  ``HPCAI_LOCAL_DEVICE=0``;
- ``all``: every GPU stays visible and ``HPCAI_LOCAL_DEVICE`` is the index of the rank's
  (first) GPU, for sites whose programs pick the device themselves;
- ``slurm``: srun binds the GPUs (``--gpus-per-task``, ``--gpu-bind=closest``), where the
  allocation has GPUs as GRES; hpcai sets no ``CUDA_VISIBLE_DEVICES`` and
  ``HPCAI_LOCAL_DEVICE=0``.
NICs are shown in the plan, not set: NCCL chooses among them by the same PCI distances.
"""

from __future__ import annotations

from ...core.record import record

from ...core.errors import UserError
from .gpus import GpuSet
from .placement import Placement

VISIBLE = ("per-rank", "all")
GRES_VARS = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE")


@record
class GpuSlot:
    """One local rank's GPUs, the NICs beside them, and why these."""

    local_rank: int
    gpus: tuple[int, ...]         # indices; () where Slurm chooses
    nics: tuple[str, ...]
    far: bool
    why: str

    def to_dict(self) -> dict:
        return {"local_rank": self.local_rank, "gpus": list(self.gpus),
                "nics": list(self.nics), "far": self.far, "why": self.why}


@record
class GpuPlacement:
    """Every local rank's GPUs on one node."""

    source: str                   # the GpuSet's description
    count: int                    # GPUs of the node that the plan uses
    visible: str                  # "per-rank", "all" or "slurm"
    gpus_per_rank: int
    ranks_per_gpu: int
    slots: tuple[GpuSlot, ...]
    gres: str | None = None       # the Slurm variable that shows GPUs as GRES

    @property
    def far(self) -> tuple[GpuSlot, ...]:
        return tuple(s for s in self.slots if s.far)

    def env(self, local_rank: int) -> dict[str, str]:
        """The variables that give one rank its GPU(s)."""
        slot = self.slots[local_rank]
        if self.visible == "slurm":
            return {"HPCAI_LOCAL_DEVICE": "0"}
        if self.visible == "all":
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                    "HPCAI_LOCAL_DEVICE": str(slot.gpus[0])}
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "CUDA_VISIBLE_DEVICES": ",".join(map(str, slot.gpus)),
                "HPCAI_LOCAL_DEVICE": "0"}

    def warnings(self) -> tuple[str, ...]:
        return tuple(f"local rank {s.local_rank} gets a GPU on another NUMA domain than its "
                     f"cores ({s.why})" for s in self.far)

    def to_dict(self) -> dict:
        return {"source": self.source, "count": self.count, "visible": self.visible,
                "gpus_per_rank": self.gpus_per_rank, "ranks_per_gpu": self.ranks_per_gpu,
                "gres": self.gres, "slots": [s.to_dict() for s in self.slots]}


def slurm_gres(env: dict[str, str]) -> str | None:
    """The variable by which Slurm shows that the allocation has GPUs as GRES, or None."""
    return next((v for v in GRES_VARS if env.get(v, "").strip()), None)


def gres_count(env: dict[str, str], found: int) -> int:
    """GPUs of this node in the allocation: ``SLURM_GPUS_ON_NODE``, else those found."""
    text = env.get("SLURM_GPUS_ON_NODE", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else found


def default_ranks_per_node(gpus: GpuSet, env: dict[str, str]) -> int | None:
    """One rank per GPU of the node; None without GPUs."""
    if not gpus.gpus:
        return None
    return gres_count(env, len(gpus.gpus)) if slurm_gres(env) else len(gpus.gpus)


def check_fit(ranks: int, gpus: int, share: bool) -> tuple[int, int]:
    """(GPUs per rank, ranks per GPU), or the :class:`UserError` for a mismatch."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    fits = " or ".join(map(str, divisors)) if len(divisors) < 3 else \
        f"{', '.join(map(str, divisors[:-1]))} or {divisors[-1]}"
    if ranks <= gpus:
        if gpus % ranks == 0:
            return gpus // ranks, 1
        raise UserError(f"{gpus} GPUs do not split evenly over {ranks} ranks per node",
                        f"use --ranks-per-node {fits} (or leave it out: one rank per GPU), "
                        "or --gpus none for a CPU-only run")
    if not share:
        raise UserError(f"{ranks} ranks per node but the node has {gpus} GPU(s): ranks would "
                        "share GPUs (NCCL does not put two ranks on one GPU)",
                        f"use --ranks-per-node {fits}, pass --share-gpus to let ranks share "
                        "them, or --gpus none")
    if ranks % gpus:
        raise UserError(f"{ranks} ranks per node do not share {gpus} GPU(s) evenly",
                        f"use a multiple of {gpus} ranks per node")
    return 1, ranks // gpus


def plan_gpus(gpus: GpuSet, placement: Placement, *, visible: str = "per-rank",
              share: bool = False, gres: str | None = None,
              gres_gpus: int | None = None) -> GpuPlacement:
    """Every local rank's GPU(s), nearest its cores' NUMA domain(s) first. ``gres``: srun
    binds them (the variable that shows it); ``gres_gpus``: how many the node has there."""
    n = placement.ranks_per_node
    if gres is not None:
        count = gres_gpus if gres_gpus is not None else len(gpus.gpus)
        per_rank, per_gpu = check_fit(n, count, share=False)
        why = (f"Slurm binds: --gpus-per-task={per_rank} --gpu-bind=closest "
               f"({gres} is set)")
        slots = tuple(GpuSlot(r, (), (), False, why) for r in range(n))
        return GpuPlacement(gpus.describe(), count, "slurm", per_rank, per_gpu, slots, gres)
    if visible not in VISIBLE:
        raise UserError(f"GPU visibility {visible!r} is not one of {', '.join(VISIBLE)}",
                        "use --gpu-visible per-rank or all")
    per_rank, per_gpu = check_fit(n, len(gpus.gpus), share)
    free = {g.index: per_gpu for g in gpus.gpus}
    slots = []
    for slot in placement.slots:
        home = set(slot.numa)
        chosen = []
        for _ in range(per_rank):
            pick = min((g for g in gpus.gpus if free[g.index] > 0 and g.index not in chosen),
                       key=lambda g: (g.numa >= 0 and g.numa not in home, g.index))
            free[pick.index] -= 1
            chosen.append(pick.index)
        mine = [gpus.gpus[i] for i in chosen]
        far = [g for g in mine if g.numa >= 0 and g.numa not in home]
        unknown = [g for g in mine if g.numa < 0]
        cores = ",".join(map(str, slot.numa))
        if far:
            why = (f"FAR: GPU {','.join(str(g.index) for g in far)} on NUMA "
                   f"{','.join(sorted({str(g.numa) for g in far}))}, cores on NUMA {cores} "
                   "(no free GPU left there)")
        elif unknown:
            why = "GPU's NUMA node unknown (numa_node -1)"
        else:
            why = f"NUMA {cores}, as its cores"
        if per_gpu > 1:
            why += f"; shared by {per_gpu} ranks"
        nics = tuple(dict.fromkeys(n for g in mine for n in g.nics))
        slots.append(GpuSlot(slot.local_rank, tuple(chosen), nics, bool(far), why))
    return GpuPlacement(gpus.describe(), len(gpus.gpus), visible, per_rank, per_gpu,
                        tuple(slots))


def check_numa(gpus: GpuSet, numa_domains: tuple[int, ...]) -> None:
    """A synthetic GPU on a NUMA domain the synthetic CPU topology lacks is a typo."""
    if not gpus.synthetic:
        return
    for g in gpus.gpus:
        if g.numa not in numa_domains:
            raise UserError(f"--gpus puts GPU {g.index} on NUMA {g.numa}, but the topology "
                            f"has NUMA {','.join(map(str, numa_domains))}",
                            "make the numa: list of --gpus match --topology's NUMA domains")
