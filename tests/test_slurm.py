"""hpcai-launch under a real Slurm (munged + slurmctld + slurmd started by the tests).

Two cluster shapes, one module-scoped fixture each:
- the real node (task/affinity: Slurm binds the tasks), Open MPI over pmix and MPICH
  over pmi2;
- two fake nodes n1, n2 of 2 CPUs on this same machine (task/none: hpcai binds).

Every srun has a timeout and the MPI traffic is pinned to the loopback interface
(``LocalCluster.env``). The fixtures stop the daemons whatever the tests do.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localcluster import LocalCluster, missing_programs
from hpcai.training.config import horovod_built

SRUN_TIMEOUT = 120
VENV_BIN = os.path.dirname(sys.executable)     # the venv running pytest holds hpcai-launch
PROBE = ("python", "-m", "hpcai.launcher.probe")

_missing = missing_programs()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(bool(_missing), reason="Slurm/munge not installed (missing: "
                       f"{', '.join(_missing)}; apt-get install slurm-wlm munge)"),
]


def _have_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


needs_mpi4py = pytest.mark.skipif(not _have_module("mpi4py"), reason="mpi4py not installed")
needs_openmpi = pytest.mark.skipif(shutil.which("mpirun.openmpi") is None,
                                   reason="Open MPI (mpirun.openmpi) not installed")
needs_mpich = pytest.mark.skipif(shutil.which("mpiexec.mpich") is None,
                                 reason="MPICH (mpiexec.mpich) not installed")


# --- fixtures and helpers ----------------------------------------------------------------

# Variables from the caller's shell that would change what hpcai-launch plans.
_UNSET = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
          "LOCAL_WORLD_SIZE", "NODE_RANK", "MPI4PY_MPIABI", "HPCAI_RANKS_PER_NODE",
          "HPCAI_THREADS_PER_RANK", "HPCAI_LAUNCHER", "HPCAI_MPI", "HPCAI_MPIRUN",
          "HPCAI_TOPOLOGY", "OMPI_MCA_btl")


def _cluster(cluster: LocalCluster, cache: Path, **extra: str):
    cluster.test_env = {"PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", os.defpath),
                        "HPCAI_CACHE": str(cache), **extra}
    return cluster


@pytest.fixture(scope="module")
def real_node(tmp_path_factory):
    """The real node: ``NodeName=<hostname> CPUs=<nproc>``, task/affinity."""
    with LocalCluster() as cluster:
        yield _cluster(cluster, tmp_path_factory.mktemp("hpcai-cache"))


@pytest.fixture(scope="module")
def fake_nodes(tmp_path_factory):
    """Two fake nodes n1, n2 with 2 CPUs each (task/none)."""
    with LocalCluster(fake_nodes=2, cpus_per_node=2) as cluster:
        # Nothing injected: hpcai derives MASTER_ADDR from the node list. n1 does not resolve
        # here, so these tests use no torch rendezvous (tests/test_netns.py: nodes that do).
        yield _cluster(cluster, tmp_path_factory.mktemp("hpcai-cache"))


def run(cluster: LocalCluster, argv: list[str], timeout: float = SRUN_TIMEOUT,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    unset = tuple(k for k in _UNSET if k not in cluster.test_env
                  and k not in cluster.env)
    try:
        return cluster.run(argv, timeout=timeout, env=cluster.test_env, unset=unset,
                           cwd=str(cwd) if cwd else None)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{shlex.join(argv)} did not finish in {timeout} s\n"
                    f"stdout: {exc.stdout!r}\nstderr: {exc.stderr!r}\n{cluster.log_tails()}")


def ok(cluster: LocalCluster, argv: list[str], **kw) -> subprocess.CompletedProcess:
    result = run(cluster, argv, **kw)
    assert result.returncode == 0, (f"{shlex.join(argv)} exited {result.returncode}\n"
                                    f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def records(out: Path) -> dict[int, dict]:
    found = {}
    for path in sorted(out.glob("rank-*.json")):
        data = json.loads(path.read_text())
        found[data["rank"]] = data
    return found


def check_world(recs: dict[int, dict], size: int, ranks_per_node: int) -> None:
    """Size, allreduce and the torch variables agree with the MPI ranks."""
    assert sorted(recs) == list(range(size)), f"rank files: {sorted(recs)}"
    for rank, rec in recs.items():
        assert rec["size"] == size, f"rank {rank} saw world size {rec['size']} " \
                                    "(singletons: wrong srun --mpi plugin?)"
        assert rec["allreduce_ok"] is True
        env = rec["env"]
        assert env["RANK"] == str(rank)
        assert env["WORLD_SIZE"] == str(size)
        assert env["LOCAL_WORLD_SIZE"] == str(ranks_per_node)
        assert env["LOCAL_RANK"] == str(rank % ranks_per_node)    # srun's block distribution
        assert env["NODE_RANK"] == str(rank // ranks_per_node)
        assert env["MASTER_ADDR"] and env["MASTER_PORT"], env
        assert rec["affinity"], f"rank {rank} has an empty CPU set"
        assert rec["affinity_list"] == env["HPCAI_CPUS"], \
            f"rank {rank}: real CPUs {rec['affinity_list']} != planned {env['HPCAI_CPUS']}"
    assert len({r["env"]["MASTER_PORT"] for r in recs.values()}) == 1
    assert len({r["env"]["MASTER_ADDR"] for r in recs.values()}) == 1


def check_disjoint_per_node(recs: dict[int, dict]) -> None:
    by_node: dict[str, list[set[int]]] = {}
    for rec in recs.values():
        by_node.setdefault(rec["env"]["NODE_RANK"], []).append(set(rec["affinity"]))
    for node, sets in by_node.items():
        union = set().union(*sets)
        assert len(union) == sum(map(len, sets)), f"node {node}: CPU sets overlap: {sets}"


def srun_probe(cluster: LocalCluster, out: Path, srun_args: list[str],
               launch_args: list[str]) -> subprocess.CompletedProcess:
    return ok(cluster, ["srun", *srun_args, "hpcai-launch", *launch_args, "--",
                        *PROBE, "--out", str(out)])


# --- the cluster itself ------------------------------------------------------------------

def test_real_node_is_up(real_node):
    assert Path(real_node.env["SLURM_CONF"]).is_file()
    assert real_node.env["OMPI_MCA_btl_tcp_if_include"] == "lo"
    assert real_node.env["UCX_NET_DEVICES"] == "lo"
    states = real_node.node_states()
    assert list(states) == [real_node.hostname], states
    assert real_node.start_seconds is not None and real_node.start_seconds < 60


def test_cluster_stops_exactly_its_daemons(tmp_path):
    cluster = LocalCluster(fake_nodes=1, cpus_per_node=1)
    with cluster:
        procs = [p for _, p in cluster.processes]
        names = [n for n, _ in cluster.processes]
        workdir = cluster.dir
        assert names == ["munged", "slurmctld", "slurmd n1"]
        assert all(p.poll() is None for p in procs)
        assert "OMPI_MCA_btl" in cluster.env
    assert all(p.returncode is not None for p in procs), "a daemon survived stop()"
    assert cluster.processes == []
    assert workdir is not None and not workdir.exists()


# --- one real node -----------------------------------------------------------------------

@needs_mpi4py
@needs_openmpi
def test_real_node_openmpi_pmix(real_node, tmp_path):
    out = tmp_path / "out"
    result = srun_probe(real_node, out, ["--mpi=pmix", "--ntasks-per-node", "2"],
                        ["--ranks-per-node", "2"])
    recs = records(out)
    assert sorted(p.name for p in out.glob("rank-*.json")) == ["rank-0.json", "rank-1.json"], \
        result.stdout + result.stderr
    check_world(recs, size=2, ranks_per_node=2)
    check_disjoint_per_node(recs)
    for rec in recs.values():
        assert any("libmpi.so.40" in lib for lib in rec["libmpi"]), rec["libmpi"]
        assert rec["env"]["MASTER_ADDR"] == "127.0.0.1"   # the whole job is on this node


@needs_mpi4py
@needs_mpich
def test_real_node_mpich_pmi2(real_node, tmp_path):
    out = tmp_path / "out"
    result = srun_probe(real_node, out, ["--mpi=pmi2", "--ntasks-per-node", "2"],
                        ["--mpi", "mpich", "--ranks-per-node", "2"])
    recs = records(out)
    assert sorted(recs) == [0, 1], result.stdout + result.stderr
    check_world(recs, size=2, ranks_per_node=2)
    check_disjoint_per_node(recs)
    for rec in recs.values():
        assert any("mpich" in Path(lib).name for lib in rec["libmpi"]), rec["libmpi"]
        assert not any("libmpi.so.40" in lib for lib in rec["libmpi"]), rec["libmpi"]
        assert "MPICH" in rec["mpi_library_version"]
    # The Debian layout needs the libmpi.so.12 compat link, made under HPCAI_CACHE.
    links = list(Path(real_node.test_env["HPCAI_CACHE"]).rglob("libmpi.so.12"))
    assert links and all(p.is_symlink() for p in links), links


@pytest.mark.parametrize("command", [["true"], [*PROBE]], ids=["true", "probe"])
def test_ranks_per_node_mismatch(real_node, tmp_path, command):
    out = tmp_path / "out"
    argv = ["srun", "--ntasks-per-node", "2", "hpcai-launch", "--ranks-per-node", "1",
            "--", *command]
    if command != ["true"]:
        argv += ["--out", str(out)]
    result = run(real_node, argv)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    err = result.stderr
    assert "error:" in err and "hint:" in err, err
    assert err.count("error: srun started 2 task(s)") == 1, err   # only local rank 0 speaks
    hint = next(line for line in err.splitlines() if line.startswith("hint:"))
    assert "srun" in hint and "--ntasks-per-node=1" in hint, hint
    assert not out.exists() or not any(out.iterdir()), "the program ran despite the error"


def test_mismatch_hint_line_runs(real_node):
    """The srun line suggested by the mismatch error is itself a working command."""
    result = run(real_node, ["srun", "--ntasks-per-node", "2", "hpcai-launch",
                             "--ranks-per-node", "1", "--", "true"])
    hint = next(line for line in result.stderr.splitlines() if line.startswith("hint:"))
    suggested = shlex.split(hint.split("run:", 1)[1])
    assert suggested[0] == "srun" and suggested[-1] == "true", suggested
    ok(real_node, suggested)


def _sbatch_wait(cluster: LocalCluster, argv: list[str], cwd: Path,
                 timeout: float = SRUN_TIMEOUT) -> str:
    """Submit, poll until the job ends (faster than ``sbatch --wait``), return JobState."""
    job = ok(cluster, ["sbatch", "--parsable", *argv], cwd=cwd).stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        show = run(cluster, ["scontrol", "-o", "show", "job", job])
        fields = dict(f.split("=", 1) for f in show.stdout.split() if "=" in f)
        state = fields.get("JobState", "")
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return f"{state} {fields.get('ExitCode', '')}"
        time.sleep(0.2)
    pytest.fail(f"batch job {job} did not end in {timeout} s\n{cluster.log_tails()}")


@needs_mpi4py
@needs_openmpi
def test_sbatch_script_is_not_a_step(real_node, tmp_path):
    """In a batch script SLURM_STEP_ID is absent, so hpcai-launch starts srun itself."""
    tmp_path.chmod(0o755)
    out = tmp_path / "out"
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n"
                      f"env > {tmp_path / 'batch.env'}\n"
                      f"hpcai-launch --dry-run --json --ranks-per-node 2 -- "
                      f"python -m hpcai.launcher.probe > {tmp_path / 'plan.json'}\n"
                      f"hpcai-launch --ranks-per-node 2 -- python -m hpcai.launcher.probe "
                      f"--out {out}\n")
    script.chmod(0o755)
    state = _sbatch_wait(real_node, ["--ntasks-per-node", "2", "-o", str(tmp_path / "job.out"),
                                     str(script)], cwd=tmp_path)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert state == "COMPLETED 0:0", f"{state}\n{log}"
    batch_env = dict(line.split("=", 1) for line in
                     (tmp_path / "batch.env").read_text().splitlines() if "=" in line)
    assert "SLURM_JOB_ID" in batch_env
    assert "SLURM_STEP_ID" not in batch_env and "SLURM_STEPID" not in batch_env, \
        {k: v for k, v in batch_env.items() if "STEP" in k}
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mode"] == "srun", plan["reason"]
    assert plan["argv"][0] == "srun" and "--mpi=pmix" in plan["argv"], plan["argv"]
    recs = records(out)
    check_world(recs, size=2, ranks_per_node=2)
    check_disjoint_per_node(recs)


STOP_JOB = """#!/bin/bash
hpcai-launch --ranks-per-node 2 -- {python} {program} out &
launch=$!
for i in $(seq 300); do [ "$(cat out/* 2>/dev/null | grep -c ready)" = 2 ] && break; sleep 0.2; done
target=$launch
[ {target} = srun ] && target=$(pgrep -P $launch srun)
kill -TERM $target
wait $launch
echo "hpcai-launch exit $?"
"""


@pytest.mark.parametrize("target", ["hpcai-launch", "srun"])
def test_sigterm_to_hpcai_launch_running_srun_lets_the_ranks_checkpoint(real_node, target,
                                                                        tmp_path):
    """In a batch script hpcai-launch runs srun itself; SIGTERM to hpcai-launch reaches the
    ranks as SIGUSR1 (srun passes that on and waits) and each finishes a 3 s checkpoint
    (tests/programs/stop_marker.py). The control sends the SIGTERM to that srun: it cancels
    the step and the ranks are killed without one (``slurm.srun.STOP_SIGNAL``)."""
    tmp_path.chmod(0o755)
    (tmp_path / "out").mkdir()
    script = tmp_path / "job.sh"
    script.write_text(STOP_JOB.format(python=sys.executable, target=target, program=Path(
        __file__).parent / "programs" / "stop_marker.py"))
    script.chmod(0o755)
    state = _sbatch_wait(real_node, ["--ntasks-per-node", "2", "-o", str(tmp_path / "job.out"),
                                     str(script)], cwd=tmp_path)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    said = [f.read_text().split("\n")[:-1] for f in (tmp_path / "out").iterdir()]
    assert len(said) == 2, f"{state}\n{log}"
    if target == "hpcai-launch":
        want = ["ready", f"signal {int(signal.SIGUSR1)}", "checkpoint"]
        assert said == [want, want] and "hpcai-launch exit 0" in log, f"{state}\n{log}"
    else:
        assert all("checkpoint" not in lines for lines in said), f"{said}\n{log}"


# --- two fake nodes ----------------------------------------------------------------------

def test_fake_nodes_are_up(fake_nodes):
    assert fake_nodes.node_states() == {"n1": "idle", "n2": "idle"}
    assert fake_nodes.env["OMPI_MCA_btl"] == "self,tcp"


@needs_mpi4py
@needs_openmpi
def test_fake_nodes_openmpi_pmix(fake_nodes, tmp_path):
    out = tmp_path / "out"
    result = srun_probe(fake_nodes, out, ["-N", "2", "--ntasks-per-node", "2", "--mpi=pmix"],
                        ["--ranks-per-node", "2"])
    recs = records(out)
    assert sorted(recs) == [0, 1, 2, 3], result.stdout + result.stderr
    check_world(recs, size=4, ranks_per_node=2)
    assert {r["env"]["NODE_RANK"] for r in recs.values()} == {"0", "1"}
    assert {r["env"]["LOCAL_RANK"] for r in recs.values()} == {"0", "1"}
    # Both "nodes" are this machine: CPU sets repeat across nodes, never within one.
    check_disjoint_per_node(recs)
    assert {r["env"]["MASTER_ADDR"] for r in recs.values()} == {"n1"}   # the first node


def test_srun_without_pmi_is_warned_about(real_node):
    """srun --mpi=none gives N singleton worlds: rank 0 says so before running the program."""
    result = run(real_node, ["srun", "--mpi=none", "--ntasks-per-node=2", "hpcai-launch",
                             "--ranks-per-node", "2", "--", "true"])
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("warning: srun started the ranks without a PMI plugin") == 1


HOROVOD_SCRIPT = str(Path(__file__).parent / "programs" / "horovod_synthetic_benchmark.py")
needs_horovod = pytest.mark.skipif(
    not horovod_built("torch"),
    reason="Horovod is not built here: run scripts/build-horovod.sh (README, 'Horovod')")


@needs_horovod
@pytest.mark.parametrize("shape", ["real-node-2-tasks", "fake-nodes-2x1"])
def test_unmodified_horovod_script_under_srun(shape, request):
    """Horovod reads its world from MPI (PMIx under srun): every worker must see size 2 and
    the replicas must agree after training (the script prints a CRC of its weights)."""
    from test_horovod import check_consistent_world

    if shape == "real-node-2-tasks":
        cluster = request.getfixturevalue("real_node")
        srun = ["srun", "--mpi=pmix", "--ntasks-per-node", "2"]
        launch = ["--ranks-per-node", "2"]
    else:
        cluster = request.getfixturevalue("fake_nodes")
        srun = ["srun", "--mpi=pmix", "-N", "2", "--ntasks-per-node", "1"]
        launch = ["--ranks-per-node", "1"]
    result = ok(cluster, [*srun, "hpcai-launch", *launch, "--", "python", HOROVOD_SCRIPT,
                          "--num-iters", "2"], timeout=300)
    check_consistent_world(result.stdout, 2)
