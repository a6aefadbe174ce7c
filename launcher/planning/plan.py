"""The launch plan: a frozen value built by pure functions from options and facts.

``build_plan(options, facts)`` decides the mode:
- ``rank``: this process already is a rank (started by mpirun/mpiexec/srun); the plan is
  "bind to these CPUs, set this env, exec the command";
- ``srun``: inside a Slurm allocation, start the ranks with srun;
- ``mpirun``: anywhere else, start them with the MPI's own launcher.
In the last two the ranks run ``hpcai-launch`` again, which then plans in ``rank`` mode
(or reads the outer launcher's plan), except where the outer launcher's mpirun starts the
ranks' commands itself (:func:`direct_mpirun_plan`, :mod:`hpcai.launcher.outerplan`).
"""

from __future__ import annotations

import os
from ...core.record import asdict, field, record, replace

from ...core.errors import UserError
from ..mpi import pmi
from ...slurm.srun import STOP_SIGNAL as SRUN_STOP_SIGNAL
from ...slurm.srun import SrunStep, srun_argv
from ..mpi import flavours
from ..job import jobplan
from ..mpi.abi import SYSTEM_LIBDIRS
from ..container.containers import HOST_MOUNT, get_runtime
from .facts import Facts, choose_mode
from ..mpi.flavours import MpiInstall
from ..node.hosts import parse_hosts
from . import gpuplan
from ..node.gpuplace import GpuPlacement
from .options import Options
from ..node.placement import Placement, plan_placement, thread_env
from ..job.rankenv import RankInfo
from ..node.topology import Topology, allowed_env

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from ..container.containerplan import ContainerFacts

# Signals hpcai-launch passes on unchanged when it runs the launcher as a child.
RELAYED_AS_IS = ("SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


@record
class RankPlan:
    """One local rank's binding and environment."""

    local_rank: int
    numa: tuple[int, ...]
    cpus: str
    threads: int
    env: tuple[tuple[str, str], ...]


@record
class LaunchPlan:
    mode: str                              # "mpirun", "srun" or "rank"
    reason: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]       # set in the launching process (and exported)
    placement: Placement
    ranks: tuple[RankPlan, ...]            # every local rank (rank mode: only this one)
    topology: str
    mpi: MpiInstall | None = None
    rank: RankInfo | None = None
    bind_cpus: tuple[int, ...] | None = None   # rank mode: sched_setaffinity target
    compat_links: tuple[tuple[str, str], ...] = ()  # (link, target) to create first
    notes: tuple[str, ...] = field(default=())
    container: ContainerFacts | None = None
    warnings: tuple[str, ...] = ()         # said by rank 0 when the plan is carried out
    relay: tuple[tuple[str, str], ...] = ()  # (signal to hpcai-launch, signal it sends the
                                             # launcher instead), the first time it comes;
                                             # non-empty: the launcher runs as a child
    gpus: GpuPlacement | None = None       # None: no GPUs (:mod:`.gpuplan`)

    def relay_text(self) -> str:
        """What happens to a signal sent to hpcai-launch, for the printed plan."""
        launcher = os.path.basename(self.argv[0]) if self.argv else "the launcher"
        if not self.relay:
            return f"hpcai-launch becomes {launcher} (exec): signals reach it directly"
        turns = ", ".join(f"{got} as {sent}" for got, sent in self.relay)
        names = ", ".join(sorted({got for got, _ in self.relay}))
        return (f"{launcher} runs in its own process group; hpcai-launch passes on {turns} "
                f"(a second {names} as it is), {', '.join(RELAYED_AS_IS)} as they are, "
                f"and exits as {launcher} does")

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def to_dict(self) -> dict:
        data = {
            "mode": self.mode,
            "reason": self.reason,
            "argv": list(self.argv),
            "env": dict(self.env),
            "topology": self.topology,
            "mpi": self.mpi.to_dict() if self.mpi else None,
            "placement": {
                "ranks_per_node": self.placement.ranks_per_node,
                "threads_per_rank": self.placement.threads_per_rank,
                "cores_per_rank": self.placement.cores_per_rank,
                "layout": self.placement.layout,
                "hyperthreads": self.placement.hyperthreads,
                "oversubscribed": self.placement.oversubscribed,
            },
            "ranks": [dict(asdict(r), env=dict(r.env)) for r in self.ranks],
            "rank": self.rank.to_dict() if self.rank else None,
            "bind_cpus": list(self.bind_cpus) if self.bind_cpus is not None else None,
            "compat_links": [list(x) for x in self.compat_links],
            "container": self.container.to_dict() if self.container else None,
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "relay": dict(self.relay),
            "gpus": self.gpus.to_dict() if self.gpus else None,
        }
        return data

    def to_json(self) -> str:
        import json     # here: only --dry-run --json prints it
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def render(self) -> str:
        """Readable form for ``--dry-run``."""
        lines = [f"mode:      {self.mode} ({self.reason})", f"topology:  {self.topology}"]
        if self.gpus:
            lines.append(f"gpus:      {self.gpus.source}; {_gpu_how(self.gpus)}")
        if self.mpi:
            lines.append(f"mpi:       {self.mpi.flavour.title} {self.mpi.version} "
                         f"[{self.mpi.how}]")
        p = self.placement
        lines.append(f"placement: {p.ranks_per_node} rank(s)/node x {p.threads_per_rank} "
                     f"thread(s), {p.cores_per_rank} core(s)/rank, layout {p.layout}"
                     + (", OVERSUBSCRIBED" if p.oversubscribed else ""))
        for r in self.ranks:
            lines.append(f"  local rank {r.local_rank}: NUMA {','.join(map(str, r.numa))} "
                         f"cpus {r.cpus} threads {r.threads}"
                         + (_gpu_text(self.gpus, r.local_rank) if self.gpus else ""))
        if self.ranks:
            lines.append("rank env:  " + " ".join(f"{k}={v}" for k, v in self.ranks[0].env
                                                  if k not in _PER_RANK))
        if self.env:
            lines.append("env:")
            lines.extend(f"  {k}={v}" for k, v in self.env)
        for link, target in self.compat_links:
            lines.append(f"link:      {link} -> {target}")
        if self.container:
            c = self.container
            lines.append(f"container: {c.runtime} {c.image}")
            lines.extend(f"  check:   {text}" for text in c.checks)
            lines.append(f"  read-only binds: {get_runtime(c.runtime).read_only_how}")
            if c.staged:
                where = "staged in" if c.copied else "to be staged in (dry run: not copied)"
                lines.append(f"  host libraries {where} {c.staged}, bound read-only at "
                             f"{HOST_MOUNT}:")
                lines.extend(f"    {lib.name} <- {lib.path}" for lib in c.libs)
            if c.driver is not None:
                lines.extend(_driver_lines(c))
            rt = get_runtime(c.runtime)
            lines.append("  env:     " + (
                f"{', '.join(rt.explicit_env)}: given as {rt.env_flag} NAME=VALUE where "
                f"planned ({c.runtime} does not import LD_LIBRARY_PATH); the rest of the "
                "rank's environment passes through" if rt.env_flag else
                "the rank's environment passes through, LD_LIBRARY_PATH included"))
        lines.append("argv:")
        lines.append("  " + " ".join(_quote(a) for a in self.argv))
        if self.mode != "rank":
            lines.append(f"signals:   {self.relay_text()}")
        lines.extend(f"note:      {n}" for n in self.notes)
        lines.extend(f"warning:   {w}" for w in self.warnings)
        return "\n".join(lines)


_PER_RANK = ("HPCAI_CPUS", "CUDA_VISIBLE_DEVICES", "HPCAI_LOCAL_DEVICE")


def _gpu_how(gpus: GpuPlacement) -> str:
    if gpus.visible == "slurm":
        return "srun binds them (GRES), HPCAI_LOCAL_DEVICE=0"
    if gpus.visible == "all":
        return "all visible, HPCAI_LOCAL_DEVICE per rank (CUDA_DEVICE_ORDER=PCI_BUS_ID)"
    return "CUDA_VISIBLE_DEVICES per rank (CUDA_DEVICE_ORDER=PCI_BUS_ID), HPCAI_LOCAL_DEVICE=0"


def _gpu_text(gpus: GpuPlacement, local_rank: int) -> str:
    slot = gpus.slots[local_rank]
    which = ",".join(map(str, slot.gpus)) or "by Slurm"
    return f" gpu {which} nics {','.join(slot.nics) or '-'} ({slot.why})"


def _driver_lines(c: ContainerFacts) -> list[str]:
    """The host's NVIDIA driver in the container, for ``--dry-run``: what is bound, and why."""
    lib = f"{HOST_MOUNT}/lib"
    lines = [f"  GPU driver: {c.driver_why}"]
    for f in c.libs:
        if f.role == "accelerator" and f.subdir == "bin":
            lines.append(f"    {lib}/{f.relpath} <- {f.path} (read-only, staged)")
        elif f.role == "accelerator" and f.aliases:
            lines.append(f"    {lib}/{f.name} <- {f.path} (read-only, staged; "
                         f"{', '.join(f.aliases)} links to it)")
    devices = c.device_binds()
    if devices:
        lines.extend(f"    {b.target} <- {b.source} (device node, bound read-write: "
                     f"{c.runtime}'s /dev may be minimal)" for b in devices)
    elif c.driver.devices:
        lines.append(f"    {', '.join(c.driver.devices)}: in the host's /dev, which "
                     f"{c.runtime} binds whole")
    return lines


def _quote(arg: str) -> str:
    """Display-only quoting (argv is never run through a shell)."""
    import shlex
    return shlex.quote(arg)


# --- pure planning -----------------------------------------------------------------------

def build_plan(options: Options, facts: Facts,
               prepared: tuple[str, str] | None = None) -> LaunchPlan:
    """The whole decision, as a value. Raises UserError for anything the user must fix.
    ``prepared``: (path, token) of the ranks' plan that the outer launcher writes before an
    mpirun launch (:mod:`hpcai.launcher.outerplan`); the ranks get both in their env."""
    if not options.command:
        raise UserError("no command to run",
                        "put the program after '--', e.g. hpcai-launch --ranks-per-node 2 "
                        "-- python train.py")
    mode, reason = choose_mode(options, facts.env, facts.rank)
    check_mode_options(options, facts.env, mode)
    if facts.container is not None:
        if not facts.container.has_command:
            raise UserError(f"command not found in image {facts.container.image}: "
                            f"{options.command[0]!r}",
                            "check the spelling, or give the absolute path inside the image")
        from ..container.containerplan import spec
        spec(facts.container, options.binds, facts.cwd, facts.env)   # binds refused here
    elif facts.command_path is None:
        raise UserError(f"command not found: {options.command[0]!r}",
                        "check the spelling and PATH, or give an absolute path")
    if mode == "rank":
        return _rank_plan(options, facts, reason)
    rpn, gpu_notes = gpuplan.ranks_per_node(options, facts)
    placement = _placement(options, facts.topology, rpn)
    gpus = gpuplan.gpu_placement(options, facts, placement, mode)
    ranks = tuple(_rank_plan_entry(placement, i, gpus)
                  for i in range(placement.ranks_per_node))
    if mode == "srun":
        plan = _srun_plan(options, facts, placement, ranks, reason, gpus)
    else:
        plan = _mpirun_plan(options, facts, placement, ranks, reason, prepared)
    if gpus is None:
        return plan
    return replace(plan, gpus=gpus, notes=(*gpu_notes, *plan.notes),
                   warnings=(*plan.warnings, *gpuplan.warnings(gpus, facts)))


def check_mode_options(options: Options, env: dict[str, str], mode: str) -> None:
    """Refuse what this mode cannot do or would ignore, before anything starts: srun
    outside an allocation, ``--nodes`` without srun, ``--hosts`` without mpirun."""
    if mode == "srun" and not env.get("SLURM_JOB_ID"):
        raise UserError("--launcher srun, but this is not inside a Slurm allocation "
                        "(no SLURM_JOB_ID)",
                        "get an allocation first (salloc -N 2, or an sbatch script), or use "
                        "--launcher mpirun")
    started = "this process already is a rank (started by an MPI launcher or srun)"
    if options.nodes is not None and mode != "srun":
        raise UserError(f"--nodes {options.nodes} only applies when hpcai-launch starts "
                        f"srun, but {started if mode == 'rank' else 'it starts mpirun'}",
                        "leave out --nodes" + ("" if mode == "rank" else
                                              "; mpirun runs on the --hosts given"))
    if options.hosts is not None and mode != "mpirun":
        raise UserError(f"--hosts {options.hosts} only applies when hpcai-launch starts "
                        f"mpirun, but {started if mode == 'rank' else 'it starts srun'}",
                        "leave out --hosts" + ("" if mode == "rank" else
                                              " (srun runs on the allocation's nodes; "
                                              "--nodes N picks how many), or use "
                                              "--launcher mpirun"))


def _placement(options: Options, topology: Topology, ranks_per_node: int | None) -> Placement:
    return plan_placement(topology, ranks_per_node=ranks_per_node,
                          ranks_per_numa=options.ranks_per_numa,
                          threads_per_rank=options.threads_per_rank,
                          hyperthreads=options.hyperthreads,
                          oversubscribe=options.oversubscribe)


def _rank_plan_entry(placement: Placement, local_rank: int,
                     gpus: GpuPlacement | None = None) -> RankPlan:
    slot = placement.slot(local_rank)
    env = thread_env(slot, placement.hyperthreads)
    if gpus is not None:
        env.update(gpus.env(local_rank))
    return RankPlan(local_rank=local_rank, numa=slot.numa, cpus=slot.cpulist,
                    threads=slot.threads, env=tuple(env.items()))


def wrapper_argv(options: Options, ranks_per_node: int,
                 container: ContainerFacts | None) -> list[str]:
    """The per-rank ``hpcai-launch`` options and ``-- CMD`` (rebuilds the same placement)."""
    return options.for_ranks(
        ranks_per_node, container=container.image if container else None,
        runtime=container.runtime if container else options.runtime,
        host_libs=container.staged if container else None).to_argv()


def mpi_library_env(mpi: MpiInstall | None, env: dict[str, str], cache_dir: str
                    ) -> tuple[dict[str, str], tuple[tuple[str, str], ...], list[str]]:
    """Env (and compat links) so that ranks, mpi4py included, load the chosen libmpi (pure:
    the links the library directory lacks are a fact, :attr:`.MpiInstall.missing_compat`)."""
    if mpi is None:
        return {}, (), []
    family = mpi.flavour.abi
    out = {"MPI4PY_MPIABI": family.mpi4py_abi}
    links: tuple[tuple[str, str], ...] = ()
    notes: list[str] = []
    libdirs: list[str] = []
    missing = mpi.missing_compat     # found by fact gathering (flavours.missing_compat)
    if missing:
        shim = os.path.join(os.path.expanduser(cache_dir), "abi", mpi.flavour.name)
        links = tuple((f"{shim}/{c.name}", f"{mpi.libdir}/{c.target}") for c in missing)
        libdirs.append(shim)
        notes += [f"{mpi.libdir} has {c.target} but no {c.name} (Debian layout): a compat "
                  f"link makes {family.title}-ABI programs load it" for c in missing]
    elif mpi.libdir and mpi.libdir not in SYSTEM_LIBDIRS:
        libdirs.append(mpi.libdir)
    if libdirs:
        current = env.get("LD_LIBRARY_PATH", "")
        out["LD_LIBRARY_PATH"] = ":".join([*libdirs, *([current] if current else [])])
    return out, links, notes


def _global_env(options: Options, facts: Facts, master_addr: str,
                placement: Placement) -> tuple[dict[str, str], tuple, list[str]]:
    env = {"MASTER_ADDR": facts.env.get("MASTER_ADDR", master_addr),
           "MASTER_PORT": facts.env.get("MASTER_PORT", str(facts.free_port))}
    lib_env, links, notes = mpi_library_env(facts.mpi, facts.env, facts.cache_dir)
    if facts.container is not None:   # the ranks' container env points at the bound libs
        lib_env, links, notes = {}, (), []
    env.update(lib_env)
    if facts.mpi:
        env.update(facts.mpi.flavour.binding_env(placement))
    env.update(allowed_env(facts.topology, facts.hostname))   # the ranks plan within it too
    return env, links, notes


def _mpirun_plan(options: Options, facts: Facts, placement: Placement,
                 ranks: tuple[RankPlan, ...], reason: str,
                 prepared: tuple[str, str] | None = None) -> LaunchPlan:
    mpi = facts.mpi
    if mpi is None:
        raise UserError("no MPI found to start the ranks with",
                        "install an MPI, or pass --mpirun PATH / --mpi")
    rpn = placement.ranks_per_node
    hosts = parse_hosts(options.hosts) if options.hosts else ((facts.hostname, None),)
    for name, slots in hosts:
        if slots is not None and slots < rpn:
            raise UserError(f"host {name} offers {slots} slot(s) but --ranks-per-node is {rpn}",
                            f"give {name}:{rpn} in --hosts or lower --ranks-per-node")
    local = not options.hosts
    master = "127.0.0.1" if local else hosts[0][0]
    env, links, notes = _global_env(options, facts, master, placement)
    if prepared is not None:
        env.update({jobplan.PLAN_ENV: prepared[0], jobplan.LAUNCH_ENV: prepared[1]})
        notes.append(f"the ranks start from the plan in {prepared[0]} (written before mpirun; "
                     "no rank plans)")
    flavour = mpi.flavour
    total = rpn * len(hosts)
    argv: list[str] = [mpi.launcher, "-n", str(total)]
    if flavour.hosts_style == "slots":
        argv += ["--host", ",".join(f"{h}:{rpn}" for h, _ in hosts)]
    else:
        argv += ["-hosts", ",".join(h for h, _ in hosts), "-ppn", str(rpn)]
    if flavour.root_flags and facts.uid == 0:
        argv += flavour.root_flags
        notes.append(f"running as root: {flavour.title} needs {' '.join(flavour.root_flags)}")
    argv += flavour.binding_args(placement)
    argv += flavour.keep_env_flags
    argv += flavour.env_args(env)
    argv += [*facts.self_argv, *wrapper_argv(options, rpn, facts.container)]
    relay = (("SIGTERM", flavour.stop_signal),) if flavour.stop_signal else ()
    return LaunchPlan(mode="mpirun", reason=reason, argv=tuple(argv), env=tuple(env.items()),
                      placement=placement, ranks=ranks, topology=facts.topology.describe(),
                      mpi=mpi, compat_links=links, notes=tuple(notes),
                      container=facts.container, relay=relay)


def direct_mpirun_plan(plan: LaunchPlan, hostname: str, as_root: bool,
                       ranks: tuple[tuple[tuple[str, ...], dict[str, str]], ...],
                       warnings: tuple[str, ...],
                       links: tuple[tuple[str, str], ...] = ()) -> LaunchPlan:
    """An Open MPI plan on this host that starts every local rank's command itself: one app
    context per rank (``-n 1 -x NAME=VALUE ... CMD`` joined by ``:``) instead of
    ``hpcai-launch`` per rank. ``ranks``: (argv, env beyond mpirun's own) by local rank,
    argv already prefixed with ``taskset -c CPUS`` where the rank is bound (mpirun binds
    nothing: ``--bind-to none``). ``warnings`` and ``links``: those a rank would say and
    make."""
    assert plan.mpi is not None and plan.mode == "mpirun"
    flavour = plan.mpi.flavour
    argv: list[str] = [plan.mpi.launcher, "--host", f"{hostname}:{len(ranks)}"]
    if flavour.root_flags and as_root:
        argv += flavour.root_flags
    argv += ["--bind-to", "none", *flavour.keep_env_flags]
    for i, (command, env) in enumerate(ranks):
        argv += [":"] if i else []
        argv += ["-n", "1", *flavour.env_args(env), *command]
    note = ("mpirun starts each local rank's command itself, one app context per rank with "
            "its variables (-x) and its CPUs (taskset): no hpcai-launch runs in the ranks")
    return replace(plan, argv=tuple(argv), notes=(*plan.notes, note), warnings=(
        *plan.warnings, *(w for w in warnings if w not in plan.warnings)),
        compat_links=(*plan.compat_links, *(x for x in links if x not in plan.compat_links)))


def srun_line(options: Options, pmi: str | None, placement: Placement, topology: Topology,
              nodes: int | None, self_argv: tuple[str, ...],
              container: ContainerFacts | None = None,
              gpus: GpuPlacement | None = None) -> list[str]:
    """The srun line that starts this placement (also quoted in mismatch errors); with
    Slurm's GPU options where Slurm binds the GPUs."""
    by_slurm = gpus is not None and gpus.visible == "slurm"
    step = SrunStep(ranks_per_node=placement.ranks_per_node,
                    cores_per_rank=min(placement.cores_per_rank, len(topology.cores)),
                    threads_per_core=topology.threads_per_core, nodes=nodes, pmi=pmi,
                    oversubscribed=placement.oversubscribed,
                    gpus_per_task=gpus.gpus_per_rank if by_slurm else None)
    return srun_argv(step, [*self_argv,
                            *wrapper_argv(options, placement.ranks_per_node, container)])


def _srun_plan(options: Options, facts: Facts, placement: Placement,
               ranks: tuple[RankPlan, ...], reason: str,
               gpus: GpuPlacement | None = None) -> LaunchPlan:
    nodes = options.nodes or _int_or_none(facts.env.get("SLURM_JOB_NUM_NODES")
                                          or facts.env.get("SLURM_NNODES"))
    env, links, notes = _global_env(options, facts, "", placement)
    env.update(facts.pmi.env)          # srun hands it to the ranks
    notes += [facts.pmi.note] if facts.pmi.note else []
    if not env["MASTER_ADDR"]:
        del env["MASTER_ADDR"]   # each rank takes the step's first node
    del env["MASTER_PORT"]       # each rank derives it from the job and step id
    flavour = facts.mpi.flavour if facts.mpi else None
    if flavour is None:
        notes.append("MPI flavour unknown: srun uses the site's default --mpi plugin")
    site = facts.container.site if facts.container else facts.site
    pmi_name = pmi.choose(None, site, flavour.srun_mpi if flavour else None)
    argv = srun_line(options, pmi_name, placement, facts.topology, nodes, facts.self_argv,
                     container=facts.container, gpus=gpus)
    return LaunchPlan(mode="srun", reason=reason, argv=tuple(argv), env=tuple(env.items()),
                      placement=placement, ranks=ranks, topology=facts.topology.describe(),
                      mpi=facts.mpi, compat_links=links, notes=tuple(notes),
                      container=facts.container, relay=(("SIGTERM", SRUN_STOP_SIGNAL),))


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def _rank_plan(options: Options, facts: Facts, reason: str) -> LaunchPlan:
    info = facts.rank
    assert info is not None
    placement, template, notes, warnings = _rank_parts(options, facts)
    argv, env, bind_cpus = jobplan.for_rank(template, info, facts.env)
    gpus = gpuplan.gpu_placement(options, facts, placement, "rank")
    return LaunchPlan(mode="rank", reason=reason, argv=argv, env=tuple(env.items()),
                      placement=placement,
                      ranks=(_rank_plan_entry(placement, info.local_rank, gpus),), gpus=gpus,
                      topology=facts.topology.describe(), rank=info, bind_cpus=bind_cpus,
                      mpi=facts.mpi, compat_links=template.compat_links, notes=notes,
                      container=facts.container, warnings=warnings)


def rank_template(options: Options, facts: Facts) -> jobplan.RankTemplate:
    """What every rank of the job needs (written once to the job's plan file by the
    planning rank; :func:`.jobplan.for_rank` makes one rank's argv and env of it)."""
    return _rank_parts(options, facts)[1]


def rank_template_with_warnings(options: Options, facts: Facts) -> tuple[jobplan.RankTemplate, tuple[str, ...]]:
    """The template and the warnings rank 0 says when it carries out its plan (for a plan
    made before the launch, whose ranks do not plan: the planner says them)."""
    _, template, _, warnings = _rank_parts(options, facts)
    return template, warnings


def key_files(facts: Facts) -> tuple[tuple[str, str], ...]:
    """The files a rank's plan depends on: image, host MPI, staged host libraries."""
    files: list[tuple[str, str]] = []
    c = facts.container
    if c is not None:
        files.append(("image", c.image))
        if c.host_mpi is not None:
            files.append(("host MPI", c.host_mpi.libmpi))
        if c.staged:
            files.append(("staged host libraries", c.staged))
    elif facts.mpi is not None and facts.mpi.launcher:
        files.append(("host MPI", facts.mpi.launcher))
    return tuple(files)


def _rank_parts(options: Options, facts: Facts) -> tuple[
        Placement, jobplan.RankTemplate, tuple[str, ...], tuple[str, ...]]:
    """(placement, the node's template, notes, warnings) of a rank's plan."""
    info = facts.rank
    assert info is not None
    if options.ranks_per_node is not None and options.ranks_per_node != info.local_size:
        raise _mismatch_error(options, facts, info)
    placement = _placement(options, facts.topology, info.local_size)
    if info.started_by == "slurm" and facts.mpi is not None:
        _check_step_pmi(options, facts, info, placement)
    if info.local_rank >= placement.ranks_per_node:
        raise UserError(f"local rank {info.local_rank} outside the {placement.ranks_per_node} "
                        "planned ranks per node", "check the launcher's ranks per node")
    synthetic = facts.topology.source != "sysfs"
    gpus = gpuplan.gpu_placement(options, facts, placement, "rank")
    entries = tuple(jobplan.RankEntry(_rank_plan_entry(placement, i, gpus).env,
                                      None if synthetic else placement.slot(i).cpus)
                    for i in range(placement.ranks_per_node))
    env: dict[str, str] = {}
    notes: list[str] = []
    links: tuple[tuple[str, str], ...] = ()
    argv: tuple[str, ...] = (facts.command_path or options.command[0], *options.command[1:])
    if facts.container is not None:
        from ..container.containerplan import spec
        from ..container.containers import wrap
        cspec = spec(facts.container, options.binds, facts.cwd, facts.env)
        env.update(cspec.env)
        argv = tuple(wrap(cspec, options.command, join_ct=info.local_size,
                          join_tag=f"hpcai-{jobplan.JOB_MARK}-{jobplan.NODE_MARK}"))
    elif facts.mpi is not None and "MPI4PY_MPIABI" not in facts.env:
        lib_env, links, lib_notes = mpi_library_env(facts.mpi, facts.env, facts.cache_dir)
        env.update(lib_env)
        notes += lib_notes
    env.update(facts.pmi.env)          # e.g. I_MPI_PMI_LIBRARY: Slurm's libpmi2 on the host
    warnings: list[str] = [facts.pmi.note] if facts.pmi.note else []
    has_pmi = pmi.step_plugin(facts.env) is not None or any(
        key in facts.env for key in ("PMIX_RANK", "PMI_RANK", "PMI_FD"))
    if info.started_by == "slurm" and info.size > 1 and not has_pmi:
        warnings.append("srun started the ranks without a PMI plugin (--mpi=none): MPI "
                        "programs will each see a world of size 1; use srun --mpi=pmix "
                        "(Open MPI) or --mpi=pmi2 (MPICH, Intel MPI)")
    if info.started_by == "slurm" and info.size > 1 and facts.srun_kills_on_bad_exit is False:
        warnings.append("srun started the ranks without --kill-on-bad-exit: if one rank "
                        "fails, srun leaves the others running (they can wait in their next "
                        "collective until the time limit); add --kill-on-bad-exit=1 to the "
                        "srun line (hpcai-launch's own srun lines and sbatch scripts have it)")
    if synthetic:
        warnings.append(f"topology {facts.topology.source} is not this machine's: the ranks "
                        "are not bound (--topology and HPCAI_TOPOLOGY are for planning "
                        "other machines with --dry-run)")
    warnings.extend(gpuplan.warnings(gpus, facts))
    template = jobplan.RankTemplate(ranks=entries, env=tuple(env.items()), argv=argv,
                                    compat_links=links)
    return placement, template, tuple(notes), tuple(warnings)


def _check_step_pmi(options: Options, facts: Facts, info: RankInfo,
                    placement: Placement) -> None:
    """The plugin srun started this rank with must be the one hpcai would choose."""
    assert facts.mpi is not None
    site = facts.container.site if facts.container else None
    needed = pmi.choose(None, site, facts.mpi.flavour.srun_mpi)
    used = pmi.step_plugin(facts.env)
    if pmi.step_mismatch(needed, used):
        line = srun_line(options, needed, placement, facts.topology,
                         len(info.nodes) or None, ("hpcai-launch",))
        raise pmi.step_error(needed, used, facts.mpi.flavour.title,
                             " ".join(_quote(a) for a in line))


def _mismatch_error(options: Options, facts: Facts, info: RankInfo) -> UserError:
    wanted = options.ranks_per_node
    what = {"slurm": "srun", "openmpi": "mpirun", "hydra": "mpiexec"}[info.started_by]
    message = (f"{what} started {info.local_size} task(s) on this node but "
               f"--ranks-per-node is {wanted}")
    if info.started_by == "slurm":
        try:
            placement = _placement(options, facts.topology, wanted)
            flavour = flavours.get(options.mpi) if options.mpi != "auto" else None
            nodes = len(info.nodes) or None
            pmi = flavour.srun_mpi if flavour else facts.env.get("SLURM_MPI_TYPE")
            line = " ".join(_quote(a) for a in srun_line(
                options, pmi if pmi and pmi != "none" else None, placement, facts.topology,
                nodes, ("hpcai-launch",)))
            return UserError(message, f"run: {line}")
        except UserError as exc:
            return UserError(message, exc.hint)
    return UserError(message, f"start {wanted} rank(s) per node ({what} -ppn/--map-by "
                              f"ppr:{wanted}:node), or let hpcai-launch start the ranks itself")
