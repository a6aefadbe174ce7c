"""What ``hpcai-launch tune`` measured, as one JSON file that ``predict`` reads back.

Schema 1 (``tune.json``)::

    {"schema": 1, "model": "3dgan", "command": ["train", ...], "batch_per_rank": 16,
     "epoch_samples": 2000 | null, "cores": 2, "memory_bytes": ..., "flops_per_sample": ...,
     "buckets": [bytes of each gradient allreduce of one step, ...],
     "compute": [{"ranks", "threads", "s_per_sample", "mem_bytes_per_rank"}, ...],
     "links": {"shm": {"alpha_s", "beta_s_per_byte", "samples": [[ranks, bytes, s], ...]},
               "net": {...} | absent},
     "provenance": {"host", "date", "loadavg", "git_revision", "budget_s", "elapsed_s"}}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.errors import UserError
from .model import AllreduceSample, ComputeFit, ComputeSample, LinkCost, fit_link

SCHEMA = 1


@dataclass(frozen=True)
class Layout:
    """One measured layout on this node."""

    ranks: int
    threads: int
    s_per_sample: float           # everything but gradient communication, per rank
    mem_bytes_per_rank: float
    samples_per_s: float          # measured, per node, communication included


@dataclass(frozen=True)
class Link:
    """One transport: its allreduce measurements and the alpha-beta fitted to them."""

    cost: LinkCost
    samples: tuple[AllreduceSample, ...]

    @classmethod
    def fitted(cls, samples: list[AllreduceSample]) -> "Link":
        return cls(fit_link(samples), tuple(samples))


@dataclass(frozen=True)
class TuneResult:
    model: str
    command: tuple[str, ...]
    batch_per_rank: int
    epoch_samples: int | None
    cores: int
    memory_bytes: int
    flops_per_sample: float
    buckets: tuple[int, ...]
    compute: tuple[Layout, ...]
    shm: Link
    net: Link | None
    provenance: dict[str, object]

    def compute_fit(self) -> ComputeFit:
        return ComputeFit.fit([ComputeSample(c.ranks, c.threads, c.s_per_sample)
                               for c in self.compute])

    def mem_bytes_per_rank(self) -> float:
        """The largest resident set any measured layout had per rank."""
        return max(c.mem_bytes_per_rank for c in self.compute)

    def to_json(self) -> str:
        def link(value: Link | None):
            if value is None:
                return None
            return {**asdict(value.cost),
                    "samples": [[s.ranks, s.nbytes, s.seconds] for s in value.samples]}
        doc = {"schema": SCHEMA, "model": self.model, "command": list(self.command),
               "batch_per_rank": self.batch_per_rank, "epoch_samples": self.epoch_samples,
               "cores": self.cores, "memory_bytes": self.memory_bytes,
               "flops_per_sample": self.flops_per_sample, "buckets": list(self.buckets),
               "compute": [asdict(c) for c in self.compute],
               "links": {"shm": link(self.shm), "net": link(self.net)},
               "provenance": self.provenance}
        return json.dumps(doc, indent=1)

    @classmethod
    def load(cls, path: str | Path) -> "TuneResult":
        """Read a tune.json; a missing, unreadable or malformed file is a UserError."""
        hint = "give the file hpcai-launch tune wrote (--json, default tune.json)"
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"tune result {path} does not exist", hint) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"tune result {path} is unreadable or not JSON ({exc})",
                            hint) from None
        try:
            if doc.get("schema") != SCHEMA:
                raise ValueError(f"schema {doc.get('schema')!r}, this hpcai reads {SCHEMA}")

            def link(value):
                if value is None:
                    return None
                samples = tuple(AllreduceSample(int(r), int(n), float(s))
                                for r, n, s in value["samples"])
                return Link(LinkCost(float(value["alpha_s"]), float(value["beta_s_per_byte"])),
                            samples)
            return cls(model=str(doc["model"]), command=tuple(doc["command"]),
                       batch_per_rank=int(doc["batch_per_rank"]),
                       epoch_samples=doc.get("epoch_samples"), cores=int(doc["cores"]),
                       memory_bytes=int(doc["memory_bytes"]),
                       flops_per_sample=float(doc["flops_per_sample"]),
                       buckets=tuple(int(b) for b in doc["buckets"]),
                       compute=tuple(Layout(int(c["ranks"]), int(c["threads"]),
                                            float(c["s_per_sample"]),
                                            float(c["mem_bytes_per_rank"]),
                                            float(c["samples_per_s"]))
                                     for c in doc["compute"]),
                       shm=link(doc["links"]["shm"]), net=link(doc["links"].get("net")),
                       provenance=dict(doc.get("provenance", {})))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(f"tune result {path} is malformed ({exc!r})", hint) from None
