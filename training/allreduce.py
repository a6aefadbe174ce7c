"""PyTorch gradient averaging over MPI: fused buckets, overlapped with the backward pass.

Parameters are grouped, in reverse registration order (roughly the order in which backward
produces their gradients), into buckets of at most ``bucket_mb`` (``sync.plan_buckets``).
Each parameter's ``.grad`` is a view into its bucket's flat buffer, so backward writes the
bucket directly and averaging copies nothing (zero gradients in place,
``zero_grad(set_to_none=False)``, to keep it that way; a replaced gradient is copied in once
and re-pointed). In overlap mode a post-accumulate-grad hook on every parameter counts
arrivals; when a bucket is complete a non-blocking ``MPI_Iallreduce`` of its buffer starts
while backward goes on. :meth:`synchronize` waits for all buckets and divides by the world
size, in place. Call it once after every backward (a second backward before it, i.e.
gradient accumulation, is detected and redone blocking). Blocking mode (``overlap=False``)
does the same with ``MPI_Allreduce`` after backward, after a barrier that measures how long
the fastest rank waited for the slowest (load imbalance, reported apart from the transfer).

The transport is MPI (mpi4py: whatever libmpi it loaded, the host MPI when the launcher
bound it in), torch.distributed's gloo or Horovod, so all are measured with the same
bucketing. On a GPU (``train --device cuda``) the buckets live in device memory and the MPI
transport reduces a host copy of each (``_Staged``), then copies the sum back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np

from .sync import DEFAULT_BUCKET_MB, SyncStats, check_horovod_world, plan_buckets


class MpiTransport:
    """Sum-allreduce of flat tensors with mpi4py (in place)."""

    name = "mpi"

    def __init__(self, comm) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.size = comm.Get_size()

    def start(self, flat: torch.Tensor):
        """An ``MPI.Request``; for a GPU tensor a :class:`_Staged` one (host copy)."""
        array, copy_back = host_array(flat)
        request = self.comm.Iallreduce(self._mpi.IN_PLACE, array, op=self._mpi.SUM)
        return _Staged(request, array, flat) if copy_back else request

    def blocking(self, flat: torch.Tensor) -> None:
        array, copy_back = host_array(flat)
        self.comm.Allreduce(self._mpi.IN_PLACE, array, op=self._mpi.SUM)
        if copy_back:
            flat.copy_(torch.from_numpy(array))

    def wait_all(self, handles) -> None:
        handles = list(handles)
        self._mpi.Request.Waitall([_request(h) for h in handles])
        for handle in handles:
            if isinstance(handle, _Staged):
                handle.flat.copy_(torch.from_numpy(handle.host))

    def barrier(self) -> None:
        self.comm.Barrier()

    def poke(self, handles) -> None:
        """Let MPI progress outstanding requests (no progress thread in most MPIs)."""
        if handles:
            self._mpi.Request.Testall([_request(h) for h in handles])


def host_array(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """(a NumPy array MPI can read and fill for ``t``, whether ``t`` needs it copied back):
    a view of a contiguous CPU tensor, else a host copy. MPI is not assumed to read device
    memory (CUDA-aware)."""
    if t.device.type == "cpu" and t.is_contiguous():
        return t.numpy(), False
    return t.contiguous().cpu().numpy(), True


@dataclass
class _Staged:
    """A GPU tensor's allreduce: MPI works on ``host`` (a copy), ``flat`` gets the sum back
    in ``MpiTransport.wait_all``."""

    request: object
    host: np.ndarray
    flat: torch.Tensor


def _request(handle):
    return handle.request if isinstance(handle, _Staged) else handle


class TorchDistTransport:
    """The same, through torch.distributed (gloo: the transport DDP uses on CPU)."""

    def __init__(self, name: str = "gloo") -> None:
        import torch.distributed as dist

        self.name = name
        self._dist = dist
        self.size = dist.get_world_size()

    def start(self, flat: torch.Tensor):
        return self._dist.all_reduce(flat, async_op=True)

    def blocking(self, flat: torch.Tensor) -> None:
        self._dist.all_reduce(flat)

    def wait_all(self, handles) -> None:
        for work in handles:
            work.wait()

    def barrier(self) -> None:
        self._dist.barrier()

    def poke(self, handles) -> None:
        pass


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    offsets: list[int]
    views: list[torch.Tensor] = field(default_factory=list)
    ready: int = 0
    request: object = None


def _dense(p: torch.Tensor) -> bool:
    """Strides that cover exactly numel() elements (contiguous in some dimension order)."""
    expected = 1
    for size, stride in sorted(zip(p.shape, p.stride()), key=lambda t: t[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _grad_view(flat: torch.Tensor, p: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``flat`` shaped like ``p`` with p's strides (channels-last stays so, which
    keeps autograd's gradient layout contract)."""
    if _dense(p):
        # as_strided's offset counts from the storage's start, and flat is a slice of it
        return flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset)
    return flat[offset:offset + p.numel()].view(p.shape)


def _arenas(groups: list[list[torch.nn.Parameter]]) -> list[torch.Tensor]:
    """One zeroed flat buffer per bucket, all buckets of a dtype slices of one allocation,
    on the parameters' device.

    The allocation is numpy's, which asks Linux for transparent huge pages
    (``madvise(MADV_HUGEPAGE)``) on large arrays; torch's allocator does not. Open MPI's
    single-copy shared-memory path pins the pages it reads, and on 4 KiB pages the
    ResNet50 gradient set took about twice as long to reduce (``bench/allreduce_bw.py``).
    """
    import numpy as np

    totals: dict[torch.dtype, int] = {}
    for group in groups:
        dtype = group[0].dtype
        totals[dtype] = totals.get(dtype, 0) + sum(p.numel() for p in group)
    arena = {}
    device = groups[0][0].device if groups else torch.device("cpu")
    for dtype, n in totals.items():
        if device.type != "cpu":
            arena[dtype] = torch.zeros(n, dtype=dtype, device=device)
            continue
        try:
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:   # no numpy twin (bfloat16): torch's own allocation
            arena[dtype] = torch.zeros(n, dtype=dtype)
        else:
            arena[dtype] = torch.from_numpy(np.zeros(n, dtype=np_dtype))
    used = dict.fromkeys(totals, 0)
    flats = []
    for group in groups:
        dtype, n = group[0].dtype, sum(p.numel() for p in group)
        flats.append(arena[dtype][used[dtype]:used[dtype] + n])
        used[dtype] += n
    return flats


class GradAllreducer:
    """Average the gradients of ``module``'s parameters across the transport's ranks."""

    def __init__(self, module: torch.nn.Module, transport, *,
                 bucket_mb: float = DEFAULT_BUCKET_MB, overlap: bool = True) -> None:
        self.transport = transport
        self.size = transport.size
        self.overlap = overlap and self.size > 1
        self.stats = SyncStats()
        self.buckets = self._make_buckets(
            [p for p in module.parameters() if p.requires_grad], int(bucket_mb * 2**20))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._handles = []
        if self.overlap:
            self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                             for bucket in self.buckets for p in bucket.params]

    @staticmethod
    def _make_buckets(params: list[torch.nn.Parameter], limit: int) -> list[_Bucket]:
        groups = plan_buckets([p.numel() * p.element_size() for p in params],
                              [p.dtype for p in params], limit)
        arenas = _arenas([[params[i] for i in group] for group in groups])
        return [GradAllreducer._bucket([params[i] for i in group], flat)
                for group, flat in zip(groups, arenas)]

    @staticmethod
    def _bucket(params: list[torch.nn.Parameter], flat: torch.Tensor) -> _Bucket:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        views = [_grad_view(flat, p, off) for p, off in zip(params, offsets)]
        for p, view in zip(params, views):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view   # backward accumulates straight into the bucket
        return _Bucket(params=params, flat=flat, offsets=offsets, views=views)

    # -- overlap mode ---------------------------------------------------------------------
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)
        self._poke()

    def _poke(self) -> None:
        self.transport.poke([b.request for b in self.buckets if b.request is not None])

    # -- both modes ---------------------------------------------------------------------
    def _pack(self, bucket: _Bucket) -> None:
        """Make every gradient of the bucket live in its flat buffer.

        Gradients are views into the buffer (set at construction), so backward already
        accumulated into it and nothing is copied. A gradient that was replaced (zero_grad
        with set_to_none, or first use) is copied in once and re-pointed at its view.
        """
        for p, view in zip(bucket.params, bucket.views):
            grad = p.grad
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            else:
                continue
            p.grad = view

    def _launch(self, bucket: _Bucket) -> None:
        self._pack(bucket)
        bucket.request = self.transport.start(bucket.flat)
        self.stats.allreduces += 1
        self.stats.bytes += bucket.flat.numel() * bucket.flat.element_size()

    def _unpack(self, bucket: _Bucket) -> None:
        bucket.flat.div_(self.size)   # the gradients are views: now they hold the mean

    def synchronize(self) -> None:
        """Finish averaging; afterwards every rank holds the same mean gradients."""
        if self.size == 1:
            return
        start = time.perf_counter()
        if self.overlap:
            for bucket in self.buckets:
                if bucket.request is None:   # unused parameters: never got a gradient
                    self._launch(bucket)
            self.transport.wait_all([b.request for b in self.buckets])
            for bucket in self.buckets:
                if bucket.ready > len(bucket.params):
                    # a second backward before synchronize (accumulation): redo exactly
                    self._pack(bucket)
                    self.transport.blocking(bucket.flat)
        else:
            self.transport.barrier()   # separates load imbalance from transfer time
            self.stats.imbalance_s += time.perf_counter() - start
            for bucket in self.buckets:
                self._pack(bucket)
                self.transport.blocking(bucket.flat)
                self.stats.allreduces += 1
                self.stats.bytes += bucket.flat.numel() * bucket.flat.element_size()
        for bucket in self.buckets:
            self._unpack(bucket)
            bucket.request = None
            bucket.ready = 0
        self.stats.wait_s += time.perf_counter() - start

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class HorovodTransport:
    """Horovod's allreduce as the transport (only when ``horovod.torch`` imports).

    Horovod 0.28.1 is built from its patched sdist by ``scripts/build-horovod.sh`` (README);
    ``--comm horovod`` without it is a user error. Horovod does its own fusion too; handing it
    hpcai's buckets keeps the comparison about the transport.
    """

    name = "horovod"

    def __init__(self, comm=None) -> None:
        import horovod.torch as hvd

        if not hvd.is_initialized():
            hvd.init()
        if comm is not None:
            check_horovod_world(hvd, comm)
        self._hvd = hvd
        self.size = hvd.size()

    def start(self, flat: torch.Tensor):
        return self._hvd.allreduce_async_(flat, op=self._hvd.Sum)

    def blocking(self, flat: torch.Tensor) -> None:
        self._hvd.synchronize(self.start(flat))

    def wait_all(self, handles) -> None:
        for handle in handles:
            self._hvd.synchronize(handle)

    def barrier(self) -> None:
        self._hvd.allreduce(torch.zeros(1), name="hpcai.barrier")

    def poke(self, handles) -> None:
        pass
