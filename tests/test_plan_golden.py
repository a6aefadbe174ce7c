"""Golden files: the exact argv and env hpcai-launch produces for each MPI and srun.

Regenerate after an intended change with ``HPCAI_UPDATE_GOLDEN=1 pytest tests/test_plan_golden.py``
and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpcai.launcher.mpi import flavours
from hpcai.launcher.mpi.flavours import MpiInstall
from hpcai.launcher.planning.options import Options
from hpcai.launcher.planning.facts import Facts
from hpcai.launcher.planning.plan import build_plan
from hpcai.launcher.node.topology import synthetic
from hpcai.launcher.mpi.pmi import PmiClient

GOLDEN = Path(__file__).parent / "golden"
COMMAND = ("python3", "-m", "hpcai.launcher.probe")

INSTALLS = {
    "openmpi": MpiInstall(flavours.OPENMPI, "/usr/bin/mpirun.openmpi", "4.1.4", None, "test"),
    "mpich": MpiInstall(flavours.MPICH, "/usr/bin/mpiexec.mpich", "4.0.2", None, "test"),
    "intel": MpiInstall(flavours.INTEL, "/opt/intel/oneapi/mpi/2021.10/bin/mpiexec.hydra",
                        "2021.10", "/opt/intel/oneapi/mpi/2021.10/lib", "test"),
}
TOPOLOGIES = {
    "1node-1rank": ("pack:1 numa:1 core:2", {"ranks_per_node": 1}),
    "1node-2ranks": ("pack:1 numa:1 core:2", {"ranks_per_node": 2}),
    "supermuc-ng-4x12": ("pack:2 numa:2 core:12 pu:2", {"ranks_per_node": 4}),
    "2nodes-2ranks": ("pack:1 numa:1 core:2", {"ranks_per_node": 2,
                                               "hosts": "node001,node002"}),
}
CASES = [(launcher, case) for launcher in ("openmpi", "mpich", "intel", "srun")
         for case in TOPOLOGIES if not (launcher == "srun" and case == "2nodes-2ranks")]
CASES.append(("srun-intel", "lrz-768nodes-4x12"))


def _plan(launcher: str, case: str):
    pmi = PmiClient()
    if case == "lrz-768nodes-4x12":
        topo_text, kwargs = TOPOLOGIES["supermuc-ng-4x12"][0], {"ranks_per_node": 4}
        env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "768"}
        mpi = INSTALLS["intel"]
        # Slurm's libpmi2 as hpcai finds it there (tests/test_lrz.py runs this path here)
        pmi = PmiClient(env=(("I_MPI_PMI_LIBRARY", "/usr/lib64/libpmi2.so"),))
    else:
        topo_text, kwargs = TOPOLOGIES[case]
        env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1"} if launcher == "srun" else {}
        mpi = INSTALLS["openmpi" if launcher == "srun" else launcher]
    facts = Facts(env={"PATH": "/usr/bin", **env}, topology=synthetic(topo_text),
                  hostname="node001", self_argv=("hpcai-launch",),
                  command_path="/usr/bin/python3", uid=1000, free_port=29500, mpi=mpi,
                  cache_dir="/home/user/.cache/hpcai", pmi=pmi)
    return build_plan(Options(command=COMMAND, **kwargs), facts)


def _golden_text(plan) -> str:
    data = plan.to_dict()
    keep = {k: data[k] for k in ("mode", "argv", "env", "ranks", "notes", "relay")}
    return json.dumps(keep, indent=1) + "\n"


@pytest.mark.parametrize("launcher,case", CASES)
def test_plan_matches_golden(launcher, case):
    text = _golden_text(_plan(launcher, case))
    path = GOLDEN / f"{launcher}-{case}.json"
    if os.environ.get("HPCAI_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden {path}: run with HPCAI_UPDATE_GOLDEN=1"
    assert text == path.read_text()


def test_supermuc_ng_lines_say_what_the_seed_run_did():
    """4 ranks x 12 threads, one per NUMA quarter, in each flavour's own words."""
    ompi = _plan("openmpi", "supermuc-ng-4x12")
    assert "--map-by" in ompi.argv
    assert ompi.argv[ompi.argv.index("--map-by") + 1] == "ppr:1:numa:PE=12"
    assert ompi.argv[ompi.argv.index("--bind-to") + 1] == "core"
    mpich = _plan("mpich", "supermuc-ng-4x12")
    assert mpich.argv[mpich.argv.index("-bind-to") + 1] == \
        "user:" + ",".join("+".join(str(c) for c in range(q * 12, q * 12 + 12)) for q in range(4))
    intel = _plan("intel", "supermuc-ng-4x12")
    assert intel.env_dict()["I_MPI_PIN_DOMAIN"] == "[0xfff,0xfff000,0xfff000000,0xfff000000000]"
    assert intel.argv[intel.argv.index("-genv") + 1] == "I_MPI_PIN"
    srun = _plan("srun-intel", "lrz-768nodes-4x12")
    assert srun.argv[:5] == ("srun", "--mpi=pmi2", "--nodes=768", "--ntasks-per-node=4",
                             "--cpus-per-task=24")   # 12 cores x 2 hardware threads
    assert [r.threads for r in srun.ranks] == [12] * 4
    assert all(dict(r.env)["OMP_NUM_THREADS"] == "12" for r in srun.ranks)


def test_dry_run_render_is_readable():
    text = _plan("openmpi", "supermuc-ng-4x12").render()
    assert "local rank 3: NUMA 3 cpus 36-47 threads 12" in text
    assert "OMP_NUM_THREADS=12" in text and "mpirun.openmpi -n 4" in text
    assert "passes on SIGTERM as SIGUSR1 (a second SIGTERM as it is)" in text
    assert "hpcai-launch becomes mpiexec.mpich (exec)" in _plan("mpich", "1node-2ranks").render()


# --- GPU nodes, in synthetic form (hpcai.launcher.node.gpus.synthetic) -------------------------
# 4 x A100 on a 2-socket, 64-cores-per-socket node: GPUs 0,1 on NUMA 0 and 2,3 on NUMA 1,
# one NIC beside each GPU pair. 4 x H100 on a 2 x 56-core node with 2 hardware threads per
# core: GPUs 0,1 on NUMA 0 and 2,3 on NUMA 1, two NICs beside each GPU (8 NICs).
GPU_MACHINES = {
    "a100-4gpu-2numa": ("pack:2 numa:1 core:64",
                        "gpu:4 numa:0,0,1,1 nic:mlx5_0@0+1,mlx5_1@2+3 model:A100-SXM4-80GB"),
    "h100-4gpu-8nic": ("pack:2 numa:1 core:56 pu:2",
                       "gpu:4 numa:0,0,1,1 nic:mlx5_0@0,mlx5_1@0,mlx5_2@1,mlx5_3@1,mlx5_4@2,"
                       "mlx5_5@2,mlx5_6@3,mlx5_7@3 model:H100-SXM5-80GB"),
}
GPU_CASES = [(launcher, machine) for launcher in ("openmpi", "srun-gres")
             for machine in GPU_MACHINES]


def _gpu_plan(launcher: str, machine: str):
    """No --ranks-per-node: one rank per GPU. srun-gres: a 2-node allocation with the
    GPUs as GRES, so srun binds them."""
    from hpcai.launcher.node.gpus import synthetic as synthetic_gpus
    topo_text, gpu_text = GPU_MACHINES[machine]
    env = {"PATH": "/usr/bin"}
    if launcher == "srun-gres":
        env.update({"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2",
                    "SLURM_JOB_GPUS": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4"})
    facts = Facts(env=env, topology=synthetic(topo_text), hostname="node001",
                  self_argv=("hpcai-launch",), command_path="/usr/bin/python3", uid=1000,
                  free_port=29500, mpi=INSTALLS["openmpi"],
                  cache_dir="/home/user/.cache/hpcai", gpus=synthetic_gpus(gpu_text))
    return build_plan(Options(command=COMMAND, gpus=gpu_text), facts)


@pytest.mark.parametrize("launcher,machine", GPU_CASES)
def test_gpu_plan_matches_golden(launcher, machine):
    plan = _gpu_plan(launcher, machine)
    data = plan.to_dict()
    text = json.dumps({k: data[k] for k in ("mode", "argv", "env", "ranks", "notes",
                                            "warnings", "gpus")}, indent=1) + "\n"
    path = GOLDEN / f"gpu-{launcher}-{machine}.json"
    if os.environ.get("HPCAI_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden {path}: run with HPCAI_UPDATE_GOLDEN=1"
    assert text == path.read_text()


@pytest.mark.parametrize("machine", GPU_MACHINES)
def test_gpu_dry_run_matches_golden(machine):
    """The --dry-run text: every rank's cores, GPU, NICs and why."""
    text = _gpu_plan("openmpi", machine).render() + "\n"
    path = GOLDEN / f"gpu-dry-run-{machine}.txt"
    if os.environ.get("HPCAI_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden {path}: run with HPCAI_UPDATE_GOLDEN=1"
    assert text == path.read_text()
