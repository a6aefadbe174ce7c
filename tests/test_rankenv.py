"""Rank identity from every launcher's env, and its torch/Horovod translation."""

from __future__ import annotations

import pytest

from hpcai.slurm.nodelist import expand_hostlist, parse_tasks_per_node
from hpcai.launcher.job.rankenv import (
    PORT_BASE, PORT_SPAN, from_environ, rendezvous_port, torch_env)


def test_openmpi_env():
    info = from_environ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                         "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                         "OMPI_MCA_ess_base_jobid": "123"})
    assert (info.rank, info.size, info.local_rank, info.local_size, info.node_rank) == \
        (5, 8, 1, 4, 1)
    env = torch_env(info, {"MASTER_ADDR": "n1", "MASTER_PORT": "4242"})
    assert env == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                   "NODE_RANK": "1", "GROUP_RANK": "1", "MASTER_ADDR": "n1",
                   "MASTER_PORT": "4242"}


def test_hydra_env_mpich_and_intel():
    info = from_environ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1",
                         "MPI_LOCALNRANKS": "2", "I_MPI_HYDRA_UUID": "abc"})
    assert (info.rank, info.node_rank, info.started_by) == (3, 1, "hydra")
    single = from_environ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                           "MPI_LOCALNRANKS": "2"}, ppid=77)
    env = torch_env(single, {})
    assert env["MASTER_ADDR"] == "127.0.0.1"  # whole job on this node
    assert env["MASTER_PORT"] == str(rendezvous_port("hydra-ppid:77"))


def test_mpiexec_inside_a_slurm_job_meets_at_the_jobs_first_node():
    """A site's mpiexec in a batch job (Hydra's proxies are one srun step; Open MPI's
    daemons too): rank 0 is on the job's first node, and every node keys one port."""
    job = {"SLURM_JOB_ID": "31", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0"}
    hydra = [from_environ({"PMI_RANK": str(r), "PMI_SIZE": "4", "MPI_LOCALRANKID": str(r % 2),
                           "MPI_LOCALNRANKS": "2", **job}, ppid=100 + r // 2)
             for r in range(4)]
    ompi = [from_environ({"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "4",
                          "OMPI_COMM_WORLD_LOCAL_RANK": str(r % 2),
                          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "9",
                          **job}) for r in range(4)]
    for ranks in (hydra, ompi):
        envs = [torch_env(info, {}) for info in ranks]
        assert {e["MASTER_ADDR"] for e in envs} == {"n1"}
        assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert hydra[0].job_key == "slurm:31.0"


def test_slurm_step_env():
    env = {"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_PROCID": "6",
           "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "n[07-08]"}
    info = from_environ(env)
    assert (info.rank, info.size, info.local_rank, info.local_size, info.node_rank) == \
        (6, 8, 2, 4, 1)
    out = torch_env(info, env)
    assert out["MASTER_ADDR"] == "n07"
    assert out["MASTER_PORT"] == str(rendezvous_port("slurm:4711.0"))


def test_batch_script_is_not_a_rank():
    assert from_environ({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0"}) is None
    assert from_environ({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0",
                         "SLURM_STEP_ID": str(0xFFFFFFFB)}) is None
    assert from_environ({}) is None


def test_every_step_of_a_job_has_its_own_port():
    """Used to repeat every 8 steps (the step was taken modulo 8)."""
    for job in (1, 4711, 9_999_999):
        ports = [rendezvous_port(f"slurm:{job}.{step}") for step in range(PORT_SPAN)]
        assert len(set(ports)) == PORT_SPAN
        assert min(ports) == PORT_BASE and max(ports) == PORT_BASE + PORT_SPAN - 1 < 32768
    assert rendezvous_port("slurm:4711.0") != rendezvous_port("slurm:4711.8")


def test_the_same_step_of_two_jobs_collides_only_a_span_apart():
    for step in (0, 1, 7):
        ports = {rendezvous_port(f"slurm:{job}.{step}") for job in range(5000, 5000 + PORT_SPAN)}
        assert len(ports) == PORT_SPAN
    assert rendezvous_port("slurm:5.0") == rendezvous_port(f"slurm:{5 + PORT_SPAN}.0")


@pytest.mark.parametrize("steps,window", [(8, 1151), (16, 440), (64, 102)])
def test_nearby_jobs_do_not_collide_within_the_stated_window(steps, window):
    """The docstring's bounds, checked on every pair (a shift of the job ids changes
    nothing: the formula depends on their difference only)."""
    base = 123_456
    seen: dict[int, tuple[int, int]] = {}
    for job in range(base, base + window):
        for step in range(steps):
            port = rendezvous_port(f"slurm:{job}.{step}")
            assert port not in seen, (f"{job}.{step} and {seen[port]} share port {port}")
            seen[port] = (job, step)
    # and the window is tight: one more job id and two of these steps meet
    clash = {rendezvous_port(f"slurm:{job}.{step}") for job in range(base, base + window + 1)
             for step in range(steps)}
    assert len(clash) < (window + 1) * steps


def test_other_launchers_hash_into_the_same_range():
    for key in ("ompi:123", "hydra-ppid:77", "abc"):
        assert PORT_BASE <= rendezvous_port(key) < PORT_BASE + PORT_SPAN


def test_hostlists():
    assert expand_hostlist("n[1-3],login1") == ("n1", "n2", "n3", "login1")
    assert expand_hostlist("gpu[01-02,10]") == ("gpu01", "gpu02", "gpu10")
    assert parse_tasks_per_node("2(x3),1") == (2, 2, 2, 1)


def test_srun_kill_on_bad_exit_flag_is_read_from_srun_s_own_options():
    from hpcai.slurm.step import flag_in_argv

    program = ["--ranks-per-node", "2", "--", "train", "3dgan"]
    line = ["srun", "--mpi=pmix", "-n", "2"]
    for flags, said in ([], None), (["-K"], True), (["-K0"], False), (["-lK"], True), \
            (["--kill-on-bad-exit"], True), (["--kill-on-bad-exit=0"], False), \
            (["--kill-on-bad=1"], True), (["-K", "--kill-on-bad-exit=0"], False), \
            (["-n2K"], None), (["-k"], None):
        argv = [*line, *flags, "hpcai-launch", *program]
        assert flag_in_argv(argv, program) is said, flags
    # a -K of the program is not srun's
    assert flag_in_argv([*line, "hpcai-launch", "--", "prog", "-K"],
                        ["--", "prog", "-K"]) is None
