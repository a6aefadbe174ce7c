"""The trainer's PyTorch hooks: tasks from ``tasks``, gradients averaged by ``allreduce``.

The loop, records, checkpoints, preemption and faults are ``trainer.Trainer``'s; this module
says how PyTorch does each framework step: broadcast and fingerprint the parameters and
buffers (NumPy views of the tensors), average the gradients (hpcai's buckets over mpi4py,
torch.distributed's gloo, or Horovod), set the learning rate, write ``torch.save``
checkpoints (``checkpoint.read`` loads them), seed the step's randomness and probe the GEMM
peak. With ``--device cuda`` the models and batches live on the rank's GPU and whatever MPI
touches is copied through host memory.
"""

from __future__ import annotations

import os
from typing import BinaryIO, Iterable

import numpy as np
import torch
from mpi4py import MPI

from .allreduce import (GradAllreducer, HorovodTransport, MpiTransport, TorchDistTransport,
                        host_array)
from .metrics import best_gemm_gflops
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


def gemm_peak_gflops(device: torch.device = torch.device("cpu")) -> float:
    """Best-of-8 fp32 2048^3 ``torch.mm`` rate on ``device`` (on the CPU with this process's
    torch threads)."""
    a = torch.randn(2048, 2048, device=device)
    b = torch.randn(2048, 2048, device=device)
    if device.type == "cpu":
        return best_gemm_gflops(lambda: torch.mm(a, b))

    def multiply() -> None:
        torch.mm(a, b)
        torch.cuda.synchronize(device)

    return best_gemm_gflops(multiply)


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
        super().__init__(cfg, *args, **kwargs)

    def _threads(self) -> int:
        return torch.get_num_threads()

    def _make_task(self):
        return make_task(self.cfg, self.target_lr, self.device)

    def _make_reducers(self) -> dict:
        cfg = self.cfg
        if cfg.comm == "gloo":
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method="env://", rank=self.rank,
                                        world_size=self.world)
            transport = TorchDistTransport("gloo")
        elif cfg.comm == "horovod":
            transport = HorovodTransport(self.comm)
        else:
            transport = MpiTransport(self.comm)
        return {id(m): GradAllreducer(m, transport, bucket_mb=cfg.bucket_mb, overlap=cfg.overlap)
                for m in self.task.modules.values()}

    def _after_backward(self, module: torch.nn.Module) -> None:
        self.reducers[id(module)].synchronize()

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
        where = ("" if self.device.type == "cpu"
                 else f" on {torch.cuda.get_device_name(self.device)}")
        return gemm_peak_gflops(self.device), f"fp32 GEMM 2048^3 (torch.mm){where}"

    def _framework_version(self) -> str:
        if self.device.type == "cpu":
            return torch.__version__
        return (f"{torch.__version__} (CUDA {torch.version.cuda}, "
                f"{torch.cuda.get_device_name(self.device)})")
