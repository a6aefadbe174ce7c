"""3DGAN data: synthetic shower files, validation, preprocessing, sharding, batches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcai.core.errors import UserError
from hpcai.models.gan3d_spec import sampling_fraction
from hpcai.training import showers
from hpcai.training.batches import BatchStream, EpochSharder
from hpcai.training.shower_data import (DatasetIndex, ShowerReader, default_test_files,
                                        find_files, preprocess, split_files, validate)
from hpcai.training.synthetic_images import SyntheticImages

N_FILES, N_EVENTS = 2, 64


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("showers")
    showers.generate(out, n_files=N_FILES, events_per_file=N_EVENTS, seed=0)
    return out


@pytest.fixture(scope="module")
def arrays(data_dir) -> tuple[np.ndarray, np.ndarray]:
    ecal, target = [], []
    for path in sorted(data_dir.glob("Ele_0_*.h5")):
        with h5py.File(path, "r") as h5:
            ecal.append(h5["ECAL"][:])
            target.append(h5["target"][:])
    return np.concatenate(ecal), np.concatenate(target)


# ----------------------------------------------------------------- generated files

def test_layout_and_dtypes(data_dir):
    files = sorted(data_dir.iterdir())
    assert [p.name for p in files] == ["Ele_0_0.h5", "Ele_0_1.h5"]  # no temp files left
    for path in files:
        assert path.match("Ele*_*.h5")
        with h5py.File(path, "r") as h5:
            assert h5["ECAL"].shape == (N_EVENTS, 25, 25, 25)
            assert h5["ECAL"].dtype == np.float32
            assert h5["ECAL"].chunks == (1, 25, 25, 25)
            assert h5["ECAL"].compression in ("gzip", "lzf")
            assert h5["target"].dtype == np.float32
            assert h5["target"].ndim == 2 and h5["target"].shape[0] == N_EVENTS
            assert h5["target"].shape[1] >= 2
            assert np.all(h5["target"][:, 0] == 11)
            assert h5["HCAL"].shape == (N_EVENTS, 5, 5, 60)
            assert np.all(np.isfinite(h5["ECAL"][:])) and h5["ECAL"][:].min() >= 0


def test_deterministic_by_seed(tmp_path, data_dir):
    again = showers.generate(tmp_path / "a", n_files=1, events_per_file=N_EVENTS, seed=0)
    other = showers.generate(tmp_path / "b", n_files=1, events_per_file=N_EVENTS, seed=1)
    with h5py.File(data_dir / "Ele_0_0.h5") as ref, h5py.File(again[0]) as same, \
            h5py.File(other[0]) as diff:
        assert ref["ECAL"][:].tobytes() == same["ECAL"][:].tobytes()
        assert ref["target"][:].tobytes() == same["target"][:].tobytes()
        assert ref["ECAL"][:].tobytes() != diff["ECAL"][:].tobytes()
        assert not np.array_equal(ref["target"][:, 1], diff["target"][:, 1])
    with h5py.File(data_dir / "Ele_0_1.h5") as second, h5py.File(data_dir / "Ele_0_0.h5") as first:
        assert not np.array_equal(first["ECAL"][:8], second["ECAL"][:8])  # files differ


def test_physics(arrays):
    ecal, target = arrays
    energy = target[:, 1]
    assert energy.min() >= 10 and energy.max() <= 500
    assert energy.max() - energy.min() > 200                       # spread over the range
    total = ecal.sum(axis=(1, 2, 3), dtype=np.float64)
    ratio = total / sampling_fraction(energy / 100.0)      # sum [GeV] ~ f(E')
    assert 0.9 < ratio.mean() < 1.1
    assert ratio.std() < 0.05
    assert np.all(np.abs(ratio - 1) < 0.2)
    assert 0.01 < np.mean(total / energy) < 0.03                   # ~2 % sampling fraction

    longitudinal = ecal.sum(axis=(1, 2))                           # (N, 25): last axis = depth
    peak = longitudinal.argmax(axis=1)
    assert 3 <= peak.mean() <= 12
    low, high = energy < 100, energy > 350
    assert peak[high].mean() > peak[low].mean()                    # deeper for higher energy
    assert np.all(longitudinal[:, 0] < longitudinal.max(axis=1))  # not at the front face

    window = ecal[:, 9:16, 9:16, :].sum(axis=(1, 2, 3), dtype=np.float64)
    assert np.all(window / total > 0.8)
    assert not np.array_equal(ecal[0], ecal[1])
    nonzero = ecal[ecal > 0]
    assert nonzero.size < ecal.size                                # sparse: exact zeros exist


def test_cli_generate_and_errors(tmp_path):
    cmd = [sys.executable, "-m", "hpcai.training.showers", "generate"]
    ok = subprocess.run(cmd + ["--out", str(tmp_path / "d"), "--files", "1", "--events", "3",
                               "--seed", "5"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "Ele_5_0.h5" in ok.stdout
    assert (tmp_path / "d" / "Ele_5_0.h5").is_file()

    bad = subprocess.run(cmd + ["--out", str(tmp_path / "e"), "--events", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "error:" in bad.stderr and "hint:" in bad.stderr and "Traceback" not in bad.stderr

    blocker = tmp_path / "afile"
    blocker.write_text("x")
    bad = subprocess.run(cmd + ["--out", str(blocker), "--events", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "error:" in bad.stderr and "not a directory" in bad.stderr

    assert showers.main(["generate", "--out", str(blocker / "sub")]) == 2
    assert showers.main(["generate", "--out", str(tmp_path / "f"), "--files", "0"]) == 2
    assert showers.main(["generate"]) == 2                          # --out is required


# ----------------------------------------------------------------- validation

def _write(path: Path, **datasets) -> Path:
    with h5py.File(path, "w") as h5:
        for name, value in datasets.items():
            h5[name] = value
    return path


def test_find_and_validate(data_dir):
    files = find_files(data_dir)
    assert [p.name for p in files] == ["Ele_0_0.h5", "Ele_0_1.h5"]
    index = validate(files)
    assert isinstance(index, DatasetIndex)
    assert index.counts == (N_EVENTS, N_EVENTS) and index.total == 2 * N_EVENTS
    assert list(index.offsets) == [0, N_EVENTS]


def test_find_files_prefers_ele_and_natural_order(tmp_path):
    for name in ["EleEscan_1_10.h5", "EleEscan_1_2.h5", "other.h5"]:
        _write(tmp_path / name, x=np.zeros(1))
    assert [p.name for p in find_files(tmp_path)] == ["EleEscan_1_2.h5", "EleEscan_1_10.h5"]
    plain = tmp_path / "plain"
    plain.mkdir()
    _write(plain / "b.h5", x=np.zeros(1))
    _write(plain / "a.h5", x=np.zeros(1))
    assert [p.name for p in find_files(plain)] == ["a.h5", "b.h5"]


def test_validate_errors(tmp_path):
    good_target = np.zeros((4, 2), dtype=np.float32)
    cases = {
        "no_ecal.h5": (dict(target=good_target), ["no_ecal.h5", "ECAL"]),
        "bad_shape.h5": (dict(ECAL=np.zeros((4, 25, 25, 20), np.float32), target=good_target),
                         ["bad_shape.h5", "(4, 25, 25, 20)"]),
        "one_col.h5": (dict(ECAL=np.zeros((4, 25, 25, 25), np.float32),
                            target=np.zeros((4, 1), np.float32)), ["one_col.h5", "target"]),
        "mismatch.h5": (dict(ECAL=np.zeros((4, 25, 25, 25), np.float32),
                             target=np.zeros((3, 2), np.float32)), ["mismatch.h5", "3"]),
    }
    for name, (datasets, words) in cases.items():
        path = _write(tmp_path / name, **datasets)
        with pytest.raises(UserError) as info:
            validate([path])
        for word in words:
            assert word in info.value.message, (name, info.value.message)
        assert info.value.hint
    with pytest.raises(UserError) as info:
        validate([tmp_path / "no_ecal.h5"])
    assert "python -m hpcai.training.showers generate" in info.value.hint

    junk = tmp_path / "junk.h5"
    junk.write_text("not hdf5")
    with pytest.raises(UserError, match="junk.h5"):
        validate([junk])

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no .h5 files") as info:
        find_files(empty)
    assert "showers generate" in info.value.hint
    with pytest.raises(UserError, match="does not exist"):
        find_files(tmp_path / "missing")
    with pytest.raises(UserError):
        validate([])


# ----------------------------------------------------------------- real layout, reading

def test_real_layout_loads_unchanged(tmp_path):
    rng = np.random.default_rng(7)
    ecal = rng.exponential(1e-3, size=(5, 25, 25, 25))             # float64, like real files
    ecal[ecal < 5e-4] = rng.uniform(0, 2e-6, size=int((ecal < 5e-4).sum()))
    target = np.stack([np.full(5, 11.0), rng.uniform(10, 500, 5), rng.uniform(0, 1, 5)], 1)
    _write(tmp_path / "EleEscan_1_1.h5", ECAL=ecal, target=target,
           HCAL=np.zeros((5, 5, 5, 60)))
    index = validate(find_files(tmp_path))
    assert index.total == 5

    expected = ecal.copy()
    expected[expected < 1e-6] = 0
    expected = expected.astype(np.float32)[:, None]
    with ShowerReader(index) as reader:
        x, e = reader.read([4, 0, 2])
    assert x.dtype == np.float32 and x.shape == (3, 1, 25, 25, 25)
    assert e.dtype == np.float32 and e.shape == (3,)
    np.testing.assert_array_equal(x, expected[[4, 0, 2]])
    np.testing.assert_allclose(e, (target[[4, 0, 2], 1] / 100).astype(np.float32))
    assert (x[x > 0] >= 1e-6).all() and (x == 0).any()

    px, pe = preprocess(ecal, target)
    np.testing.assert_array_equal(px, expected)
    assert px.dtype == np.float32 and pe.dtype == np.float32
    np.testing.assert_allclose(pe, target[:, 1] / 100, rtol=1e-6)


def test_reader_order_matches_h5py(data_dir, arrays):
    ecal, target = arrays
    index = validate(find_files(data_dir))
    reader = ShowerReader(index)
    wanted = [100, 3, 70, 64, 63, 3, 0, 127, 6, 5, 7, 8]             # both files, repeat, run
    x, e = reader.read(wanted)
    expected = np.where(ecal[wanted] < 1e-6, 0, ecal[wanted])[:, None]
    np.testing.assert_array_equal(x, expected)
    np.testing.assert_array_equal(e, (target[wanted, 1] / 100).astype(np.float32))
    empty_x, empty_e = reader.read([])
    assert empty_x.shape == (0, 1, 25, 25, 25) and empty_e.shape == (0,)
    with pytest.raises(IndexError):
        reader.read([2 * N_EVENTS])
    reader.close()
    x2, _ = reader.read(wanted)                                    # reopens lazily
    assert np.array_equal(x, x2)
    reader.close()


# ----------------------------------------------------------------- sharding, batches

@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharder_disjoint_and_complete(world):
    total, batch, seed = 103, 4, 11
    shards = [EpochSharder(total, world, r, batch, seed) for r in range(world)]
    steps = total // (batch * world)
    for epoch in (0, 1):
        parts = [s.indices(epoch) for s in shards]
        for s, part in zip(shards, parts):
            assert s.steps_per_epoch == steps
            assert part.shape == (steps * batch,)
        union = np.concatenate(parts)
        assert len(set(union.tolist())) == union.size              # disjoint
        kept = np.random.default_rng(seed + epoch).permutation(total)[:steps * batch * world]
        assert set(union.tolist()) == set(kept.tolist())           # union = kept set
        for s in shards:                                           # same permutation
            np.testing.assert_array_equal(s.permutation(epoch), shards[0].permutation(epoch))
        for step in range(steps):                                  # step-major windows
            window = np.concatenate([s.batch_indices(epoch, step) for s in shards])
            np.testing.assert_array_equal(window,
                                          kept[step * batch * world:(step + 1) * batch * world])
    assert not np.array_equal(shards[0].indices(0), shards[0].indices(1))
    assert not np.array_equal(shards[0].permutation(0), shards[0].permutation(1))


def test_sharder_errors_and_no_drop():
    with pytest.raises(UserError, match="fewer than one global batch"):
        EpochSharder(10, 2, 0, 8, 0)
    with pytest.raises(UserError):
        EpochSharder(10, 2, 2, 1, 0)
    padded = [EpochSharder(10, 3, r, 2, 0, drop_last=False) for r in range(3)]
    assert padded[0].steps_per_epoch == 2
    union = np.concatenate([s.indices(0) for s in padded])
    assert union.size == 12 and set(union.tolist()) == set(range(10))


@pytest.mark.parametrize("prefetch", [False, True])
def test_batches_resume_matches_tail(data_dir, prefetch):
    index = validate(find_files(data_dir))
    reader = ShowerReader(index)
    sharder = EpochSharder(index.total, 2, 1, 8, seed=3)
    full = list(BatchStream(sharder, reader, epoch=2, prefetch=prefetch))
    assert [s for s, _, _ in full] == list(range(sharder.steps_per_epoch))
    for step, x, e in full:
        ref_x, ref_e = reader.read(sharder.batch_indices(2, step))
        assert np.array_equal(x, ref_x) and np.array_equal(e, ref_e)
    stream = BatchStream(sharder, reader, epoch=2, start_step=5, prefetch=prefetch)
    assert len(stream) == sharder.steps_per_epoch - 5
    tail = list(stream)
    assert [s for s, _, _ in tail] == list(range(5, sharder.steps_per_epoch))
    for (s1, x1, e1), (s2, x2, e2) in zip(full[5:], tail):
        assert s1 == s2 and np.array_equal(x1, x2) and np.array_equal(e1, e2)
    assert stream.wait_s >= 0 and stream.read_s > 0 and stream.steps_done == len(tail)
    with BatchStream(sharder, reader, epoch=0, prefetch=prefetch) as early:  # abandon early
        for step, _, _ in early:
            if step == 1:
                break
    reader.close()


def test_synthetic_images():
    data = SyntheticImages(50, image_size=32, classes=10, seed=4)
    x, y = data.read([7, 3, 7])
    assert x.shape == (3, 3, 32, 32) and x.dtype == np.float32
    assert y.shape == (3,) and y.dtype == np.int64
    assert np.array_equal(x[0], x[2]) and not np.array_equal(x[0], x[1])
    x2, y2 = SyntheticImages(50, image_size=32, classes=10, seed=4).read([7, 3, 7])
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    x3, _ = SyntheticImages(50, image_size=32, classes=10, seed=5).read([7])
    assert not np.array_equal(x[0], x3[0])
    assert ((0 <= y) & (y < 10)).all()
    assert abs(float(x.mean())) < 0.5 and 0.5 < float(x.std()) < 2.5  # normalised
    sharder = EpochSharder(len(data), 2, 0, 4, seed=0)
    steps = [(s, xb.shape, yb.shape)
             for s, xb, yb in BatchStream(sharder, data, 0, prefetch=False)]
    assert len(steps) == 50 // 8 and steps[0][1] == (4, 3, 32, 32)


# -- the held-out split (--test-files) ------------------------------------------------------


def _index(n_files: int) -> DatasetIndex:
    return DatasetIndex(tuple(Path(f"Ele_1_{i}.h5") for i in range(n_files)), (10,) * n_files)


@pytest.mark.parametrize("n_files,default", [(1, 0), (2, 1), (9, 1), (20, 2), (35, 3)])
def test_default_held_out_files_are_ten_percent_and_at_least_one(n_files, default):
    assert default_test_files(n_files) == default
    train, held_out = split_files(_index(n_files), None)
    assert len(train.files) == n_files - default
    assert (held_out is None) == (default == 0)


def test_the_last_files_are_held_out_and_never_sharded_for_training():
    index = _index(20)
    train, held_out = split_files(index, 3)
    assert held_out.files == index.files[17:] and train.files == index.files[:17]
    assert train.total == 170 and held_out.total == 30
    seen = set()
    for rank in range(2):   # every event any rank reads in two epochs
        sharder = EpochSharder(len(train), 2, rank, 4, seed=7)
        for epoch in range(2):
            fid, _ = train.locate(sharder.indices(epoch))
            seen.update(train.files[i] for i in fid)
    assert seen == set(index.files[:17])   # every training file, no held-out file
    # the negative control: without the split the same sharding reaches the held-out files
    fid, _ = index.locate(EpochSharder(len(index), 1, 0, 40, seed=7).indices(0))
    assert {index.files[i] for i in fid} & set(index.files[17:])


def test_holding_out_every_file_is_refused():
    with pytest.raises(UserError) as info:
        split_files(_index(2), 2)
    assert "nothing left to train on" in info.value.message and "--test-files 1" in info.value.hint
    assert split_files(_index(2), 0) == (_index(2), None)
