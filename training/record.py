"""The per-epoch record: one JSON line of ``OUT/epochs.jsonl``, typed and versioned.

The trainer (rank 0) writes one :class:`EpochRecord` per epoch with :meth:`EpochRecord.to_json`;
``hpcai-launch report`` reads the lines back with :meth:`EpochRecord.from_json`, which checks
the schema version and the type of every field and names the first field that is wrong.
Standard library only: reading records needs neither torch nor NumPy.

Schema 1: the JSON keys are the field names (27 keys, and the optional ``eval``,
``physics``: the 3DGAN's held-out validation summary, ``physics.Validation.summary``, and
``precision`` and ``memory_format``, which records written before they existed lack), in the
order of the fields, after ``"record": "epoch"`` and ``"version": 1``; ``peak``, ``allreduce`` and
``provenance`` are objects with the fields of :class:`Peak`, :class:`AllreduceTotals` and
:class:`Provenance`. Seconds are the epoch's wall time (maximum over ranks) and the per-rank
means of its parts; FLOP rates count FLOPs as ``flop_convention`` says.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

SCHEMA_VERSION = 1
KIND = "epoch"


class RecordError(ValueError):
    """A line that is not an epoch record this code can read; the message says why."""


class OtherRecord(RecordError):
    """A record of another kind than ``"epoch"`` (readers skip it)."""


@dataclass(frozen=True)
class Peak:
    """The per-rank peak that ``pct_of_peak`` divides by, and where it came from."""

    gflops_per_rank: float
    source: str


@dataclass(frozen=True)
class AllreduceTotals:
    """The epoch's gradient averaging on one rank."""

    bytes_per_rank: int
    calls: int
    overlap: bool
    bucket_mb: float


@dataclass(frozen=True)
class Provenance:
    """Who ran the epoch: world, placement, libraries, hosts, code revision."""

    world_size: int
    ranks_per_node: int
    threads_per_rank: int
    cpus_rank0: str | None
    framework: str
    framework_version: str
    comm: str
    comm_version: str
    mpi_library_version: str
    libmpi: str | None
    hosts: tuple[str, ...]
    git_revision: str
    torch: str | None        # the installed torch distribution's version (None: not installed)


@dataclass(frozen=True)
class EpochRecord:
    """One epoch of training, as rank 0 reports it."""

    model: str
    framework: str
    epoch: int
    steps: int                      # steps run in this epoch
    first_step: int                 # > 0: the epoch was resumed at this step
    epoch_time_s: float
    compute_s: float
    comm_s: float                   # gradient averaging + replica checks
    grad_sync_s: float
    grad_sync_imbalance_s: float    # of grad_sync_s: waiting for the slowest rank (blocking;
    # measured on every allreduce.IMBALANCE_EVERY-th step, scaled up: an estimate)
    data_s: float
    samples_per_rank: int
    samples_per_s_per_rank: float
    samples_per_s: float
    flops_per_sample: float
    flop_convention: str
    gflops_per_rank: float
    gflops_total: float
    peak: Peak
    pct_of_peak: float
    lr: float
    losses: dict[str, float]        # per-step means over the epoch and the ranks
    allreduce: AllreduceTotals
    max_rss_mb_per_rank: float      # maximum over ranks
    provenance: Provenance
    eval: dict[str, float] | None = None   # rank 0's metrics on fixed samples, if asked
    physics: dict[str, float] | None = None   # held-out physics validation's summary, if run
    precision: str | None = None       # PyTorch: "fp32", "tf32" or "bf16" (train --precision)
    memory_format: str | None = None   # PyTorch: "channels_last" or "contiguous"

    def to_dict(self) -> dict[str, Any]:
        out = {"record": KIND, "version": SCHEMA_VERSION, **asdict(self)}
        for optional in ("eval", "physics", "precision", "memory_format"):
            if out[optional] is None:
                del out[optional]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, line: str) -> "EpochRecord":
        """Parse one line; RecordError (OtherRecord for another kind) if it is not a
        readable epoch record of schema 1."""
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(f"not JSON ({exc.msg})") from exc
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, obj: object) -> "EpochRecord":
        if not isinstance(obj, dict):
            raise RecordError("not a JSON object")
        kind = obj.get("record", KIND)
        if kind != KIND:
            raise OtherRecord(f"a {kind!r} record, not an epoch record")
        version = _value(obj, "version", int, "")
        if version != SCHEMA_VERSION:
            raise RecordError(f"epoch record schema version {version}, but this hpcai reads "
                              f"version {SCHEMA_VERSION} only (written by another hpcai "
                              "version? read it with that one)")
        return _build(cls, obj, "")


_NESTED = {"peak": Peak, "allreduce": AllreduceTotals, "provenance": Provenance}
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _build(cls, obj: Mapping, prefix: str):
    """``cls`` from the JSON object ``obj``, every field checked (``prefix`` names the
    enclosing field in messages)."""
    values = {}
    for f in fields(cls):
        if f.name not in obj and f.default is None:
            continue   # optional (eval, physics)
        if f.name in _NESTED:
            inner = obj.get(f.name)
            if not isinstance(inner, dict):
                raise RecordError(_problem(obj, f.name, prefix, "not an object"))
            values[f.name] = _build(_NESTED[f.name], inner, f"{prefix}{f.name}.")
        else:
            values[f.name] = _value(obj, f.name, f.type, prefix)
    return cls(**values)


def _value(obj: Mapping, name: str, annotation, prefix: str):
    """Field ``name`` of ``obj`` if it matches ``annotation`` (a type, or its string)."""
    spec = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    optional = spec.endswith(" | None")
    spec = spec.removesuffix(" | None")
    if name not in obj:
        raise RecordError(_problem(obj, name, prefix, ""))
    value = obj[name]
    if value is None and optional:
        return None
    if spec.startswith("dict["):
        if not (isinstance(value, dict) and all(_is(v, float) for v in value.values())):
            raise RecordError(_problem(obj, name, prefix, "not an object of numbers"))
        return value
    if spec.startswith("tuple["):
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise RecordError(_problem(obj, name, prefix, "not a list of strings"))
        return tuple(value)
    kind = _TYPES[spec]
    if not _is(value, kind):
        what = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
        raise RecordError(_problem(obj, name, prefix, f"not {what[kind]}"))
    return value


def _is(value: object, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def _problem(obj: Mapping, name: str, prefix: str, what: str) -> str:
    if name not in obj:
        return f"field {prefix + name!r} missing"
    return f"field {prefix + name!r} {what} ({obj[name]!r})"
