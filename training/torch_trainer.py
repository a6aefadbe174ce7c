"""The trainer's PyTorch hooks: tasks from ``tasks``, gradients averaged by ``allreduce``.

The loop, records, checkpoints, preemption and faults are ``trainer.Trainer``'s; this module
says how PyTorch does each framework step: broadcast and fingerprint the parameters and
buffers (NumPy views of the tensors), average the gradients (hpcai's buckets over mpi4py,
torch.distributed's gloo, or Horovod), set the learning rate, write ``torch.save``
checkpoints (``checkpoint.read`` loads them), seed the step's randomness and probe the GEMM
peak. With ``--device cuda`` the models and batches live on the rank's GPU (``device_data``),
cuDNN picks its fastest kernels (``cudnn.benchmark``), ``--precision`` sets TF32 and bf16
autocast (:func:`precision_settings`), the GEMM peak is measured in that precision, and the
gradients are averaged with NCCL (:func:`init_nccl`) unless ranks share a GPU; whatever MPI
touches is copied through host memory. No step waits for the GPU: the losses stay there
until the epoch's end.
"""

from __future__ import annotations

import os
import socket
from typing import BinaryIO, Iterable

import numpy as np
import torch
from mpi4py import MPI

from .allreduce import (GradAllreducer, HorovodTransport, MpiTransport, TorchDistTransport,
                        host_array)
from .device_data import device_data
from .metrics import best_gemm_gflops, nccl_version
from .tasks import make_task
from .trainer import Trainer


def _tensors(modules: Iterable[torch.nn.Module], buffers: bool) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for module in modules:
        out.extend(p.detach() for p in module.parameters())
        if buffers:
            out.extend(b.detach() for b in module.buffers())
    return out


def module_arrays(modules: Iterable[torch.nn.Module], buffers: bool = True) -> list[np.ndarray]:
    """NumPy views of every parameter (and buffer) of ``modules`` (host copies of GPU
    tensors), for ``replicas.verify``."""
    return [t.cpu().numpy() for t in _tensors(modules, buffers)]


def broadcast_state(modules: Iterable[torch.nn.Module], comm, root: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with rank ``root``'s, in place."""
    for t in _tensors(modules, buffers=True):
        array, copy_back = host_array(t)
        comm.Bcast(array, root=root)
        if copy_back:
            t.copy_(torch.from_numpy(array))


GPU_GEMM = 8192   # a GPU's peak probe: an 8192^3 product (2048^3 is too short to fill one)


def gemm_peak_gflops(device: torch.device = torch.device("cpu"),
                     precision: str = "fp32") -> float:
    """Best-of-8 ``torch.mm`` rate on ``device``: on the CPU fp32 2048^3 with this process's
    torch threads; on a GPU 8192^3 in ``precision`` (random operands, bf16 ones for bf16; the
    TF32 switches as :func:`precision_settings` left them)."""
    if device.type == "cpu":
        a = torch.randn(2048, 2048)
        b = torch.randn(2048, 2048)
        return best_gemm_gflops(lambda: torch.mm(a, b))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(GPU_GEMM, GPU_GEMM, device=device, dtype=dtype)
    b = torch.randn(GPU_GEMM, GPU_GEMM, device=device, dtype=dtype)

    def multiply() -> None:
        torch.mm(a, b)
        torch.cuda.synchronize(device)

    return best_gemm_gflops(multiply, size=GPU_GEMM)


def precision_settings(precision: str, device: torch.device) -> None:
    """On a GPU: cuDNN autotuning on, and TF32 for matrix products and convolutions off
    for fp32, on for tf32 and bf16 (what autocast leaves in float32). The CPU is left as it
    is (fp32 only)."""
    if device.type != "cuda":
        return
    tf32 = precision != "fp32"
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def gpu_sharing(comm, device: torch.device) -> int:
    """The most ranks of this job on one GPU (the same host and device UUID); collective."""
    props = torch.cuda.get_device_properties(device)
    key = (socket.gethostname(), str(getattr(props, "uuid", device.index)))
    mine = comm.allgather(key)
    return max(mine.count(k) for k in mine)


def init_torch_dist(backend: str, comm, rank: int, world: int,
                    device: torch.device | None = None) -> None:
    """torch.distributed's process group for this job (once). The rendezvous is
    MASTER_ADDR/MASTER_PORT (hpcai-launch sets them); without them rank 0 offers a free port
    on loopback when the whole job is on one host, else on its host name, and broadcasts it
    over MPI. ``device``: the rank's GPU, bound to the group (NCCL)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        method = "env://"
    else:
        hosts = comm.allgather(socket.gethostname())
        offer = None
        if rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                free = s.getsockname()[1]
            offer = f"tcp://{'127.0.0.1' if len(set(hosts)) == 1 else hosts[0]}:{free}"
        method = comm.bcast(offer, root=0)
    extra = {} if device is None else {"device_id": device}
    dist.init_process_group(backend, init_method=method, rank=rank, world_size=world, **extra)


def init_nccl(comm, rank: int, world: int, device: torch.device) -> str:
    """The NCCL process group (:func:`init_torch_dist`), proven with one allreduce of ones;
    returns NCCL's version."""
    import torch.distributed as dist

    init_torch_dist("nccl", comm, rank, world, device)
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != world:
        raise RuntimeError(f"NCCL allreduce of ones over {world} ranks gave {probe.item()}")
    return nccl_version(torch.cuda.nccl.version())


def rank_device(kind: str) -> torch.device:
    """``cpu``, or for ``cuda`` this rank's GPU: its local rank (the launcher's LOCAL_RANK)
    modulo the GPUs it sees, made the current one."""
    if kind == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    device = torch.device(kind, local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


class TorchTrainer(Trainer):
    framework = "pytorch"

    def __init__(self, cfg, *args, **kwargs) -> None:
        self.device = rank_device(cfg.device)
        precision_settings(cfg.precision, self.device)
        super().__init__(cfg, *args, **kwargs)

    def _threads(self) -> int:
        return torch.get_num_threads()

    def _data(self, index, held_out):
        data, sharder, held_out = super()._data(index, held_out)
        data, where = device_data(data, self.device)
        if self.rank == 0 and self.device.type == "cuda":
            print(f"hpcai-train: training data in {where}", flush=True)
        return data, sharder, held_out

    def _make_task(self):
        return make_task(self.cfg, self.target_lr, self.device)

    def _make_reducers(self) -> dict:
        cfg = self.cfg
        if cfg.comm == "gloo":
            init_torch_dist("gloo", self.comm, self.rank, self.world)
            transport = TorchDistTransport("gloo")
        elif cfg.comm == "horovod":
            transport = HorovodTransport(self.comm)
        elif cfg.comm == "nccl" and self._nccl():
            transport = TorchDistTransport("nccl")
        else:
            transport = MpiTransport(self.comm)
        progress = cfg.allreduce_progress if isinstance(transport, MpiTransport) else None
        reducers = {id(m): GradAllreducer(m, transport, bucket_mb=cfg.bucket_mb,
                                          overlap=cfg.overlap, progress=progress)
                    for m in self.task.modules.values()}
        overlapping = {r.progress for r in reducers.values() if r.overlap}
        if isinstance(transport, MpiTransport) and overlapping:
            self.comm_detail = f" ({', '.join(sorted(overlapping))} progress)"
        return reducers

    def _nccl(self) -> bool:
        """--comm nccl: start NCCL and say so; False (MPI through host memory, said too)
        when ranks share a GPU, which NCCL refuses."""
        shared = gpu_sharing(self.comm, self.device)
        if shared > 1:
            self.comm_backend = "mpi"
            if self.rank == 0:
                print(f"hpcai-train: up to {shared} ranks share a GPU, which NCCL cannot "
                      "serve: gradients are averaged over MPI through host memory",
                      flush=True)
            return False
        version = init_nccl(self.comm, self.rank, self.world, self.device)
        if self.rank == 0:
            print(f"hpcai-train: gradients averaged with NCCL {version} (torch.distributed) "
                  f"over {self.world} rank(s), one GPU each", flush=True)
        return True

    def _finish_device_work(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _to_host(self, values: list) -> list[float]:
        """One copy for all the tensors among ``values`` (0-d, on one device)."""
        tensors = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        if not tensors:
            return [float(v) for v in values]
        read = torch.stack([values[i].float() for i in tensors]).cpu().tolist()
        out = [float(v) if not isinstance(v, torch.Tensor) else 0.0 for v in values]
        for i, value in zip(tensors, read):
            out[i] = value
        return out

    def _gradients(self, module: torch.nn.Module, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the loss divided by the world size (backward produces each
        rank's share of the mean: no pass divides the gradients), then the rest of the
        allreduce that overlapped it."""
        reducer = self.reducers[id(module)]
        reducer.backward(loss)
        reducer.synchronize()

    def _broadcast(self) -> None:
        broadcast_state(self.task.modules.values(), self.comm)

    def _state_arrays(self, everything: bool) -> list[np.ndarray]:
        return module_arrays(self.task.modules.values(), buffers=everything)

    def _moving_statistics(self) -> list[torch.Tensor]:
        """Every BatchNorm's running mean and variance of the task's modules."""
        return [buf for module in self.task.modules.values() for m in module.modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                and m.running_mean is not None for buf in (m.running_mean, m.running_var)]

    def _local_statistics(self) -> list:
        return [buf.detach().cpu().clone() for buf in self._moving_statistics()]

    def _load_local_statistics(self, saved: list) -> None:
        for buf, value in zip(self._moving_statistics(), saved, strict=True):
            buf.copy_(value)

    def _average_bn(self) -> None:
        for buf in self._moving_statistics():
            array, copy_back = host_array(buf)
            self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            if copy_back:
                buf.copy_(torch.from_numpy(array))
            buf.div_(self.world)

    def _apply_lr(self, lr: float) -> None:
        for opt in self.task.optimizers.values():
            for group in opt.param_groups:
                group["lr"] = lr

    def _task_state(self) -> dict:
        extra = self.task.extra_state()
        return {"modules": {k: m.state_dict() for k, m in self.task.modules.items()},
                "optimizers": {k: o.state_dict() for k, o in self.task.optimizers.items()},
                **({"extra": extra} if extra else {})}

    def _load_task_state(self, state: dict) -> None:
        self.task.load_extra_state(state.get("extra", {}))
        for key, module in self.task.modules.items():
            module.load_state_dict(state["modules"][key])
        for key, opt in self.task.optimizers.items():
            opt.load_state_dict(state["optimizers"][key])

    def _write_checkpoint(self, state: dict, handle: BinaryIO) -> None:
        torch.save(state, handle)

    def _step_rng(self, seed: int) -> torch.Generator:
        torch.manual_seed(seed)   # dropout draws from the global generator (every device's)
        return torch.Generator(self.device).manual_seed(seed)

    def _gemm_probe(self) -> tuple[float, str]:
        if self.device.type == "cpu":
            return gemm_peak_gflops(self.device), "fp32 GEMM 2048^3 (torch.mm)"
        precision = self.cfg.precision
        return (gemm_peak_gflops(self.device, precision),
                f"{precision} GEMM {GPU_GEMM}^3 (torch.mm"
                f"{', bf16 operands' if precision == 'bf16' else ''}, TF32 "
                f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}) on "
                f"{torch.cuda.get_device_name(self.device)}")

    def _framework_version(self) -> str:
        if self.device.type == "cpu":
            return torch.__version__
        return (f"{torch.__version__} (CUDA {torch.version.cuda}, "
                f"{torch.cuda.get_device_name(self.device)})")
