"""GPUs: discovery, the synthetic --gpus form, nearest-NUMA placement, srun under GRES,
one rank per GPU by default, and CPU-only plans unchanged.

Discovery reads a fake ``/sys`` and ``/proc`` tree in ``tmp_path``: the kernel's PCI tree
and the NVIDIA driver's ``/proc/driver/nvidia/gpus`` have no package that installs them on a
machine without the GPUs, so the tree is written here, laid out as the kernel and driver lay
them out (PCI functions under ``devices/pciDDDD:BB/...``, linked from ``bus/pci/devices``
and ``class/{net,infiniband}/*/device``). ``bench/gpu_discovery.py`` reads a real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import base_env, run

from hpcai.core.errors import UserError
from hpcai.launcher.mpi import flavours
from hpcai.launcher.planning.facts import Facts
from hpcai.launcher.mpi.flavours import MpiInstall
from hpcai.launcher.node.gpuplace import plan_gpus
from hpcai.launcher.node.gpus import NONE, GpuSet, from_host, synthetic as synthetic_gpus
from hpcai.launcher.planning.options import Options
from hpcai.launcher.node.placement import plan_placement
from hpcai.launcher.planning.plan import build_plan
from hpcai.launcher.job.rankenv import RankInfo
from hpcai.launcher.job.site import SiteProfile
from hpcai.launcher.node.topology import synthetic

REPO = Path(__file__).resolve().parents[1]
OPENMPI = MpiInstall(flavours.OPENMPI, "/usr/bin/mpirun.openmpi", "4.1.4", None, "test")
TWO_SOCKETS = "pack:2 numa:1 core:8"
A100 = "gpu:4 numa:0,0,1,1 nic:mlx5_0@0+1,mlx5_1@2+3 model:A100"
GRES = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_GPUS": "0,1,2,3",
        "SLURM_GPUS_ON_NODE": "4"}


# --- a fake sysfs/procfs ------------------------------------------------------------------

def _pci(sys_root: Path, root: str, path: str, vendor: str, cls: str,
         numa: int | None = None) -> Path:
    """A PCI function at ``devices/<root>/<path>``, linked from ``bus/pci/devices``."""
    device = sys_root / "devices" / root / path
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text(cls + "\n")
    if numa is not None:
        (device / "numa_node").write_text(f"{numa}\n")
    links = sys_root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    (links / device.name).symlink_to(os.path.relpath(device, links))
    return device


def _nic(sys_root: Path, cls: str, name: str, device: Path | None) -> None:
    entry = sys_root / "class" / cls / name
    entry.mkdir(parents=True)
    if device is not None:
        (entry / "device").symlink_to(os.path.relpath(device, entry))


def _driver(proc_root: Path, pci: str, model: str, uuid: str) -> None:
    entry = proc_root / "driver" / "nvidia" / "gpus" / pci
    entry.mkdir(parents=True)
    (entry / "information").write_text(
        f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\n"
        f"Video BIOS: \t ??.??.??.??.??\nBus Type: \t PCIe\nDMA Size: \t 47 bits\n"
        f"Bus Location: \t {pci.replace('0000:', '00000000:', 1)}\nDevice Minor: \t 0\n")


@pytest.fixture
def fake_host(tmp_path):
    """Two PCI roots: GPU 0000:17 with an InfiniBand HCA (mlx5_0, also ib0) beside it on
    NUMA 0; GPU 0000:b1 (no driver entry, NUMA unknown) with an Ethernet NIC on another
    root; an NVIDIA audio function, an Intel NIC on a third root, and a virtual interface."""
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    _pci(sys_root, "pci0000:16", "0000:16:02.0/0000:17:00.0", "0x10de", "0x030200", 0)
    _pci(sys_root, "pci0000:16", "0000:16:02.0/0000:17:00.1", "0x10de", "0x040300", 0)
    hca = _pci(sys_root, "pci0000:16", "0000:16:03.0/0000:18:00.0", "0x15b3", "0x020700", 0)
    _pci(sys_root, "pci0000:b0", "0000:b0:01.0/0000:b1:00.0", "0x10de", "0x030000", -1)
    eth = _pci(sys_root, "pci0000:b0", "0000:b0:02.0/0000:b2:00.0", "0x8086", "0x020000", 1)
    other = _pci(sys_root, "pci0000:00", "0000:00:1f.6", "0x8086", "0x020000", 0)
    _nic(sys_root, "infiniband", "mlx5_0", hca)
    _nic(sys_root, "net", "ib0", hca)
    _nic(sys_root, "net", "eth1", eth)
    _nic(sys_root, "net", "eno1", other)
    _nic(sys_root, "net", "lo", None)
    _driver(proc_root, "0000:17:00.0", "NVIDIA A100-SXM4-80GB",
            "GPU-4f1a2b3c-0000-1111-2222-333344445555")
    return sys_root, proc_root


def test_discovery_reads_gpus_numa_uuid_and_nics_beside_them(fake_host):
    found = from_host(*fake_host)
    assert [g.to_dict() for g in found.gpus] == [
        {"index": 0, "pci": "0000:17:00.0", "numa": 0, "model": "NVIDIA A100-SXM4-80GB",
         "uuid": "GPU-4f1a2b3c-0000-1111-2222-333344445555", "nics": ["mlx5_0"]},
        {"index": 1, "pci": "0000:b1:00.0", "numa": -1, "model": "NVIDIA GPU",
         "uuid": None, "nics": ["eth1"]},
    ]
    assert found.source == "host" and not found.synthetic


def test_discovery_takes_a_gpu_the_driver_lists_but_sysfs_lacks(fake_host, tmp_path):
    sys_root, proc_root = fake_host
    _driver(proc_root, "0000:ca:00.0", "NVIDIA H200", "GPU-ffff")
    found = from_host(sys_root, proc_root)
    assert [(g.pci, g.model, g.numa, g.nics) for g in found.gpus][2] == \
        ("0000:ca:00.0", "NVIDIA H200", -1, ())


def test_discovery_without_gpus_or_without_the_trees_is_empty(tmp_path):
    assert from_host(tmp_path / "nothing", tmp_path / "nothing").gpus == ()
    sys_root = tmp_path / "sys"
    _pci(sys_root, "pci0000:00", "0000:00:1f.6", "0x8086", "0x020000", 0)
    assert from_host(sys_root, tmp_path / "proc").gpus == ()


def test_bench_script_prints_the_fake_hosts_gpus_and_an_empty_list_without(fake_host,
                                                                          tmp_path):
    sys_root, proc_root = fake_host
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_discovery.py"),
                          "--sys", str(sys_root), "--proc", str(proc_root)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [g["pci"] for g in json.loads(out.stdout)["gpus"]] == ["0000:17:00.0",
                                                                  "0000:b1:00.0"]
    empty = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_discovery.py"),
                            "--sys", str(tmp_path / "no"), "--proc", str(tmp_path / "no")],
                           capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert empty.returncode == 0 and json.loads(empty.stdout)["gpus"] == []


# --- the synthetic form -------------------------------------------------------------------

def test_synthetic_gpus():
    found = synthetic_gpus(A100)
    assert [(g.index, g.numa, g.nics, g.model) for g in found.gpus] == [
        (0, 0, ("mlx5_0",), "A100"), (1, 0, ("mlx5_0",), "A100"),
        (2, 1, ("mlx5_1",), "A100"), (3, 1, ("mlx5_1",), "A100")]
    assert found.synthetic
    assert [g.numa for g in synthetic_gpus("gpu:2").gpus] == [0, 0]


@pytest.mark.parametrize("text,says", [
    ("", "no gpu:N"), ("numa:0,1", "no gpu:N"), ("gpu:0", "gpu:0 is not a count"),
    ("gpu:two", "not a count"), ("gpu:2 numa:0", "gives 1 node(s) for 2 GPU(s)"),
    ("gpu:2 numa:0,x", "not a list of NUMA"), ("gpu:2 nic:mlx5_0", "NAME@GPU"),
    ("gpu:2 nic:mlx5_0@2", "'2' is not a GPU index below 2"),
    ("gpu:2 nic:a@0,a@0", "named twice"), ("gpu:2 gpu:3", "given twice"),
    ("gpu:2 cores:4", "unknown or empty token"), ("gpu:2 model:A/B", "model:A/B"),
])
def test_bad_synthetic_gpus_say_what_and_how(text, says):
    with pytest.raises(UserError) as err:
        synthetic_gpus(text)
    assert says in err.value.message
    assert "--gpus 'gpu:4 numa:0,0,1,1" in err.value.hint


def test_bad_gpus_on_the_command_line_is_error_hint_exit_2():
    result = run(["hpcai-launch", "--dry-run", "--topology", TWO_SOCKETS, "--gpus",
                  "gpu:4 numa:0,0,1", "--", "true"], base_env(), timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: bad --gpus") and lines[1].startswith("hint: ")
    assert "Traceback" not in result.stderr


# --- placement ----------------------------------------------------------------------------

def _facts(gpus: GpuSet | None, env: dict[str, str] | None = None,
           rank: RankInfo | None = None, site: SiteProfile | None = None) -> Facts:
    return Facts(env={"PATH": "/usr/bin", **(env or {})}, topology=synthetic(TWO_SOCKETS),
                 hostname="node001", self_argv=("hpcai-launch",),
                 command_path="/usr/bin/true", mpi=OPENMPI, cache_dir="/tmp/c", rank=rank,
                 gpus=gpus, site=site)


def _plan(gpu_text: str | None, env=None, rank=None, site=None, **options):
    gpus = synthetic_gpus(gpu_text) if gpu_text else None
    return build_plan(Options(command=("true",), gpus=gpu_text, **options),
                      _facts(gpus, env, rank, site))


def _visible(plan) -> list[str | None]:
    return [dict(r.env).get("CUDA_VISIBLE_DEVICES") for r in plan.ranks]


def test_each_rank_gets_the_gpu_on_its_numa_domain_not_the_lowest_free_one():
    """GPUs 0,1 sit on NUMA 1: the ranks on NUMA 0's cores get GPUs 2,3."""
    plan = _plan("gpu:4 numa:1,1,0,0")
    assert [r.numa for r in plan.ranks] == [(0,), (0,), (1,), (1,)]
    assert _visible(plan) == ["2", "3", "0", "1"]
    assert not plan.gpus.far and not plan.warnings


def test_a_rank_left_with_a_far_gpu_is_flagged_far_and_warned():
    """Negative control: three GPUs on NUMA 0, one on NUMA 1; 4 ranks, 2 per domain.
    Local rank 3 (cores on NUMA 1) can only get GPU 2 (NUMA 0)."""
    plan = _plan("gpu:4 numa:0,0,0,1")
    assert _visible(plan) == ["0", "1", "3", "2"]
    assert [s.far for s in plan.gpus.slots] == [False, False, False, True]
    assert plan.gpus.slots[3].why.startswith("FAR: GPU 2 on NUMA 0, cores on NUMA 1")
    assert any("local rank 3 gets a GPU on another NUMA domain" in w for w in plan.warnings)
    assert "(FAR: GPU 2 on NUMA 0" in plan.render()


def test_fewer_ranks_than_gpus_each_take_their_domains_gpus():
    plan = _plan(A100, ranks_per_node=2)
    assert _visible(plan) == ["0,1", "2,3"]
    assert [s.nics for s in plan.gpus.slots] == [("mlx5_0",), ("mlx5_1",)]


def test_gpu_visible_all_names_the_device_and_hides_nothing():
    plan = _plan(A100, gpu_visible="all")
    assert _visible(plan) == [None] * 4
    assert [dict(r.env)["HPCAI_LOCAL_DEVICE"] for r in plan.ranks] == ["0", "1", "2", "3"]
    site = SiteProfile.from_dict({"gpu_visible": "all"})
    assert _visible(_plan(A100, site=site)) == [None] * 4
    assert _visible(_plan(A100, site=site, gpu_visible="per-rank")) == ["0", "1", "2", "3"]
    with pytest.raises(UserError, match="gpu_visible"):
        SiteProfile.from_dict({"gpu_visible": "some"})


@pytest.mark.parametrize("ranks,share,says", [
    (3, False, "4 GPUs do not split evenly over 3 ranks per node"),
    (8, False, "8 ranks per node but the node has 4 GPU(s)"),
    (6, True, "6 ranks per node do not share 4 GPU(s) evenly"),
])
def test_ranks_that_do_not_fit_the_gpus_are_refused(ranks, share, says):
    with pytest.raises(UserError) as err:
        _plan(A100, ranks_per_node=ranks, share_gpus=share)
    assert says in err.value.message and err.value.hint


def test_shared_gpus_two_ranks_each_on_their_domain():
    plan = _plan(A100, ranks_per_node=8, share_gpus=True)
    assert _visible(plan) == ["0", "0", "1", "1", "2", "2", "3", "3"]


def test_a_synthetic_gpu_on_a_numa_domain_the_topology_lacks_is_refused():
    with pytest.raises(UserError, match="GPU 3 on NUMA 2"):
        _plan("gpu:4 numa:0,0,1,2")


def test_default_ranks_per_node_is_one_per_gpu():
    assert _plan(A100).placement.ranks_per_node == 4
    assert _plan("gpu:2 numa:0,1").placement.ranks_per_node == 2
    assert _plan(A100, ranks_per_node=2).placement.ranks_per_node == 2
    assert _plan(A100, ranks_per_numa=1).placement.ranks_per_node == 2
    assert _plan(None).placement.ranks_per_node == 1


def test_placement_alone_is_pure_and_matches_the_plan():
    placement = plan_placement(synthetic(TWO_SOCKETS), ranks_per_node=4)
    gpus = plan_gpus(synthetic_gpus(A100), placement)
    assert [s.gpus for s in gpus.slots] == [(0,), (1,), (2,), (3,)]
    assert gpus.env(2) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2",
                           "HPCAI_LOCAL_DEVICE": "0"}


# --- srun ---------------------------------------------------------------------------------

def test_srun_with_gres_leaves_the_gpus_to_slurm():
    plan = _plan(A100, env=GRES)
    assert plan.mode == "srun"
    assert "--gpus-per-task=1" in plan.argv and "--gpu-bind=closest" in plan.argv
    assert _visible(plan) == [None] * 4
    assert plan.gpus.visible == "slurm" and plan.gpus.gres == "SLURM_JOB_GPUS"
    two = _plan(A100, env=GRES, ranks_per_node=2)
    assert "--gpus-per-task=2" in two.argv


def test_srun_without_gres_binds_the_gpus_itself():
    plan = _plan(A100, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"})
    assert not any(a.startswith("--gpu") for a in plan.argv[:plan.argv.index("hpcai-launch")])
    assert _visible(plan) == ["0", "1", "2", "3"]


def test_srun_with_gres_refuses_shared_gpus():
    with pytest.raises(UserError, match="--share-gpus under srun"):
        _plan(A100, env=GRES, ranks_per_node=8, share_gpus=True)


def test_srun_line_without_gpus_is_unchanged():
    plan = _plan(None, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"})
    assert not any("gpu" in a for a in plan.argv) and plan.gpus is None


# --- rank mode ----------------------------------------------------------------------------

def _rank(local_rank: int, started_by: str = "openmpi") -> RankInfo:
    return RankInfo(rank=local_rank, size=4, local_rank=local_rank, local_size=4,
                    node_rank=0, started_by=started_by, job_key="k")


def test_a_rank_sets_its_own_gpu():
    plan = _plan(A100, rank=_rank(2), ranks_per_node=4)
    assert plan.mode == "rank"
    assert plan.env_dict()["CUDA_VISIBLE_DEVICES"] == "2"
    assert plan.env_dict()["HPCAI_LOCAL_DEVICE"] == "0"


def test_a_rank_srun_started_with_gres_keeps_slurms_gpus():
    plan = _plan(A100, env={**GRES, "SLURM_STEP_GPUS": "2"}, rank=_rank(2, "slurm"),
                 ranks_per_node=4)
    assert "CUDA_VISIBLE_DEVICES" not in plan.env_dict()
    assert plan.env_dict()["HPCAI_LOCAL_DEVICE"] == "0"


# --- CPU-only nodes -----------------------------------------------------------------------

@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"}])
def test_a_node_without_gpus_plans_as_before(env):
    """No GPU found (or --gpus none) gives the very plan of Facts without GPUs."""
    options = Options(command=("true",), ranks_per_node=2)
    before = build_plan(options, _facts(None, env)).to_dict()
    assert build_plan(options, _facts(GpuSet((), "host"), env)).to_dict() == before
    assert build_plan(options, _facts(NONE, env)).to_dict() == before
    assert before["gpus"] is None
    assert not any("CUDA" in k for r in before["ranks"] for k in r["env"])


def test_options_write_the_gpu_flags_back():
    options = Options(command=("true",), gpus=A100, gpu_visible="all", share_gpus=True)
    argv = options.to_argv()
    assert argv[argv.index("--gpus") + 1] == A100
    assert argv[argv.index("--gpu-visible") + 1] == "all" and "--share-gpus" in argv
    assert Options(command=("true",)).to_argv() == ["--", "true"]
