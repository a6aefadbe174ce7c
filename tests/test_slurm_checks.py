"""Under a real private Slurm: the test cluster's own munge key, and the warning when srun
runs without --kill-on-bad-exit (srun exports nothing that says so: rank 0 reads it from
srun's command line, found with ``scontrol show step``)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from localcluster import LocalCluster, missing_programs

VENV_BIN = os.path.dirname(sys.executable)
WARNING = "warning: srun started the ranks without --kill-on-bad-exit"

_missing = missing_programs()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(bool(_missing), reason="Slurm/munge not installed (missing: "
                       f"{', '.join(_missing)}; apt-get install slurm-wlm munge)"),
]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster() as c:
        yield c


def run(cluster: LocalCluster, argv: list[str]):
    env = {"PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", os.defpath)}
    return cluster.run(argv, timeout=120, env=env,
                       unset=("HPCAI_LAUNCHER", "HPCAI_RANKS_PER_NODE", "MASTER_PORT"))


def test_the_cluster_makes_its_own_munge_key(cluster):
    key = cluster.munge_key
    assert key is not None and key.parent == cluster.dir / "munge"
    assert stat.S_IMODE(key.stat().st_mode) == 0o400
    data = key.read_bytes()
    assert len(data) >= 32
    host = Path("/etc/munge/munge.key")
    if os.access(host, os.R_OK):
        assert data != host.read_bytes(), "the host's munge key was copied"
    assert run(cluster, ["srun", "-n", "1", "true"]).returncode == 0   # and it works


@pytest.mark.parametrize("flags,warned", [
    ([], True),
    (["--kill-on-bad-exit=0"], True),
    (["--kill-on-bad-exit"], False),
    (["--kill-on-bad-exit=1"], False),
    (["-K"], False),
    (["-lK1"], False),
])
def test_srun_without_kill_on_bad_exit_is_warned_once(cluster, flags, warned):
    result = run(cluster, ["srun", "--mpi=pmix", *flags, "--ntasks-per-node=2",
                           "hpcai-launch", "--ranks-per-node", "2", "--", "true"])
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(WARNING) == (1 if warned else 0), result.stderr


def test_a_program_flag_is_not_taken_for_srun_s(cluster):
    """``-K`` after the program belongs to the program, not to srun."""
    result = run(cluster, ["srun", "--mpi=pmix", "--ntasks-per-node=2", "hpcai-launch",
                           "--ranks-per-node", "2", "--", "echo", "-K"])
    assert result.stderr.count(WARNING) == 1, result.stderr


DETECT = ("import os; from hpcai.slurm.step import srun_kills_on_bad_exit as k; "
          "print('kills:', os.environ['SLURM_PROCID'], k(dict(os.environ), []))")


@pytest.mark.parametrize("flags,answer", [([], "False"), (["-K"], "True")])
def test_the_answer_is_read_not_guessed(cluster, flags, answer):
    """Control for the silence above: rank 0 really finds srun and reads its flag (None
    would mean "cannot tell", which is silent too)."""
    result = run(cluster, ["srun", *flags, "-n", "1", "python", "-c", DETECT])
    assert result.returncode == 0, result.stderr
    assert f"kills: 0 {answer}" in result.stdout, result.stdout + result.stderr


def test_hpcai_launchs_own_srun_is_not_warned_about(cluster):
    """Inside an allocation hpcai-launch starts srun itself, with --kill-on-bad-exit=1."""
    result = run(cluster, ["salloc", "-n", "2", "hpcai-launch", "--ranks-per-node", "2",
                           "--", "python", "-c", DETECT])
    assert result.returncode == 0, result.stderr
    assert WARNING not in result.stderr, result.stderr
    assert "kills: 0 True" in result.stdout, result.stdout + result.stderr
