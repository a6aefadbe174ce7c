"""A ``train`` command's inputs are checked once, before any rank starts (issue 42, item 7).

Seven bad inputs under ``hpcai-launch -N 2 -- train …``: no data source, a data directory
that is missing, not HDF5, without datasets or empty, an unwritable ``--out``, and
``--resume`` over a corrupt checkpoint. Each is one ``error:``/``hint:``, exit 2, with no
rank output, no MPI launcher's banner and nothing written. The control for each is the same
input run bare (``train …``), which the ranks' own checks refuse with the same error
(``hpcai.training.preflight`` is the one owner of these checks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_input_checks import Sandbox, refused

BANNERS = ("mpirun", "MPI_ABORT", "PRTE", "prterun", "mpiexec", "BAD TERMINATION")


@pytest.fixture
def box(tmp_path) -> Sandbox:
    return Sandbox(tmp_path)


def _data(root: Path, case: str) -> Path:
    """A --data directory of the given fault."""
    import h5py

    path = root / f"data-{case}"
    if case == "missing":
        return path
    path.mkdir()
    if case == "not-hdf5":
        (path / "Ele_0_0.h5").write_text("not an HDF5 file\n")
    elif case == "no-datasets":
        h5py.File(path / "Ele_0_0.h5", "w").close()
    return path


def _corrupt_checkpoint(out: Path) -> Path:
    """OUT/checkpoints holding one checkpoint of garbage bytes."""
    (out / "checkpoints").mkdir(parents=True)
    bad = out / "checkpoints" / "ckpt-E0001-S000000.pt"
    bad.write_bytes(b"PK\x03\x04 truncated while copying")
    return bad


CASES = {   # case: (train arguments after the model, with {data} and {out}; the error)
    "no data source": (["--out", "{out}"], "3dgan needs data: --data DIR"),
    "missing": (["--data", "{data}", "--out", "{out}"], "does not exist"),
    "not-hdf5": (["--data", "{data}", "--out", "{out}"], "cannot open Ele_0_0.h5 as HDF5"),
    "no-datasets": (["--data", "{data}", "--out", "{out}"],
                    "Ele_0_0.h5 has no ECAL dataset (it holds nothing)"),
    "empty": (["--data", "{data}", "--out", "{out}"], "no .h5 files in"),
    "unwritable out": (["--generate", "8", "--out", "/proc/hpcai-out"],
                       "output directory /proc/hpcai-out is not writable"),
}


def _args(case: str, box: Sandbox, root: Path) -> list[str]:
    template, _ = CASES[case]
    data = _data(root, case) if "{data}" in template else None
    return ["3dgan", *(a.format(data=data, out=box.out) for a in template)]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("error: ", "hint: "))]


def _refused_before_any_rank(result, box: Sandbox, fragment: str) -> str:
    err = refused(result, box, fragment)
    assert result.stdout == "", "a rank (or the plan) printed something"
    for banner in BANNERS:
        assert banner not in err, (banner, err)
    assert err.count("hint: ") == 1, err
    return err


@pytest.mark.parametrize("case", list(CASES))
def test_launch_refuses_bad_input_before_any_rank(box, tmp_path, case):
    args = _args(case, box, tmp_path)
    launched = box.run("hpcai-launch", "-N", "2", "--", "train", *args)
    err = _refused_before_any_rank(launched, box, CASES[case][1])
    bare = box.run("train", *args)     # the control: the ranks' own check, bare
    refused(bare, box, CASES[case][1])
    assert _error_lines(err) == _error_lines(bare.stderr)


def test_launch_refuses_resume_over_a_corrupt_checkpoint(tmp_path):
    box = Sandbox(tmp_path)
    bad = _corrupt_checkpoint(box.out)
    args = ["3dgan", "--generate", "8", "--resume", "--out", str(box.out)]
    fragment = "--resume: none of the 1 checkpoint(s)"
    results = []
    for argv in (["hpcai-launch", "-N", "2", "--", "train", *args], ["train", *args]):
        results.append(box.run(*argv))
        assert sorted(p.name for p in box.out.rglob("*")) == ["checkpoints", bad.name], \
            "something was written"
    launched, bare = results
    box.out.rename(tmp_path / "kept")   # refused() checks that OUT was not made
    err = _refused_before_any_rank(launched, box, fragment)
    assert bad.name in err and "nothing was trained" in err
    # the control: bare, the rank's own check (after its warning about the file)
    assert bare.returncode == 2 and bare.stderr.count("error: ") == 1, bare.stderr
    assert fragment in bare.stderr and bad.name in bare.stderr


def test_good_input_passes_the_launchers_check(box, tmp_path):
    """Control: the same checks pass valid input (a real data file, a writable --out, a
    readable checkpoint is test_faults' resume); the dry run writes nothing."""
    from hpcai.training.showers import generate

    data = tmp_path / "data"
    generate(data, n_files=1, events_per_file=4)
    result = box.run("hpcai-launch", "-N", "2", "--dry-run", "--", "train", "3dgan", "--data",
                     str(data), "--out", str(box.out))
    assert result.returncode == 0, result.stderr
    assert not box.out.exists()


@pytest.mark.parametrize("sub", ["sbatch", "sweep"])
def test_jobs_refuse_bad_input_before_anything_is_written(box, tmp_path, sub):
    data = _data(tmp_path, "missing")
    result = box.run("hpcai-launch", sub, "--", "train", "3dgan", "--data", str(data),
                     "--out", str(box.out))
    refused(result, box, f"data directory {data} does not exist")


def test_sbatch_checks_the_resume_its_script_adds(box, tmp_path):
    """The job script resumes (``--resume`` added): a corrupt checkpoint is refused now."""
    out = tmp_path / "run"
    _corrupt_checkpoint(out)
    result = box.run("hpcai-launch", "sbatch", "--", "train", "3dgan", "--generate", "8",
                     "--out", str(out))
    refused(result, box, "--resume: none of the 1 checkpoint(s)")
    control = box.run("hpcai-launch", "sbatch", "--container", str(tmp_path / "image"), "--",
                      "train", "3dgan", "--generate", "8", "--out", str(out))
    assert control.returncode == 0, control.stderr   # in a container: the image's paths
