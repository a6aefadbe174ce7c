"""Keep model replicas identical: broadcast from rank 0, then prove it.

- :func:`broadcast_state` sends every parameter and buffer of rank 0 to all ranks.
- :func:`exact_fingerprint` is a CRC32 over the bytes of all parameters and buffers: after a
  broadcast every rank must have the very same bits.
- :func:`verify` compares fingerprints across ranks (one small allgather) and raises
  :class:`ReplicaDivergence` naming the ranks that differ. Cheap enough to run every K steps;
  with ``exact=False`` it compares per-tensor float64 sums with a relative tolerance, which
  survives MPIs whose allreduce rounds differently on different ranks but still catches a
  backend that silently stopped averaging (those diverge by orders of magnitude more).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch


class ReplicaDivergence(RuntimeError):
    """Ranks hold different model weights: gradients were not (or wrongly) averaged."""


def _tensors(modules, buffers: bool = True) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for module in modules:
        out.extend(p.data for p in module.parameters())
        if buffers:
            out.extend(b for b in module.buffers())
    return out


def broadcast_state(modules, comm, root: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with rank ``root``'s, in place."""
    for t in _tensors(modules):
        array = t.detach().numpy() if t.is_contiguous() else t.detach().contiguous().numpy()
        comm.Bcast(array, root=root)
        if not t.is_contiguous():
            t.copy_(torch.from_numpy(array))


def exact_fingerprint(modules) -> int:
    crc = 0
    for t in _tensors(modules):
        crc = zlib.crc32(t.detach().contiguous().numpy().tobytes(), crc)
    return crc


def sum_fingerprint(modules, buffers: bool = False) -> np.ndarray:
    return np.array([float(t.detach().double().sum()) for t in _tensors(modules, buffers)])


def verify(modules, comm, *, exact: bool, rtol: float = 1e-5, what: str = "weights",
           buffers: bool = False) -> None:
    """Raise ReplicaDivergence unless all ranks hold the same state.

    The exact check covers parameters and buffers (right after a broadcast all must match);
    the tolerant one covers parameters, and buffers only when asked: BatchNorm running
    statistics are per rank by design unless they are averaged.
    """
    if comm.Get_size() == 1:
        return
    mine = exact_fingerprint(modules) if exact else sum_fingerprint(modules, buffers)
    compare_fingerprints(comm, mine, exact=exact, rtol=rtol, what=what)


def compare_fingerprints(comm, mine, *, exact: bool, rtol: float = 1e-5,
                         what: str = "weights") -> None:
    """Raise ReplicaDivergence unless every rank's fingerprint matches rank 0's: a CRC
    exactly (``exact``), or per-tensor sums within ``rtol`` (framework independent)."""
    if exact:
        prints = comm.allgather(mine)
        differ = [r for r, f in enumerate(prints) if f != prints[0]]
        if differ:
            raise ReplicaDivergence(
                f"{what} differ between ranks after broadcast: ranks {differ} do not match "
                f"rank 0 (CRC32 {prints})")
        return
    allprints = comm.allgather(np.asarray(mine))
    ref = allprints[0]
    scale = np.maximum(np.abs(ref), 1e-3)
    differ = [r for r, f in enumerate(allprints)
              if f.shape != ref.shape or np.any(np.abs(f - ref) > rtol * scale)]
    if differ:
        worst = max(float(np.max(np.abs(allprints[r] - ref) / scale)) for r in differ)
        raise ReplicaDivergence(
            f"{what} diverged: ranks {differ} differ from rank 0 (worst relative difference "
            f"{worst:.3g} > {rtol}); gradients are not being averaged consistently")
