"""Scaling sweeps: one job per (nodes, ranks/node, threads) point, collected into one result set.

    hpcai-launch sweep --nodes 1,2,4 --ranks-per-node 1,2,4 [--threads-per-rank auto]
                       [--repeat K] [--scaling weak|strong] [--results DIR]
                       [--launcher slurm|mpirun --hosts h1,h2,…] [--no-wait] -- train 3dgan …

Weak scaling (default): the per-rank batch stays as given, so the global batch grows with
the ranks and, the epoch being fixed, time per epoch should fall linearly with nodes (the
LRZ setup; the learning rate scales with the world size as the training engine does).
Strong scaling (``--scaling strong``): the global batch stays at the given batch x the
smallest point's ranks, the per-rank batch shrinks.

Each point gets ``RESULTS/N{n}-R{r}-T{t}-rep{k}/`` with ``point.json`` (its parameters,
job id, status) and the training's ``epochs.jsonl`` (``--out`` is set per point). Under
Slurm every point is a batch job rendered by ``hpcai-launch sbatch`` (named
``JOBNAME-<point>``); ``--no-wait`` returns after submitting, ``hpcai-launch sweep --collect
--results RESULTS`` later refreshes each point's status and reports (``hpcai-launch report
RESULTS`` only reads).
Without a scheduler (``--launcher mpirun --hosts …``) points run one after another, each
within ``--time`` (as a job would be): past it the point's process group gets SIGTERM (the
training checkpoints and exits), 30 s later SIGKILL, and the point's status is ``timeout``.
Options only Slurm can use (``--partition``, ``--account``, ``--job-name``, ``--signal``,
``--setup``, ``--no-wait``, ``--wait-timeout``) are refused there, and ``--hosts`` under
Slurm; ``--scaling strong`` needs ``--batch-size`` in the command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ...core.cli import Parser, split_command
from ...core.errors import UserError
from .points import Point, PointRecord
from .sbatch import DEFAULT_SIGNAL, check_job_args, time_limit
from ..planning.options import Options
from ..node.placement import check_fits


def parse_counts(text: str, what: str) -> list[int]:
    values = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = int(item)
        except ValueError:
            raise UserError(f"{what} must be a list of whole numbers, got {text!r}",
                            f"e.g. {what} 1,2,4") from None
        if value < 1:
            raise UserError(f"{what} must be positive, got {value} in {text!r}",
                            f"e.g. {what} 1,2,4")
        values.append(value)
    return sorted(set(values))


KILL_GRACE_S = 30.0   # SIGTERM -> SIGKILL for a point past its --time
# Sweep option -> its default: what only a Slurm sweep can use
SLURM_ONLY = {"partition": None, "account": None, "job_name": "hpcai",
              "signal": DEFAULT_SIGNAL, "setup": [], "no_wait": False,
              "wait_timeout": 24 * 3600.0}


def _option_value(command: list[str], flag: str) -> tuple[int, str] | None:
    """(index, value) of ``flag V`` or ``flag=V`` in the command, the last one given."""
    found = None
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            found = (i, command[i + 1])
        elif arg.startswith(flag + "="):
            found = (i, arg[len(flag) + 1:])
    return found


def _count_of(command: list[str], flag: str) -> int | None:
    found = _option_value(command, flag)
    if found is None:
        return None
    if not found[1].isdigit() or int(found[1]) < 1:
        raise UserError(f"{flag} {found[1]!r} in the command is not a whole number of at "
                        "least 1", f"e.g. {flag} 16")
    return int(found[1])


def _batch_of(command: list[str]) -> int | None:
    return _count_of(command, "--batch-size")


def plan_points(nodes: list[int], ranks: list[int], threads: str, cores: int, repeat: int,
                scaling: str, command: list[str], oversubscribe: bool = False) -> list[Point]:
    """Every point of the sweep (pure). ``threads`` is "auto" or a number."""
    points = []
    base_batch = _batch_of(command)
    smallest = min(nodes) * min(ranks)
    for r in ranks:
        t = max(cores // r, 1) if threads == "auto" else int(threads)
        if t < 1:
            raise UserError(f"--threads-per-rank must be at least 1, got {t}",
                            "or use --threads-per-rank auto")
        check_fits(r, t, cores, f"nodes have {cores}", oversubscribe=oversubscribe)
        for n in nodes:
            batch = None
            if scaling == "strong" and base_batch:
                batch = max(base_batch * smallest // (n * r), 1)
            for k in range(repeat):
                points.append(Point(n, r, t, k, scaling, batch))
    return points


def point_command(command: list[str], point: Point, out: Path) -> list[str]:
    """The command with the point's ``--out`` (and per-rank batch, strong scaling)."""
    cmd = list(command)
    for flag, value in (("--batch-size", point.batch_size), ("--out", out)):
        found = _option_value(cmd, flag)
        if value is None:
            continue
        if found is None:
            cmd += [flag, str(value)]
        elif cmd[found[0]] == flag:
            cmd[found[0] + 1] = str(value)
        else:
            cmd[found[0]] = f"{flag}={value}"
    return cmd


def write_point(directory: Path, record: PointRecord) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / ".point.json.tmp"
    tmp.write_text(record.to_json())
    tmp.replace(directory / "point.json")


def _status(directory: Path, expected_epochs: int | None) -> str:
    epochs = directory / "epochs.jsonl"
    if not epochs.exists():
        return "failed"
    lines = [line for line in epochs.read_text().splitlines() if line.strip()]
    if expected_epochs and len(lines) < expected_epochs:
        return "incomplete"
    return "done"


def _epochs_of(command: list[str]) -> int | None:
    return _count_of(command, "--epochs")


def _run_slurm(points, command, results: Path, ns) -> dict[str, str]:
    from . import sbatch as sb

    if not shutil.which("sbatch"):
        raise UserError("the sweep uses Slurm, but sbatch is not on PATH",
                        "load Slurm, or run without a scheduler: --launcher mpirun --hosts …")
    jobs: dict[str, str] = {}
    for point in points:
        directory = results / point.name
        spec = sb.spec_from_args(ns, point_command(command, point, directory.resolve()),
                                 nodes=point.nodes, ranks_per_node=point.ranks_per_node,
                                 threads_per_rank=point.threads_per_rank,
                                 job_name=f"{ns.job_name}-{point.name}",
                                 output=str((directory / "slurm-%j.out").resolve()))
        directory.mkdir(parents=True, exist_ok=True)
        script = directory / "job.sbatch"
        script.write_text(sb.render(spec))
        job = sb.submit(script)
        jobs[point.name] = job
        write_point(directory, PointRecord(point, "submitted", job_id=job))
        print(f"submitted {point.name}: job {job}", flush=True)
    return jobs


def _wait_slurm(jobs: dict[str, str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(jobs.values())
    while pending and time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(sorted(pending))],
                             capture_output=True, text=True, timeout=60, check=False)
        pending = {line.strip() for line in out.stdout.splitlines() if line.strip()}
        if pending:
            time.sleep(1.0)
    if pending:
        raise UserError(f"jobs {sorted(pending)} still queued or running after {timeout:.0f} s",
                        "collect later with: hpcai-launch sweep --collect --results RESULTS")


def point_options(ns: argparse.Namespace, point: Point, hosts: list[str],
                  command: list[str], directory: Path) -> Options:
    """What ``hpcai-launch`` gets for one point without a scheduler: the sweep's own
    launch options (MPI, container, site, binds, oversubscription) and the point's shape."""
    if point.nodes > 1 and not hosts:
        raise UserError(f"point {point.name} needs {point.nodes} nodes",
                        "give --hosts h1,h2,… for multi-node points without Slurm")
    return Options(command=tuple(point_command(command, point, directory.resolve())),
                   ranks_per_node=point.ranks_per_node,
                   threads_per_rank=point.threads_per_rank, oversubscribe=ns.oversubscribe,
                   launcher="mpirun", mpi=ns.mpi, topology=ns.topology,
                   hosts=",".join(hosts[:point.nodes]) if hosts else None,
                   container=ns.container, runtime=ns.runtime, site=ns.site,
                   binds=tuple(ns.bind))


def _run_mpirun(points, command, results: Path, ns) -> None:
    hosts = [h for h in (ns.hosts or "").split(",") if h]
    for point in points:
        if hosts and point.nodes > len(hosts):
            raise UserError(f"point {point.name} needs {point.nodes} hosts, --hosts has "
                            f"{len(hosts)}", "give more hosts or fewer nodes")
    argvs = [[sys.executable, "-m", "hpcai.launcher",
              *point_options(ns, point, hosts, command, results / point.name).to_argv()]
             for point in points]
    limit = time_limit(ns.time)
    for point, argv in zip(points, argvs):
        directory = results / point.name
        write_point(directory, PointRecord(point, "running"))
        code, timed_out = run_within(argv, directory / "run.log", limit)
        if timed_out:
            status = "timeout"
        else:
            status = _status(directory, _epochs_of(command)) if code == 0 else "failed"
        write_point(directory, PointRecord(point, status, exit_code=code))
        print(f"{point.name}: {status}" + (f" (past --time {ns.time})" if timed_out else ""),
              flush=True)


def run_within(argv: list[str], log_path: Path, limit: float | None,
               grace: float = KILL_GRACE_S, env: Mapping[str, str] | None = None,
               ) -> tuple[int, bool]:
    """Run one point in its own process group, output to ``log_path``; past ``limit``
    seconds the group gets SIGTERM, after ``grace`` more SIGKILL. Returns (exit code,
    timed out). An interrupt of the sweep stops the point's group too.

    The point gets ``env``, by default a copy of ``os.environ``, and never the C library's
    environment as it stands: a library may have set variables there that ``os.environ``
    does not show (Open MPI's singleton ``MPI_Init`` does; an ``mpirun`` that inherits them
    exits 1 without a word)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ if env is None else env),
                                start_new_session=True)
        try:
            return proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            _stop_group(proc, grace)
            return proc.returncode, True
        except BaseException:
            _stop_group(proc, grace)
            raise


def _stop_group(proc: subprocess.Popen, grace: float) -> None:
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # the launcher is gone; make sure nothing it started in its group is left
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def collect_status(results: Path, command_epochs: int | None = None) -> None:
    """Refresh every point.json's status from what its run left behind."""
    for point_file in sorted(results.glob("*/point.json")):
        try:
            record = PointRecord.load(point_file)
        except (OSError, ValueError):
            continue      # the report names the file and why
        if record.status in ("submitted", "running"):
            write_point(point_file.parent,
                        replace(record, status=_status(point_file.parent, command_epochs)))


def _cores(ns) -> int:
    if ns.cores_per_node:
        return ns.cores_per_node
    if ns.site:
        from ..job.site import SiteProfile
        site = SiteProfile.load(ns.site)
        if site.cores_per_node:
            return site.cores_per_node
    from ..node.topology import load
    return len(load(ns.topology).cores)


def check_sweep_args(ns: argparse.Namespace, command: list[str]) -> None:
    """Options this launcher would ignore, and what :func:`.sbatch.check_job_args` checks
    (the ``train`` command included), before any point is written or started (its inputs:
    :func:`.sbatch.check_job_inputs`, once the points are planned)."""
    if ns.launcher == "mpirun":
        given = [name for name, default in SLURM_ONLY.items() if getattr(ns, name) != default]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UserError(f"{flag} is for Slurm; the --launcher mpirun sweep would ignore it",
                            f"leave out {flag}, or sweep under Slurm (--launcher slurm)")
    elif ns.hosts:
        raise UserError("--hosts is for --launcher mpirun; Slurm picks the nodes of each job",
                        "leave out --hosts, or add --launcher mpirun")
    check_job_args(ns, command)
    if ns.wait_timeout <= 0:
        raise UserError(f"--wait-timeout must be positive, got {ns.wait_timeout:g}",
                        "e.g. --wait-timeout 3600, or --no-wait")
    if ns.scaling == "strong" and _batch_of(command) is None:
        raise UserError("--scaling strong needs --batch-size B in the command: the global "
                        "batch it keeps is B x the smallest point's ranks",
                        "add e.g. --batch-size 16 after the command, or use --scaling weak")
    _epochs_of(command)


def main(argv: list[str]) -> int:
    from . import sbatch as sb

    head, rest = split_command(argv)
    command = rest or []
    p = Parser(prog="hpcai-launch sweep", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sb.add_job_options(p)
    p.set_defaults(nodes=None, ranks_per_node=None)
    p.add_argument("--results", default="sweep-results")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--scaling", choices=("weak", "strong"), default="weak")
    p.add_argument("--launcher", choices=("slurm", "mpirun"), default="slurm")
    p.add_argument("--hosts")
    p.add_argument("--cores-per-node", type=int)
    p.add_argument("--topology")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--wait-timeout", type=float, default=24 * 3600)
    p.add_argument("--collect", action="store_true", help="only collect RESULTS and report")
    # sb.add_job_options defines --nodes/--ranks-per-node as ints; the sweep takes lists
    for action in p._actions:
        if action.dest in ("nodes", "ranks_per_node", "threads_per_rank"):
            action.type = str
    ns = p.parse_args(head)
    results = Path(ns.results)
    if not ns.collect:
        if not command:
            raise UserError("no command to sweep", "put it after '--', e.g. -- train 3dgan")
        check_sweep_args(ns, command)
        nodes = parse_counts(ns.nodes or "1", "--nodes")
        ranks = parse_counts(ns.ranks_per_node or "1", "--ranks-per-node")
        threads = ns.threads_per_rank or "auto"
        if threads != "auto" and not threads.lstrip("-").isdigit():
            raise UserError(f"--threads-per-rank must be a number or auto, got {threads!r}",
                            "e.g. --threads-per-rank auto")
        if ns.repeat < 1:
            raise UserError("--repeat must be at least 1", "e.g. --repeat 3")
        points = plan_points(nodes, ranks, threads, _cores(ns), ns.repeat, ns.scaling, command,
                             ns.oversubscribe)
        sb.check_job_inputs(ns, [*command, "--out", str(results)])   # the points' --out
        results.mkdir(parents=True, exist_ok=True)
        if ns.launcher == "slurm":
            ns.threads_per_rank = None   # per point below
            jobs = _run_slurm(points, command, results, ns)
            if ns.no_wait:
                print(f"{len(jobs)} jobs submitted; collect with: hpcai-launch sweep --collect "
                      f"--results {results}")
                return 0
            _wait_slurm(jobs, ns.wait_timeout)
        else:
            _run_mpirun(points, command, results, ns)
    collect_status(results, _epochs_of(command) if command else None)
    from .report import run as report
    return report([str(results)])
