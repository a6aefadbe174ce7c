"""The engine's gradients are the mean over ranks, scaled exactly once: checked in closed form.

Rank r's loss is sum_i (r + 1) (i + 1) w_i over three parameters in two buckets (the one
left out of backward shares its bucket with a used one), so its gradient is (r + 1) (i + 1)
and the mean over W ranks is (W + 1) / 2 (i + 1): exact in float32 for W = 2. Every way of running a step is checked:
overlap with each progress strategy and blocking, the loss divided by
``GradAllreducer.backward`` or not or backward run by ``train``'s own callback
(``TorchTrainer._gradients``, which the tasks call instead of ``loss.backward()``),
gradients zeroed in place or set to None. Prints one line per case, ``ok`` or ``FAIL`` with
the factor found, and exits 1 if any failed.

``--control twice``: the caller also divides the loss by W (the gradients are scaled twice);
``--control never``: the engine is told the loss was divided when it was not (scaled not at
all). Both must print FAIL.

``--each-control`` runs the three (none, ``twice``, ``never``) one after the other in this one
MPI job, each line prefixed with ``CONTROL: ``, and ends each with ``CONTROL: exit N``, N the
status a job of that control alone would exit with; the job itself then exits 0.

usage: grad_scale.py [--control twice|never | --each-control]
"""

import sys
from types import SimpleNamespace

import torch
from mpi4py import MPI

from hpcai.training import allreduce
from hpcai.training.allreduce import GradAllreducer, MpiTransport
from hpcai.training.torch_trainer import TorchTrainer

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
K = 1000


def step(control: str | None, overlap: bool, progress: str, divided: bool | str,
         set_to_none: bool) -> float:
    """One step; the factor by which the gradients differ from the mean (1.0 when right).
    ``divided``: True (``GradAllreducer.backward``), False (``loss.backward()``) or
    ``"train"`` (the trainer's callback does backward and synchronize)."""
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in (K, 3 * K, 7)])
    reducer = GradAllreducer(params, MpiTransport(comm), bucket_mb=4 * (3 * K + 7) / 2**20,
                             overlap=overlap, progress=progress)
    assert [len(b.params) for b in reducer.buckets] == [2, 1]
    trainer = SimpleNamespace(reducers={id(params): reducer})   # what _gradients reads
    expected = []
    for _ in range(2):   # the second step runs on the state the first left
        for p in params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        coeff = [(rank + 1) * torch.arange(1, p.numel() + 1, dtype=torch.float32)
                 for p in params[:2]]   # params[2] is unused: its gradient is 0
        loss = sum((c * p).sum() for c, p in zip(coeff, params))
        if control == "never":
            allreduce._loss_divided_by = world   # a lie: the loss was not divided
            loss.backward()
            allreduce._loss_divided_by = 0
        elif divided == "train":   # backward and synchronize, as train's tasks call it
            TorchTrainer._gradients(trainer, params, loss / world if control == "twice" else loss)
        elif control == "twice":
            reducer.backward(loss / world)
        elif divided:
            reducer.backward(loss)
        else:
            loss.backward()
        if divided != "train" or control == "never":
            reducer.synchronize()
        expected = [(world + 1) / 2 * torch.arange(1, K * m + 1, dtype=torch.float32)
                    for m in (1, 3)]
    reducer.close()
    got = torch.cat([params[0].grad, params[1].grad])
    want = torch.cat(expected)
    assert torch.equal(params[2].grad, torch.zeros(7)), "the unused parameter's gradient"
    return float((got / want).median()) if not torch.equal(got, want) else 1.0


def cases(control: str | None, prefix: str) -> int:
    """Every case with ``control``; prints a line per case (rank 0); how many failed."""
    failed = 0
    for overlap, progress in ((True, "hook"), (True, "thread"), (True, "nonblocking"),
                              (False, "hook")):
        for divided in (False, True, "train"):
            for set_to_none in (False, True):
                factor = step(control, overlap, progress, divided, set_to_none)
                case = (f"overlap={overlap} progress={progress} loss_divided={divided} "
                        f"set_to_none={set_to_none}")
                if rank == 0:
                    print(f"{prefix}{'ok' if factor == 1.0 else 'FAIL'} {case} "
                          f"factor {factor:g}", flush=True)
                failed += factor != 1.0
    return failed


if "--each-control" in sys.argv:
    for control in (None, "twice", "never"):
        status = 1 if cases(control, f"{control or 'none'}: ") else 0
        if rank == 0:
            print(f"{control or 'none'}: exit {status}", flush=True)
    sys.exit(0)
control = sys.argv[sys.argv.index("--control") + 1] if "--control" in sys.argv else None
sys.exit(1 if cases(control, "") else 0)
