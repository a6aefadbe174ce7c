"""Run 3 optimiser steps data-parallel and save the parameters before and after (rank 0).

World W, per-rank batch B = GLOBAL // W: rank r takes rows [r*B, (r+1)*B) of each fixed
global batch, gradients are averaged by hpcai's GradAllreducer, then SGD steps. With W = 1
this is plain single-process training on the global batch, so the weight updates of the
W = 2 run must equal those of the W = 1 run up to rounding.

BatchNorm runs in eval mode and dropout is off: per-rank batch statistics are by design not
the statistics of the global batch, and dropout masks are per rank.

The generator case runs in float64: at initialisation its ecal MAPE is ~7e4 % and its
gradients (~2e4) come from heavy cancellation, so in float32 even one process's full-batch
gradient and the mean of its two half-batch gradients differ by ~1.6e-4 relative. float64
removes that rounding and leaves only what the engine does.

The learning rates keep the 3 steps small (updates of 2-4 % of the parameters' norm): at
lr 0.01 the generator's initial gradients blow its weights up to ~1e88 by the third step.

Saved: every parameter before (``init.NAME``) and after (``NAME``) the 3 steps, so that the
test compares the updates. ``--no-average`` leaves the gradients alone (each rank steps on its
own rows): the control that shows the comparison can fail. ``--device cuda`` runs the models
on the rank's GPU (``torch_trainer.rank_device``), so the allreduce goes through host copies,
in full fp32 (TF32 off).

``--progress hook|thread|nonblocking`` picks the overlap's progress strategy (default: the MPI
family's); ``--loss-divided`` runs backward through ``GradAllreducer.backward`` (the loss
divided by the world size instead of the gradients).

``--alone R`` runs the variant on rank R alone (``MPI.COMM_SELF``, which R saves) while the
other ranks skip it (``variants.py``, shared with keras_dp_equivalence.py).

``--each RUNS.json`` runs several such variants one after the other in this one MPI job
(the suite's way of paying for one start-up instead of one per variant): RUNS.json is a list
of argument lists, each ``[MODEL, OUT.npz, flags...]``. Every variant starts from the same
seeds as a process of its own would.

The optimiser is SGD with momentum 0.9 written out (``torch.optim.SGD``'s update with its
defaults: buf = g on the first step, then buf = 0.9 buf + g; p -= lr buf): the same update
on every rank and in the reference, without the 2.4 CPU-s import of ``torch._dynamo`` that
torch's optimisers make on first use.

usage: dp_equivalence.py MODEL OUT.npz [--blocking] [--no-average] [--device cuda]
                         [--progress hook|thread|nonblocking] [--loss-divided] [--alone R]
       dp_equivalence.py --each RUNS.json
       MODEL: mlp | gan-d | gan-g
"""

import sys
from pathlib import Path

import numpy as np
import torch

from hpcai.models import gan3d
from hpcai.models.gan3d_spec import LATENT, weighted_loss
from hpcai.training.allreduce import GradAllreducer, MpiTransport
from hpcai.training.torch_trainer import broadcast_state, rank_device
from variants import run_each, variant_comm

LR = {"mlp": 0.01, "gan-d": 1e-3, "gan-g": 1e-6}
MOMENTUM = 0.9
# full fp32 on a GPU, as on the CPU: cuDNN's default TF32 convolutions alone moved the
# discriminator's 2-rank update by 3.5e-4 (relative) on an H200, beyond the tolerance
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False


def no_dropout_eval_bn(module):
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.eval()


class MomentumSGD:
    """``torch.optim.SGD(params, lr, momentum)`` with its other defaults (no dampening,
    weight decay or Nesterov): the first step's buffer is the gradient itself."""

    def __init__(self, params, lr: float, momentum: float) -> None:
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers: dict[int, torch.Tensor] = {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            buf = self.buffers.get(id(p))
            if buf is None:
                buf = self.buffers[id(p)] = p.grad.detach().clone()
            else:
                buf.mul_(self.momentum).add_(p.grad)
            p.add_(buf, alpha=-self.lr)


def variant(argv: list[str]) -> None:
    """3 steps of one variant (``MODEL OUT.npz [flags...]``); rank 0 of the variant's
    communicator saves the parameters."""
    comm = variant_comm(argv)
    if comm is None:
        return
    rank, world = comm.Get_rank(), comm.Get_size()
    model_name, out = argv[0], argv[1]
    overlap = "--blocking" not in argv
    average = "--no-average" not in argv
    progress = argv[argv.index("--progress") + 1] if "--progress" in argv else None
    loss_divided = "--loss-divided" in argv
    device = rank_device(argv[argv.index("--device") + 1] if "--device" in argv else "cpu")
    GLOBAL = 4 if model_name == "mlp" else 2
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(42)
    if model_name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 3))
        batches = [(torch.randn(GLOBAL, 16, generator=data),
                    torch.randn(GLOBAL, 3, generator=data)) for _ in range(3)]

        def loss_fn(x, y):
            return torch.nn.functional.mse_loss(model(x), y)
    elif model_name == "gan-d":
        model = gan3d.Discriminator(rng=torch.Generator().manual_seed(1))
        batches = [(torch.rand(GLOBAL, 1, 25, 25, 25, generator=data) * 0.01,
                    torch.rand(GLOBAL, generator=data) * 4.9 + 0.1) for _ in range(3)]

        def loss_fn(x, e):  # the real-batch objective, labels without bit flip
            fake, aux, ecal = model(x)
            parts = (gan3d.bce(fake, torch.ones_like(fake)), gan3d.mape(e.view(-1, 1), aux),
                     gan3d.mape(x.sum(dim=(1, 2, 3, 4)).view(-1, 1), ecal))
            return weighted_loss(parts)
    else:
        model = gan3d.Generator(rng=torch.Generator().manual_seed(1))
        critic = gan3d.Discriminator(rng=torch.Generator().manual_seed(2))
        no_dropout_eval_bn(critic)
        critic.requires_grad_(False)
        model.double()
        critic.double()
        batches = []
        for _ in range(3):
            e = torch.rand(GLOBAL, generator=data, dtype=torch.float64) * 4.9 + 0.1
            z = torch.randn(GLOBAL, LATENT, generator=data, dtype=torch.float64)
            batches.append((e.view(-1, 1) * z, e))

        def loss_fn(latent, e):  # the generator objective with D frozen
            fake, aux, ecal = critic(model(latent))
            e = e.view(-1, 1)
            parts = (gan3d.bce(fake, torch.ones_like(fake)), gan3d.mape(e, aux),
                     gan3d.mape(gan3d.sampling_fraction(e), ecal))
            return weighted_loss(parts)

    if model_name == "gan-g":
        critic.to(device)
    model.to(device)
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    no_dropout_eval_bn(model)
    broadcast_state([model], comm)
    initial = {name: p.detach().cpu().numpy().copy() for name, p in model.named_parameters()}
    reducer = GradAllreducer(model, MpiTransport(comm), bucket_mb=0.05, overlap=overlap,
                             progress=progress) if average else None
    opt = MomentumSGD(model.parameters(), lr=LR[model_name], momentum=MOMENTUM)
    per_rank = GLOBAL // world
    for x, y in batches:
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        opt.zero_grad()
        loss = loss_fn(x[lo:hi], y[lo:hi])
        if loss_divided and reducer is not None:
            reducer.backward(loss)
        else:
            loss.backward()
        if reducer is not None:
            reducer.synchronize()
        opt.step()
    if reducer is not None:
        reducer.close()
    if rank == 0:
        np.savez(out, **{name: p.detach().cpu().numpy() for name, p in model.named_parameters()},
                 **{f"init.{name}": a for name, a in initial.items()})


if __name__ == "__main__":
    if sys.argv[1] == "--each":
        run_each(Path(sys.argv[2]), variant)
    else:
        variant(sys.argv[1:])
