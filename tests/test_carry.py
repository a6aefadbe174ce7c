"""``bench/carry.py``: a learning run's state saved on one machine and restored on the next,
its generated data written again and checked file by file (issue 17's long runs)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hpcai.training.showers import generate
from jobs import train

REPO = Path(__file__).resolve().parent.parent
CARRY = str(REPO / "bench" / "carry.py")


def _run_dir(root: Path, seed: int = 5) -> Path:
    """A seed's run directory as ``train --generate`` leaves it: two training files and one
    held-out file of real generated showers, two checkpoints, the epoch and physics records."""
    run = root / f"seed{seed}"
    generate(run / "data", n_files=2, events_per_file=8, seed=seed)
    generate(run / "data", n_files=1, events_per_file=8, seed=1_000_000 + seed)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "ckpt-E0001-S000000.pt").write_bytes(b"older")
    (run / "checkpoints" / "ckpt-E0002-S000000.pt").write_bytes(b"newest")
    (run / "epochs.jsonl").write_text('{"epoch": 0}\n{"epoch": 1}\n')
    (run / "steps.jsonl").write_text('{"step": 0}\n')
    (run / "physics.json").write_text('{"validations": []}\n')
    return run


def _carry(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CARRY, *args], cwd=cwd, capture_output=True,
                          text=True)


def test_a_saved_run_is_restored_with_its_data_written_again_bit_for_bit(tmp_path):
    run = _run_dir(tmp_path / "old")
    state = tmp_path / "state"
    saved = _carry("save", str(run.parent), str(state), cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    kept = sorted(p.name for p in (state / "seed5").iterdir())
    assert kept == ["ckpt-E0002-S000000.pt", "data.json", "epochs.jsonl", "physics.json",
                    "steps.jsonl"]
    manifest = json.loads((state / "seed5" / "data.json").read_text())["files"]
    assert [f["name"] for f in manifest] == ["Ele_1000005_0.h5", "Ele_5_0.h5", "Ele_5_1.h5"]

    restored = _carry("restore", str(state), str(tmp_path / "new"), cwd=tmp_path)
    assert restored.returncode == 0, restored.stderr
    assert "every SHA-256 as saved" in restored.stdout
    new = tmp_path / "new" / "seed5"
    for name in ("epochs.jsonl", "steps.jsonl", "physics.json"):
        assert (new / name).read_bytes() == (run / name).read_bytes()
    assert [p.name for p in (new / "checkpoints").iterdir()] == ["ckpt-E0002-S000000.pt"]
    assert (new / "checkpoints" / "ckpt-E0002-S000000.pt").read_bytes() == b"newest"
    for f in manifest:   # written again, not copied: the state holds no data
        assert (new / "data" / f["name"]).read_bytes() == (run / "data" / f["name"]).read_bytes()

    # a later save keeps only the newest checkpoint
    (run / "checkpoints" / "ckpt-E0003-S000000.pt").write_bytes(b"later")
    assert _carry("save", str(run.parent), str(state), cwd=tmp_path).returncode == 0
    assert sorted(p.name for p in (state / "seed5").glob("*.pt")) == ["ckpt-E0003-S000000.pt"]


def test_data_that_does_not_come_out_the_same_is_refused_and_nothing_is_left(tmp_path):
    """The control: one saved SHA-256 changed, as another machine's different bytes would."""
    run = _run_dir(tmp_path / "old")
    state = tmp_path / "state"
    assert _carry("save", str(run.parent), str(state), cwd=tmp_path).returncode == 0
    path = state / "seed5" / "data.json"
    doc = json.loads(path.read_text())
    doc["files"][1]["sha256"] = "0" * 64
    path.write_text(json.dumps(doc))

    restored = _carry("restore", str(state), str(tmp_path / "new"), cwd=tmp_path)
    assert restored.returncode == 2
    assert "error: Ele_5_0.h5 written again differs" in restored.stderr
    assert "hint:" in restored.stderr and "Traceback" not in restored.stderr
    assert list((tmp_path / "new").iterdir()) == []


def test_a_seed_already_in_the_work_directory_is_never_overwritten(tmp_path):
    run = _run_dir(tmp_path / "old")
    state = tmp_path / "state"
    assert _carry("save", str(run.parent), str(state), cwd=tmp_path).returncode == 0
    (run / "epochs.jsonl").write_text("the run's own\n")

    restored = _carry("restore", str(state), str(run.parent), cwd=tmp_path)
    assert restored.returncode == 2
    assert f"error: {run} exists" in restored.stderr and "hint:" in restored.stderr
    assert (run / "epochs.jsonl").read_text() == "the run's own\n"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "ckpt-E0001-S000000.pt", "ckpt-E0002-S000000.pt"]


def test_a_restored_run_resumes_from_its_checkpoint_for_real(tmp_path):
    """A real 1-rank training saved after its first epoch, restored on "another machine"
    (another directory, no data), resumes there from its checkpoint and adds the second."""
    common = ("3dgan", "--generate", "32", "--seed", "7", "--max-steps", "2",
              "--batch-size", "2", "--validate-events", "8", "--eval-samples", "0",
              "--peak-gflops", "100")
    first = train(1, *common, "--epochs", "1", "--out", str(tmp_path / "old" / "seed7"))
    assert first.returncode == 0, first.stderr
    assert _carry("save", str(tmp_path / "old"), str(tmp_path / "state"),
                  cwd=tmp_path).returncode == 0
    assert _carry("restore", str(tmp_path / "state"), str(tmp_path / "new"),
                  cwd=tmp_path).returncode == 0
    out = tmp_path / "new" / "seed7"
    second = train(1, *common, "--epochs", "2", "--resume", "--out", str(out))
    assert second.returncode == 0, second.stderr
    log = second.stdout + second.stderr
    assert f"resumed from {out}/checkpoints/ckpt-E0001-S000000.pt at epoch 1" in log
    assert [json.loads(line)["epoch"] for line in (out / "epochs.jsonl").open()] == [0, 1]
    assert len(json.loads((out / "physics.json").read_text())["validations"]) == 2
