"""validate's GPU section (launcher/gpucheck.py) on real probe runs, without a GPU.

Each case runs ``python -m hpcai.launcher.probe --gpu`` for real (one MPI rank, a singleton)
and judges its record with validate's check. Fakes, because no package provides them: the
driver's libcuda (``tests/test_gpu_driver.py``'s compiled stand-in that answers cuInit, the
device count, UUID and PCI address; its stub twin answers cuInit with 34, as a CUDA toolkit's
stub libcuda does) and the sysfs that says which NUMA node the GPU and the CPUs are on (a
tree given with the probe's ``--sysfs``). The NCCL allreduce needs two GPUs and is
"not measured" here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_gpu_driver import fake_driver

from hpcai.launcher import gpucheck, gpuprobe
from hpcai.launcher.gpucheck import GpuExpectation, RankGpu
from hpcai.launcher.probe import ProbeRecord
from hpcai.launcher.validate import Expectation, Launch, check_gpu

MODULE = "580.159.03"


def _sysfs(root: Path, gpu_node: int) -> Path:
    """Two NUMA nodes: this machine's CPUs on node 0, CPUs 1000-1001 on node 1; the GPU
    0000:3b:00.0 on ``gpu_node``."""
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    for node, listed in ((0, cpus), (1, "1000-1001")):
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(listed + "\n")
    (root / "bus/pci/devices/0000:3b:00.0").mkdir(parents=True)
    (root / "bus/pci/devices/0000:3b:00.0/numa_node").write_text(f"{gpu_node}\n")
    return root


def _probe(tmp_path: Path, lib_dir: Path | None, sysfs: Path) -> Launch:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = str(lib_dir)
    done = subprocess.run([sys.executable, "-m", "hpcai.launcher.probe", "--gpu", "--quiet",
                           "--out", str(out), "--sysfs", str(sysfs)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return Launch("container", 0, done.stderr, (ProbeRecord.load(out / "rank-0.json"),))


def _want(host_root: Path, bound: bool = True) -> Expectation:
    return Expectation(world=1, host="h", cpus={}, libmpi_prefix="/", unbound=None,
                       host_roots=(str(host_root),), topology="t",
                       gpu=GpuExpectation(bound, MODULE))


def test_the_host_drivers_libcuda_passes_and_is_reported(tmp_path):
    lib_dir = fake_driver(tmp_path / "host")
    run = _probe(tmp_path, lib_dir, _sysfs(tmp_path / "sys", gpu_node=0))
    lines, problems = check_gpu(run, _want(tmp_path / "host"))
    assert problems == []
    text = "\n".join(lines)
    assert "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f (Fake H200, NUMA 0, CPUs on NUMA 0)" in text
    assert f"libcuda {lib_dir}/libcuda.so.{MODULE}" in text
    assert "NCCL not loaded" in text and "NCCL allreduce: not measured: one rank" in text


def test_the_images_stub_libcuda_fails(tmp_path):
    """Negative control: the image's own stub (cuInit 34) where the driver should be."""
    stub = fake_driver(tmp_path / "image", init_status=gpuprobe.CUDA_ERROR_STUB_LIBRARY)
    run = _probe(tmp_path, stub, _sysfs(tmp_path / "sys", gpu_node=0))
    for bound in (True, False):     # whether or not the plan bound a driver
        _, problems = check_gpu(run, _want(tmp_path / "host", bound))
        assert len(problems) == 1 and "rank 0 on" in problems[0]
        assert f"{stub}/libcuda.so.{MODULE} is a stub library (cuInit returned 34)" \
            in problems[0]


def test_a_working_libcuda_from_the_image_fails(tmp_path):
    """A libcuda that answers (the right version) but lies in the image, not a host path."""
    lib_dir = fake_driver(tmp_path / "image")
    run = _probe(tmp_path, lib_dir, _sysfs(tmp_path / "sys", gpu_node=0))
    _, problems = check_gpu(run, _want(tmp_path / "host"))
    assert problems == [f"rank 0 on {run.records[0].host}: GPU check: "
                        f"{lib_dir}/libcuda.so.{MODULE} is the image's, not the host driver's"]


def test_a_rank_pinned_to_a_gpu_on_the_far_numa_node_is_flagged(tmp_path):
    """Negative control: the GPU on NUMA node 1, the rank's CPUs on node 0."""
    lib_dir = fake_driver(tmp_path / "host")
    run = _probe(tmp_path, lib_dir, _sysfs(tmp_path / "sys", gpu_node=1))
    _, problems = check_gpu(run, _want(tmp_path / "host"))
    assert len(problems) == 1
    assert ("GPU GPU-00010203-0405-0607-0809-0a0b0c0d0e0f (00000000:3b:00.0) is on NUMA "
            "node 1, the rank's CPUs on NUMA node(s) 0: pinned to a far GPU") in problems[0]


def test_no_gpu_says_so_and_fails_nothing_unless_a_driver_is_bound(tmp_path):
    run = _probe(tmp_path, None, _sysfs(tmp_path / "sys", gpu_node=0))
    if run.records[0].gpu["probe"]["libcuda"] is not None:
        import pytest
        pytest.skip("this machine has a libcuda.so.1 on the loader's path")
    lines, problems = check_gpu(run, _want(tmp_path / "host", bound=False))
    assert problems == [] and lines == [
        "GPU: no GPU (no rank loaded a libcuda, and the plan binds no driver)"]
    _, problems = check_gpu(run, _want(tmp_path / "host", bound=True))
    assert len(problems) == 1 and "no libcuda.so.1 could be loaded" in problems[0]


def test_an_allreduce_below_the_floor_fails_and_old_records_are_read():
    probe = gpuprobe.GpuProbe("/opt/hpcai/host/lib/libcuda.so.580.159.03", 0, None, 13000, 1,
                              "H200", "GPU-1", "2.27.3", "0", "0000:3b:00.0")
    from dataclasses import asdict
    fast = RankGpu(asdict(probe), 0, (0,), 140.0, "64 MiB allreduce over 2 ranks: 140 GB/s")
    slow = RankGpu(asdict(probe), 0, (0,), 2.5, "64 MiB allreduce over 2 ranks: 2.5 GB/s")
    want = GpuExpectation(True, MODULE)
    host = lambda path: path.startswith("/opt/hpcai/host/")   # noqa: E731
    assert gpucheck.check([(0, "a", fast), (1, "a", fast)], want, host)[1] == []
    _, problems = gpucheck.check([(0, "a", fast), (1, "a", slow)], want, host)
    assert problems == ["NCCL allreduce bus bandwidth 2.5 GB/s is below the floor 6 GB/s"]
    # a record from a probe without --gpu reads as gpu None
    assert RankGpu.from_dict(asdict(fast)) == fast
