"""hpcai-launch validate: prove, rank by rank, that a containerised job runs the planned world
on the host's MPI, bound as planned, at the host's speed.

    hpcai-launch validate --container IMG [launch options] [--trials 5] [--max-trials 15]
                          [--threshold 0.8] [--json FILE] [--expect-libmpi PREFIX]
                          [--nccl-floor GB/s] [--only CHECK[,CHECK]]

The launch options make a plan, as for any launch; ``validate`` runs that job shape with
``python3 -m hpcai.launcher.probe --bench`` in the container and bare on the host, and
checks the container's ranks against the plan. Each launch is planned in validate's own
process, as ``hpcai-launch`` plans it (the files of the host libraries are read once per
validate, not once per launch), and carried out as ``hpcai-launch`` carries out a plan
(its ``mpirun`` or ``srun`` command); both sides are planned before any rank starts. The
checks:

- **world**: one record per planned rank (ranks per node x hosts or nodes), ranks 0..N-1
  once each, every rank sees size N. N processes that each are "rank 0 of 1" (no PMI the
  MPI speaks) fail here: by count, by duplicate rank and as a singleton world;
- **MPI**: the file that defines ``MPI_Init`` in every rank (``dladdr``) lies under
  ``--expect-libmpi``, else the site profile's ``expected_libmpi``, else ``/opt/hpcai/host``
  (the bound host MPI); the image's own libmpi fails, and so does a plan that binds no host MPI,
  and a library version other than the one the same launch runs bare on the host;
- **fabric**: every fabric library (libfabric, libpsm2, UCX, libibverbs, NCCL) the MPI
  loads bare on the host is loaded in the container too, from the host's files (the host
  mount or another bind), not from the image;
- **binding**: every rank runs on its planned CPU set (the plan's, on this host; the
  per-rank plan ``HPCAI_CPUS`` on other hosts);
- **GPU** (:mod:`.gpucheck`): per rank the GPU's UUID, the libcuda that defines ``cuInit``
  (it must be the host driver's ``libcuda.so.<kernel module version>`` from a host path: an
  image's stub fails), the NCCL version, a GPU on another NUMA node than the rank's CPUs
  (fails), and where a node has two or more GPUs an NCCL allreduce's bus bandwidth against
  ``--nccl-floor`` (torch with CUDA only; else "not measured"). Without a GPU the section
  says "no GPU" and fails nothing;
- **speed**: a ping-pong between rank 0 and its partner at 8 B, 64 KiB and 4 MiB, the two
  sides alternated (C B, B C, C B, ...) over ``--trials`` launches each (at least 5). A
  trial's figure is its best sample (a sample times a batch of round trips; other jobs on a
  shared node slow single samples down; a size whose samples are slow, as on an
  oversubscribed node, times fewer of them, see :mod:`.probe`). Per size the report shows
  both sides' medians over the trials, their spread and the ratio: the median over the
  trials of the trial's container speed / bare speed (a trial's two launches run back to
  back, so load that comes and goes mostly cancels). The floor: at 64 KiB and 4 MiB the
  ratio must be at least ``--threshold`` (0.8). When, after ``--trials``, a judged size has
  trials on both sides of the floor, those trials do not settle its median: validate goes on
  to ``--max-trials`` per side (default 3 x ``--trials``) and judges the median of all of
  them (the output and the report say how many ran and why): on a 2-core VM, idle, a launch
  now and then runs its whole ping-pong at a third of the speed, on either side, and 3 such
  container launches in 5 once made a healthy set-up FAIL. 8 B latency is reported, not
  judged: one launch's 8 B latency is 0.47 or 0.65 us here by luck of the launch, on either
  side. Measured with ``bench/validate_repeat.py`` (2-core VM, other jobs running): in 20
  healthy runs the lowest ratio was 0.93 at 64 KiB and 0.89 at 4 MiB (8 B: 0.93); Open MPI
  forced onto TCP (``btl self,tcp``) 0.32-0.38 at 64 KiB, 0.21-0.35 at 4 MiB (8 B:
  0.10-0.12).

Each container launch is checked as soon as it ends (the world every time, the MPI, binding
and fabric on the first trial); the first failure ends the run. A warning the container
launches print (an MPI saying it falls back to a slower path) is shown once as a ``note:``
line with the trials that printed it, and the report keeps every launch's stderr tail.
Exit codes:

    0  OK          every check passed, the floor held
    1  FAIL        a check failed; each line names the rank, host, library, CPUs or ratio
    2  usage error ``error:`` + ``hint:``, nothing run
    3  UNVERIFIED  everything else passed, but the bare side could not be measured, so the
                   floor was not checked (never reported as OK)

``--only CHECK[,CHECK]`` runs only the named checks of world, mpi, fabric, binding, gpu and
speed (world always: the others read its records); an unknown name is a usage error. The
output, the OK line and the report (``checks``, ``not_checked``) name what was left out.
Without speed there are no trials: one container launch, plus one bare launch where mpi or
fabric compare with it, and a bare launch without a full world is UNVERIFIED as above;
``--trials`` and ``--max-trials`` then are usage errors.

A table, the per-size medians with their spread and ratio, and a JSON report (``--json``,
default ``hpcai-validate.json``) with every trial are written either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..core.cli import Parser
from ..core.errors import UserError
from ..core.record import replace
from .container.containers import HOST_MOUNT
from .gpucheck import DEFAULT_NCCL_FLOOR_GBS, GpuExpectation, RankGpu
from .planning.facts import gather_facts
from .node.hosts import parse_hosts
from .planning.options import Options
from .planning.plan import LaunchPlan, build_plan
from .probe import PINGPONG_BUDGET_S, PINGPONG_SIZES, ProbeRecord
from .node.topology import format_cpulist, parse_cpulist

DEFAULT_THRESHOLD = 0.8
JUDGED_MIN_BYTES = 64 << 10     # the floor applies from this message size up
MIN_TRIALS = 5
EXTEND_FACTOR = 3               # --max-trials defaults to this many times --trials
EXIT_OK, EXIT_FAIL, EXIT_UNVERIFIED = 0, 1, 3
LAUNCH_TIMEOUT_S = 300
PROBE = ("-m", "hpcai.launcher.probe", "--bench", "--quiet", "--gpu")
# What --only can select, in the order the module doc lists them; world is always checked.
CHECKS = ("world", "mpi", "fabric", "binding", "gpu", "speed")
_ERROR_LINE = r"^\w*(Error|Exception)\b|^error:|cannot open shared object|no end after"


def _split(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = Parser(prog="hpcai-launch validate", add_help=False, verbose_flag=False)
    parser.add_argument("--json", default="hpcai-validate.json")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help="floor: container speed / bare speed, per message size")
    parser.add_argument("--only", default=None, metavar="CHECK[,CHECK]",
                        help=f"run only these checks, of {', '.join(CHECKS)} (world is "
                             "always checked; without speed one launch per side)")
    parser.add_argument("--trials", type=int, default=None,
                        help=f"launches per side, alternated (at least {MIN_TRIALS})")
    parser.add_argument("--max-trials", type=int, default=None,
                        help="launches per side at most, when a size's trials fall on both "
                             "sides of the floor (default: 3 x --trials)")
    parser.add_argument("--expect-libmpi", default=None,
                        help=f"path prefix every rank's libmpi must have (default: the site "
                             f"profile's expected_libmpi, else {HOST_MOUNT})")
    parser.add_argument("--nccl-floor", type=float, default=DEFAULT_NCCL_FLOOR_GBS,
                        help="GPU nodes: NCCL allreduce bus bandwidth floor, GB/s")
    parser.add_argument("-h", "--help", action="store_true")
    ns, rest = parser.parse_known_args(argv)
    if ns.help:
        print(__doc__)
        raise SystemExit(0)
    ns.checks = _checks(ns.only)
    if "speed" not in ns.checks:
        given = [flag for flag, value in (("--trials", ns.trials),
                                          ("--max-trials", ns.max_trials)) if value is not None]
        if given:
            raise UserError(f"{' and '.join(given)} with --only {ns.only}: trials are the "
                            "speed check's, which --only leaves out",
                            f"add speed to --only, or drop {' and '.join(given)}")
    if ns.trials is None:
        ns.trials = MIN_TRIALS
    if ns.trials < MIN_TRIALS:
        raise UserError(f"--trials {ns.trials}: the comparison needs at least {MIN_TRIALS} "
                        "trials per side", f"give --trials {MIN_TRIALS} or more")
    if ns.max_trials is None:
        ns.max_trials = EXTEND_FACTOR * ns.trials
    elif ns.max_trials < ns.trials:
        raise UserError(f"--max-trials {ns.max_trials} is below --trials {ns.trials}",
                        f"give --max-trials {ns.trials} or more (equal: never extend)")
    if not 0 < ns.threshold <= 1:
        raise UserError(f"--threshold {ns.threshold} is not a ratio in (0, 1]",
                        "e.g. --threshold 0.8: the container reaches 80 % of the bare speed")
    return ns, rest


def _checks(only: str | None) -> tuple[str, ...]:
    """The checks ``--only`` selects (None: all), in :data:`CHECKS` order, world always."""
    if only is None:
        return CHECKS
    names = [name.strip() for name in only.split(",")]
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        raise UserError(f"--only {only}: unknown check {', '.join(map(repr, unknown))}",
                        f"name checks of {', '.join(CHECKS)}, comma-separated, e.g. "
                        "--only mpi,fabric")
    return tuple(c for c in CHECKS if c in names or c == "world")


# --- what the plan says -------------------------------------------------------------------

@dataclass(frozen=True)
class Expectation:
    """What the validated job must look like, from the plan of the same launch options."""

    world: int | None                       # None: the number of nodes is not known
    host: str                               # where ``cpus`` apply
    cpus: dict[int, tuple[int, ...]]        # local rank -> planned CPU set
    libmpi_prefix: str
    unbound: str | None                     # why the plan binds no host MPI (None: it does)
    host_roots: tuple[str, ...]             # container paths that hold host files
    topology: str
    gpu: GpuExpectation = GpuExpectation(False, None)


def expect(options: Options, ns: argparse.Namespace) -> Expectation:
    """Plan the probe launch exactly as ``hpcai-launch`` will (nothing copied or started)."""
    probe_options = replace(options, command=("python3", *PROBE))
    facts = gather_facts(probe_options, stage=False)
    plan = build_plan(probe_options, facts)
    if plan.mode == "rank":
        raise UserError("validate runs inside a rank: it must start the ranks itself",
                        "run hpcai-launch validate outside mpirun/srun (inside an allocation "
                        "it starts srun)")
    world = planned_world(plan, options, facts.env)
    if world is not None and world < 2:
        raise UserError(f"the plan has {world} rank: validate needs two to measure the MPI",
                        "give -N 2 (or more ranks per node, or more nodes)")
    container = plan.container
    assert container is not None
    site = container.site
    prefix = ns.expect_libmpi or (site.expected_libmpi if site else None) or HOST_MOUNT
    from .container.containerplan import spec
    binds = spec(container, options.binds, facts.cwd, facts.env).binds
    roots = tuple(dict.fromkeys([HOST_MOUNT, prefix, *(b.target for b in binds)]))
    return Expectation(world=world, host=facts.hostname,
                       cpus={r.local_rank: parse_cpulist(r.cpus) for r in plan.ranks},
                       libmpi_prefix=prefix, unbound=None if any(
                           lib.role == "mpi" for lib in container.libs) else (
                           "--no-bind-host-mpi" if options.bind_host_mpi is False
                           else "no host MPI was found"),
                       host_roots=roots, topology=plan.topology,
                       gpu=gpu_expectation(container, ns))


def gpu_expectation(container, ns: argparse.Namespace) -> GpuExpectation:
    """Whether the plan binds the host's NVIDIA driver, and its kernel module's version
    (this host's, where none is bound)."""
    from .container import nvdriver
    driver = container.driver
    module = driver.module_version if driver else nvdriver.module_version(Path("/"))
    return GpuExpectation(driver is not None, module,
                          getattr(ns, "nccl_floor", DEFAULT_NCCL_FLOOR_GBS))


def planned_world(plan: LaunchPlan, options: Options, env: dict[str, str]) -> int | None:
    """Ranks per node x the hosts mpirun gets, or x the nodes srun gets (None: unknown)."""
    per_node = plan.placement.ranks_per_node
    if plan.mode == "mpirun":
        return per_node * (len(parse_hosts(options.hosts)) if options.hosts else 1)
    nodes = options.nodes or next((int(v) for v in (env.get("SLURM_JOB_NUM_NODES"),
                                                    env.get("SLURM_NNODES"))
                                   if v and v.isdigit()), None)
    return per_node * nodes if nodes else None


# --- one launch ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Launch:
    """One run of the probe on one side: its records and how it ended."""

    side: str                               # "container" or "bare"
    code: int
    stderr: str
    records: tuple[ProbeRecord, ...]

    @property
    def rank0(self) -> ProbeRecord | None:
        return next((r for r in self.records if r.rank == 0 and r.pingpong), None)

    def failure(self) -> str:
        """How it ended: the error lines of its stderr (exceptions, ``error:``, the dynamic
        loader), else the last lines (mpirun's own banner comes last and says little)."""
        lines = [line.strip() for line in self.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if re.search(_ERROR_LINE, line)]
        said = " | ".join(dict.fromkeys(errors[-3:] or lines[-4:])) or "no output"
        return f"the {self.side} probe exited {self.code}: {said}"


def bare(options: Options) -> Options:
    """The same launch on the host, without the container and what only it uses."""
    return replace(options, container=None, runtime="none", site=None, binds=(),
                   host_libs=None, bind_host_mpi=None, gpu_driver="auto")


def probe_args(checks: tuple[str, ...] = CHECKS) -> tuple[str, ...]:
    """The probe's arguments: the ping-pong for speed, the GPU probe for gpu."""
    return tuple(a for a in PROBE if {"--bench": "speed", "--gpu": "gpu"}.get(a, "world")
                 in checks)


def plan_side(options: Options, side: str, out: Path,
              checks: tuple[str, ...] = CHECKS) -> LaunchPlan:
    """One launch of one side, planned as ``hpcai-launch`` plans it (host libraries
    staged), its probe writing into ``out``."""
    python = "python3" if side == "container" else sys.executable
    command = (python, *probe_args(checks), "--out", os.path.relpath(out))
    run_options = replace(options if side == "container" else bare(options), command=command)
    return build_plan(run_options, gather_facts(run_options, stage=True))


def launch(plan: LaunchPlan, side: str, out: Path) -> Launch:
    """Carry out one launch's plan as ``hpcai-launch`` does (its compatibility links, its
    environment), then read the records its probe wrote into ``out``."""
    from .run.child import with_environ
    from .run.execute import make_compat_links
    make_compat_links(plan.compat_links)
    code, stderr = _run(list(plan.argv), with_environ(plan.env_dict()))
    records = tuple(ProbeRecord.load(p) for p in sorted(out.glob("rank-*.json")))
    return Launch(side, code, stderr, records)


class Planned:
    """:func:`run_trials`' default ``run``: every side's first launch is planned before
    any rank starts, each later one when its turn comes (:func:`plan_side`, in this
    process: the ELF facts of the host libraries stay cached), then carried out
    (:func:`launch`)."""

    def __init__(self, options: Options, sides: set[str], work: Path,
                 checks: tuple[str, ...]) -> None:
        self.checks = checks
        self.first = {work / f"{side}-0": plan_side(options, side, work / f"{side}-0", checks)
                      for side in sorted(sides)}

    def __call__(self, options: Options, side: str, out: Path) -> Launch:
        plan = self.first.pop(out, None) or plan_side(options, side, out, self.checks)
        return launch(plan, side, out)


def _run(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit code, stderr; 127 where ``argv[0]`` cannot start). After
    :data:`LAUNCH_TIMEOUT_S`, or when validate itself is interrupted, the launch's whole
    process group is stopped (SIGTERM to mpirun or srun and the processes beside it, then
    SIGKILL), so no rank is left spinning."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)
    except OSError as exc:
        return 127, f"error: cannot start {argv[0]}: {exc.strerror}"
    with proc:
        try:
            _, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
            return proc.returncode, err
        except subprocess.TimeoutExpired:
            _, err = _stop(proc)
            return -1, f"{err}\nno end after {LAUNCH_TIMEOUT_S} s: stopped"
        except BaseException:
            _stop(proc)
            raise


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            continue
    return proc.communicate()


# --- checks --------------------------------------------------------------------------------

def check_world(run: Launch, want: Expectation) -> list[str]:
    """One world of the planned size: count, duplicates, sizes, singletons."""
    records = run.records
    if not records:
        return [f"no rank reported; {run.failure()}"]
    problems: list[str] = []
    if want.world is not None and len(records) != want.world:
        problems.append(f"{len(records)} probe record(s) for a planned world of {want.world}")
    seen: dict[int, list[ProbeRecord]] = {}
    for r in records:
        seen.setdefault(r.rank, []).append(r)
    for rank, same in sorted(seen.items()):
        if len(same) > 1:
            who = ", ".join(f"PID {r.pid} on {r.host}" for r in same)
            problems.append(f"rank {rank} reported by {len(same)} processes ({who})")
    sizes = {r.size for r in records}
    planned = want.world or len(records)
    if sizes == {1} and planned > 1:
        who = (f"{len(records)} processes each are" if len(records) > 1
               else "the one process that reported is")
        problems.append(f"singleton world: {who} rank 0 of 1 (the ranks' MPI found no PMI it "
                        "speaks: check the launcher, its PMI and the MPI the ranks load)")
        if len(records) < planned:
            problems.append(f"{planned - len(records)} of {planned} planned process(es) did "
                            f"not report; {run.failure()}")
    else:
        size = want.world or max(sizes)
        for r in sorted(records, key=lambda r: r.rank):
            if r.size != size:
                problems.append(f"rank {r.rank} on {r.host} sees a world of {r.size}, "
                                f"the plan has {size}")
        missing = sorted(set(range(size)) - set(seen))
        if missing:
            problems.append(f"rank(s) {format_cpulist(missing)} of {size} did not report; "
                            f"{run.failure()}")
    problems += [f"rank {r.rank} on {r.host}: the allreduce over the world gave a wrong sum"
                 for r in records if not r.allreduce_ok and r.size > 1]
    return problems


def _from_host(path: str, want: Expectation) -> bool:
    return any(path.startswith(root.rstrip("/") + "/") for root in want.host_roots)


def check_mpi(run: Launch, want: Expectation) -> list[str]:
    """Every rank's MPI_Init comes from the expected prefix."""
    problems = []
    why = f" (the plan binds no host MPI: {want.unbound})" if want.unbound else ""
    for r in sorted(run.records, key=lambda r: r.rank):
        path = r.libmpi[0] if r.libmpi else None
        if path and path.startswith(want.libmpi_prefix):
            continue
        what = ("no library defining MPI_Init" if path is None else
                f"{'the image' if not _from_host(path, want) else 'the host'}'s {path}")
        problems.append(f"rank {r.rank} on {r.host} runs MPI from {what}, not from "
                        f"{want.libmpi_prefix}{why}")
    return problems


def check_same_mpi(run: Launch, reference: Launch | None) -> list[str]:
    """The container's ranks run the MPI that the same launch runs bare on the host."""
    if reference is None:
        return []
    inside = {r.mpi_library_version for r in run.records}
    outside = {r.mpi_library_version for r in reference.records}
    if inside == outside:
        return []
    return [f"the container's ranks run {' / '.join(sorted(inside))}, the same launch bare "
            f"on the host runs {' / '.join(sorted(outside))}"]


def check_fabric(run: Launch, reference: Launch | None, want: Expectation) -> list[str]:
    """Fabric libraries: the ones the MPI loads bare must be loaded, from host files."""
    bare_fabric: dict[str, str] = {}
    for r in reference.records if reference else ():
        bare_fabric.update(r.fabric)
    problems = []
    for r in sorted(run.records, key=lambda r: r.rank):
        for kind in sorted(set(bare_fabric) | set(r.fabric)):
            path = r.fabric.get(kind)
            on_host = f" (bare on the host this MPI loads {bare_fabric[kind]})" \
                if kind in bare_fabric else ""
            if path is None:
                problems.append(f"rank {r.rank} on {r.host} loads no {kind}{on_host}: a "
                                "fabric library is missing from the binding")
            elif not _from_host(path, want):
                problems.append(f"rank {r.rank} on {r.host} loads {kind} from the image "
                                f"({path}), not from the host's libraries{on_host}: the "
                                "host's fabric library is missing from the binding")
    return problems


def check_cpus(run: Launch, want: Expectation) -> list[str]:
    """Every rank on its planned CPUs (this host: the plan; other hosts: HPCAI_CPUS)."""
    problems = []
    for r in sorted(run.records, key=lambda r: r.rank):
        local = r.env.get("LOCAL_RANK")
        if r.host == want.host and local is not None and local.isdigit():
            planned = want.cpus.get(int(local))
            source = f"the plan ({want.topology})"
        else:
            text = r.env.get("HPCAI_CPUS")
            planned = parse_cpulist(text) if text else None
            source = "the per-rank plan (HPCAI_CPUS)"
        if planned is None:
            problems.append(f"rank {r.rank} on {r.host} (local rank {local}) has no planned "
                            f"CPUs: it was not started by the hpcai-launch wrapper")
        elif set(r.affinity) != set(planned):
            problems.append(f"rank {r.rank} on {r.host} (local rank {local}) runs on CPUs "
                            f"{r.affinity_list}, {source} has {format_cpulist(planned)}")
    return problems


# --- speed ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class SizeResult:
    """One message size over all trials: each trial's best half round trip (µs), the two
    sides' lists aligned by trial (trial i's two launches ran back to back), and how many
    samples each trial timed (fewer than the probe's most where a sample was slow)."""

    nbytes: int
    container_us: tuple[float, ...]
    bare_us: tuple[float, ...]
    container_samples: tuple[int, ...] = ()
    bare_samples: tuple[int, ...] = ()

    @property
    def container_median_us(self) -> float:
        return statistics.median(self.container_us)

    @property
    def bare_median_us(self) -> float:
        return statistics.median(self.bare_us)

    @property
    def ratio(self) -> float:
        """Container speed / bare speed (above 1: the container is faster): the median over
        the trials of each trial's ratio. A trial's two launches run back to back, so load
        from other jobs, which here comes and goes over tens of seconds, mostly cancels."""
        return statistics.median(self.trial_ratios())

    @property
    def ratio_of_medians(self) -> float:
        return self.bare_median_us / self.container_median_us

    def trial_ratios(self) -> tuple[float, ...]:
        return tuple(b / c for b, c in zip(self.bare_us, self.container_us))

    def below(self, threshold: float) -> int:
        """How many trials' ratios are below the floor."""
        return sum(r < threshold for r in self.trial_ratios())

    def mixed(self, threshold: float) -> bool:
        """A judged size with trials on both sides of the floor: not settled yet."""
        return self.judged and 0 < self.below(threshold) < len(self.container_us)

    @property
    def judged(self) -> bool:
        """Bandwidth sizes carry the floor; 8 B latency is only reported (module doc)."""
        return self.nbytes >= JUDGED_MIN_BYTES

    def figure(self, us: float) -> str:
        """A half round trip as latency (small messages) or bandwidth."""
        if self.nbytes < 1024:
            return f"{us:.2f} us"
        rate = self.nbytes / us / 1e3
        return f"{rate:.2f} GB/s" if rate >= 0.1 else f"{rate * 1e3:.2f} MB/s"

    def describe(self, threshold: float | None = None) -> str:
        figure = self.figure

        def side(values: tuple[float, ...]) -> str:
            median = statistics.median(values)
            spread = (max(values) - min(values)) / median
            fast, slow = min(values), max(values)     # half round trips
            low, high = ((figure(fast), figure(slow)) if self.nbytes < 1024
                         else (figure(slow), figure(fast)))
            return f"{figure(median)} (spread {spread:.0%}: {low}..{high})"

        below = self.below(threshold) if threshold and self.judged else 0
        judged = ("" if self.judged else " (reported, not judged)") + (
            f"; {below} of {len(self.container_us)} trials below the floor" if below else "")
        counts = self.container_samples + self.bare_samples
        most = PINGPONG_SIZES.get(self.nbytes, (0, 0))[1]
        if counts and min(counts) < most:
            span = (f"{min(counts)}" if min(counts) == max(counts)
                    else f"{min(counts)}-{max(counts)}")
            judged += (f"; {span} of {most} samples per trial (slow samples: each size "
                       f"stops after about {PINGPONG_BUDGET_S:g} s)")
        return (f"{_size(self.nbytes):>6}: container {side(self.container_us)}, "
                f"bare {side(self.bare_us)}, ratio {self.ratio:.2f} (of the medians "
                f"{self.ratio_of_medians:.2f}){judged}")

    def to_dict(self) -> dict:
        return {**asdict(self), "container_median_us": self.container_median_us,
                "bare_median_us": self.bare_median_us, "ratio": self.ratio,
                "ratio_of_medians": self.ratio_of_medians, "judged": self.judged}


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def compare(container: list[Launch], bare_runs: list[Launch]) -> list[SizeResult]:
    """Per size, the per-trial figures of both sides, every trial measured on both: a
    trial's best sample, as other jobs on a shared node slow single samples down."""
    inside = [r.rank0.pingpong for r in container if r.rank0 and r.rank0.pingpong]
    outside = [r.rank0.pingpong for r in bare_runs if r.rank0 and r.rank0.pingpong]
    return [SizeResult(p.nbytes, tuple(t[i].best_us for t in inside),
                       tuple(t[i].best_us for t in outside),
                       tuple(t[i].samples for t in inside), tuple(t[i].samples for t in outside))
            for i, p in enumerate(inside[0])]


# --- the run -------------------------------------------------------------------------------

@dataclass
class Outcome:
    problems: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    container: list[Launch] = field(default_factory=list)
    bare: list[Launch] = field(default_factory=list)
    sizes: list[SizeResult] = field(default_factory=list)
    trials_run: int = 0
    extended: list[str] = field(default_factory=list)   # why more than --trials ran
    checks: tuple[str, ...] = CHECKS                      # what was checked (--only)

    @property
    def verdict(self) -> tuple[str, int]:
        if self.problems:
            return "FAIL", EXIT_FAIL
        if self.unverified:
            return "UNVERIFIED", EXIT_UNVERIFIED
        return "OK", EXIT_OK


def run_trials(options: Options, want: Expectation, trials: int, threshold: float,
               work: Path, max_trials: int | None = None,
               run: Callable[[Options, str, Path], Launch] | None = None,
               checks: tuple[str, ...] = CHECKS) -> Outcome:
    """Alternate the two sides. Each container launch is checked as soon as it ends (the
    world every time; MPI and CPUs the first time, fabric once the first bare launch is
    in); the first failure ends the run. After ``trials``, a judged size whose trials lie
    on both sides of the floor gets more trials, up to ``max_trials`` (module doc).
    Without speed in ``checks`` each side runs once, and the bare side only for mpi or
    fabric (what the container is compared with). ``run``: one launch (default: the sides
    planned once, :class:`Planned`)."""
    speed = "speed" in checks
    if not speed:
        trials = max_trials = 1
    max_trials = max(trials, max_trials or trials)
    sides = {"container"} | ({"bare"} if speed or {"mpi", "fabric"} & set(checks) else set())
    run = run or Planned(options, sides, work, checks)
    out = Outcome(checks=tuple(checks))
    trial = 0
    while trial < trials or (trial < max_trials and _unsettled(out, threshold)):
        out.trials_run = trial + 1
        order = ("container", "bare") if trial % 2 == 0 else ("bare", "container")
        for side in (s for s in order if s in sides):
            ran = run(options, side, work / f"{side}-{trial}")
            (out.container if side == "container" else out.bare).append(ran)
            if side == "container":
                out.problems += _check_container(ran, want, trial, checks)
            elif trial == 0 and out.container:
                out.problems += _check_against_bare(out.container[0], ran, want, checks)
            if out.problems:
                return out
        trial += 1
    missed = [i + 1 for i, r in enumerate(out.bare)
              if (speed and r.rank0 is None) or check_world(r, want)]
    if missed:
        first = out.bare[missed[0] - 1]
        detail = "; ".join(check_world(first, want)) or first.failure()
        out.unverified.append(f"the bare host probe did not {'measure' if speed else 'report'}"
                              f" in trial(s) {format_cpulist(missed)} of {out.trials_run}: "
                              f"{detail}")
        return out
    if not speed:
        return out
    out.sizes = compare(out.container, out.bare)
    out.problems += [f"{_size(s.nbytes)} ping-pong: the container reaches {s.ratio:.2f} x "
                     f"the bare bandwidth (median of {len(s.container_us)} trials; medians "
                     f"{s.figure(s.container_median_us)} vs {s.figure(s.bare_median_us)}), "
                     f"below the floor {threshold:.2f}"
                     for s in out.sizes if s.judged and s.ratio < threshold]
    return out


def _unsettled(out: Outcome, threshold: float) -> bool:
    """Are the trials so far split around the floor at some judged size? Records why in
    ``out.extended`` the first time."""
    if any(r.rank0 is None for r in out.bare):
        return False                     # UNVERIFIED either way: no more trials
    split = [s for s in compare(out.container, out.bare) if s.mixed(threshold)]
    if split and not out.extended:
        out.extended = [f"{_size(s.nbytes)}: {s.below(threshold)} of {len(s.container_us)} "
                        f"trials below the floor" for s in split]
    return bool(split)


def check_gpu(run: Launch, want: Expectation) -> tuple[list[str], list[str]]:
    """The GPU section (:mod:`.gpucheck`): report lines and problems."""
    from . import gpucheck
    ranks = [(r.rank, r.host, RankGpu.from_dict(r.gpu) if r.gpu else None)
             for r in run.records]
    return gpucheck.check(ranks, want.gpu, lambda path: _from_host(path, want))


def _check_container(run: Launch, want: Expectation, trial: int,
                     checks: tuple[str, ...] = CHECKS) -> list[str]:
    problems = check_world(run, want)
    if trial == 0 and run.records:
        problems += ((check_mpi(run, want) if "mpi" in checks else [])
                     + (check_cpus(run, want) if "binding" in checks else [])
                     + (check_gpu(run, want)[1] if "gpu" in checks else []))
    if not problems and "speed" in checks and run.rank0 is None:
        problems.append(f"no ping-pong from the container; {run.failure()}")
    return [f"trial {trial + 1}: {p}" if trial else p for p in problems]


def _check_against_bare(run: Launch, bare_run: Launch, want: Expectation,
                        checks: tuple[str, ...] = CHECKS) -> list[str]:
    """The same MPI as bare (mpi), and the fabric libraries it loads bare (fabric; first
    trial)."""
    reference = bare_run if bare_run.records and bare_run.code == 0 else None
    return ((check_same_mpi(run, reference) if "mpi" in checks else [])
            or (check_fabric(run, reference, want) if "fabric" in checks else []))


def launch_warnings(launches: list[Launch]) -> list[str]:
    """The warnings the container launches printed (an MPI says so when it falls back to a
    slower path), each once, with the trials that printed it: a line that starts with
    "warning" and the lines after it up to a blank or dashed one."""
    seen: dict[str, list[int]] = {}
    for trial, run in enumerate(launches, 1):
        lines = run.stderr.splitlines()
        for i, line in enumerate(lines):
            if not re.match(r"\s*warning\b", line, re.IGNORECASE):
                continue
            text = [line.strip()]
            for more in lines[i + 1:i + 4]:
                if not more.strip() or set(more.strip()) <= {"-", "="}:
                    break
                text.append(more.strip())
            trials = seen.setdefault(" ".join(text)[:300], [])
            if trial not in trials:
                trials.append(trial)
    return [f"container trial(s) {format_cpulist(t)} printed: {text}"
            for text, t in seen.items()]


def table(records: tuple[ProbeRecord, ...], want: Expectation) -> str:
    lines = [f"{'rank':>4} {'size':>4} {'host':12} {'pid':>7} {'cpus':6} {'plan':6} "
             f"{'libmpi (defines MPI_Init)':46} fabric"]
    for r in sorted(records, key=lambda r: (r.rank, r.pid)):
        local = r.env.get("LOCAL_RANK")
        planned = want.cpus.get(int(local)) if local and local.isdigit() else None
        fabric = ",".join(f"{k}:{os.path.dirname(v)}" for k, v in sorted(r.fabric.items()))
        lines.append(f"{r.rank:>4} {r.size:>4} {r.host[:12]:12} {r.pid:>7} "
                     f"{r.affinity_list[:6]:6} "
                     f"{format_cpulist(planned) if planned else '-':6} "
                     f"{(r.libmpi[0] if r.libmpi else '-')[:46]:46} {fabric or '-'}")
    return "\n".join(lines)


def report(outcome: Outcome, want: Expectation, threshold: float) -> dict:
    verdict, code = outcome.verdict

    def runs(launches: list[Launch]) -> list[dict]:
        return [{"code": r.code, "records": [asdict(x) for x in r.records],
                 "stderr_tail": r.stderr[-2000:]} for r in launches]

    return {"verdict": verdict, "exit_code": code, "valid": verdict == "OK",
            "problems": outcome.problems, "unverified": outcome.unverified,
            "threshold": threshold, "trials_run": outcome.trials_run,
            "extended": outcome.extended, "checks": list(outcome.checks),
            "not_checked": [c for c in CHECKS if c not in outcome.checks],
            "expected": {**asdict(want), "cpus": {k: list(v) for k, v in want.cpus.items()}},
            "sizes": [s.to_dict() for s in outcome.sizes],
            "container": runs(outcome.container), "bare": runs(outcome.bare)}


def main(argv: list[str],
         parse: Callable[[list[str]], tuple[Options, argparse.Namespace]]) -> int:
    """``parse``: hpcai-launch's own option parser (the launch options pass through it)."""
    ns, launch_args = _split(argv)
    options, _ = parse(launch_args)
    if options.container is None or options.runtime == "none":
        raise UserError("validate needs --container IMG",
                        "e.g. hpcai-launch validate --container ~/.cache/hpcai/images/"
                        "hpcai-bookworm -N 2")
    want = expect(options, ns)
    work = Path(tempfile.mkdtemp(prefix=".hpcai-validate-", dir=os.getcwd()))
    try:
        outcome = run_trials(options, want, ns.trials, ns.threshold, work, ns.max_trials,
                             checks=ns.checks)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    verdict, code = outcome.verdict
    skipped = [c for c in CHECKS if c not in ns.checks]
    speed = "speed" in ns.checks
    print(f"plan: {want.world or '?'} ranks; libmpi under {want.libmpi_prefix}; "
          + (f"{outcome.trials_run} trial(s) per side run: {ns.trials}, then up to "
             f"{ns.max_trials} as {'; '.join(outcome.extended)}" if outcome.extended else
             f"{outcome.trials_run} of {ns.trials} trial(s) per side run" if speed else
             f"{len(outcome.container)} container and {len(outcome.bare)} bare launch(es) run"))
    if skipped:
        print(f"checks (--only): {', '.join(ns.checks)}; not checked: {', '.join(skipped)}")
    if outcome.container and outcome.container[0].records:
        print("in the container (trial 1):")
        print(table(outcome.container[0].records, want))
    if outcome.container and outcome.container[0].records and "gpu" in ns.checks:
        print("\n".join(check_gpu(outcome.container[0], want)[0]))
    if outcome.sizes:
        print(f"ping-pong, median of {outcome.trials_run} trials per side "
              f"(floor {ns.threshold:.2f}):")
        for size in outcome.sizes:
            print("  " + size.describe(ns.threshold))
    for line in launch_warnings(outcome.container):
        print(f"note: {line}")
    Path(ns.json).write_text(json.dumps(report(outcome, want, ns.threshold), indent=1))
    for problem in outcome.problems:
        print(f"FAIL: {problem}")
    for reason in outcome.unverified:
        print(f"UNVERIFIED: {reason}")
    if verdict == "OK":
        said = [f"{len(outcome.container[0].records)} ranks, one world"]
        said += [f"MPI from {want.libmpi_prefix}"] if "mpi" in ns.checks else []
        said += ["bound as planned"] if "binding" in ns.checks else []
        if speed:
            worst = min((s for s in outcome.sizes if s.judged), key=lambda s: s.ratio)
            said[-1] += (f"; container/bare bandwidth >= {worst.ratio:.2f} x "
                         f"(floor {ns.threshold:.2f})")
        print("OK: " + ", ".join(said)
              + (f"; not checked (--only): {', '.join(skipped)}" if skipped else ""))
    print(f"verdict: {verdict} (exit {code}); report {ns.json}")
    return code
