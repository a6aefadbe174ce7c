"""Host lists: Slurm's compressed form (``n[01-04],login1``) and ``--hosts a:2,b:2``."""

from __future__ import annotations

import re

from .errors import UserError


def expand_hostlist(text: str) -> tuple[str, ...]:
    """Expand a Slurm hostlist such as ``n[1-3,7],gpu01`` into host names."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        match = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", item)
        if not match:
            if item:
                hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                for tail in expand_hostlist(suffix) if suffix else ("",):
                    hosts.append(f"{prefix}{i:0{width}d}{tail}")
    return tuple(hosts)


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def parse_tasks_per_node(text: str) -> tuple[int, ...]:
    """Expand ``SLURM_TASKS_PER_NODE`` such as ``2(x3),1`` into ``(2, 2, 2, 1)``."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"bad tasks-per-node text {text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return tuple(counts)


def parse_hosts(text: str) -> tuple[tuple[str, int | None], ...]:
    """Parse ``--hosts a,b:4``: names with optional slot counts, in order, deduplicated.

    Naming a host twice with different slot counts is an error.
    """
    seen: dict[str, int | None] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, slots_text = item.partition(":")
        slots: int | None = None
        if slots_text:
            if not slots_text.isdigit() or int(slots_text) < 1:
                raise UserError(f"bad slot count in --hosts entry {item!r}",
                                "write HOST or HOST:SLOTS with SLOTS >= 1, e.g. node1:4,node2:4")
            slots = int(slots_text)
        if name in seen and seen[name] != slots:
            raise UserError(
                f"host {name!r} is named twice in --hosts with conflicting slots "
                f"({_slots(seen[name])} and {_slots(slots)})",
                "name each host once, e.g. --hosts node1:4,node2:4")
        seen[name] = slots
    if not seen:
        raise UserError("--hosts is empty", "give host names, e.g. --hosts node1,node2")
    return tuple(seen.items())


def _slots(value: int | None) -> str:
    return "unspecified" if value is None else str(value)
