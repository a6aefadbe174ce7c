"""The probe's ping-pong keeps each size to a time budget, for real under mpirun.

Two busy-polling ranks on one CPU (an oversubscribed node, as the 2 fake nodes of the Slurm
rig on this 2-core machine are) take milliseconds per round trip, where idle they take a
microsecond; without the budget one probe then spends over half a minute at 8 B alone.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from conftest import FLAVOURS, SHARED_CORES, base_env, run
from hpcai.launcher.probe import (PINGPONG_MIN_SAMPLES, PINGPONG_SIZES, PingPong, ProbeRecord,
                                  sample_count)

MOST = max(most for _, most in PINGPONG_SIZES.values())
SCRIPT = """\
import json, sys
from mpi4py import MPI
from hpcai.launcher.probe import pingpong
results = pingpong(MPI.COMM_WORLD, 1, float(sys.argv[1]))
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps({p.nbytes: p.samples for p in results}))
else:
    assert results == (), results
"""


@pytest.mark.parametrize("warm_s, expected", [
    (0.001, MOST),                  # fast: every sample
    (2.0 / 40, 40),                 # the budget fits 40
    (0.5, PINGPONG_MIN_SAMPLES),    # slow: the least
    (60.0, PINGPONG_MIN_SAMPLES),
    (0.0, MOST),                    # a clock that did not move
])
def test_sample_count_fits_the_budget_within_its_bounds(warm_s, expected):
    assert sample_count(warm_s, MOST, budget_s=2.0) == expected


def test_sample_count_never_exceeds_the_sizes_most():
    assert sample_count(0.5, 4, budget_s=2.0) == 4


def _pingpong(tmp_path: Path, budget: float, *pin: str,
              env: dict | None = None) -> tuple[dict[int, int], float]:
    if "openmpi" not in FLAVOURS:
        pytest.fail("Open MPI (apt) is missing: scripts/install.sh installs it")
    script = tmp_path / "pp.py"
    script.write_text(SCRIPT)
    mpi = FLAVOURS["openmpi"]
    start = time.monotonic()
    result = run([mpi.launcher, *mpi.direct_args, "-n", "2", "--bind-to", "none", *pin,
                  sys.executable, str(script), str(budget)], env or base_env(), timeout=300)
    took = time.monotonic() - start
    assert result.returncode == 0, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    counts = {int(k): v for k, v in json.loads(last).items()}
    assert sorted(counts) == sorted(PINGPONG_SIZES), counts
    return counts, took


def test_both_ranks_agree_on_the_count_at_either_bound(tmp_path):
    """A budget that fits everything times every sample; none, the least; both ranks run
    the same count (a disagreement would hang, and the run has a timeout)."""
    everything, _ = _pingpong(tmp_path, 1e9)
    assert everything == {n: most for n, (_, most) in PINGPONG_SIZES.items()}
    least, _ = _pingpong(tmp_path, 0.0)
    assert least == {n: PINGPONG_MIN_SAMPLES for n in PINGPONG_SIZES}


def test_a_slow_path_is_cut_to_the_budget(tmp_path):
    """Both ranks pinned to CPU 0, their waits spinning (Open MPI's default, not the test
    bed's yielding): the 8 B round trip takes milliseconds, so its samples are cut and the
    probe ends in seconds (it would take about 35 s at 8 B alone)."""
    if not shutil.which("taskset"):
        pytest.fail("taskset (util-linux) is missing")
    spinning = base_env(**dict.fromkeys(SHARED_CORES))
    counts, _ = _pingpong(tmp_path, 2.0, "taskset", "-c", "0", env=spinning)
    assert counts[8] < PINGPONG_SIZES[8][1], counts


def test_a_record_keeps_the_sample_counts():
    record = ProbeRecord(rank=0, size=2, allreduce_ok=True, host="h", pid=1, affinity=(0,),
                         affinity_list="0", env={}, mpi_library_version="v", libmpi=(),
                         fabric={}, pingpong=(PingPong(8, 1.0, 0.9, 10),), partner=1)
    assert ProbeRecord.from_json(record.to_json()).pingpong == (PingPong(8, 1.0, 0.9, 10),)
