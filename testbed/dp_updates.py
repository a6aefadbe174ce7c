"""Reading and comparing the weight updates that ``tests/programs/dp_equivalence.py`` saves: shared
by ``test_engine.py`` (the CPU, in the suite) and ``bench/gpu_equivalence.py`` (a GPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# |update(2 x b) - update(1 x 2b)| <= TOL |update(1 x 2b)| for every parameter. Measured on
# the CPU: at most 3e-6 in float32 (mlp, gan-d) and 1e-14 in float64 (gan-g); the control (no
# averaging) is off by 0.18 to 1.0 over all parameters together.
TOL = {"mlp": 1e-4, "gan-d": 1e-4, "gan-g": 1e-10}


def updates(npz: Path) -> dict[str, np.ndarray]:
    """The update of every parameter over the programme's 3 steps (after - ``init.``)."""
    saved = dict(np.load(npz))
    names = [k for k in saved if not k.startswith("init.")]
    assert names and sorted(f"init.{k}" for k in names) == sorted(set(saved) - set(names))
    return {k: (saved[k] - saved[f"init.{k}"]).astype(np.float64) for k in names}


def worst(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> tuple[str, float]:
    """The parameter whose update differs most from the reference, relative to it."""
    assert reference.keys() == other.keys()
    return max(((name, float(np.linalg.norm(other[name] - ref) / np.linalg.norm(ref)))
                for name, ref in reference.items()), key=lambda item: item[1])


def total(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> float:
    """|other - reference| / |reference| over all parameters' updates together."""
    ref = np.concatenate([reference[k].ravel() for k in sorted(reference)])
    got = np.concatenate([other[k].ravel() for k in sorted(reference)])
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
