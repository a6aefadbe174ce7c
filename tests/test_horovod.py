"""Horovod through hpcai-launch: unmodified user scripts, and --comm horovod in the engine.

Skipped, with the reason printed, where Horovod is not built (``scripts/build-horovod.sh``,
which ``run-tests.sh`` runs: about 6 minutes once, then a cached wheel). The TensorFlow
engine's ``--comm horovod`` is tested on test_tf_training.py's resumed 3DGAN run
(``needs_hvd_tf`` marks it).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from conftest import base_env, run
from hpcai.training.config import horovod_built

pytestmark = pytest.mark.mpi
PROGRAMS = Path(__file__).parent / "programs"
BUILD_HINT = "Horovod is not built here: run scripts/build-horovod.sh (README, 'Horovod')"


# checked without importing Horovod: the tests run it in their own processes
needs_hvd_torch = pytest.mark.skipif(not horovod_built("torch"), reason=BUILD_HINT)
needs_hvd_tf = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or not horovod_built("tensorflow"),
    reason=BUILD_HINT + " (with TensorFlow)")

WORKER = re.compile(r"horovod-worker rank=(\d+) size=(\d+) local_rank=(\d+) local_size=(\d+) "
                    r"host=(\S+) weights_crc=([0-9a-f]{8})")


def workers(stdout: str) -> dict[int, dict]:
    """What each Horovod worker printed about itself, by rank."""
    found = {}
    for m in WORKER.finditer(stdout):
        rank, size, local_rank, local_size, host, crc = m.groups()
        found[int(rank)] = {"size": int(size), "local_rank": int(local_rank),
                            "local_size": int(local_size), "host": host, "crc": crc}
    return found


def check_consistent_world(stdout: str, size: int) -> None:
    seen = workers(stdout)
    assert sorted(seen) == list(range(size)), stdout
    assert {w["size"] for w in seen.values()} == {size}, seen
    assert len({w["crc"] for w in seen.values()}) == 1, f"replicas differ: {seen}"
    assert f"Total img/sec on {size} CPU(s)" in stdout


@needs_hvd_torch
def test_unmodified_horovod_script_under_mpirun():
    result = run(["hpcai-launch", "-N", "2", "--", sys.executable,
                  str(PROGRAMS / "horovod_synthetic_benchmark.py"), "--num-iters", "2"],
                 base_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    check_consistent_world(result.stdout, 2)
    seen = workers(result.stdout)
    assert sorted(w["local_rank"] for w in seen.values()) == [0, 1]
    assert {w["local_size"] for w in seen.values()} == {2}


@needs_hvd_torch
def test_comm_horovod_pytorch_trains_and_keeps_replicas_identical(tmp_path):
    out = tmp_path / "run"
    result = run(["hpcai-launch", "-N", "2", "--", "train", "resnet-tiny", "--image-size",
                  "32", "--classes", "10", "--batch-size", "4", "--samples", "16",
                  "--epochs", "1", "--comm", "horovod", "--verify-every", "1",
                  "--eval-samples", "0", "--peak-gflops", "50", "--out", str(out)],
                 base_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = [json.loads(x) for x in (out / "epochs.jsonl").read_text().splitlines()]
    assert record["provenance"]["comm"] == "horovod"
    assert record["provenance"]["comm_version"] == "horovod 0.28.1"
    assert record["steps"] == 2 and record["allreduce"]["calls"] >= 2


@needs_hvd_torch
def test_horovod_on_another_mpi_abi_is_refused_before_mpi_starts(tmp_path):
    """Horovod linked to Open MPI under MPICH would crash in MPI_Init (it did: SIGSEGV)."""
    import shutil

    if shutil.which("mpiexec.mpich") is None:
        pytest.skip("MPICH (mpiexec.mpich) not installed")
    out = tmp_path / "run"
    result = run(["hpcai-launch", "--mpi", "mpich", "-N", "2", "--", "train", "resnet-tiny",
                  "--image-size", "32", "--classes", "10", "--comm", "horovod",
                  "--out", str(out)], base_env(), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Horovod is built against libmpi.so.40 (openmpi ABI)" in result.stderr
    assert "mpich-ABI MPI" in result.stderr and "hint: " in result.stderr
    assert not out.exists()
