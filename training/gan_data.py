"""3DGAN data: find and validate HDF5 files, shard events by rank, read batches lazily.

Pipeline (one process = one rank)::

    index   = validate(find_files(data_dir))          # before training: UserError if bad
    sharder = EpochSharder(index.total, world, rank, batch_size, seed)
    reader  = ShowerReader(index)                     # opens files lazily, reads events only
    stream  = batches(sharder, reader, epoch, start_step=0, prefetch=True)
    for step, x, e in stream:                         # x (B,1,25,25,25) f32, e = E' (B,) f32
        ...
    stream.wait_s                                      # seconds the loop waited for data
    reader.close()

The layout is that of the real CERN files (``EleEscan_1_1.h5``; see
``hpcai.training.showers`` for synthetic ones): ``ECAL`` (N,25,25,25) cell energies in GeV,
``target`` (N,>=2) with column 1 = primary energy in GeV, ``HCAL`` ignored. Reference
preprocessing (``preprocess``): cells < 1e-6 -> 0, cast to float32, add the channel axis,
``E' = target[:,1] / 100``.

Sharding policy (fixes the reference trainer, which gave every rank all events):

- Each epoch, every rank computes the same permutation of ``range(total)`` with
  ``numpy.random.default_rng(seed + epoch)``.
- ``steps = total // (batch_size * world_size)`` (as the reference); with ``drop_last=True``
  only the first ``steps * batch_size * world_size`` permuted events are used and the rest
  (fewer than one global batch) is dropped for that epoch -- a different random remainder each
  epoch, so nothing is dropped systematically.
- Step-major assignment: at step ``s`` the ranks together take the contiguous window
  ``perm[s*B*W : (s+1)*B*W]`` and rank ``r`` takes the block ``[r*B : (r+1)*B]`` of it. So the
  global batch of step ``s`` is the same set of events as a single process with batch ``B*W``
  would see, shards of all ranks are disjoint and their union is the kept set.
- ``drop_last=False`` instead pads the permutation by wrapping around to its start so that every
  rank still runs the same number of full batches (``ceil(total / (B*W))`` steps); then a few
  events appear twice in the epoch and shards are no longer disjoint.

``SyntheticImages`` offers the same ``read(indices)`` interface with ImageNet-shaped data for
ResNet-50 benchmarks.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import numpy as np
import torch

from ..core.errors import UserError

GRID = 25
THRESHOLD = 1e-6   # cells below this (GeV) are set to 0, as in the reference
E_SCALE = 100.0    # E' = E / 100 GeV
GENERATE_HINT = ("write synthetic files of the right layout with "
                 "`python -m hpcai.training.showers generate --out DIR`")


# --------------------------------------------------------------------------- files

def _natural_key(path: Path) -> list:
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", path.name)]


def find_files(data_dir: str | os.PathLike) -> list[Path]:
    """HDF5 files of a data folder, in natural order (``_2`` before ``_10``).

    Files named ``Ele*_*.h5`` (the real ``EleEscan_1_1.h5`` and the synthetic ``Ele_0_0.h5``)
    are preferred: if any exist, only those are returned; otherwise every ``*.h5``. A path to
    a single ``.h5`` file is accepted too. Raises UserError when there is nothing to read.
    """
    path = Path(data_dir)
    if path.is_file():
        if path.suffix != ".h5":
            raise UserError(f"{path} is not an .h5 file", "give a folder of .h5 files")
        return [path]
    if not path.exists():
        raise UserError(f"data directory {path} does not exist", GENERATE_HINT)
    if not path.is_dir():
        raise UserError(f"data path {path} is not a directory", "give a folder of .h5 files")
    every = sorted((p for p in path.glob("*.h5") if p.is_file()), key=_natural_key)
    preferred = [p for p in every if p.match("Ele*_*.h5")]
    files = preferred or every
    if not files:
        raise UserError(f"no .h5 files in {path}", GENERATE_HINT)
    return files


@dataclass(frozen=True)
class DatasetIndex:
    """The validated files, their event counts, and the global event numbering.

    Global event ``g`` lives in file ``i`` with ``offsets[i] <= g < offsets[i] + counts[i]``.
    """

    files: tuple[Path, ...]
    counts: tuple[int, ...]

    @property
    def total(self) -> int:
        return int(sum(self.counts))

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)[:-1]]).astype(np.int64)

    def __len__(self) -> int:
        return self.total

    def locate(self, global_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, local event index) for each global index."""
        g = np.asarray(global_indices, dtype=np.int64)
        if g.size and (g.min() < 0 or g.max() >= self.total):
            bad = g[(g < 0) | (g >= self.total)][0]
            raise IndexError(f"event {bad} out of range 0..{self.total - 1}")
        offsets = self.offsets
        fid = np.searchsorted(offsets, g, side="right") - 1
        return fid, g - offsets[fid]

    def summary(self) -> str:
        return f"{len(self.files)} files, {self.total} events"


def validate(files: Sequence[str | os.PathLike]) -> DatasetIndex:
    """Check every file before training; return the index. Raises UserError naming the file.

    Each file must open with h5py and hold ``ECAL`` of shape (N,25,25,25) and ``target`` of
    shape (N, >=2) with the same N >= 1 and numeric dtypes. Only metadata is read.
    """
    import h5py

    paths = [Path(f) for f in files]
    if not paths:
        raise UserError("no data files given", GENERATE_HINT)
    counts: list[int] = []
    for path in paths:
        name = path.name
        if not path.is_file():
            raise UserError(f"data file {path} does not exist", GENERATE_HINT)
        try:
            h5 = h5py.File(path, "r")
        except OSError as exc:
            raise UserError(f"cannot open {name} as HDF5: {exc}",
                            f"is {path} a complete HDF5 file? {GENERATE_HINT}") from exc
        with h5:
            ecal = h5.get("ECAL")
            if not isinstance(ecal, h5py.Dataset):
                keys = ", ".join(sorted(h5.keys())) or "nothing"
                raise UserError(f"{name} has no ECAL dataset (it holds {keys})",
                                f"3DGAN files need ECAL (N,25,25,25) and target (N,2); "
                                f"{GENERATE_HINT}")
            if ecal.ndim != 4 or tuple(ecal.shape[1:]) != (GRID, GRID, GRID):
                raise UserError(f"{name}: ECAL has shape {tuple(ecal.shape)}, "
                                f"expected (N, {GRID}, {GRID}, {GRID})",
                                f"the 3DGAN calorimeter is 25x25x25 cells; {GENERATE_HINT}")
            if ecal.dtype.kind not in "fiu":
                raise UserError(f"{name}: ECAL has dtype {ecal.dtype}, expected numbers",
                                GENERATE_HINT)
            target = h5.get("target")
            if not isinstance(target, h5py.Dataset):
                raise UserError(f"{name} has no target dataset",
                                f"target column 1 must hold the primary energy in GeV; "
                                f"{GENERATE_HINT}")
            if target.ndim != 2 or target.shape[1] < 2:
                raise UserError(f"{name}: target has shape {tuple(target.shape)}, "
                                f"expected (N, 2) or wider",
                                "target column 1 must hold the primary energy in GeV")
            if target.dtype.kind not in "fiu":
                raise UserError(f"{name}: target has dtype {target.dtype}, expected numbers",
                                "target column 1 must hold the primary energy in GeV")
            if target.shape[0] != ecal.shape[0]:
                raise UserError(f"{name}: ECAL has {ecal.shape[0]} events but target has "
                                f"{target.shape[0]}", "the file is inconsistent; rewrite it")
            if ecal.shape[0] == 0:
                raise UserError(f"{name} holds no events", "remove it or rewrite it")
            counts.append(int(ecal.shape[0]))
    return DatasetIndex(tuple(paths), tuple(counts))


def preprocess(ecal: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference preprocessing: ECAL (n,25,25,25) any float -> (n,1,25,25,25) float32 with
    cells < 1e-6 set to 0; E' = target[:,1] / 100 as float32 (n,)."""
    x = np.array(ecal, copy=True)
    x[x < THRESHOLD] = 0          # on the stored dtype, before the cast (reference order)
    x = x.astype(np.float32, copy=False)[:, None]
    e = (np.asarray(target)[:, 1] / E_SCALE).astype(np.float32)
    return x, e


# --------------------------------------------------------------------------- sharding

class EpochSharder:
    """Which global events rank ``rank`` of ``world_size`` trains on in each epoch.

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
            raise UserError("the dataset has no events", GENERATE_HINT)
        global_batch = batch_size * world_size
        if drop_last and total < global_batch:
            raise UserError(f"{total} events are fewer than one global batch "
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

    def __len__(self) -> int:
        return self.steps_per_epoch

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of all events, identical on every rank."""
        return np.random.default_rng(self.seed + int(epoch)).permutation(self.total)

    def kept(self, epoch: int) -> np.ndarray:
        """All events trained on in this epoch by all ranks, in step-major order."""
        perm = self.permutation(epoch)
        need = self.steps_per_epoch * self.global_batch
        if need <= self.total:
            return perm[:need]
        return np.resize(perm, need)      # drop_last=False: wrap around to fill the last step

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's global event indices for the epoch, in step order (int64, steps*B)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        blocks = self.kept(epoch).reshape(self.steps_per_epoch, self.world_size,
                                          self.batch_size)
        mine = np.ascontiguousarray(blocks[:, self.rank, :]).reshape(-1).astype(np.int64)
        mine.setflags(write=False)
        self._cache = (epoch, mine)
        return mine

    def batch_indices(self, epoch: int, step: int) -> np.ndarray:
        """This rank's events at one step of one epoch."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside 0..{self.steps_per_epoch - 1}")
        b = self.batch_size
        return self.indices(epoch)[step * b:(step + 1) * b]


# --------------------------------------------------------------------------- readers

class Reader(Protocol):
    total: int

    def read(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        ...


def _read_events(dataset, wanted: np.ndarray) -> np.ndarray:
    """Events ``wanted`` (sorted, unique) of an (N,...) dataset, one slice per run of
    consecutive indices (h5py's point-list selection is ~15x slower than this)."""
    out = np.empty((wanted.size, *dataset.shape[1:]), dtype=dataset.dtype)
    breaks = np.flatnonzero(np.diff(wanted) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [wanted.size]])
    for a, b in zip(starts.tolist(), stops.tolist()):
        first = int(wanted[a])
        dataset.read_direct(out, np.s_[first:first + (b - a)], np.s_[a:b])
    return out


class ShowerReader:
    """Reads single events of a validated dataset; files are opened lazily per process.

    ``read(idx)`` returns ``(x, e)``: x float32 (n,1,25,25,25) preprocessed, e = E' float32
    (n,), in the order of ``idx`` (repeats allowed). Only the requested events are read from
    disk; the small ``target`` energy column of a file is cached on first use.
    """

    def __init__(self, index: DatasetIndex) -> None:
        self.index = index
        self.total = index.total
        self._offsets = index.offsets
        self._files: dict[int, object] = {}
        self._energy: dict[int, np.ndarray] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.total

    def _file(self, i: int):
        import h5py

        if self._pid != os.getpid():  # forked: the parent's handles are not ours to use
            self._files.clear()
            self._pid = os.getpid()
        h5 = self._files.get(i)
        if h5 is None:
            h5 = h5py.File(self.index.files[i], "r")
            self._files[i] = h5
        return h5

    def _energies(self, i: int) -> np.ndarray:
        e = self._energy.get(i)
        if e is None:
            e = (np.asarray(self._file(i)["target"][:, 1], dtype=np.float64) / E_SCALE)
            e = e.astype(np.float32)
            self._energy[i] = e
        return e

    def read(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        g = np.asarray(indices, dtype=np.int64).reshape(-1)
        x = np.empty((g.size, 1, GRID, GRID, GRID), dtype=np.float32)
        e = np.empty(g.size, dtype=np.float32)
        if g.size == 0:
            return torch.from_numpy(x), torch.from_numpy(e)
        fid, local = self.index.locate(g)
        with self._lock:
            for i in np.unique(fid):
                where = np.flatnonzero(fid == i)
                # h5py wants strictly increasing indices: read each event once, in order,
                # then scatter back to the requested positions.
                wanted, inverse = np.unique(local[where], return_inverse=True)
                ecal = _read_events(self._file(int(i))["ECAL"], wanted)
                ecal[ecal < THRESHOLD] = 0
                x[where, 0] = ecal.astype(np.float32, copy=False)[inverse]
                e[where] = self._energies(int(i))[local[where]]
        return torch.from_numpy(x), torch.from_numpy(e)

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                for h5 in self._files.values():
                    try:
                        h5.close()
                    except Exception:  # noqa: BLE001 - closing is best effort
                        pass
            self._files.clear()
            self._energy.clear()

    def __enter__(self) -> "ShowerReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class SyntheticImages:
    """ImageNet-shaped synthetic data for ResNet-50: ``n`` images, (3,H,W), ``classes`` labels.

    Image ``i`` is generated from ``default_rng([seed, i])`` alone (random 8-bit pixels,
    normalised with the ImageNet mean/std), so any rank reads the same image for the same
    index. ``read(idx)`` returns x float32 (k,3,H,W) and labels int64 (k,).
    """

    def __init__(self, n: int, image_size: int = 224, classes: int = 1000, seed: int = 0) -> None:
        if n < 1 or image_size < 1 or classes < 1:
            raise UserError(f"bad synthetic image set: n={n}, image_size={image_size}, "
                            f"classes={classes}", "all must be positive")
        self.total = int(n)
        self.image_size = int(image_size)
        self.classes = int(classes)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.total

    def read(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        g = np.asarray(indices, dtype=np.int64).reshape(-1)
        if g.size and (g.min() < 0 or g.max() >= self.total):
            raise IndexError(f"image index out of range 0..{self.total - 1}")
        s = self.image_size
        x = np.empty((g.size, 3, s, s), dtype=np.float32)
        y = np.empty(g.size, dtype=np.int64)
        scale = (1.0 / (255.0 * IMAGENET_STD))[:, None, None]
        shift = (IMAGENET_MEAN / IMAGENET_STD)[:, None, None]
        for k, idx in enumerate(g):
            rng = np.random.default_rng([self.seed, int(idx)])
            y[k] = rng.integers(self.classes)
            pixels = rng.integers(0, 256, size=(3, s, s), dtype=np.uint8)
            np.multiply(pixels, scale, out=x[k], casting="unsafe")
            x[k] -= shift
        return torch.from_numpy(x), torch.from_numpy(y)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- batches

class BatchStream:
    """Iterable of ``(step, x, y)`` for one rank and one epoch, from ``start_step`` on.

    With ``prefetch=True`` a background thread reads the next batch while the caller computes
    (one batch ahead). Timing counters, for logging data loading apart from compute:

    - ``wait_s``: total seconds the consumer was blocked waiting for a batch;
    - ``last_wait_s``: the wait before the most recent batch;
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
        self.last_wait_s = 0.0
        self.read_s = 0.0
        self.steps_done = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._started = False

    def __len__(self) -> int:
        return self.sharder.steps_per_epoch - self.start_step

    def _read(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        t0 = time.perf_counter()
        x, y = self.reader.read(self.sharder.batch_indices(self.epoch, step))
        return x, y, time.perf_counter() - t0

    def _producer(self) -> None:
        try:
            for step in range(self.start_step, self.sharder.steps_per_epoch):
                if self._stop.is_set():
                    return
                item = (step, *self._read(step))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            self._put_final(("error", exc))
            return
        self._put_final(("done", None))

    def _put_final(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a BatchStream can be iterated only once")
        self._started = True
        if not self.prefetch:
            for step in range(self.start_step, self.sharder.steps_per_epoch):
                x, y, dt = self._read(step)
                self.read_s += dt
                self.last_wait_s = dt
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
                self.last_wait_s = waited
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


def batches(sharder: EpochSharder, reader: Reader, epoch: int, start_step: int = 0,
            prefetch: bool = True) -> BatchStream:
    """This rank's batches of one epoch as ``(step, x, y)``, from ``start_step`` (resume).

    ``y`` is E' for ``ShowerReader`` and the labels for ``SyntheticImages``. The returned
    ``BatchStream`` counts the seconds spent waiting for data (``wait_s``, ``last_wait_s``).
    """
    return BatchStream(sharder, reader, epoch, start_step=start_step, prefetch=prefetch)
