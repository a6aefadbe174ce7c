"""``--hosts a,b:4`` for mpirun: host names with optional slot counts."""

from __future__ import annotations

from ...core.errors import UserError


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
