"""2 ranks: MpiTransport.blocking of a 3 MiB bucket, in one call or (``--call N``) in
consecutive calls of N elements, whatever the MPI family, and the sum is exact. Prints one
line per rank: ``FAMILY CALLS ok`` (or ``... FAIL``). ``--family F`` acts as family F."""

import argparse
import os

import numpy as np
import torch
from mpi4py import MPI

from hpcai.training.allreduce import MpiTransport


class Counting:
    """The communicator, counting its Allreduce calls."""

    def __init__(self, comm):
        self.comm, self.calls = comm, 0

    def Allreduce(self, *args, **kwargs):
        self.calls += 1
        return self.comm.Allreduce(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.comm, name)


parser = argparse.ArgumentParser()
parser.add_argument("--family", default=None)
parser.add_argument("--call", type=int, default=0, help="elements per call (0: one call)")
args = parser.parse_args()
transport = MpiTransport(MPI.COMM_WORLD)
if args.family:
    transport.family = args.family
counting = transport.comm = Counting(MPI.COMM_WORLD)
rank = MPI.COMM_WORLD.rank
n = 3 * (1 << 18) + 1                    # 3 MiB and 4 bytes of float32
flat = torch.from_numpy(np.arange(n, dtype=np.float32) % 1000 + rank)
transport.blocking(flat, args.call)
want = 2 * (np.arange(n, dtype=np.float32) % 1000) + 1
good = np.array_equal(flat.numpy(), want)
os.write(1, f"{transport.family} {counting.calls} {'ok' if good else 'FAIL'}\n".encode())
