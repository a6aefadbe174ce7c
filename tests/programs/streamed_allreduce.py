"""2 ranks: the reducer's calls follow its arena (``GradAllreducer.streams``), in chunks that
cross bucket boundaries, and every gradient is the exact mean at every step. The model's
arena is about 2.6 MiB in 4 buckets; ``--call-mb X`` fixes the call size (default: measured
when the reducer is made, then tried again by the first steps; the same on both ranks at
every step); ``--no-sync`` leaves out ``synchronize()`` after a backward that gave one
parameter of the last bucket no gradient, as for an unused parameter (the control: the calls
from that bucket on are then never made). Runs steps until the call size is chosen (one
step with ``--call-mb`` or ``--no-sync``), then one more. Prints one line per rank for the
last step: ``CHUNK CALLS ok`` (or ``... FAIL``), and ``sizes: N N ...``, the call size of
each step."""

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
bases = [torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) % 1000 + i
         for i, p in enumerate(model.parameters())]
good, used = len(reducer.buckets) == 4, []
while True:
    for p, base in zip(model.parameters(), bases):
        p.grad.copy_(2 * base + 2 * comm.rank)
    chunk, tuning = stream.chunk, reducer.tuning
    used.append(chunk)
    reducer.stats.reset()
    if args.no_sync:   # the last bucket's first parameter unused, and no synchronize()
        unused = reducer.buckets[-1].params[0]
        for bucket in reducer.buckets:
            for p in bucket.params:
                if p is not unused:
                    reducer._on_grad(p)
    else:
        reducer.replay_backward(loss_divided=False)   # the hooks halve; the sum is the mean
        reducer.synchronize()
    for p, base in zip(model.parameters(), bases):
        good = good and torch.equal(p.grad, 2 * base + 1)
    if args.no_sync or not tuning:
        break
good = good and len({tuple(u) for u in comm.allgather(used)}) == 1
os.write(1, f"{chunk} {reducer.stats.allreduces} {'ok' if good else 'FAIL'}\n"
            f"sizes: {' '.join(map(str, used))}\n".encode())
