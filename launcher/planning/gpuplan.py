"""The GPU part of the launch plan: options and facts in, :class:`.gpuplace.GpuPlacement` out.

Pure; :mod:`.plan` calls it for every mode. No GPUs (a CPU-only node, ``--gpus none``, or
``--topology`` of another machine without ``--gpus``): no GPU part, and the plan is what
it was before GPUs existed.
"""

from __future__ import annotations

from ...core.errors import UserError
from .facts import Facts
from ..node.gpuplace import GpuPlacement, check_numa, default_ranks_per_node, gres_count, \
    plan_gpus, slurm_gres
from .options import Options
from ..node.placement import Placement


def ranks_per_node(options: Options, facts: Facts) -> tuple[int | None, tuple[str, ...]]:
    """``--ranks-per-node``, else one rank per GPU where the node has GPUs (and no
    ``--ranks-per-numa``); with the note that says so."""
    if options.ranks_per_node is not None or options.ranks_per_numa is not None:
        return options.ranks_per_node, ()
    n = default_ranks_per_node(facts.gpus, facts.env) if facts.gpus else None
    if n is None:
        return None, ()
    return n, (f"ranks per node: {n}, one per GPU (no --ranks-per-node given)",)


def gpu_placement(options: Options, facts: Facts, placement: Placement,
                  mode: str) -> GpuPlacement | None:
    """Every local rank's GPUs, or None without GPUs. Srun (or a rank srun started) in an
    allocation with GPUs as GRES leaves the binding to Slurm."""
    gpus = facts.gpus
    if gpus is None or not gpus.gpus:
        return None
    check_numa(gpus, facts.topology.numa_domains)
    by_slurm = mode == "srun" or (facts.rank is not None and facts.rank.started_by == "slurm")
    gres = slurm_gres(facts.env) if by_slurm else None
    if gres is not None and options.share_gpus:
        raise UserError(f"--share-gpus under srun in an allocation with GPUs as GRES "
                        f"({gres} is set): srun's --gpus-per-task gives each task GPUs of its "
                        "own", "leave out --share-gpus and use at most one rank per GPU, or "
                        "start the ranks with --launcher mpirun")
    site = facts.container.site if facts.container is not None else facts.site
    visible = options.gpu_visible or (site.gpu_visible if site is not None else None) \
        or "per-rank"
    return plan_gpus(gpus, placement, visible=visible, share=options.share_gpus, gres=gres,
                     gres_gpus=gres_count(facts.env, len(gpus.gpus)) if gres else None)


def warnings(gpus: GpuPlacement | None, facts: Facts) -> tuple[str, ...]:
    """Far GPUs, and synthetic GPUs in a real run."""
    if gpus is None:
        return ()
    out = list(gpus.warnings())
    if facts.gpus is not None and facts.gpus.synthetic and facts.rank is not None:
        out.append(f"GPUs {facts.gpus.source} are not this machine's: CUDA_VISIBLE_DEVICES "
                   "follows them anyway (--gpus is for planning other machines with "
                   "--dry-run)")
    return tuple(out)
