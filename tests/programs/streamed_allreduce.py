"""2 ranks: the reducer's calls follow its arena (``GradAllreducer.streams``), in chunks that
cross bucket boundaries, and every gradient is the exact mean. The model's arena is about
2.6 MiB in 4 buckets; ``--call-mb X`` fixes the call size (default: measured, the same on
both ranks); ``--no-sync`` leaves out ``synchronize()`` (the control: the last chunk is
then never reduced). Prints one line per rank: ``CHUNK CALLS ok`` (or ``... FAIL``)."""

import argparse
import os

import torch
from mpi4py import MPI

from hpcai.training.allreduce import GradAllreducer, MpiTransport

parser = argparse.ArgumentParser()
parser.add_argument("--call-mb", type=float, default=None)
parser.add_argument("--no-sync", action="store_true")
args = parser.parse_args()
comm = MPI.COMM_WORLD
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(400, 400) for _ in range(4)])
for i, p in enumerate(model.parameters()):   # even integers: halves and sums are exact
    base = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) % 1000 + i
    p.grad = 2 * base + 2 * comm.rank
reducer = GradAllreducer(model, MpiTransport(comm), bucket_mb=0.6, call_mb=args.call_mb)
(stream,) = reducer.streams
chunks = comm.allgather(stream.chunk)
reducer.replay_backward(loss_divided=False)   # the hooks halve; the sum is the mean
if not args.no_sync:
    reducer.synchronize()
good = len(set(chunks)) == 1 and len(reducer.buckets) == 4
for i, p in enumerate(model.parameters()):
    base = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) % 1000 + i
    good = good and torch.equal(p.grad, 2 * base + 1)
os.write(1, f"{stream.chunk} {reducer.stats.allreduces} {'ok' if good else 'FAIL'}\n".encode())
