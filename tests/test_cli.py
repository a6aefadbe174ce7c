"""The command line: --dry-run output, and every bad input as error:/hint:, exit 2."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import FLAVOURS, base_env, run


def launch(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return run(["hpcai-launch", *args], env or base_env(), timeout=timeout)


def assert_user_error(result, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: "), result.stderr
    assert any(line.startswith("hint: ") for line in lines), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


def test_dry_run_json_is_the_plan_and_starts_nothing(tmp_path):
    marker = tmp_path / "ran"
    result = launch("--ranks-per-node", "2", "--dry-run", "--json", "--",
                    "touch", str(marker))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["mode"] == "mpirun" and plan["placement"]["ranks_per_node"] == 2
    assert [r["cpus"] for r in plan["ranks"]] == ["0", "1"]
    # the ranks' wrapper's "-- touch MARKER", or (Open MPI) each rank's command itself
    assert plan["argv"][-3:] == ["--", "touch", str(marker)] or (
        plan["argv"][-2:] == [shutil.which("touch"), str(marker)]), plan["argv"]
    assert plan["mpi"]["flavour"] in ("openmpi", "mpich", "intel")
    assert not marker.exists()


def test_dry_run_text_shows_env_and_argv():
    result = launch("--ranks-per-node", "2", "--dry-run", "--", "true")
    assert result.returncode == 0, result.stderr
    assert "OMP_NUM_THREADS=1" in result.stdout and "argv:" in result.stdout


def test_dry_run_inside_a_slurm_allocation_plans_srun():
    env = base_env(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2")
    result = launch("--ranks-per-node", "2", "--dry-run", "--json", "--", "true", env=env)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["mode"] == "srun" and "--nodes=2" in plan["argv"]
    assert "--ntasks-per-node=2" in plan["argv"]


def test_more_ranks_times_threads_than_cores(tmp_path):
    cores = len(os.sched_getaffinity(0))
    result = launch("--ranks-per-node", "2", "--threads-per-rank", str(cores), "--",
                    "touch", str(tmp_path / "x"))
    assert_user_error(result, "--oversubscribe")
    assert not (tmp_path / "x").exists()


def test_more_ranks_than_the_cpus_a_taskset_allows(tmp_path):
    """Two ranks under ``taskset -c C`` need two cores where one is allowed: refused before
    any rank starts. The control is the same launch on the whole node, which runs."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 CPUs to restrict a launch to one, this process has {allowed}")
    marker = tmp_path / "x"
    result = run(["taskset", "-c", str(allowed[-1]), "hpcai-launch", "--ranks-per-node", "2",
                  "--", "touch", str(marker)], base_env())
    assert_user_error(result, "the node has 1", "this process's CPU affinity")
    assert not marker.exists()
    result = launch("--ranks-per-node", "2", "--", "touch", str(marker))
    assert result.returncode == 0, result.stderr
    assert marker.exists()


def test_oversubscribe_lets_it_run(tmp_path):
    result = launch("--ranks-per-node", "2", "--threads-per-rank", "2", "--oversubscribe",
                    "--", "python", "-m", "hpcai.launcher.probe", "--quiet", "--out",
                    str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert len(list(tmp_path.glob("rank-*.json"))) == 2


def test_unknown_mpi_name():
    assert_user_error(launch("--mpi", "lam", "--", "true"), "unknown MPI", "openmpi")


def test_unknown_mpi_behind_the_launcher(tmp_path):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'SuperMPI 9.1 (c) nobody'\n")
    fake.chmod(0o755)
    assert_user_error(launch("--mpirun", str(fake), "--", "true"), "unknown MPI", "SuperMPI")


def test_missing_command():
    assert_user_error(launch("--ranks-per-node", "2", "--", "no-such-program-hpcai"),
                      "command not found")
    assert_user_error(launch("--ranks-per-node", "2"), "no command")


def test_zero_threads_per_rank():
    assert_user_error(launch("--threads-per-rank", "0", "--", "true"), "--threads-per-rank")


def test_host_named_twice_with_conflicting_slots():
    assert_user_error(launch("--hosts", "node1:2,node1:4", "--", "true"),
                      "node1", "conflicting")


def test_bad_option_value_is_an_error_hint():
    assert_user_error(launch("--ranks-per-node", "two", "--", "true"), "invalid int")


@pytest.mark.mpi
def test_ranks_per_node_mismatch_under_mpirun(tmp_path):
    if "openmpi" not in FLAVOURS:
        pytest.skip("needs Open MPI")
    result = run([FLAVOURS["openmpi"].launcher, "-n", "2", "--allow-run-as-root",
                  "hpcai-launch", "--ranks-per-node", "1", "--",
                  "python", "-m", "hpcai.launcher.probe", "--out", str(tmp_path)], base_env())
    assert result.returncode != 0
    assert "error: mpirun started 2 task(s) on this node but --ranks-per-node is 1" \
        in result.stderr
    assert "hint:" in result.stderr
    assert result.stderr.count("error:") == 1   # said once, by local rank 0
    assert not list(tmp_path.glob("rank-*.json"))


def test_verbose_shows_the_traceback():
    result = launch("-v", "--threads-per-rank", "0", "--", "true")
    assert result.returncode == 2 and "Traceback" in result.stderr
