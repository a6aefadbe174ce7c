"""The thin layer that carries out a :class:`LaunchPlan`: links, binding, one exec."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from ..core.errors import UserError

if TYPE_CHECKING:
    from .plan import LaunchPlan
    from .rankenv import RankInfo


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
    from .topology import format_cpulist
    planned = set(bind_cpus) if bind_cpus is not None else after
    ok = after == planned
    line = (f"hpcai: rank {info.rank}/{info.size} local {info.local_rank}/{info.local_size} "
            f"node {info.node_rank} host {os.uname().nodename}: cpus {format_cpulist(after)} "
            f"planned {format_cpulist(planned)} threads {threads} "
            f"bound-by {how} {'OK' if ok else 'MISMATCH'}")
    return line, ok


def exec_plan(plan: LaunchPlan, report_bindings: bool = False) -> None:
    """Replace this process with the planned command (never returns on success)."""
    if plan.mode == "rank":
        assert plan.rank is not None
        exec_rank(plan.argv, plan.env_dict(), plan.compat_links, plan.rank, plan.bind_cpus,
                  plan.warnings, report_bindings)
    make_compat_links(plan.compat_links)
    _exec(plan.argv, plan.env_dict())


def exec_rank(argv: tuple[str, ...], env: dict[str, str], links: tuple[tuple[str, str], ...],
              info: RankInfo, bind_cpus: tuple[int, ...] | None, warnings: tuple[str, ...],
              report_bindings: bool) -> None:
    """A rank: links, warnings (rank 0), binding and its report, then exec."""
    make_compat_links(links)
    if info.rank == 0:
        for warning in warnings:
            os.write(sys.stderr.fileno(), f"warning: {warning}\n".encode())
    _, after, how = apply_binding(bind_cpus)
    if report_bindings or (bind_cpus is not None and after != set(bind_cpus)):
        line, ok = binding_report(info, bind_cpus, env.get("OMP_NUM_THREADS"), after, how)
        text = line if ok else f"warning: {line}: real affinity differs from the plan"
        os.write(sys.stderr.fileno(), (text + "\n").encode())  # one write: no interleaving
    _exec(argv, env)


def _exec(argv: tuple[str, ...], plan_env: dict[str, str]) -> None:
    env = dict(os.environ)
    env.update(plan_env)
    try:
        os.execvpe(argv[0], list(argv), env)
    except OSError as exc:
        raise UserError(f"cannot start {argv[0]}: {exc.strerror}",
                        "check that the program exists and is executable") from exc
