"""The thin layer that carries out a :class:`LaunchPlan`: links, binding, one exec."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from ..core.errors import UserError
from .plan import LaunchPlan
from .topology import format_cpulist


def make_compat_links(links: tuple[tuple[str, str], ...]) -> None:
    """Create ``link -> target`` symlinks atomically (ranks may race to make them)."""
    for link, target in links:
        path = Path(link)
        if path.is_symlink() and os.readlink(path) == target:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, path)


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


def binding_report(plan: LaunchPlan, after: set[int], how: str) -> tuple[str, bool]:
    """One line per rank: real CPU set vs plan. Returns (line, matches plan)."""
    info = plan.rank
    assert info is not None
    planned = set(plan.bind_cpus) if plan.bind_cpus is not None else after
    ok = after == planned
    env = plan.env_dict()
    line = (f"hpcai: rank {info.rank}/{info.size} local {info.local_rank}/{info.local_size} "
            f"node {info.node_rank} host {socket.gethostname()}: cpus {format_cpulist(after)} "
            f"planned {format_cpulist(planned)} threads {env.get('OMP_NUM_THREADS')} "
            f"bound-by {how} {'OK' if ok else 'MISMATCH'}")
    return line, ok


def exec_plan(plan: LaunchPlan, report_bindings: bool = False) -> None:
    """Replace this process with the planned command (never returns on success)."""
    make_compat_links(plan.compat_links)
    if plan.mode == "rank":
        if plan.rank is not None and plan.rank.rank == 0:
            for warning in plan.warnings:
                os.write(sys.stderr.fileno(), f"warning: {warning}\n".encode())
        _, after, how = apply_binding(plan.bind_cpus)
        line, ok = binding_report(plan, after, how)
        if report_bindings or not ok:
            text = line if ok else f"warning: {line}: real affinity differs from the plan"
            os.write(sys.stderr.fileno(), (text + "\n").encode())  # one write: no interleaving
    env = dict(os.environ)
    env.update(plan.env)
    try:
        os.execvpe(plan.argv[0], list(plan.argv), env)
    except OSError as exc:
        raise UserError(f"cannot start {plan.argv[0]}: {exc.strerror}",
                        "check that the program exists and is executable") from exc
