"""hpcai-launch: start training ranks under mpirun or srun with NUMA-aware placement.

Usage:
  hpcai-launch [options] -- CMD [ARGS...]
  hpcai-launch validate --container IMG [options]   (site admins: which MPI is loaded?)
  hpcai-launch sbatch [job options] -- train ...     (a Slurm job script; --submit)
  hpcai-launch plan-step -- srun ... hpcai-launch ... (in a job script: plan the step once)
  hpcai-launch sweep --nodes 1,2,4 --ranks-per-node 1,2,4 -- train ...
  hpcai-launch report RESULTS                        (scaling table, CSV, JSON, PNG)
  hpcai-launch export-onnx CHECKPOINT --model 3dgan  (validated with onnxruntime)
  hpcai-launch mpis                                  (every MPI install on this host)
  hpcai-launch abi --container IMG [--json]          (which host MPI runs the image's MPI code)
  hpcai-launch tune -- train 3dgan ...               (ranks x threads for this node)
  hpcai-launch predict --tune tune.json --nodes 1,2,4 (time, samples/s, efficiency)

Three ways to use it, one result:
  hpcai-launch --ranks-per-node 2 -- CMD           starts mpirun/mpiexec itself
  srun --ntasks-per-node 4 hpcai-launch --ranks-per-node 4 -- CMD
  mpirun -n 2 hpcai-launch -- CMD                  per-rank wrapper mode
Inside a Slurm allocation (salloc/sbatch) without srun, it starts srun itself.

Each rank gets its CPU set (bound with sched_setaffinity unless the launcher already did),
the OpenMP/MKL/TF thread variables, and RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
NODE_RANK, MASTER_ADDR, MASTER_PORT, then execs CMD. (Open MPI's mpirun started here for a
bare run sets them per rank itself, with `taskset -c` for the CPU set: no wrapper runs.)

--dry-run prints the plan and starts nothing (--json for machines). Errors print
`error:` and `hint:` and exit 2 before any rank starts; -v adds tracebacks.
Defaults for several options come from HPCAI_* environment variables.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from ..core.errors import UserError
from .job import jobplan
from .job.rankenv import from_environ

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from ..core.cli import Parser
    from .planning.options import Options


def _validate(argv: list[str]) -> int:
    from .validate import main as validate
    return validate(argv, parse)


def _plan_step(argv: list[str]) -> int:
    from .stepplan import main as plan_step
    return plan_step(argv, parse)


def _sbatch(argv: list[str]) -> int:
    from .batch.sbatch import main as sbatch
    return sbatch(argv)


def _sweep(argv: list[str]) -> int:
    from .batch.sweep import main as sweep
    return sweep(argv)


def _report(argv: list[str]) -> int:
    from .batch.report import run as report
    return report(argv)


def _export_onnx(argv: list[str]) -> int:
    from ..training.export import main as export_onnx
    return export_onnx(argv)


def _mpis(argv: list[str]) -> int:
    from .abicli import mpis_main
    return mpis_main(argv)


def _abi(argv: list[str]) -> int:
    from .abicli import abi_main
    return abi_main(argv)


def _tune(argv: list[str]) -> int:
    from ..perf.tune import run as tune
    return tune(argv)


def _predict(argv: list[str]) -> int:
    from ..perf.predict import run as predict
    return predict(argv)


SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "validate": _validate, "sbatch": _sbatch, "plan-step": _plan_step, "sweep": _sweep,
    "report": _report, "export-onnx": _export_onnx, "mpis": _mpis, "abi": _abi,
    "tune": _tune, "predict": _predict}


def make_parser() -> Parser:
    """hpcai-launch's options. Those with an ``HPCAI_*`` default parse to None when not
    given; :func:`parse` fills them in (and so knows which ones the user gave)."""
    import argparse

    from ..core.cli import Parser
    from .planning.options import ENV_DEFAULTS, LAUNCHERS, add_arguments
    p = Parser(prog="hpcai-launch", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter, add_help=True)
    place = p.add_argument_group("placement")
    add_arguments(place, "ranks_per_node")
    place.add_argument("--ranks-per-numa", type=int, help="ranks per NUMA domain")
    add_arguments(place, "threads_per_rank")
    place.add_argument("--hyperthreads", action="store_true",
                       help="use all hardware threads of each core")
    add_arguments(place, "oversubscribe")
    place.add_argument("--topology", default=None,
                       help="hwloc XML file or synthetic text ('pack:2 numa:2 core:12') "
                            "instead of this machine's sysfs")
    gpu = p.add_argument_group("GPUs")
    gpu.add_argument("--gpus", metavar="SPEC",
                     help="GPUs of the node to plan for instead of this machine's: "
                          "'gpu:4 numa:0,0,1,1 nic:mlx5_0@0+1,mlx5_1@2+3 model:A100', "
                          "or none (default: this machine's; none with --topology)")
    gpu.add_argument("--gpu-visible", choices=("per-rank", "all"),
                     help="per-rank: CUDA_VISIBLE_DEVICES lists the rank's GPUs; all: every "
                          "GPU visible, HPCAI_LOCAL_DEVICE names the rank's (default: the "
                          "site profile's gpu_visible, else per-rank)")
    gpu.add_argument("--share-gpus", action="store_true",
                     help="let more ranks than GPUs share them evenly")
    launch = p.add_argument_group("launcher")
    launch.add_argument("--launcher", choices=LAUNCHERS, help="default auto")
    add_arguments(launch, "mpi")
    launch.add_argument("--mpirun", help="path of the MPI launcher (mpirun/mpiexec) to use")
    launch.add_argument("--hosts", help="hosts for mpirun: h1,h2 or h1:4,h2:4")
    launch.add_argument("--nodes", type=int, help="nodes for srun (default: the allocation)")
    cont = p.add_argument_group("containers")
    add_arguments(cont, "container", "runtime")
    cont.add_argument("--bind-host-mpi", dest="bind_host_mpi", action="store_true",
                      default=None, help="bind the host MPI and fabric libraries read-only "
                      "(default: when a container is used and a host MPI is found)")
    cont.add_argument("--no-bind-host-mpi", dest="bind_host_mpi", action="store_false")
    cont.add_argument("--host-libs", help=argparse.SUPPRESS)  # staged by the outer launcher
    add_arguments(cont, "site", "binds", "gpu_driver")
    out = p.add_argument_group("output")
    out.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    out.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    out.add_argument("--report-bindings", action="store_true",
                     help="every rank prints its real CPU set and thread count")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    p.epilog = "Defaults from the environment: " + ", ".join(
        f"{var} ({'--' + name.replace('_', '-')})" for name, var, _ in ENV_DEFAULTS)
    return p


def parse(argv: list[str]) -> tuple[Options, argparse.Namespace]:
    """The command line and the ``HPCAI_*`` defaults, checked for values and combinations
    that would be ignored or cannot work."""
    from ..core.cli import split_command
    from .planning.options import ENV_DEFAULTS, MPI_CHOICES, Options, env_defaults
    head, command = split_command(argv)
    ns = make_parser().parse_args(head)
    if command is None:
        command = ns.command
    given = {name for name, _, _ in ENV_DEFAULTS if getattr(ns, name) is not None}
    defaults = env_defaults(os.environ)
    for name in defaults.keys() - given:
        setattr(ns, name, defaults[name])
    if ns.mpi not in MPI_CHOICES:
        _select_install(ns)
    if ns.json and not ns.dry_run:
        raise UserError("--json only goes with --dry-run", "add --dry-run")
    _check_counts(ns)
    _check_container_options(ns, given)
    options = Options(command=tuple(command), ranks_per_node=ns.ranks_per_node,
                      ranks_per_numa=ns.ranks_per_numa, threads_per_rank=ns.threads_per_rank,
                      hyperthreads=ns.hyperthreads, oversubscribe=ns.oversubscribe,
                      launcher=ns.launcher, mpi=ns.mpi, mpirun=ns.mpirun, hosts=ns.hosts,
                      nodes=ns.nodes, topology=ns.topology,
                      report_bindings=ns.report_bindings, verbose=ns.verbose,
                      container=ns.container, runtime=ns.runtime,
                      bind_host_mpi=ns.bind_host_mpi, host_libs=ns.host_libs, site=ns.site,
                      binds=tuple(ns.bind), gpus=ns.gpus, gpu_visible=ns.gpu_visible,
                      share_gpus=ns.share_gpus,
                      gpu_driver=ns.gpu_driver or "auto")
    return options, ns


def _select_install(ns: argparse.Namespace) -> None:
    """``--mpi family@version`` or ``--mpi PATH``: the host install it names becomes the
    flavour and (unless ``--mpirun`` is given) the launcher."""
    from .mpi.abi import FLAVOURS
    from .mpi.mpis import discover, select

    from .job.site import SiteProfile

    env = dict(os.environ)
    site = SiteProfile.chosen(ns.site, env)
    install = select(ns.mpi, discover(env, site.mpi_prefixes if site else ()), env)
    if install.launcher is None and not ns.mpirun:
        raise UserError(f"--mpi {ns.mpi}: {install.label} has no launcher next to it",
                        "pass --mpirun with its mpirun/mpiexec")
    ns.mpi = install.name if install.name in FLAVOURS else next(
        f.name for f in FLAVOURS.values() if f.family == install.family)
    ns.mpirun = ns.mpirun or install.launcher


def _check_counts(ns: argparse.Namespace) -> None:
    if ns.nodes is not None and ns.nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {ns.nodes}",
                        "give the number of nodes srun should use, or leave it out")


def _check_container_options(ns: argparse.Namespace, given: set[str]) -> None:
    """Container options that would be silently ignored (no container to apply them to)
    are refused. ``--runtime none`` over ``HPCAI_CONTAINER`` is a bare run on purpose."""
    def source(name: str, var: str) -> str:
        return f"--{name}" if name in given else var

    if ns.container is not None and ns.runtime == "none":
        if "container" in given or "runtime" not in given:
            raise UserError(f"{source('container', 'HPCAI_CONTAINER')} {ns.container} with "
                            f"{source('runtime', 'HPCAI_RUNTIME')} none: the image would be "
                            "ignored", "use --runtime charliecloud or singularity, or leave "
                            "out the container")
    elif ns.container is not None:
        return
    bare = "--runtime none" if ns.container is not None else "no --container"
    hint = "give --container IMG, or leave the option out"
    if ns.bind:
        raise UserError(f"--bind {ns.bind[0]} with {bare}: there is no container to bind "
                        "it into", hint)
    if ns.bind_host_mpi is not None:
        flag = "--bind-host-mpi" if ns.bind_host_mpi else "--no-bind-host-mpi"
        raise UserError(f"{flag} with {bare}: it only applies to a container", hint)
    if ns.gpu_driver is not None:
        raise UserError(f"--gpu-driver {ns.gpu_driver} with {bare}: it only applies to a "
                        "container (a bare run uses the host's driver as it is)", hint)
    if ns.container is None and "runtime" in given and ns.runtime != "none":
        raise UserError(f"--runtime {ns.runtime} with no --container: there is no image to "
                        "run", hint)


def main(argv: list[str] | None = None) -> int:
    """A subcommand, a rank that starts from its job's plan (:mod:`.job.jobplan`: before any
    import that planning needs), or planning."""
    started = time.time()
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] and args[0] in SUBCOMMANDS:
        from ..core.cli import run_main
        return run_main(SUBCOMMANDS[args[0]], args[1:])
    env = dict(os.environ)
    job = jobplan.role(args, env, from_environ(env, os.getppid()))
    if job is not None and not job.planner:
        from .run.execute import run_rank
        code = run_rank(job, env, started)           # execs, unless an error
        if code is not None:
            return code
        job = None                                   # this rank plans by itself
    from ..core.cli import run_main
    launch = _Launch(job)
    return run_main(launch, args, report=launch.report)


def check_training_command(options: Options):
    """A ``train`` command checked once here before any rank starts
    (:func:`hpcai.training.preflight.preflight`): a usage error, and for a bare run its
    data, output directory and ``--resume`` checkpoint, are said once, not by every rank
    and then by mpirun's abort banner. In a container the paths are the image's, which
    the ranks check. A bare ``train`` is checked only if it is hpcai's (someone else's
    ``train`` is theirs). Returns the command's ``TrainConfig``, or None."""
    from ..core.paths import which
    from ..training.command import train_arguments

    if train_arguments(options.command) is None:   # not hpcai's training: nothing to check
        return None
    from ..training.preflight import preflight

    bare = options.container is None or options.runtime == "none"
    program = which(options.command[0]) if bare and options.command else None
    return preflight(options.command, program, inputs=bare)


def _with_recipe(text: str, train) -> str:
    """The plan's text, and for a 3DGAN ``train`` the recipe it starts from."""
    if train is None:
        return text
    from ..training.recipes import settings_line   # dataclasses: only for a train command

    line = settings_line(train)
    return text if line is None else f"{text}\ntrain:     {line}"


class _Launch:
    """Plan, then print it (``--dry-run``) or carry it out. In rank mode only local rank 0
    reports a user error (every rank hits the same one). The job's planning rank
    (``job``) writes the job's plan for the others, or its error."""

    def __init__(self, job: jobplan.JobRole | None) -> None:
        self.loud = True
        self.job = job

    def __call__(self, argv: list[str]) -> int:
        try:
            return self._plan(argv)
        except UserError as exc:
            if self.job is not None:
                jobplan.write_error(self.job, exc)
            raise

    def _plan(self, argv: list[str]) -> int:
        from .planning.facts import gather_facts
        from .planning.plan import build_plan, key_files, rank_template

        options, ns = parse(argv)
        train = None
        if from_environ(dict(os.environ)) is None:   # the outer hpcai-launch, not a rank
            train = check_training_command(options)
        facts = gather_facts(options, stage=not ns.dry_run)
        self.loud = facts.rank is None or facts.rank.local_rank == 0
        plan = build_plan(options, facts)
        written = None
        if plan.mode == "mpirun":
            from .outerplan import prepare
            plan, written = prepare(options, facts, plan, parse, dry_run=ns.dry_run)
        if ns.dry_run:
            print(plan.to_json() if ns.json else _with_recipe(plan.render(), train))
            return 0
        if self.job is not None and plan.mode == "rank":
            key = jobplan.make_key(self.job, facts.env, facts.cwd, key_files(facts))
            jobplan.write(self.job.path, key, rank_template(options, facts))
        from .mpi.flavours import keep_versions
        from .run.execute import exec_plan
        keep_versions()
        try:
            return exec_plan(plan, report_bindings=options.report_bindings)
        finally:
            if written:
                with contextlib.suppress(OSError):
                    os.unlink(written)

    def report(self, exc: UserError) -> None:
        if self.loud:
            from ..core.cli import say_error
            say_error(exc)
