"""Checks on the rank-R.json files the probe writes: the full set, one world, disjoint CPUs."""

from __future__ import annotations

import json
from pathlib import Path


def load_ranks(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def assert_one_world(records: list[dict], size: int, lib_marker: str | None = None) -> None:
    """Every rank of one world of ``size`` reported; catches N x "rank 0 of 1"."""
    assert sorted(r["rank"] for r in records) == list(range(size)), records
    for r in records:
        assert r["size"] == size, f"rank {r['rank']} saw world size {r['size']}, not {size}"
        assert r["allreduce_ok"], r
        assert r["env"]["RANK"] == str(r["rank"]), r["env"]
        assert r["env"]["WORLD_SIZE"] == str(size), r["env"]
        if lib_marker:
            assert any(lib_marker in lib for lib in r["libmpi"]), (lib_marker, r["libmpi"])
    by_node: dict[str, list[dict]] = {}
    for r in records:
        by_node.setdefault(r["env"]["NODE_RANK"], []).append(r)
    for node_records in by_node.values():
        local = sorted(int(r["env"]["LOCAL_RANK"]) for r in node_records)
        assert local == list(range(len(node_records))), local
        cpus = [set(r["affinity"]) for r in node_records]
        for i, a in enumerate(cpus):
            for b in cpus[i + 1:]:
                assert not a & b, f"CPU sets overlap: {cpus}"
