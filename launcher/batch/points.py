"""A sweep point and its ``point.json``: written by the sweep, read by the report."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Point:
    nodes: int
    ranks_per_node: int
    threads_per_rank: int
    repeat: int
    scaling: str
    batch_size: int | None = None

    @property
    def name(self) -> str:
        return f"N{self.nodes}-R{self.ranks_per_node}-T{self.threads_per_rank}-rep{self.repeat}"


POINT_SCHEMA = 1
SCALINGS = ("weak", "strong")


@dataclass(frozen=True)
class PointRecord:
    """``RESULTS/<point>/point.json``: the point and where its run stands (flat JSON)."""

    point: Point
    status: str                      # submitted, running, done, incomplete, failed, timeout
    job_id: str | None = None
    exit_code: int | None = None
    schema: int = POINT_SCHEMA

    def to_json(self) -> str:
        return json.dumps({**asdict(self.point), "status": self.status,
                           "job_id": self.job_id, "exit_code": self.exit_code,
                           "schema": self.schema}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "PointRecord":
        """Read one; ValueError saying which field is wrong. A file without ``schema`` is
        of schema 1 (written before the field existed, same keys)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("schema", 1) != POINT_SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, this hpcai reads {POINT_SCHEMA}")
        for key in ("nodes", "ranks_per_node", "threads_per_rank"):
            value = data.get(key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                why = "missing" if key not in data else f"not a positive integer ({value!r})"
                raise ValueError(f"field {key!r} {why}")
        scaling = data.get("scaling", "weak")
        if scaling not in SCALINGS:
            raise ValueError(f"field 'scaling' is {scaling!r}, not weak or strong")
        point = Point(data["nodes"], data["ranks_per_node"], data["threads_per_rank"],
                      int(data.get("repeat", 0)), scaling, data.get("batch_size"))
        return cls(point, str(data.get("status")), data.get("job_id"), data.get("exit_code"))

    @classmethod
    def load(cls, path: Path) -> "PointRecord":
        return cls.from_json(path.read_text(encoding="utf-8"))
