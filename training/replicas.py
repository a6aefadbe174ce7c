"""Prove that model replicas are identical on all ranks (NumPy arrays; no framework).

The trainers hand over their state as NumPy arrays (views of the tensors where possible).
:func:`verify` compares one fingerprint per rank (one small allgather) and raises
:class:`ReplicaDivergence` naming the ranks that differ:

- ``exact=True``: a CRC32 over the bytes of every array; right after a broadcast every rank
  must hold the very same bits;
- ``exact=False``: per-array float64 sums within a relative tolerance, cheap enough to run
  every K steps. It survives MPIs whose allreduce rounds differently on different ranks but
  still catches a backend that silently stopped averaging (those diverge by orders of
  magnitude more).
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np


class ReplicaDivergence(RuntimeError):
    """Ranks hold different model weights: gradients were not (or wrongly) averaged."""


def exact_fingerprint(arrays: Sequence[np.ndarray]) -> int:
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
    return crc


def sum_fingerprint(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return np.array([float(np.sum(a, dtype=np.float64)) for a in arrays])


def verify(arrays: Sequence[np.ndarray], comm, *, exact: bool, rtol: float = 1e-5,
           what: str = "weights") -> None:
    """Raise ReplicaDivergence unless every rank's ``arrays`` match rank 0's: bit for bit
    (``exact``), or per-array sums within ``rtol``. Collective; nothing to do on one rank."""
    if comm.Get_size() == 1:
        return
    if exact:
        prints = comm.allgather(exact_fingerprint(arrays))
        differ = [r for r, f in enumerate(prints) if f != prints[0]]
        if differ:
            raise ReplicaDivergence(
                f"{what} differ between ranks after broadcast: ranks {differ} do not match "
                f"rank 0 (CRC32 {prints})")
        return
    allprints = comm.allgather(sum_fingerprint(arrays))
    ref = allprints[0]
    scale = np.maximum(np.abs(ref), 1e-3)
    differ = [r for r, f in enumerate(allprints)
              if f.shape != ref.shape or np.any(np.abs(f - ref) > rtol * scale)]
    if differ:
        worst = max(float(np.max(np.abs(allprints[r] - ref) / scale)) for r in differ)
        raise ReplicaDivergence(
            f"{what} diverged: ranks {differ} differ from rank 0 (worst relative difference "
            f"{worst:.3g} > {rtol}); gradients are not being averaged consistently")
