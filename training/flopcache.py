"""FLOP counts kept in hpcai's cache (``<cache>/flops/<key>.json``).

A model's count per sample is a pure function of the code that runs it, its layers and the
input's shape, so a rank that finds the count under its key reads it instead of tracing the
model on shape-only tensors again (about a second of every rank's start). The key hashes:
torch's version; the source files of the task and of every layer class; each layer's class,
``repr`` and plain attributes (flags that a ``forward`` may branch on); the input shapes; and
what the caller adds. An entry that cannot be read, or holds no positive finite count, is
counted again; a cache that cannot be written is left alone."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..core.paths import cache_root
from .atomic import replacing

PLAIN = (bool, int, float, str, tuple, type(None))


def _layer(m: torch.nn.Module) -> list:
    attrs = sorted((k, repr(v)) for k, v in vars(m).items()
                   if not k.startswith("_") and k != "training" and isinstance(v, PLAIN))
    return [type(m).__module__ + "." + type(m).__qualname__, m.extra_repr(), attrs]


def _file(obj) -> str:
    try:
        return inspect.getfile(obj)
    except TypeError:   # built in: no source file
        return "built-in"


def _digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "unknown"


def key(modules: Iterable[torch.nn.Module], inputs: Iterable[tuple[int, ...]],
        code: Iterable[object], **extra) -> str:
    """The key of a count over ``modules`` on inputs of shapes ``inputs``, run by ``code``
    (modules or functions whose source files the count depends on) and ``extra``."""
    layers = [list(top.modules()) for top in modules]
    paths = {_file(type(m)) for tops in layers for m in tops} | {_file(c) for c in code}
    doc = {"torch": torch.__version__, "files": sorted(map(_digest, paths)),
           "layers": [[_layer(m) for m in tops] for tops in layers],
           "inputs": [list(s) for s in inputs], "extra": sorted(extra.items())}
    return hashlib.sha256(json.dumps(doc, default=repr).encode()).hexdigest()


def cached(k: str, count: Callable[[], float], env=os.environ) -> float:
    """The count stored under ``k``, else ``count()``, stored there for the next start."""
    path = Path(cache_root(env)) / "flops" / f"{k}.json"
    try:
        stored = json.loads(path.read_text())["flops_per_sample"]
        if isinstance(stored, (int, float)) and math.isfinite(stored) and stored > 0:
            return float(stored)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    value = float(count())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as tmp:
            tmp.write_text(json.dumps({"flops_per_sample": value}))
    except OSError:
        pass
    return value
