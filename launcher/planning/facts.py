"""The impure half of planning: read the world once into :class:`Facts`.

``gather_facts`` runs the MPI launcher's ``--version`` (when it must), reads the topology,
the rank identity, the site profile (checked whether or not a container uses it) and the
container facts, and on rank 0 of an srun step whether srun ends the step when a task
fails; :mod:`.plan` then decides with pure functions.
"""

from __future__ import annotations

import os
import _socket   # the C module: socket.py adds selectors, array and enum tables (~5 ms)
import sys
from ...core.record import record

from ...core.paths import cache_root, which
from ..mpi import flavours
from ..job import jobplan, rankenv
from ..node import topology
from ..mpi.flavours import MpiInstall
from ..node.gpus import GpuSet, load as load_gpus
from .options import Options
from ..job.rankenv import RankInfo, in_slurm_step
from ..job.site import SiteProfile
from ..node.topology import Topology
from ...core.errors import UserError
from ..mpi import pmi

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from ..container.containerplan import ContainerFacts


@record
class Facts:
    """What planning needs from the world, gathered once by :func:`gather_facts`."""

    env: dict[str, str]
    topology: Topology
    hostname: str
    self_argv: tuple[str, ...]
    command_path: str | None
    uid: int = 1000
    free_port: int = 29500
    mpi: MpiInstall | None = None
    cache_dir: str = "~/.cache/hpcai"
    rank: RankInfo | None = None
    container: ContainerFacts | None = None
    cwd: str = "/"
    site: SiteProfile | None = None
    srun_kills_on_bad_exit: bool | None = None   # rank 0 of an srun step; None: cannot tell
    pmi: pmi.PmiClient = pmi.PmiClient()         # PMI client library of a bare job
    gpus: GpuSet | None = None                   # None: not read (a plan without GPUs)


def choose_mode(options: Options, env: dict[str, str],
                rank: RankInfo | None) -> tuple[str, str]:
    """Which launch mode, and why (pure)."""
    if rank is not None:
        return "rank", f"started as rank {rank.rank} of {rank.size} by {rank.started_by}"
    if options.launcher == "srun":
        return "srun", "--launcher srun"
    if options.launcher == "mpirun":
        return "mpirun", "--launcher mpirun"
    if options.hosts:
        return "mpirun", "--hosts given"
    if env.get("SLURM_JOB_ID") and not in_slurm_step(env):
        return "srun", f"inside Slurm allocation {env['SLURM_JOB_ID']}"
    return "mpirun", "outside any allocation"

def gather_facts(options: Options, env: dict[str, str] | None = None, *,
                 stage: bool = True, rank: RankInfo | None = None,
                 srun_kills: bool | None = None) -> Facts:
    """Read the world once: topology, rank identity, MPI, command path, a free port, the
    container. ``stage=False`` (``--dry-run``): the host libraries are found but not copied.
    ``rank``: plan as this rank (``plan-step``: rank 0 of the step a batch script starts
    next, whose srun line says ``srun_kills``) instead of the rank ``env`` names."""
    env = dict(os.environ if env is None else env)
    info = rank if rank is not None else rankenv.from_environ(env, os.getppid())
    topo = _topology(options, env, in_rank=info is not None, hostname=_hostname())
    site = SiteProfile.chosen(options.site, env)
    command_path = None
    if options.command:
        command_path = which(options.command[0], path=env.get("PATH"))
    mpi = None
    port = 0
    if info is not None and options.mpi != "auto":
        mpi = flavours.locate(flavours.get(options.mpi), options.mpirun, env)
    mode, _ = choose_mode(options, env, info)
    if info is None:
        if mode == "mpirun" or options.mpi != "auto" or options.mpirun:
            mpi = flavours.resolve(options.mpi, options.mpirun, env)
        elif mode == "srun":
            found = flavours.find_launcher(None, env)
            mpi = flavours.resolve("auto", found, env) if found else None
        port = _free_port()
    cache_dir = cache_root(env)
    stage_root = cache_dir
    if site is not None and site.job_dir and site.job_dir_scope == jobplan.NODE:
        stage_root = os.path.expandvars(site.job_dir)   # node-local: no shared copy
    container = None
    if options.container and options.runtime != "none":
        from ..container import containerplan
        srun_pmi = pmi.choose(None, site, mpi.flavour.srun_mpi if mpi else None) \
            if mode == "srun" else None
        container = containerplan.gather(
            runtime=options.runtime, image=options.container,
            bind_host_mpi=options.bind_host_mpi, host_libs=options.host_libs,
            site=site, env=env, launcher=mpi.launcher if mpi else options.mpirun,
            family=flavours.get(options.mpi).family if options.mpi != "auto" else None,
            srun_pmi=srun_pmi, cache_dir=stage_root,
            in_rank=info is not None, command=options.command[0] if options.command else None,
            stage=stage, argv=options.command, gpu_driver=options.gpu_driver,
            driver_root=env.get("HPCAI_DRIVER_ROOT") or "/")
    kills = srun_kills
    if rank is None and info is not None and info.started_by == "slurm" and info.rank == 0 \
            and info.size > 1:
        from ...slurm.step import srun_kills_on_bad_exit
        kills = srun_kills_on_bad_exit(env, sys.argv[1:])
    return Facts(env=env, topology=topo, hostname=_hostname(),
                 self_argv=(sys.executable, "-m", "hpcai.launcher"), command_path=command_path,
                 uid=os.getuid(), free_port=port, mpi=mpi,
                 cache_dir=cache_dir,
                 rank=info, container=container, cwd=os.getcwd(), site=site,
                 srun_kills_on_bad_exit=kills,
                 pmi=_pmi_client(mode, info, mpi, env) if container is None
                 else pmi.PmiClient(),
                 gpus=load_gpus(options.gpus, planning_other_machine=bool(
                     options.topology or env.get("HPCAI_TOPOLOGY"))))


def _topology(options: Options, env: dict[str, str], in_rank: bool, hostname: str
              ) -> Topology:
    """``--topology``, else ``HPCAI_TOPOLOGY``, else this machine within the CPUs the job
    may use (``topology.allowed_cpus``; an error names the variable when the text came
    from it)."""
    if not options.topology and not env.get("HPCAI_TOPOLOGY"):
        return topology.load(None, topology.allowed_cpus(in_rank, env, hostname))
    if options.topology:
        return topology.load(options.topology)
    try:
        return topology.load(env["HPCAI_TOPOLOGY"])
    except UserError as exc:
        raise UserError(f"HPCAI_TOPOLOGY: {exc.message}",
                        f"{exc.hint}; or unset HPCAI_TOPOLOGY") from None


def _pmi_client(mode: str, info: RankInfo | None, mpi: MpiInstall | None,
                env: dict[str, str]) -> pmi.PmiClient:
    """Slurm's PMI client library (host path) for an MPI that loads it by path, in a job
    without a container: a rank of an srun step (the plugin srun used), or hpcai-launch
    starting srun itself (the flavour's plugin; srun hands the env to the ranks)."""
    if mpi is None:
        return pmi.PmiClient()
    if mode == "rank":
        plugin = pmi.step_plugin(env) if info is not None and info.started_by == "slurm" \
            else None
    else:
        plugin = mpi.flavour.srun_mpi if mode == "srun" else None
    return pmi.client(mpi.flavour.name, plugin, env, None)


def _hostname() -> str:
    return _socket.gethostname()


def _free_port() -> int:
    """A TCP port on loopback that is free now (the rendezvous port of a one-host launch)."""
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
    finally:
        s.close()
