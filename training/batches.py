"""Which samples each rank trains on, and its batches of them, for any data set.

Pipeline (one process = one rank)::

    sharder = EpochSharder(len(data), world, rank, batch_size, seed)
    stream  = BatchStream(sharder, data, epoch, start_step=0, prefetch=True)
    for step, x, y in stream:                  # data.read(this rank's indices of the step)
        ...
    stream.wait_s                              # seconds the loop waited for data

``data`` is any :class:`Reader`: ``ShowerReader`` (3DGAN, ``shower_data``) or
``SyntheticImages`` (ResNet, ``synthetic_images``).

Sharding policy (fixes the reference trainer, which gave every rank all samples):

- Each epoch, every rank computes the same permutation of ``range(total)`` with
  ``numpy.random.default_rng(seed + epoch)``.
- ``steps = total // (batch_size * world_size)`` (as the reference); with ``drop_last=True``
  only the first ``steps * batch_size * world_size`` permuted samples are used and the rest
  (fewer than one global batch) is dropped for that epoch -- a different random remainder each
  epoch, so nothing is dropped systematically.
- Step-major assignment: at step ``s`` the ranks together take the contiguous window
  ``perm[s*B*W : (s+1)*B*W]`` and rank ``r`` takes the block ``[r*B : (r+1)*B]`` of it. So the
  global batch of step ``s`` is the same set of samples as a single process with batch ``B*W``
  would see, shards of all ranks are disjoint and their union is the kept set.
- ``drop_last=False`` instead pads the permutation by wrapping around to its start so that every
  rank still runs the same number of full batches (``ceil(total / (B*W))`` steps); then a few
  samples appear twice in the epoch and shards are no longer disjoint.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator, Protocol, Sequence

import numpy as np

from ..core.errors import UserError


class Reader(Protocol):
    """A data set: ``read(indices)`` returns (inputs, targets) of those samples."""

    def __len__(self) -> int:
        ...

    def read(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ...


class EpochSharder:
    """Which global samples rank ``rank`` of ``world_size`` trains on in each epoch.

    See the module docstring for the policy (seeded per-epoch permutation, step-major blocks,
    last partial global batch dropped).
    """

    def __init__(self, total: int, world_size: int, rank: int, batch_size: int,
                 seed: int = 0, drop_last: bool = True) -> None:
        if world_size < 1:
            raise UserError(f"world size must be at least 1, got {world_size}", "")
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside 0..{world_size - 1}", "")
        if batch_size < 1:
            raise UserError(f"batch size must be at least 1, got {batch_size}",
                            "pass a positive batch size")
        if total < 1:
            raise UserError("the data set is empty", "give data with at least one global batch")
        global_batch = batch_size * world_size
        if drop_last and total < global_batch:
            raise UserError(f"{total} samples are fewer than one global batch "
                            f"({batch_size} per rank x {world_size} ranks = {global_batch})",
                            "use more data, a smaller batch size, or fewer ranks")
        self.total = int(total)
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self._cache: tuple[int, np.ndarray] | None = None

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.total // self.global_batch
        return -(-self.total // self.global_batch)

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of all samples, identical on every rank."""
        return np.random.default_rng(self.seed + int(epoch)).permutation(self.total)

    def kept(self, epoch: int) -> np.ndarray:
        """All samples trained on in this epoch by all ranks, in step-major order."""
        perm = self.permutation(epoch)
        need = self.steps_per_epoch * self.global_batch
        if need <= self.total:
            return perm[:need]
        return np.resize(perm, need)      # drop_last=False: wrap around to fill the last step

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's global sample indices for the epoch, in step order (int64, steps*B)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        blocks = self.kept(epoch).reshape(self.steps_per_epoch, self.world_size,
                                          self.batch_size)
        mine = np.ascontiguousarray(blocks[:, self.rank, :]).reshape(-1).astype(np.int64)
        mine.setflags(write=False)
        self._cache = (epoch, mine)
        return mine

    def batch_indices(self, epoch: int, step: int) -> np.ndarray:
        """This rank's samples at one step of one epoch."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside 0..{self.steps_per_epoch - 1}")
        b = self.batch_size
        return self.indices(epoch)[step * b:(step + 1) * b]


class BatchStream:
    """Iterable of ``(step, x, y)`` for one rank and one epoch, from ``start_step`` on.

    With ``prefetch=True`` a background thread reads the next batch while the caller computes
    (one batch ahead). Timing counters, for logging data loading apart from compute:

    - ``wait_s``: total seconds the consumer was blocked waiting for a batch;
    - ``read_s``: total seconds spent reading (in whichever thread did it).

    Call ``close()`` (or use ``with``) when abandoning the loop early.
    """

    def __init__(self, sharder: EpochSharder, reader: Reader, epoch: int,
                 start_step: int = 0, prefetch: bool = True) -> None:
        steps = sharder.steps_per_epoch
        if not 0 <= start_step <= steps:
            raise UserError(f"start step {start_step} outside 0..{steps}",
                            "the checkpoint does not match this data/batch/world size")
        self.sharder, self.reader, self.epoch = sharder, reader, int(epoch)
        self.start_step = int(start_step)
        self.prefetch = bool(prefetch)
        self.wait_s = 0.0
        self.read_s = 0.0
        self.steps_done = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._started = False

    def __len__(self) -> int:
        return self.sharder.steps_per_epoch - self.start_step

    def _read(self, step: int) -> tuple[np.ndarray, np.ndarray, float]:
        t0 = time.perf_counter()
        x, y = self.reader.read(self.sharder.batch_indices(self.epoch, step))
        return x, y, time.perf_counter() - t0

    def _producer(self) -> None:
        try:
            for step in range(self.start_step, self.sharder.steps_per_epoch):
                if self._stop.is_set() or not self._put((step, *self._read(step))):
                    return
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            self._put(("error", exc))
            return
        self._put(("done", None))

    def _put(self, item) -> bool:
        """Queue ``item`` for the consumer; False if the stream was closed first."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        if self._started:
            raise RuntimeError("a BatchStream can be iterated only once")
        self._started = True
        if not self.prefetch:
            for step in range(self.start_step, self.sharder.steps_per_epoch):
                x, y, dt = self._read(step)
                self.read_s += dt
                self.wait_s += dt
                self.steps_done += 1
                yield step, x, y
            return
        self._thread = threading.Thread(target=self._producer, name="hpcai-prefetch",
                                        daemon=True)
        self._thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = self._queue.get()
                waited = time.perf_counter() - t0
                if item[0] == "done":
                    return
                if item[0] == "error":
                    raise item[1]
                step, x, y, dt = item
                self.read_s += dt
                self.wait_s += waited
                self.steps_done += 1
                yield step, x, y
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            while thread.is_alive():
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass
                thread.join(timeout=0.05)
            self._thread = None

    def __enter__(self) -> "BatchStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
