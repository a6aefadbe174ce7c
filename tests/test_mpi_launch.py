"""Real MPI runs through hpcai-launch under Open MPI, MPICH and Intel MPI (impi-rt)."""

from __future__ import annotations

import os

import pytest

from conftest import base_env, run
from rankcheck import assert_one_world, load_ranks

pytestmark = pytest.mark.mpi
PROBE = ["python", "-m", "hpcai.launcher.probe", "--quiet", "--out"]


def test_hpcai_starts_the_mpi_itself(mpi, tmp_path):
    """Mode 1: outside any allocation, hpcai-launch builds and runs mpirun/mpiexec."""
    env = base_env(**mpi.env)
    result = run(["hpcai-launch", "--mpi", mpi.name, "--mpirun", mpi.launcher,
                  "--ranks-per-node", "2", "--report-bindings", "--", *PROBE, str(tmp_path)],
                 env)
    assert result.returncode == 0, result.stderr
    records = load_ranks(tmp_path)
    assert_one_world(records, 2, mpi.lib_marker)
    assert {r["affinity_list"] for r in records} == {"0", "1"}
    assert {r["env"]["OMP_NUM_THREADS"] for r in records} == {"1"}
    assert result.stderr.count("hpcai: rank") == 2 and "MISMATCH" not in result.stderr


def test_a_launch_plans_within_its_cpu_affinity(mpi, tmp_path):
    """``taskset -c C hpcai-launch``: the rank is placed on cpu C with one thread. The
    control is the same launch without taskset, which places the rank on the whole node."""
    from hpcai.launcher.node.topology import format_cpulist, from_sysfs
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 CPUs to restrict a launch to one, this process has {allowed}")
    last = str(allowed[-1])
    whole = (format_cpulist(allowed), str(len(from_sysfs().cores)))
    for prefix, expected in ((["taskset", "-c", last], (last, "1")), ([], whole)):
        out = tmp_path / (prefix[-1] if prefix else "whole")
        result = run([*prefix, "hpcai-launch", "--mpi", mpi.name, "--mpirun", mpi.launcher,
                      "--ranks-per-node", "1", "--report-bindings", "--", *PROBE, str(out)],
                     base_env(**mpi.env))
        assert result.returncode == 0, result.stderr
        [record] = load_ranks(out)
        assert (record["affinity_list"], record["env"]["OMP_NUM_THREADS"]) == expected, \
            (prefix, result.stderr)
        assert "MISMATCH" not in result.stderr


def test_rank_wrapper_under_plain_mpirun(mpi, tmp_path):
    """Mode 3: the user's own `mpirun -n 2 hpcai-launch -- CMD`."""
    env = base_env(**mpi.env)
    result = run([mpi.launcher, "-n", "2", *mpi.direct_args, "hpcai-launch", "--mpi", mpi.name,
                  "--", *PROBE, str(tmp_path)], env)
    assert result.returncode == 0, result.stderr
    assert_one_world(load_ranks(tmp_path), 2, mpi.lib_marker)


def test_singleton_worlds_are_caught(tmp_path):
    """Control: MPICH's mpiexec with mpi4py loading Open MPI starts 2 singletons, each
    "rank 0 of 1"; the world check must reject that (so it can fail). Each process writes to
    a directory of its own (MPMD), so both records are seen: a probe that crashed or wrote
    nothing fails this test instead of passing it."""
    if "MPI_LOCALRANKID" in base_env():
        pytest.skip("unexpected hydra env")
    from conftest import FLAVOURS
    if "mpich" not in FLAVOURS or "openmpi" not in FLAVOURS:
        pytest.skip("needs both MPICH and Open MPI")
    outs = [tmp_path / "first", tmp_path / "second"]
    argv = [FLAVOURS["mpich"].launcher, "-n", "1", *PROBE, str(outs[0]),
            ":", "-n", "1", *PROBE, str(outs[1])]
    result = run(argv, base_env(MPI4PY_MPIABI="openmpi"))
    assert result.returncode == 0, result.stderr
    records = [record for out in outs for record in load_ranks(out)]
    assert [(r["rank"], r["size"]) for r in records] == [(0, 1), (0, 1)], records
    assert records[0]["pid"] != records[1]["pid"], records
    with pytest.raises(AssertionError):
        assert_one_world(records, 2)


def test_torch_env_init_runs_unmodified(tmp_path):
    """An unmodified torch.distributed env:// script sees one world of 2 under hpcai-launch."""
    script = tmp_path / "ddp_env.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='env://')\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "open(os.path.join(os.path.dirname(__file__), f'out-{dist.get_rank()}'), 'w')"
        ".write(f'{dist.get_world_size()} {t.item()} {os.environ[\"LOCAL_RANK\"]}')\n"
        "dist.destroy_process_group()\n")
    result = run(["hpcai-launch", "--ranks-per-node", "2", "--", "python", str(script)],
                 base_env(), timeout=180)
    assert result.returncode == 0, result.stderr
    outputs = sorted((tmp_path / f"out-{r}").read_text() for r in range(2))
    assert outputs == ["2 3.0 0", "2 3.0 1"]


def test_hpcai_binds_ranks_the_launcher_left_unbound(tmp_path):
    """mpirun --bind-to none: the wrapper applies the planned CPUs itself and says so."""
    from conftest import FLAVOURS
    if "openmpi" not in FLAVOURS:
        pytest.skip("needs Open MPI")
    result = run([FLAVOURS["openmpi"].launcher, "-n", "2", "--allow-run-as-root",
                  "--bind-to", "none", "hpcai-launch", "--report-bindings", "--",
                  *PROBE, str(tmp_path)], base_env())
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("bound-by hpcai-launch OK") == 2, result.stderr
    assert_one_world(load_ranks(tmp_path), 2)
