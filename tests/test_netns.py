"""Fake nodes with addresses of their own (``LocalCluster(netns=True)``, testbed/netns.py).

Each node is a network + UTS namespace with its own IP on a private bridge, its host name
is the node name, and node names resolve (a hosts file bound over /etc/hosts inside the
test's mount namespace only). Nothing injects ``MASTER_ADDR``: hpcai derives it from the
node list, and every rank must report the first node of its allocation, resolving to that
node's namespace address. MPI is pinned to the bridge's subnet (``LocalCluster.env``).

- 3DGAN training on 2 nodes x 2 ranks under srun, with Open MPI (pmix) and MPICH (pmi2);
- the plain torch.distributed ``env://`` script, hpcai-launch starting srun in a batch job;
- the site ``mpiexec`` launcher rendered by ``hpcai-launch sbatch``, run in a batch job;
- the container sees the node's name resolution: every node name resolves inside it (and,
  as a control, not in the same image without /etc/hosts).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

import netns
from clusterjobs import copy_rank_report, job_env, ok, rank_reports, submit
from conftest import FLAVOURS
from hpcai.launcher.mpi import flavours
from localcluster import LocalCluster, missing_programs
from test_image import image  # noqa: F401 - the image fixture
from test_image import pytestmark as IMAGE_MARKS

PROGRAMS = Path(__file__).parent / "programs"
# the physics validation and its plots are not what these tests read (test_physics.py)
TRAIN = ["train", "3dgan", "--generate", "16", "--epochs", "1", "--batch-size", "1",
         "--max-steps", "2", "--peak-gflops", "50", "--eval-samples", "0",
         "--validate-events", "0", "--out", "run"]

_missing = missing_programs()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(bool(_missing), reason="Slurm/munge not installed (missing: "
                       f"{', '.join(_missing)}; apt-get install slurm-wlm munge)"),
    pytest.mark.skipif(netns.missing() is not None,
                       reason=f"no network namespaces here: {netns.missing()}"),
]


@pytest.fixture(scope="module")
def cluster():
    """n1, n2 (2 CPUs each) in namespaces of their own, the controller on the bridge."""
    hosts_before = Path("/etc/hosts").read_bytes()
    c = LocalCluster(fake_nodes=2, cpus_per_node=2, netns=True)
    try:
        c.start()
    except netns.NetnsError as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    try:
        yield c
    finally:
        c.stop()
    assert Path("/etc/hosts").read_bytes() == hosts_before, "the machine's /etc/hosts changed"


def _first_node(cluster: LocalCluster) -> tuple[str, str]:
    assert cluster.network is not None
    return "n1", cluster.network.addresses["n1"]


def test_netns_nodes_have_addresses_of_their_own(cluster, tmp_path):
    assert cluster.node_states() == {"n1": "idle", "n2": "idle"}
    env = job_env(tmp_path / "cache")
    for name, addr in cluster.network.addresses.items():
        show = ok(cluster, ["scontrol", "-o", "show", "node", name], env, tmp_path).stdout
        assert f"NodeAddr={addr} " in show, show
    out = ok(cluster, ["srun", "-N", "2", "--ntasks-per-node", "1", "-l", "sh", "-c",
                       "echo $(hostname) $(getent hosts n1 n2 | tr -s ' ' | tr '\\n' ' ')"
                       "$(ip -4 -o addr show eth0 | awk '{print $4}')"], env, tmp_path).stdout
    lines = sorted(line.split(":", 1)[1].split() for line in out.strip().splitlines())
    assert lines == [["n1", "10.211.0.1", "n1", "10.211.0.2", "n2", "10.211.0.1/24"],
                     ["n2", "10.211.0.1", "n1", "10.211.0.2", "n2", "10.211.0.2/24"]], out
    assert cluster.env["OMPI_MCA_btl_tcp_if_include"] == netns.SUBNET.with_prefixlen
    assert cluster.env["UCX_NET_DEVICES"] == netns.NODE_IF
    # The machine's own namespace has none of these addresses.
    mine = subprocess.run([netns.which("ip") or "ip", "-o", "addr"], capture_output=True,
                          text=True).stdout
    assert "10.211." not in mine, mine


# MPICH with --comm gloo hung once in step 0 in a full-suite run (the stall watchdog ended
# it after 305 s, naming rank 0); not yet diagnosed, so the gradients go over MPI here and
# torch's rendezvous at the derived MASTER_ADDR is covered by the env:// script test.
@pytest.mark.parametrize("flavour,comm", [("openmpi", "mpi"), ("mpich", "mpi")])
def test_netns_3dgan_trains_under_srun(flavour, comm, cluster, tmp_path):
    """2 nodes x 2 ranks, srun with the flavour's PMI plugin; the gradients go over MPI
    between the namespaces."""
    if flavour not in FLAVOURS:
        pytest.skip(f"{flavour} is not installed (scripts/install.sh)")
    tmp_path.chmod(0o755)
    env = job_env(tmp_path / "cache", PYTHONPATH=str(copy_rank_report(tmp_path)))
    result = ok(cluster, ["srun", f"--mpi={flavours.get(flavour).srun_mpi}", "-N", "2",
                          "--ntasks-per-node", "2", "hpcai-launch", "--mpi", flavour,
                          "--ranks-per-node", "2", "--", *TRAIN, "--comm", comm], env,
                tmp_path, timeout=600)
    name, addr = _first_node(cluster)
    reports = rank_reports(result.stdout)
    assert sorted(reports) == [0, 1, 2, 3], result.stdout + result.stderr
    for rank, report in reports.items():
        assert report["host"] == f"n{rank // 2 + 1}", (rank, report)
        assert (report["master"], report["master_ip"]) == (name, addr), (rank, report)
        assert FLAVOURS[flavour].lib_marker in report["libmpi"], (rank, report)
    record = json.loads((tmp_path / "run" / "epochs.jsonl").read_text().splitlines()[0])
    assert record["provenance"]["world_size"] == 4
    assert record["provenance"]["hosts"] == ["n1", "n2"]
    assert record["provenance"]["comm"] == comm


def test_netns_torch_env_script_meets_at_the_first_node(cluster, tmp_path):
    """hpcai-launch starts srun itself in a batch job; the unmodified env:// script finds
    its rendezvous at the first node of the allocation."""
    tmp_path.chmod(0o755)
    script = tmp_path / "ddp_env.py"
    shutil.copy(PROGRAMS / "ddp_env.py", script)
    launch = ["hpcai-launch", "--ranks-per-node", "2"]
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/bash\nset -e\n"
                   f"{shlex.join([*launch, '--dry-run', '--json', '--', 'python', str(script)])}"
                   " > plan.json\n"
                   f"{shlex.join([*launch, '--', 'python', str(script)])}\n")
    state, log = submit(cluster, job, job_env(tmp_path / "cache"), tmp_path,
                        ("-N", "2", "--ntasks-per-node", "2"))
    assert state == "COMPLETED 0:0", f"{state}\n{log}"
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mode"] == "srun" and "MASTER_ADDR" not in plan["env"], plan["env"]
    name, addr = _first_node(cluster)
    outputs = sorted((tmp_path / f"out-{r}").read_text().split() for r in range(4))
    assert outputs == [["4", "10.0", "0", name, addr, "n1"], ["4", "10.0", "0", name, addr, "n2"],
                       ["4", "10.0", "1", name, addr, "n1"],
                       ["4", "10.0", "1", name, addr, "n2"]], (outputs, log)


def _site_mpiexec_bin(bin_dir: Path, flavour: str) -> None:
    """What a site's MPI module puts on PATH: its ``mpiexec`` (Hydra also needs its proxy
    beside it)."""
    bin_dir.mkdir()
    launcher = Path(flavours.find_launcher(flavours.get(flavour), os.environ) or "")
    target = {"mpich": "mpiexec.mpich", "openmpi": "mpiexec.openmpi"}[flavour]
    os.symlink(launcher.parent / target, bin_dir / "mpiexec")
    if flavour == "mpich":
        os.symlink(launcher.parent / "hydra_pmi_proxy", bin_dir / "hydra_pmi_proxy")


@pytest.mark.parametrize("flavour,per_node", [("mpich", "-ppn 2"),
                                              ("openmpi", "--map-by ppr:2:node")],
                         ids=["mpich", "openmpi"])
def test_netns_site_mpiexec_launcher_runs_in_a_job(flavour, per_node, cluster, tmp_path):
    """Site profile ``mpi_launcher = "mpiexec"``: the job script starts the ranks with the
    site's mpiexec, which reads the nodes from Slurm; every rank derives the first node."""
    if flavour not in FLAVOURS:
        pytest.skip(f"{flavour} is not installed (scripts/install.sh)")
    tmp_path.chmod(0o755)
    site = tmp_path / "site.toml"
    site.write_text('name = "mpiexec-site"\nmpi_launcher = "mpiexec"\ncores_per_node = 2\n')
    _site_mpiexec_bin(tmp_path / "bin", flavour)
    env = job_env(tmp_path / "cache")
    ok(cluster, ["hpcai-launch", "sbatch", "--nodes", "2", "--ranks-per-node", "2", "--mpi",
                 flavour, "--site", str(site), "--time", "00:10:00", "--script", "job.sh",
                 "--", "python", "-m", "hpcai.launcher.probe", "--quiet", "--out", "out"],
       env, tmp_path)
    line = (tmp_path / "job.sh").read_text().strip().splitlines()[-1]
    assert line.startswith(f"mpiexec -n 4 {per_node} hpcai-launch --ranks-per-node 2 "), line
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    if flavour == "openmpi" and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    state, log = submit(cluster, tmp_path / "job.sh", env, tmp_path)
    assert state == "COMPLETED 0:0", f"{state}\n{log}"
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank-*"))]
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3], log
    name, _ = _first_node(cluster)
    for r in records:
        assert r["size"] == 4 and r["allreduce_ok"], r
        assert r["host"] == f"n{r['rank'] // 2 + 1}", r
        assert r["env"]["NODE_RANK"] == str(r["rank"] // 2), r["env"]
        assert r["env"]["MASTER_ADDR"] == name, r["env"]
        assert FLAVOURS[flavour].lib_marker in ",".join(r["libmpi"]), r["libmpi"]
    assert len({r["env"]["MASTER_PORT"] for r in records}) == 1, records


RESOLVE = ("import json, socket\n"
           "def ip(n):\n"
           "    try:\n"
           "        return socket.gethostbyname(n)\n"
           "    except OSError:\n"
           "        return None\n"
           "print('resolved', socket.gethostname(), json.dumps({n: ip(n) for n in "
           "('localhost', 'ctl', 'n1', 'n2')}), flush=True)\n")


def _resolved(stdout: str) -> dict[str, dict]:
    found = {}
    for line in stdout.splitlines():
        if line.startswith("resolved "):
            _, host, data = line.split(" ", 2)
            found[host] = json.loads(data)
    return found


@IMAGE_MARKS[0]
@IMAGE_MARKS[1]
def test_netns_node_names_resolve_in_the_container(cluster, image, tmp_path):  # noqa: F811
    assert (image / "etc" / "hosts").is_file() and (image / "etc" / "resolv.conf").is_file()
    env = job_env(tmp_path / "cache")
    result = ok(cluster, ["srun", "--mpi=pmix", "-N", "2", "--ntasks-per-node", "1",
                          "hpcai-launch", "--container", str(image), "--", "python3", "-c",
                          RESOLVE], env, tmp_path, timeout=300)
    expected = {"localhost": "127.0.0.1", "ctl": cluster.network.controller_address,
                **cluster.network.addresses}
    assert _resolved(result.stdout) == {"n1": expected, "n2": expected}, result.stdout
    # Control: the same image without /etc/hosts (hard links: nothing copied) resolves no
    # node name, which is what the image built before gave.
    bare = tmp_path / "no-hosts"
    if subprocess.run(["cp", "-al", str(image), str(bare)], capture_output=True).returncode:
        pytest.skip(f"cannot hard-link {image} into {tmp_path} for the control")
    (bare / "etc" / "hosts").unlink()
    control = subprocess.run(cluster.client_argv(["ch-run", str(bare), "--", "python3", "-c",
                                                  RESOLVE], tmp_path, where="n1"),
                             env=cluster.client_env({"USER": os.environ.get("USER", "root")}),
                             capture_output=True, text=True, timeout=120)
    assert _resolved(control.stdout) == {"n1": {"localhost": None, "ctl": None, "n1": None,
                                                "n2": None}}, control.stdout + control.stderr
