"""The GPU path of the engine, checked on the CPU: training steps that never wait for the
device, --precision and --comm nccl as options, data held on the device, and
bench/gpu_parity.py's and bench/gpu_device.sh's output (structure, not speed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import KEEP_FREED_MEMORY, base_env, run
from hpcai.core.errors import UserError
from hpcai.models import gan3d
from hpcai.training import config, tasks
from hpcai.training.device_data import DeviceData, device_data
from hpcai.training.synthetic_images import SyntheticImages
from hpcai.training.torch_trainer import TorchTrainer

BENCH = Path(__file__).resolve().parent.parent / "bench"
# The CPU runs below on one intra-op thread (a second one polls a core the busy suite does
# not have: twice the CPU time for the 3DGAN step), with glibc's malloc keeping freed
# memory rather than page-faulting the 3DGAN's temporaries in again at every step. What
# the tests read (records, structure) does not depend on either.
ONE_THREAD = {"OMP_NUM_THREADS": "1", **KEEP_FREED_MEMORY}


@pytest.fixture
def one_thread():
    """torch on one intra-op thread in this process for the test, then as before."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Readbacks(TorchDispatchMode):
    """Counts the reads of a tensor's value into Python (``.item()``, ``float(t)``): on a GPU
    each waits for all queued work. The optimisers' step counters, host tensors even on a
    GPU, are left out."""

    def __init__(self, host_counters: set[int]) -> None:
        super().__init__()
        self.host_counters, self.count = host_counters, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and \
                args[0].data_ptr() not in self.host_counters:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _counters(task) -> set[int]:
    return {s["step"].data_ptr() for opt in task.optimizers.values()
            for s in opt.state.values() if isinstance(s.get("step"), torch.Tensor)}


@pytest.mark.parametrize("argv", [["resnet-tiny", "--image-size", "16", "--classes", "10"],
                                  ["3dgan", "--generate", "8"]])
def test_a_training_step_reads_nothing_back(argv, one_thread):
    cfg = config.parse(argv)
    task = tasks.make_task(cfg, 1e-3)
    if cfg.model == "3dgan":
        x = np.random.default_rng(0).random((2, 1, 25, 25, 25), dtype=np.float32)
        y = np.array([1.0, 2.0], np.float32)
    else:
        x = np.random.default_rng(0).random((2, 3, 16, 16), dtype=np.float32)
        y = np.array([1, 2])
    task.train_step(x, y, torch.Generator().manual_seed(0), None)   # optimiser state made
    with Readbacks(_counters(task)) as mode:
        losses = task.train_step(x, y, torch.Generator().manual_seed(1), None)
    assert mode.count == 0
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in losses.values())
    if cfg.model == "3dgan":   # the control: the same iteration returning floats is caught
        with Readbacks(_counters(task)) as mode:
            floats = gan3d.gan_iteration(task.G, task.D, task.opt_g, task.opt_d,
                                         torch.from_numpy(x), torch.from_numpy(y),
                                         torch.Generator().manual_seed(2))
        assert mode.count == len(floats) - 1   # every loss but g, the mean of two floats


def test_losses_are_read_once_as_floats():
    values = [torch.tensor(1.5), 2.0, torch.tensor(3, dtype=torch.int64), torch.tensor(0.25)]
    assert TorchTrainer._to_host(None, values) == [1.5, 2.0, 3.0, 0.25]
    assert TorchTrainer._to_host(None, [1, 2.5]) == [1.0, 2.5]


def test_precision_and_comm_defaults_and_refusals():
    cpu = config.parse(["resnet-tiny"])
    assert (cpu.precision, cpu.comm, cpu.memory_format) == ("fp32", "mpi", "channels_last")
    assert config.parse(["resnet-tiny", "--channels-first"]).memory_format == "contiguous"
    gpu = config.parse(["resnet50", "--device", "cuda"])   # parsing needs no GPU
    assert (gpu.precision, gpu.comm) == ("tf32", "nccl")
    assert config.parse(["3dgan", "--device", "cuda", "--comm", "mpi", "--precision",
                         "bf16"]).comm == "mpi"
    for argv, words in ((["resnet-tiny", "--precision", "bf16"], "is for --device cuda"),
                        (["resnet-tiny", "--comm", "nccl"], "needs --device cuda"),
                        (["resnet50", "--device", "cuda", "--comm", "gloo"], "nccl or mpi"),
                        (["resnet50", "--device", "cuda", "--framework", "tensorflow"],
                         "--framework pytorch")):
        with pytest.raises(UserError, match=words):
            config.parse(argv)
    assert config.parse(["resnet-tiny", "--precision", "fp32"]).precision == "fp32"


def test_device_data_holds_every_sample():
    images = SyntheticImages(10, image_size=8, classes=5, seed=3)
    same, where = device_data(images, torch.device("cpu"))
    assert same is images and where == "host memory"   # the CPU reads as before
    held = DeviceData(images, torch.device("cpu"))
    assert len(held) == 10
    idx = np.array([7, 0, 7, 3])
    x, y = held.read(idx)
    want_x, want_y = images.read(idx)
    assert torch.equal(x, torch.from_numpy(want_x)) and torch.equal(y, torch.from_numpy(want_y))


def test_a_cpu_run_records_precision_and_memory_format(tmp_path):
    out = tmp_path / "run"
    result = run([sys.executable, "-m", "hpcai.training", "resnet-tiny", "--image-size", "16",
                  "--classes", "10", "--batch-size", "2", "--samples", "4", "--epochs", "1",
                  "--eval-samples", "0", "--channels-first", "--out", str(out)],
                 base_env(**ONE_THREAD), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    assert (record["precision"], record["memory_format"]) == ("fp32", "contiguous")
    assert "% of fp32 peak" in result.stdout
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    assert all(isinstance(s["loss"], float) and np.isfinite(s["loss"]) for s in steps)


@pytest.fixture(scope="module")
def device_script(tmp_path_factory):
    """bench/gpu_device.sh --cpu, run once: its parity run (tiny sizes, one pair), its
    3DGAN profile and its smoke run, in OUT (:data:`ONE_THREAD`: the profile's 80 s limit
    is then not at the mercy of a busy machine)."""
    out = tmp_path_factory.mktemp("gpu-device") / "out"
    result = run(["bash", str(BENCH / "gpu_device.sh"), "--cpu"],
                 base_env(OUT=str(out), PARITY_BUDGET_S="300", **ONE_THREAD), timeout=1200,
                 cwd=out.parent)
    return result, out


@pytest.mark.mpi
def test_gpu_device_script_in_cpu_mode(device_script):
    result, out = device_script
    assert result.returncode == 0, result.stdout[-3000:]
    names = {p.name for p in out.iterdir()}
    assert names >= {"log.txt", "gpu-parity-h200.json", "gan-profile-h200.txt",
                     "gan-profile-h200.json", "nccl-smoke.log"} and len(names) <= 8
    assert "parity rc=0" in result.stdout and "smoke rc=0" in result.stdout
    assert result.stdout.rstrip().splitlines()[-1].startswith("== done")


@pytest.mark.mpi
def test_gpu_parity_runs_on_the_cpu_and_writes_its_json(device_script):
    """The device script's parity run (bench/gpu_parity.py on the CPU, one pair per row)."""
    doc = json.loads((device_script[1] / "gpu-parity-h200.json").read_text())
    assert doc["benchmark"] == "gpu_parity" and not doc["failures"]
    assert doc["provenance"]["git_commit"] and doc["provenance"]["torch"]
    assert [r["key"] for r in doc["rows"]] == ["resnet-tiny-b2-fp32-channels_last",
                                               "3dgan-b1-fp32-channels_last"]
    for row in doc["rows"]:
        assert len(row["plain_samples_per_s"]) == len(row["hpcai_samples_per_s"]) == 1
        assert row["plain_samples_per_s"][0] > 0 and row["hpcai_samples_per_s"][0] > 0
        assert row["ratio"]["n"] == 1 and row["ratio"]["ci95"] is None
        assert row["verdict"] == "unresolved"   # one pair has no interval
    assert doc["rows"][0]["target"] == 0.95 and doc["rows"][1]["target"] == 3.0
    assert doc["verdict"] == "unresolved"
    assert {r["config"] for r in doc["hpcai_runs"]} == {r["key"] for r in doc["rows"]}
    assert all(r["precision"] == "fp32" and r["comm"] == "mpi" for r in doc["hpcai_runs"])


def test_gpu_parity_intervals_and_verdicts():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_parity
    finally:
        sys.path.remove(str(BENCH))
    stats = gpu_parity.interval([1.0, 1.02, 0.98])
    assert stats["mean"] == 1.0 and stats["ci95"] == [0.9503, 1.0497]   # t(2) = 4.303
    assert gpu_parity.verdict(stats, 0.95) == "met"
    assert gpu_parity.verdict(stats, 1.01) == "unresolved"
    assert gpu_parity.verdict(gpu_parity.interval([0.5, 0.52]), 0.95) == "missed"
    assert gpu_parity.verdict(gpu_parity.interval([2.0]), 0.95) == "unresolved"


@pytest.mark.mpi
def test_gpu_profile_on_the_cpu(device_script):
    """The device script's torch.profiler table of the 3DGAN step, and its JSON."""
    table = device_script[1] / "gan-profile-h200.txt"
    assert "sorted by self_cpu_time_total" in table.read_text()
    doc = json.loads(table.with_suffix(".json").read_text())
    assert doc["sorted_by"] == "self_cpu_us" and 0 < len(doc["top"]) <= 25
    assert doc["ms_per_step"] > 0 and any("conv" in t["name"] for t in doc["top"])


@pytest.fixture(scope="module")
def rendezvous_job(tmp_path_factory):
    """One 2-rank job that starts a gloo process group with hpcai-launch's MASTER_ADDR/PORT,
    all-reduces, destroys it, then does the same again without them: ``GIVEN sum N`` from
    each rank for each."""
    script = tmp_path_factory.mktemp("pg") / "pg.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "from mpi4py import MPI\n"
        "from hpcai.training.torch_trainer import init_torch_dist\n"
        "comm = MPI.COMM_WORLD\n"
        "for given in (True, False):\n"
        "    if not given:\n"
        "        os.environ.pop('MASTER_ADDR', None); os.environ.pop('MASTER_PORT', None)\n"
        "    init_torch_dist('gloo', comm, comm.rank, comm.size)\n"
        "    t = torch.tensor([comm.rank + 1.0]); dist.all_reduce(t)\n"
        "    # one write: lines cannot interleave\n"
        "    os.write(1, f'{given} sum {int(t.item())}\\n'.encode())\n"
        "    dist.destroy_process_group()\n")
    return run(["hpcai-launch", "-N", "2", "--", sys.executable, str(script)],
               base_env(), timeout=300)


@pytest.mark.mpi
@pytest.mark.parametrize("given", [True, False])
def test_process_group_rendezvous_with_and_without_master_addr(given, rendezvous_job):
    """init_torch_dist (NCCL's on GPUs, here with gloo): hpcai-launch's MASTER_ADDR/PORT, or
    without them a port offered by rank 0 over MPI (after the first group is destroyed, in
    the same job)."""
    result = rendezvous_job
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"{given} sum 3") == 2, result.stdout
