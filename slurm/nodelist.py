"""Slurm's node and task lists: ``n[01-04],login1`` and ``2(x3),1``.

Expansion is python-hostlist's (the usual implementation of Slurm's hostlist syntax, zero
padding and several bracket groups included); this module only turns its errors into ours.
"""

from __future__ import annotations

import hostlist


def expand_hostlist(text: str) -> tuple[str, ...]:
    """``n[1-3,7],gpu01`` -> ``("n1", "n2", "n3", "n7", "gpu01")``. ValueError if malformed."""
    try:
        return tuple(hostlist.expand_hostlist(text.strip()))
    except hostlist.BadHostlist as exc:
        raise ValueError(f"bad Slurm host list {text!r}: {exc}") from None


def parse_tasks_per_node(text: str) -> tuple[int, ...]:
    """``SLURM_TASKS_PER_NODE`` such as ``2(x3),1`` -> ``(2, 2, 2, 1)``. ValueError if bad."""
    try:
        return tuple(hostlist.parse_slurm_tasks_per_node(text.strip()))
    except (hostlist.BadHostlist, ValueError) as exc:
        raise ValueError(f"bad tasks-per-node text {text!r}: {exc}") from None
