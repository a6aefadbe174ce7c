"""3DGAN shower files: find and validate the HDF5 files, read single events of them.

Pipeline (one process = one rank)::

    index  = validate(find_files(data_dir))   # before training: UserError if bad
    index, held_out = split_files(index, k)   # the last k files: validation only
    reader = ShowerReader(index)              # opens files lazily, reads events only
    x, e   = reader.read([4, 0, 2])           # x (3,1,25,25,25) f32, e = E' (3,) f32 (NumPy)
    reader.close()

Which events a rank reads at which step is the sharder's business (``batches``).

The layout is that of the real CERN files (``EleEscan_1_1.h5``; see
``hpcai.training.showers`` for synthetic ones): ``ECAL`` (N,25,25,25) cell energies in GeV,
``target`` (N,>=2) with column 1 = primary energy in GeV, ``HCAL`` ignored. Reference
preprocessing (``preprocess``): cells < 1e-6 -> 0, cast to float32, add the channel axis,
``E' = target[:,1] / 100``.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..core.errors import UserError
from ..models.gan3d_spec import ENERGY_SCALE_GEV, GRID

THRESHOLD = 1e-6   # cells below this (GeV) are set to 0, as in the reference
GENERATE_HINT = ("write synthetic files of the right layout with "
                 "`python -m hpcai.training.showers generate --out DIR`")


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


def default_test_files(n_files: int) -> int:
    """Held-out files when ``--test-files`` is not given: 10 % of the files, at least 1 when
    there are 2 or more (CERN holds out 2 of 20), none of a single file."""
    return max(1, n_files // 10) if n_files >= 2 else 0


def split_files(index: DatasetIndex, test_files: int | None
                ) -> tuple[DatasetIndex, DatasetIndex | None]:
    """(training files, held-out files): the last ``test_files`` files in the index's
    (sorted) order are held out; None: :func:`default_test_files`. UserError if nothing would
    be left to train on."""
    n = len(index.files)
    k = default_test_files(n) if test_files is None else test_files
    if k >= n:
        raise UserError(f"--test-files {k} holds out all {n} data file(s): nothing left to "
                        "train on", f"give --test-files {n - 1} or less, or more files")
    if k == 0:
        return index, None
    return (DatasetIndex(index.files[:n - k], index.counts[:n - k]),
            DatasetIndex(index.files[n - k:], index.counts[n - k:]))


def preprocess(ecal: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference preprocessing: ECAL (n,25,25,25) any float -> (n,1,25,25,25) float32 with
    cells < 1e-6 set to 0; E' = target[:,1] / 100 as float32 (n,)."""
    x = np.array(ecal, copy=True)
    x[x < THRESHOLD] = 0          # on the stored dtype, before the cast (reference order)
    x = x.astype(np.float32, copy=False)[:, None]
    e = (np.asarray(target)[:, 1] / ENERGY_SCALE_GEV).astype(np.float32)
    return x, e


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
            e = (np.asarray(self._file(i)["target"][:, 1], dtype=np.float64) / ENERGY_SCALE_GEV)
            e = e.astype(np.float32)
            self._energy[i] = e
        return e

    def read(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = np.asarray(indices, dtype=np.int64).reshape(-1)
        x = np.empty((g.size, 1, GRID, GRID, GRID), dtype=np.float32)
        e = np.empty(g.size, dtype=np.float32)
        if g.size == 0:
            return x, e
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
        return x, e

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
