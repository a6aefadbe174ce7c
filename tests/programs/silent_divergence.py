"""A backend that silently skips averaging (as Horovod's Keras 3 path did): each rank steps
on its own batch with no allreduce, and ``replicas.verify`` must raise ReplicaDivergence.
Prints ``caught: MESSAGE`` on every rank that caught it. The replicas start equal
(``broadcast_state``, checked exactly); the step is plain SGD, lr 0.1, written out."""

import torch
from mpi4py import MPI

from hpcai.training.replicas import ReplicaDivergence, verify
from hpcai.training.torch_trainer import broadcast_state, module_arrays

comm = MPI.COMM_WORLD
m = torch.nn.Linear(8, 2)
broadcast_state([m], comm)
verify(module_arrays([m]), comm, exact=True)
torch.manual_seed(comm.rank)
m(torch.randn(4, 8)).sum().backward()  # no allreduce: the silent failure
with torch.no_grad():
    for p in m.parameters():
        p.sub_(0.1 * p.grad)
try:
    verify(module_arrays([m], buffers=False), comm, exact=False)
except ReplicaDivergence as exc:
    print("caught:", exc, flush=True)
