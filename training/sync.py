"""What the PyTorch and TensorFlow gradient averagers share (no framework imported).

- :func:`plan_buckets`: which tensors go into which fused allreduce bucket;
- :class:`SyncStats`: the counters an epoch record reports;
- :func:`check_horovod_world`: Horovod and mpi4py must see the same world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DEFAULT_BUCKET_MB = 4.0


def plan_buckets(nbytes: Sequence[int], dtypes: Sequence, limit: int) -> list[list[int]]:
    """Group tensors ``0..n-1`` into buckets: in reverse order (roughly the order in which
    backward produces their gradients), one dtype per bucket, and a bucket closes once it
    holds ``limit`` bytes or more (so it stays under ``limit`` plus its last tensor, and a
    small tensor between two large ones never gets a call of its own). Returns the tensors'
    indices per bucket."""
    groups: list[list[int]] = []
    size, dtype = limit, None
    for i in reversed(range(len(nbytes))):
        if size >= limit or dtypes[i] != dtype:
            groups.append([])
            size, dtype = 0, dtypes[i]
        groups[-1].append(i)
        size += nbytes[i]
    return groups


@dataclass
class SyncStats:
    """Seconds the main thread spent averaging (PyTorch: in the backward hooks and in
    ``synchronize``; in blocking mode, of that the wait for the slowest rank to arrive,
    estimated from a sample of the steps: ``allreduce.IMBALANCE_EVERY``),
    bytes reduced, allreduce calls made."""

    wait_s: float = 0.0
    imbalance_s: float = 0.0
    bytes: int = 0
    allreduces: int = 0

    def reset(self) -> None:
        self.wait_s, self.imbalance_s, self.bytes, self.allreduces = 0.0, 0.0, 0, 0


def check_horovod_world(hvd, comm) -> None:
    """Horovod must see the same world as mpi4py: a Horovod built against another MPI than
    the one the launcher chose sees N singleton worlds (or fails) - say so, by name."""
    from ..core.errors import UserError

    if (hvd.size(), hvd.rank()) != (comm.Get_size(), comm.Get_rank()):
        raise UserError(
            f"Horovod sees rank {hvd.rank()} of {hvd.size()}, MPI sees rank "
            f"{comm.Get_rank()} of {comm.Get_size()}: Horovod is linked against a different "
            "MPI than the one this job runs on",
            "launch with the MPI Horovod was built with (scripts/build-horovod.sh uses the "
            "mpicxx on PATH), or use --comm mpi")
