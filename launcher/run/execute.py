"""The thin layer that carries out a :class:`LaunchPlan`: links, binding, one exec, or,
where the plan relays signals, one child that hpcai-launch waits for (and a rank whose
launcher would not end the job if it failed: one child that :mod:`.rankwatch` watches)."""

from __future__ import annotations

import os
import signal
import sys

from ...core.errors import USAGE_EXIT, UserError
from ..job import jobplan
from ..job.rankenv import abort_fd
from .child import end_by_signal, exec_command, start_child

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from ..planning.plan import LaunchPlan
    from ..job.rankenv import RankInfo


def make_compat_links(links: tuple[tuple[str, str], ...]) -> None:
    """Create ``link -> target`` symlinks atomically (ranks may race to make them)."""
    for link, target in links:
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        parent, name = os.path.split(link)
        os.makedirs(parent or ".", exist_ok=True)
        tmp = os.path.join(parent, f".{name}.{os.getpid()}")
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, link)


def apply_binding(cpus: tuple[int, ...] | None) -> tuple[set[int], set[int], str]:
    """Bind this process to ``cpus`` unless already bound there.

    Returns (affinity before, affinity after, who bound it).
    """
    before = os.sched_getaffinity(0)
    if cpus is None:
        return before, before, "not bound (no plan for this machine)"
    if before == set(cpus):
        return before, before, "launcher"
    try:
        os.sched_setaffinity(0, cpus)
        how = "hpcai-launch"
    except OSError as exc:
        how = f"failed: {exc.strerror}"
    return before, os.sched_getaffinity(0), how


def binding_report(info: RankInfo, bind_cpus: tuple[int, ...] | None, threads: str | None,
                   after: set[int], how: str) -> tuple[str, bool]:
    """One line per rank: real CPU set vs plan. Returns (line, matches plan)."""
    from ..node.topology import format_cpulist
    planned = set(bind_cpus) if bind_cpus is not None else after
    ok = after == planned
    line = (f"hpcai: rank {info.rank}/{info.size} local {info.local_rank}/{info.local_size} "
            f"node {info.node_rank} host {os.uname().nodename}: cpus {format_cpulist(after)} "
            f"planned {format_cpulist(planned)} threads {threads} "
            f"bound-by {how} {'OK' if ok else 'MISMATCH'}")
    return line, ok


def exec_plan(plan: LaunchPlan, report_bindings: bool = False) -> int:
    """Replace this process with the planned command (never returns on success), or, where
    the plan relays signals, run it as a child and return its exit status."""
    if plan.mode == "rank":
        assert plan.rank is not None
        exec_rank(plan.argv, plan.env_dict(), plan.compat_links, plan.rank, plan.bind_cpus,
                  plan.warnings, report_bindings)
    make_compat_links(plan.compat_links)
    if plan.relay:
        from ..planning.plan import RELAYED_AS_IS
        return run_relaying(plan.argv, plan.env_dict(), dict(plan.relay), RELAYED_AS_IS)
    exec_command(plan.argv, plan.env_dict())
    return 0  # not reached


def run_relaying(argv: tuple[str, ...], plan_env: dict[str, str], relay: dict[str, str],
                 as_is: tuple[str, ...]) -> int:
    """Run ``argv`` in a process group of its own and pass signals on to it: the first of
    each ``relay`` key as its value, every later one and those in ``as_is`` unchanged. A
    signal to this process's group (``timeout``) so reaches the child only as relayed.

    As a shell does with a job: if this process has the terminal in the foreground, the
    child's group gets it while it runs (keyboard input and Ctrl-C go to the child, as after
    an exec). Returns the child's exit status; if a signal ended it, ends this process with
    the same signal. If this process dies first, the child gets SIGTERM (PR_SET_PDEATHSIG)."""
    first = {getattr(signal, got): getattr(signal, sent) for got, sent in relay.items()}
    tty = _foreground_terminal()
    try:
        child = start_child(argv, plan_env)
    except OSError as exc:
        raise UserError(f"cannot start {argv[0]}: {exc.strerror}",
                        "check that the program exists and is executable") from exc

    def relay_one(signum: int, _frame: object) -> None:
        sent = first.pop(signum, signum)
        if sent != signum:
            name = signal.Signals(signum).name
            os.write(sys.stderr.fileno(), (
                f"hpcai-launch: {name}: passed on to {os.path.basename(argv[0])} as "
                f"{signal.Signals(sent).name}, so the ranks can checkpoint and stop; "
                f"{name} again stops them now\n").encode())
        child.send_signal(sent)

    for name in (*relay, *as_is):
        signal.signal(getattr(signal, name), relay_one)
    _give_terminal(tty, child.pid)
    code = child.wait()     # restarted after each handler (PEP 475)
    _give_terminal(tty, os.getpgrp())
    return code if code >= 0 else end_by_signal(-code)


def _foreground_terminal() -> int | None:
    """stdin's descriptor if it is a terminal whose foreground group is this process's."""
    try:
        fd = sys.stdin.fileno()
        return fd if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp() else None
    except (OSError, ValueError, AttributeError):
        return None


def _give_terminal(fd: int | None, pgrp: int) -> None:
    """Make ``pgrp`` the terminal's foreground group (SIGTTOU ignored meanwhile)."""
    if fd is None:
        return
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgrp)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, old)


def exec_rank(argv: tuple[str, ...], env: dict[str, str], links: tuple[tuple[str, str], ...],
              info: RankInfo, bind_cpus: tuple[int, ...] | None, warnings: tuple[str, ...],
              report_bindings: bool) -> None:
    """A rank: links, warnings (rank 0), binding and its report, then exec; or, where the
    launcher would leave the job running if this rank failed, run and watch the command
    (:mod:`.rankwatch`)."""
    make_compat_links(links)
    if info.rank == 0:
        for warning in warnings:
            os.write(sys.stderr.fileno(), f"warning: {warning}\n".encode())
    _, after, how = apply_binding(bind_cpus)
    if report_bindings or (bind_cpus is not None and after != set(bind_cpus)):
        line, ok = binding_report(info, bind_cpus, env.get("OMP_NUM_THREADS"), after, how)
        text = line if ok else f"warning: {line}: real affinity differs from the plan"
        os.write(sys.stderr.fileno(), (text + "\n").encode())  # one write: no interleaving
    pmi_fd = abort_fd(info, os.environ)
    if pmi_fd is not None:
        from .rankwatch import run as watch     # a Hydra rank only
        watch(argv, env, info, pmi_fd)
    exec_command(argv, env)


def run_rank(job: jobplan.JobRole, env: dict[str, str], started: float) -> int | None:
    """A non-planning rank: :func:`start`; an error is exit 2, said once per node as
    planning says it (the planning rank's by local rank 0 of every other node, this rank's
    own by ``job.loud`` ranks). None: this rank must plan by itself."""
    try:
        start(job, env, started)
        return None
    except jobplan.PlannerFailed as failed:
        if job.loud and job.info.local_rank == 0:
            os.write(2, (failed.error.render() + "\n").encode())
        return USAGE_EXIT
    except UserError as exc:
        if job.loud:
            os.write(2, (exc.render() + "\n").encode())
        return USAGE_EXIT


def start(job: jobplan.JobRole, env: dict[str, str], started: float) -> None:
    """Wait for the plan, check it, bind and exec. Returns when this rank must plan by
    itself. Raises PlannerFailed or UserError."""
    if job.prepared:    # written on the batch host before srun started this step
        data = jobplan.read_prepared(job.path)
    else:
        data = jobplan.wait(job.path, started, jobplan.plan_timeout(env), job.launch)
    key = jobplan.make_key(job, env, os.getcwd(), ())
    template = jobplan.check(data, key, job.path)
    if template is None or len(template.ranks) != job.info.local_size:
        return
    argv, rank_env, cpus = jobplan.for_rank(template, job.info, env)
    head = job.argv[:job.argv.index("--")] if "--" in job.argv else job.argv
    exec_rank(argv, rank_env, template.compat_links, job.info, cpus, (),
              report_bindings="--report-bindings" in head)
