"""Slurm batch scripts: a job spec (a value) rendered into a complete, readable script.

``hpcai-launch sbatch [--nodes N --ranks-per-node R --threads-per-rank T --time …
--container IMG --site FILE …] -- train …`` prints the script (``--dry-run``, the default),
writes it (``--script FILE``) or submits it (``--submit``, prints the job id).

The script asks Slurm for a warning signal before the time limit (``--signal=USR1@120``):
srun delivers it to every rank, the training engine checkpoints and exits 75, and the same
script submitted again resumes (``--resume`` is added to ``train`` commands). Before srun,
``hpcai-launch plan-step`` plans the step once on the batch host (:mod:`..stepplan`) and the
ranks start from its plan file. Ranks are
started by ``srun --mpi=<PMI of the MPI> --ntasks-per-node R --cpus-per-task T
--cpu-bind=cores`` or, where the site profile says so, ``mpiexec -n … -ppn R`` (Open MPI:
``--map-by ppr:R:node``); each runs
``hpcai-launch`` as the per-rank wrapper, which places it on the compute node's real
topology. Directives are sorted and every value is shell-quoted.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..mpi import flavours
from ...core.cli import Parser, split_command
from ...core.errors import UserError
from ...core.record import replace
from ..node.placement import check_fits
from ...training.command import train_arguments
from ...training.config import check_command
from ...training.preflight import preflight
from ..container.containers import DEFAULT_RUNTIME, NO_RUNTIME
from ..planning.options import Options, add_arguments
from ..job.site import SiteProfile
from ..mpi import pmi
from ...slurm.srun import SrunStep, srun_argv

DEFAULT_SIGNAL = "USR1@120"
# Slurm's --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
# Slurm's --signal: [{R|B}:]SIG[@SECONDS]; the training engine stops cleanly on these
_SIGNAL = re.compile(r"(?:([RB]{1,2}):)?(?:SIG)?([A-Z0-9]+)(?:@(\d+))?")
TRAIN_SIGNALS = ("USR1", "TERM", "10", "15")


@dataclass(frozen=True)
class JobSpec:
    """One batch job: the ``#SBATCH`` directives and what each rank runs."""

    command: tuple[str, ...]               # the user's command, run by every rank
    nodes: int = 1
    ranks_per_node: int = 1
    threads_per_rank: int | None = None    # None: the site's cores per node / ranks
    time: str = "01:00:00"                 # Slurm's [D-]HH:MM:SS
    partition: str | None = None
    account: str | None = None
    job_name: str = "hpcai"
    output: str = "hpcai-%j.out"           # %j: the job id
    signal: str = DEFAULT_SIGNAL
    mpi: str = "auto"
    container: str | None = None
    runtime: str = DEFAULT_RUNTIME
    site: SiteProfile | None = None
    site_path: str | None = None
    binds: tuple[str, ...] = ()
    launcher: str = "srun"              # or "mpiexec" (site profile)
    pmi: str | None = None
    oversubscribe: bool = False         # passed to the per-rank hpcai-launch
    gpu_driver: str = "auto"            # passed to the per-rank hpcai-launch
    extra_directives: tuple[str, ...] = field(default=())
    setup_lines: tuple[str, ...] = field(default=())   # e.g. "source /path/env.sh"
    plan_first: bool = True             # srun: plan the step once on the batch host


def _threads(spec: JobSpec) -> int:
    if spec.threads_per_rank is not None:
        return spec.threads_per_rank
    cores = spec.site.cores_per_node if spec.site and spec.site.cores_per_node else None
    return max(cores // spec.ranks_per_node, 1) if cores else 1


def check(spec: JobSpec) -> None:
    """Numbers that cannot work, before anything is written or submitted."""
    for name, value in (("--nodes", spec.nodes), ("--ranks-per-node", spec.ranks_per_node)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}", f"give {name} 1 or more")
    threads = _threads(spec)
    if threads < 1:
        raise UserError(f"--threads-per-rank must be at least 1, got {threads}",
                        "leave it out to use the cores of each rank's share")
    step(spec)   # raises when the ranks do not fit the site's nodes
    if not spec.command:
        raise UserError("no command for the job", "put it after '--', e.g. -- train 3dgan")


def _pmi(spec: JobSpec) -> str | None:
    return pmi.choose(spec.pmi, spec.site,
                      flavours.get(spec.mpi).srun_mpi if spec.mpi != "auto" else None)


def job_command(command: tuple[str, ...] | list[str]) -> list[str]:
    """The command as the job runs it: a ``train`` command with ``--resume``."""
    command = list(command)
    if train_arguments(command) is not None and "--resume" not in command:
        command.append("--resume")
    return command


def wrapper_argv(spec: JobSpec) -> list[str]:
    """The per-rank hpcai-launch and the user's command (with --resume for training)."""
    command = job_command(spec.command)
    options = Options(command=tuple(command), threads_per_rank=spec.threads_per_rank,
                      mpi=spec.mpi, oversubscribe=spec.oversubscribe, runtime=spec.runtime,
                      site=spec.site_path, binds=spec.binds, gpu_driver=spec.gpu_driver)
    per_rank = options.for_ranks(spec.ranks_per_node, container=spec.container,
                                 runtime=spec.runtime, host_libs=None)
    if spec.container:   # each node's wrapper finds and stages the host MPI itself
        per_rank = replace(per_rank, bind_host_mpi=None)
    return ["hpcai-launch", *per_rank.to_argv()]


def launch_argv(spec: JobSpec) -> list[str]:
    if spec.launcher == "mpiexec":
        return ["mpiexec", "-n", str(spec.nodes * spec.ranks_per_node),
                *per_node_args(spec), *wrapper_argv(spec)]
    return srun_argv(step(spec), wrapper_argv(spec))


def per_node_args(spec: JobSpec) -> list[str]:
    """Ranks per node in the site mpiexec's words: Hydra's ``-ppn R`` (MPICH, Intel MPI, and
    an unknown MPI), Open MPI's ``--map-by ppr:R:node`` (it has no -ppn). Both read the
    job's nodes from Slurm."""
    hosts_style = flavours.get(spec.mpi).hosts_style if spec.mpi != "auto" else "ppn"
    if hosts_style == "ppn":
        return ["-ppn", str(spec.ranks_per_node)]
    return ["--map-by", f"ppr:{spec.ranks_per_node}:node"]


def step(spec: JobSpec) -> SrunStep:
    """The job's srun step: each rank gets its threads' worth of whole cores."""
    site = spec.site
    threads = _threads(spec)
    cores = site.cores_per_node if site else None
    over = bool(cores) and check_fits(spec.ranks_per_node, threads, cores,
                                      f"nodes of site {site.name} have {cores}",
                                      oversubscribe=spec.oversubscribe)
    return SrunStep(ranks_per_node=spec.ranks_per_node,
                    cores_per_rank=min(threads, cores) if cores else threads,
                    threads_per_core=site.threads_per_core if site else 1,
                    nodes=spec.nodes, pmi=_pmi(spec), oversubscribed=over)


def directives(spec: JobSpec) -> list[str]:
    values = {
        "nodes": str(spec.nodes),
        "ntasks-per-node": str(spec.ranks_per_node),
        "cpus-per-task": str(step(spec).cpus_per_task),
        "time": spec.time,
        "job-name": spec.job_name,
        "output": spec.output,
        "signal": spec.signal,
    }
    if spec.partition:
        values["partition"] = spec.partition
    if spec.account:
        values["account"] = spec.account
    lines = [f"#SBATCH --{key}={shlex.quote(value)}" for key, value in sorted(values.items())]
    lines += [f"#SBATCH {shlex.quote(d)}" for d in sorted(spec.extra_directives)]
    return lines


def render(spec: JobSpec) -> str:
    """The whole job script (pure)."""
    check(spec)
    lines = ["#!/bin/bash", *directives(spec), "",
             "# Written by hpcai-launch sbatch. On the warning signal every rank checkpoints",
             "# and exits 75; submit this script again to resume.",
             "set -euo pipefail"]
    lines += list(spec.setup_lines)
    if spec.site:
        lines += [f"export {key}={shlex.quote(value)}"
                  for key, value in sorted(spec.site.env.items())]
    if spec.launcher == "srun" and spec.plan_first:
        lines += ["", *PLAN_FIRST_LINES.format(step=shlex.join(launch_argv(spec))).split("\n")]
    else:
        lines += ["", shlex.join(launch_argv(spec)), ""]
    return "\n".join(lines)


# The step's srun line is written once (a bash array); plan-step plans it, and only it.
PLAN_FIRST_LINES = """\
# hpcai-launch plans the ranks' step once, here on the batch host; every rank of this
# step (and only of this step) starts from that plan (HPCAI_PLAN). A planning error ends
# the job here, before srun.
step=({step})
plan=$(hpcai-launch plan-step -- "${{step[@]}}")
HPCAI_PLAN=$plan "${{step[@]}}"
"""


def submit(script: Path, sbatch: str | None = None) -> str:
    """``sbatch --parsable SCRIPT``; returns the job id."""
    binary = sbatch or shutil.which("sbatch")
    if not binary:
        raise UserError("--submit, but sbatch is not on PATH",
                        "load the Slurm module, or leave out --submit and copy the script")
    result = subprocess.run([binary, "--parsable", str(script)], capture_output=True,
                            text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise UserError(f"sbatch failed (exit {result.returncode}): {result.stderr.strip()}",
                        "check the partition, account and limits in the script")
    return result.stdout.strip().split(";")[0]


def add_job_options(p: argparse.ArgumentParser) -> None:
    """The job's options: Slurm's own, then the launch options it shares with hpcai-launch
    (declared by :data:`..planning.options.ARGUMENTS`; :func:`check_job_args` fills in
    their defaults)."""
    p.add_argument("--nodes", type=int, default=1)
    add_arguments(p, "ranks_per_node", "threads_per_rank")
    p.add_argument("--time", default="01:00:00")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--job-name", default="hpcai")
    p.add_argument("--signal", default=DEFAULT_SIGNAL)
    add_arguments(p, "mpi", "container", "runtime", "site", "binds", "oversubscribe",
                  "gpu_driver")
    p.add_argument("--setup", action="append", default=[],
                   help="shell line to run before srun (e.g. 'source env.sh'); repeatable")


def time_limit(text: str) -> int | None:
    """Seconds of a Slurm ``--time`` (None: no limit, for 0, INFINITE, UNLIMITED)."""
    if text.upper() in ("INFINITE", "UNLIMITED"):
        return None
    match = _TIME.fullmatch(text.strip())
    if not match:
        raise UserError(f"--time {text!r} is not a Slurm time limit",
                        "give minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]], e.g. --time 02:00:00")
    days, first, second, third = match.groups()
    if days is not None:
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        hours += 24 * int(days)
    elif third is not None:
        hours, minutes, seconds = int(first), int(second), int(third)
    else:
        hours, minutes, seconds = 0, int(first), int(second or 0)
    total = 3600 * hours + 60 * minutes + seconds
    return total or None


def check_job_args(ns: argparse.Namespace, command: list[str]) -> None:
    """What :func:`add_job_options` parsed, checked before anything is written or submitted:
    container options without a container, a malformed ``--time`` or ``--signal``, a signal
    the training engine would not stop on, a ``train`` command with a usage error. Fills in
    ``ns.runtime`` and ``ns.mpi``."""
    if ns.container is None:
        hint = "give --container IMG, or leave the option out"
        if ns.bind:
            raise UserError(f"--bind {ns.bind[0]} without --container: there is no container "
                            "to bind it into", hint)
        if ns.runtime is not None:
            raise UserError(f"--runtime {ns.runtime} without --container: there is no image "
                            "to run", hint)
    if ns.runtime == NO_RUNTIME:
        raise UserError(f"--runtime {NO_RUNTIME} with --container {ns.container}: the job's "
                        "ranks would ignore the image", "leave out --runtime, or --container "
                        "for a job without a container")
    ns.runtime = ns.runtime or DEFAULT_RUNTIME
    ns.mpi = ns.mpi or Options.mpi
    time_limit(ns.time)
    match = _SIGNAL.fullmatch(ns.signal)
    if not match:
        raise UserError(f"--signal {ns.signal!r} is not Slurm's [R:]SIG[@SECONDS]",
                        f"e.g. --signal {DEFAULT_SIGNAL}")
    if check_command(command) is not None:
        where, name, _ = match.groups()
        if where and "B" in where or name not in TRAIN_SIGNALS:
            raise UserError(f"--signal {ns.signal}: the training ranks checkpoint and stop on "
                            "USR1 or TERM sent to them, which this is not",
                            f"use --signal {DEFAULT_SIGNAL} (without B:, which signals only "
                            "the batch shell)")


def check_job_inputs(ns: argparse.Namespace, command: list[str]) -> None:
    """A ``train`` command's data, output directory and ``--resume`` checkpoint, as
    :func:`job_command` runs it (:func:`hpcai.training.preflight.preflight`): after the
    options, before anything is written or submitted. In a container the paths are the
    image's, which the ranks check."""
    if ns.container is None:
        preflight(job_command(command))


def detect_mpi(requested: str, site: SiteProfile | None) -> str:
    """``--mpi auto`` at render time: the MPI whose launcher is on PATH here (its srun PMI
    plugin goes into the script), unless the site profile names the PMI itself."""
    if requested != "auto" or (site and site.pmi):
        return requested
    import os

    try:
        return flavours.resolve("auto", None, dict(os.environ)).flavour.name
    except UserError:
        return "auto"   # no MPI here: srun uses the site's default --mpi plugin


def spec_from_args(ns: argparse.Namespace, command: list[str], **overrides) -> JobSpec:
    site = SiteProfile.load(ns.site) if ns.site else None
    launcher = site.mpi_launcher if site and site.mpi_launcher else "srun"
    values = dict(command=tuple(command), nodes=ns.nodes, ranks_per_node=ns.ranks_per_node,
                  threads_per_rank=ns.threads_per_rank, time=ns.time, partition=ns.partition,
                  account=ns.account, job_name=ns.job_name, signal=ns.signal,
                  mpi=detect_mpi(ns.mpi, site),
                  container=ns.container, runtime=ns.runtime, site=site, site_path=ns.site,
                  binds=tuple(ns.bind), launcher=launcher, setup_lines=tuple(ns.setup),
                  oversubscribe=ns.oversubscribe,
                  gpu_driver=getattr(ns, "gpu_driver", None) or "auto")
    values.update(overrides)
    return JobSpec(**values)


def main(argv: list[str]) -> int:
    head, rest = split_command(argv)
    command = rest or []
    p = Parser(prog="hpcai-launch sbatch", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_options(p)
    p.add_argument("--output", default="hpcai-%j.out")
    p.add_argument("--script", help="write the script here")
    p.add_argument("--submit", action="store_true", help="submit it and print the job id")
    p.add_argument("--dry-run", action="store_true", help="only print the script (default)")
    ns = p.parse_args(head)
    if ns.dry_run and (ns.script or ns.submit):
        raise UserError(f"--dry-run only prints the script; it does not go with "
                        f"{'--script' if ns.script else '--submit'}",
                        "leave out --dry-run to write or submit, or the other option to print")
    check_job_args(ns, command)
    if ns.ranks_per_node is None:
        ns.ranks_per_node = 1
    spec = spec_from_args(ns, command, output=ns.output)
    text = render(spec)
    if ns.submit and not shutil.which("sbatch"):
        raise UserError("--submit, but sbatch is not on PATH",
                        "load the Slurm module, or leave out --submit and copy the script")
    check_job_inputs(ns, command)
    if ns.script or ns.submit:
        path = Path(ns.script or f"{spec.job_name}.sbatch")
        path.write_text(text)
        path.chmod(0o755)
    if ns.submit:
        print(submit(path))
        return 0
    if not ns.script:
        sys.stdout.write(text)
    return 0
