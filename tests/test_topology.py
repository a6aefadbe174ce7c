"""Topology from sysfs, hwloc XML and synthetic descriptions."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from hpcai.launcher.node import topology
from hpcai.core.errors import UserError


def test_parse_and_format_cpulist_roundtrip():
    assert topology.parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert topology.format_cpulist((11, 10, 8, 3, 2, 1, 0)) == "0-3,8,10-11"
    assert topology.format_cpulist([5]) == "5"


def test_this_machine_from_sysfs_matches_os_view():
    topo = topology.from_sysfs()
    pus = {pu for core in topo.cores for pu in core.pus}
    assert pus == set(os.sched_getaffinity(0)) | pus  # every PU we may run on is known
    assert len(pus) == os.cpu_count()


def _fake_sysfs(tmp_path):
    """A fake sysfs: 2 NUMA nodes x 2 cores x 2 threads, Linux sibling numbering."""
    root = tmp_path / "system"
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "online").write_text("0-7\n")
    for cpu in range(8):
        core = cpu % 4
        topo_dir = root / "cpu" / f"cpu{cpu}" / "topology"
        topo_dir.mkdir(parents=True)
        (topo_dir / "physical_package_id").write_text(f"{core // 2}\n")
        (topo_dir / "core_id").write_text(f"{core}\n")
    for node, cpus in ((0, "0-1,4-5"), (1, "2-3,6-7")):
        (root / "node" / f"node{node}").mkdir(parents=True)
        (root / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    return root


def test_fake_sysfs_tree_two_numa_with_smt(tmp_path):
    topo = topology.from_sysfs(_fake_sysfs(tmp_path))
    assert topo.numa_domains == (0, 1)
    assert topo.sockets == (0, 1)
    assert topo.threads_per_core == 2
    assert [c.pus for c in topo.cores] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [c.numa for c in topo.cores] == [0, 0, 1, 1]


def test_synthetic_supermuc_ng_node():
    topo = topology.synthetic("pack:2 numa:2 core:12 pu:2")
    assert len(topo.cores) == 48 and topo.n_pus == 96
    assert topo.numa_domains == (0, 1, 2, 3)
    assert topo.cores[12].numa == 1 and topo.cores[24].socket == 1
    assert topo.cores[0].pus == (0, 48)


@pytest.mark.skipif(not shutil.which("lstopo-no-graphics"), reason="hwloc not installed")
def test_hwloc_xml_equals_synthetic(tmp_path):
    xml = tmp_path / "node.xml"
    xml.write_text(subprocess.run(["lstopo-no-graphics", "--input", "pack:2 numa:2 core:3 pu:2",
                                   "--of", "xml"], capture_output=True, text=True,
                                  check=True).stdout)
    topo = topology.from_hwloc_xml(xml)
    assert topo.numa_domains == (0, 1, 2, 3)
    assert len(topo.cores) == 12 and topo.threads_per_core == 2
    assert [c.numa for c in topo.cores] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert topo.cores[0].pus == (0, 1)  # hwloc numbers siblings adjacently
    assert {c.socket for c in topo.cores[6:]} == {1}


@pytest.mark.skipif(not shutil.which("lstopo-no-graphics"), reason="hwloc not installed")
def test_hwloc_xml_of_this_machine_equals_sysfs(tmp_path):
    xml = tmp_path / "me.xml"
    xml.write_text(subprocess.run(["lstopo-no-graphics", "--of", "xml"], capture_output=True,
                                  text=True, check=True).stdout)
    a, b = topology.from_hwloc_xml(xml), topology.from_sysfs()
    assert [c.pus for c in a.cores] == [c.pus for c in b.cores]
    assert a.numa_domains == b.numa_domains


def test_bad_topology_inputs_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="synthetic"):
        topology.synthetic("pack:2 cores:x")
    bad = tmp_path / "bad.xml"
    bad.write_text("<topology><object")
    with pytest.raises(UserError, match="hwloc XML"):
        topology.from_hwloc_xml(bad)


def test_a_machine_read_within_allowed_cpus_keeps_only_their_cores(tmp_path):
    root = _fake_sysfs(tmp_path)
    allowed = topology.AllowedCpus(frozenset({2, 3, 7}), "a test's set")
    topo = topology.from_sysfs(root, allowed)
    assert [c.pus for c in topo.cores] == [(2,), (3, 7)]
    assert topo.numa_domains == (1,)
    assert "cpus 2-3,7 (a test's set)" in topo.describe()
    whole = topology.from_sysfs(root, topology.AllowedCpus(frozenset(range(8)), "all"))
    assert whole.within is None and len(whole.cores) == 4      # the control: nothing left out
    with pytest.raises(UserError, match="none of the CPUs of a test's set"):
        topology.from_sysfs(root, topology.AllowedCpus(frozenset({9}), "a test's set"))


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_rank_plans_within_its_cgroup_cpuset_and_the_launch_set(tmp_path, version):
    """A rank's own affinity may be its slot already, so it plans within its cgroup's
    cpuset and, on the launching host, the set the launch planned in."""
    cgroups, me = tmp_path / "cgroup", tmp_path / "self-cgroup"
    if version == "v1":
        me.write_text("not a cgroup line\n4:memory:/x\n3:cpuset:/slurm/uid_0/job_7/step_0\n")
        folder = cgroups / "cpuset" / "slurm/uid_0/job_7/step_0"
        name = "cpuset.effective_cpus"
    else:
        me.write_text("0::/system.slice/slurmstepd.scope/job_7/step_0\n")
        folder = cgroups / "system.slice/slurmstepd.scope/job_7/step_0"
        name = "cpuset.cpus.effective"
    folder.mkdir(parents=True)
    (folder / name).write_text("4-11\n")

    def allowed(env):
        return topology.allowed_cpus(True, env, "n1", cgroups, me)

    found = allowed({})
    assert found.cpus == frozenset(range(4, 12)) and str(folder / name) in found.source
    launch = {topology.ALLOWED_ENV: "n1:0-5"}
    assert allowed(launch).cpus == frozenset({4, 5})
    other_host = {topology.ALLOWED_ENV: "n2:0-5"}   # another node's set: ignored
    assert allowed(other_host).cpus == frozenset(range(4, 12))
    assert topology.allowed_cpus(True, {}, "n1", cgroups, tmp_path / "absent") is None
    assert topology.allowed_cpus(True, launch, "n1", cgroups,
                                 tmp_path / "absent").cpus == frozenset(range(6))


def test_a_launch_plans_within_this_process_affinity():
    found = topology.allowed_cpus(False, {topology.ALLOWED_ENV: "elsewhere:0"}, "n1")
    assert found.cpus == frozenset(os.sched_getaffinity(0))
