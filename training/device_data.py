"""A rank's training data for ``train --device cuda``: on its GPU, or in pinned host memory.

With the batches copied from pageable host memory, every step waited for the GPU (a plain
``.to(device)`` from pageable memory finishes the device's queue first), and generating or
reading each batch on the host held up the GPU. :func:`device_data` reads the whole data set
once into GPU memory when it fits in :data:`CACHE_MAX_BYTES` and a quarter of the free GPU
memory (synthetic images are made once; a step gathers its batch on the GPU); otherwise each
batch is read as before and put in pinned memory, in the prefetch thread, so the task copies
it without waiting.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .batches import Reader

CACHE_MAX_BYTES = 16 * 2**30    # at most this much of a GPU holds data
CACHE_FREE_FRACTION = 0.25      # and at most this share of its free memory
CHUNK = 256                     # samples read at a time while filling the cache


class DeviceData:
    """Every sample of ``reader`` in GPU memory; ``read`` gathers a batch there."""

    def __init__(self, reader: Reader, device: torch.device) -> None:
        n = len(reader)
        x0, y0 = reader.read([0])
        self.device = device
        self.x = torch.empty((n, *x0.shape[1:]), dtype=torch.from_numpy(x0).dtype,
                             device=device)
        self.y = torch.empty((n, *y0.shape[1:]), dtype=torch.from_numpy(y0).dtype,
                             device=device)
        for start in range(0, n, CHUNK):
            x, y = reader.read(np.arange(start, min(n, start + CHUNK)))
            self.x[start:start + len(x)].copy_(torch.from_numpy(x))
            self.y[start:start + len(y)].copy_(torch.from_numpy(y))

    def __len__(self) -> int:
        return self.x.shape[0]

    def read(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(np.array(indices, dtype=np.int64).reshape(-1))
        if self.device.type == "cuda":
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        return self.x.index_select(0, idx), self.y.index_select(0, idx)


class PinnedData:
    """``reader``'s batches in pinned host memory (copied to the GPU without waiting)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def read(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.reader.read(indices)
        return torch.from_numpy(x).pin_memory(), torch.from_numpy(y).pin_memory()


def data_bytes(reader: Reader) -> int:
    """The bytes of all of ``reader``'s samples, from the size of the first."""
    x, y = reader.read([0])
    return len(reader) * (x.nbytes + y.nbytes)


def device_data(reader: Reader, device: torch.device) -> tuple[Reader, str]:
    """(``reader`` as this rank's training steps read it, a phrase saying where it is)."""
    if device.type != "cuda":
        return reader, "host memory"
    size = data_bytes(reader)
    free, _ = torch.cuda.mem_get_info(device)
    limit = min(CACHE_MAX_BYTES, int(CACHE_FREE_FRACTION * free))
    gib = f"{size / 2**30:.2f} GiB"
    if size <= limit:
        return DeviceData(reader, device), f"GPU memory ({len(reader)} samples, {gib})"
    return PinnedData(reader), (f"pinned host memory, batch by batch ({gib} exceed "
                                f"{limit / 2**30:.2f} GiB of GPU memory)")
