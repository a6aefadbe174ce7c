"""The PyTorch models as training tasks: modules, optimisers, one training step, FLOPs per
sample (counted by ``torch.utils.flop_counter`` on shape-only copies, ``META``).

A task owns no communication: ``train_step`` takes a ``backward(module, loss)`` callback that
replaces ``loss.backward()``; the engine uses it to compute gradients from the loss divided by
the world size and to average them before each optimiser step. Batches arrive as NumPy
arrays, wrapped as tensors without a copy, or with ``--device cuda`` as tensors already on
the GPU or in pinned host memory (``device_data``); what goes back to NumPy is copied to the
host. ``train_step`` returns its losses as 0-d tensors where the step ran, so that no step
waits for the device; the trainer reads them once per epoch. With ``--precision bf16`` the
forward passes and losses run under ``torch.autocast`` to bfloat16.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..core.errors import UserError
from ..models import gan3d, resnet

from . import eager, flopcache
from .averaging import WeightAverage, standing_statistics
from .config import TrainConfig

STANDING_BATCHES, STANDING_SEED = 16, 0x57A4D   # standing BatchNorm statistics' inputs
META = torch.device("meta")   # tensors with shapes and no data: the FLOP count computes nothing
FLOP_CONVENTION = ("1 multiply-add = 2 FLOP (torch.utils.flop_counter.FlopCounterMode); "
                   "training FLOPs = forward + backward of one full iteration as counted")


def count_flops(fn) -> int:
    """FLOPs of running ``fn()`` once, as FlopCounterMode counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    eager.skip_wrappers()          # its dispatch mode's, and the meta tensors' references
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


def as_tensor(a: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``a`` on ``device``: a NumPy array wrapped without a copy on the CPU; a tensor in
    pinned memory is copied without waiting (a plain ``.to`` from pageable memory waits for
    the device to finish all queued work)."""
    if isinstance(a, torch.Tensor):
        return a.to(device, non_blocking=True)
    return torch.from_numpy(a).to(device)


def autocast(precision: str, device: torch.device):
    """``torch.autocast`` to bfloat16 for ``--precision bf16`` on a GPU; else nothing."""
    if precision == "bf16" and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """torch's Adam, RMSprop or SGD (momentum 0.9, weight decay 1e-4), built by
    :func:`.eager.optimizer` (stepped without importing ``torch._dynamo``)."""
    if name == "adam":
        return eager.optimizer(torch.optim.Adam, params, lr=lr)
    if name == "rmsprop":
        return eager.optimizer(torch.optim.RMSprop, params, lr=lr, alpha=0.9)
    return eager.optimizer(torch.optim.SGD, params, lr=lr, momentum=0.9, weight_decay=1e-4)


def standing_inputs(batch_size: int, device: torch.device) -> Iterator[torch.Tensor]:
    """The batches a generator's standing BatchNorm statistics are measured on (the weight
    average's, and the trained generator's with ``--validate-bn standing``): E' * z drawn as
    in training, from a fixed seed, ``STANDING_BATCHES`` of ``batch_size``."""
    rng = torch.Generator(device).manual_seed(STANDING_SEED)
    for _ in range(STANDING_BATCHES):
        yield gan3d.sample_inputs(batch_size, rng)[2]


@contextlib.contextmanager
def _batch_statistics(module: torch.nn.Module):
    """Inference without dropout, BatchNorm normalising with the batch's own statistics and
    leaving its running averages alone; the module's modes are restored afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    tracking = [m.track_running_stats for m in norms]
    module.eval()
    for m in norms:
        m.train()
        m.track_running_stats = False
    try:
        yield
    finally:
        for m, flag in zip(norms, tracking):
            m.track_running_stats = flag
        for m, mode in modes:
            m.training = mode


class GanTask:
    """CERN's 3DGAN: D real, D fake, G, G per iteration (see docs/3dgan.md), with
    ``--generator-ema`` an average of the generator's weights beside it (``averaging``), and
    with ``--validate-bn standing`` a copy of the generator whose BatchNorm statistics are
    measured afresh for its weights when it is judged (training never uses the copy)."""

    name = "3dgan"
    flop_convention = FLOP_CONVENTION
    loss_keys = ("g", "d_real", "d_fake")   # the epoch line's; epochs.jsonl has all

    def __init__(self, cfg: TrainConfig, lr: float,
                 device: torch.device = torch.device("cpu")) -> None:
        init = torch.Generator().manual_seed(cfg.seed)   # the same weights on any device
        self.device = device
        self.G = gan3d.Generator(rng=init, bn_axis=cfg.bn_axis).to(device)
        self.D = gan3d.Discriminator(rng=init, bn_axis=cfg.bn_axis,
                                     cell_scale=cfg.cell_scale).to(device)
        self.d_bn_in_g_steps = cfg.d_bn_in_g_steps
        self.loss_weights = cfg.loss_weights
        self.cell_scale = cfg.cell_scale   # data in GeV; the networks see GeV x cell_scale
        if cfg.channels_last:
            self.G = self.G.to(memory_format=torch.channels_last_3d)
            self.D = self.D.to(memory_format=torch.channels_last_3d)
        self.opt_g = make_optimizer(cfg.optimizer, self.G.parameters(), lr)
        self.opt_d = make_optimizer(cfg.optimizer, self.D.parameters(), lr)
        self.channels_last = cfg.channels_last
        self.batch_size = cfg.batch_size
        self.average = (WeightAverage(self.G, cfg.generator_ema, self._generator_inputs)
                        if cfg.generator_ema is not None else None)
        self.validate_bn = cfg.validate_bn
        self.precision = cfg.precision
        self._standing: torch.nn.Module | None = None   # G's copy, for --validate-bn standing
        self._standing_fresh = False     # does it hold G's current weights and statistics?

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {"generator": self.G, "discriminator": self.D}

    @property
    def generators(self) -> tuple[str, ...]:
        """What physics validation judges, the run's result first: the weight average
        (with ``--generator-ema``), then the trained generator, with its moving BatchNorm
        statistics ("raw") or, with ``--validate-bn standing``, standing ones ("standing")."""
        trained = "standing" if self.validate_bn == "standing" else "raw"
        return ("average", trained) if self.average is not None else (trained,)

    def _generator_inputs(self) -> Iterator[torch.Tensor]:
        return standing_inputs(self.batch_size, self.device)

    def standing_generator(self) -> torch.nn.Module:
        """The trained generator's weights with BatchNorm statistics measured for them on
        :func:`standing_inputs` (again only after a step or a resume); G itself, its moving
        statistics included, is left as it is. Every rank holds the same weights, so every
        rank measures the same statistics without communicating."""
        if self._standing is None:
            self._standing = copy.deepcopy(self.G).requires_grad_(False)
            self._standing_fresh = False
        if not self._standing_fresh:
            self._standing.load_state_dict(self.G.state_dict())
            standing_statistics(self._standing, self._generator_inputs())
            self._standing_fresh = True
        return self._standing

    def extra_state(self) -> dict:
        """Checkpointed beside the modules and optimisers: the generator's average."""
        return {} if self.average is None else {"generator_average": self.average.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        """Restore :meth:`extra_state` on ``--resume``; a run that would drop, invent or
        change the average is a :class:`UserError`."""
        self._standing_fresh = False     # G's weights are the checkpoint's now
        saved = state.get("generator_average")
        hint = "resume with the --generator-ema the run was started with, or start a new --out"
        if (saved is None) != (self.average is None):
            raise UserError("--resume: the checkpoint has " + ("no" if saved is None else "a")
                            + " generator average and this run " + (
                                "keeps one" if saved is None else "does not"), hint)
        if saved is not None:
            try:
                self.average.load_state_dict(saved)
            except ValueError as exc:
                raise UserError(f"--resume: {exc}", hint) from None

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"generator": self.opt_g, "discriminator": self.opt_d}

    def train_step(self, x: np.ndarray, e: np.ndarray, rng: torch.Generator,
                   backward: Callable[[torch.nn.Module, torch.Tensor], None] | None
                   ) -> dict[str, torch.Tensor]:
        x, e = self._to_network(x), as_tensor(e, self.device)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        with autocast(self.precision, self.device):
            losses = gan3d.gan_iteration(self.G, self.D, self.opt_g, self.opt_d, x, e, rng,
                                         backward, self.d_bn_in_g_steps,
                                         self.loss_weights, host=False)
        if self.average is not None:
            self.average.update(self.G)
        self._standing_fresh = False
        return losses

    def _to_network(self, x: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Cells in GeV -> the networks' units on the task's device (a new tensor when scaled
        or moved; ``x`` untouched)."""
        t = as_tensor(x, self.device)
        return t * self.cell_scale if self.cell_scale != 1.0 else t

    @torch.no_grad()
    def evaluate(self, x: np.ndarray, e: np.ndarray) -> dict[str, float]:
        """Physics check on the given events (no dropout, BatchNorm on batch statistics as in
        training, nothing updated: the moving averages, momentum 0.01, lag far behind early on).

        ``aux_rel_error``: mean |aux(x) - E'| / E' of the discriminator on real showers;
        ``gen_sum_over_f``: mean Σ(G) / f(E') of generated showers (1 is right);
        ``real_sum_over_f``: the same for the real events, for reference.
        """
        x, e = as_tensor(x, self.device), as_tensor(e, self.device)
        with _batch_statistics(self.G), _batch_statistics(self.D):
            _, aux, _ = self.D(x * self.cell_scale)
            ev = e.view(-1, 1)
            rng = torch.Generator(self.device).manual_seed(4321)
            e_gen, _, latent = gan3d.sample_inputs(x.shape[0], rng)
            generated = self.G(latent) / self.cell_scale
            f_gen = gan3d.sampling_fraction(e_gen).view(-1)
            f_real = gan3d.sampling_fraction(ev).view(-1)
            return {
                "aux_rel_error": float(((aux - ev).abs() / ev).mean()),
                "gen_sum_over_f": float((generated.sum(dim=(1, 2, 3, 4)) / f_gen).mean()),
                "real_sum_over_f": float((x.sum(dim=(1, 2, 3, 4)) / f_real).mean()),
            }

    @torch.no_grad()
    def physics_pass(self, x: np.ndarray, e: np.ndarray, z: np.ndarray, chunk: int = 32,
                     generator: str = "raw", real: bool = True, batch_statistics: bool = False
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(G(E' z) in GeV, aux of D on x, aux of D on G(E' z)) as NumPy, both networks in
        inference mode (moving BatchNorm statistics, the standing ones for the "standing"
        generator, no dropout), their modes restored afterwards. ``x`` is in GeV, as read.
        ``generator``: one of :attr:`generators`;
        ``real`` False: D is not run on ``x`` (its aux comes back empty), for a second
        generator on the same events. ``batch_statistics``: G as the generator steps run it,
        its BatchNorm normalising each ``chunk`` of events with that chunk's own statistics
        (the moving ones untouched)."""
        if generator not in self.generators:
            raise ValueError(f"no generator {generator!r} here: {self.generators}")
        G = (self.average.module() if generator == "average" else
             self.standing_generator() if generator == "standing" else self.G)
        modes = [(m, m.training) for net in (G, self.D) for m in net.modules()]
        G.eval()
        self.D.eval()
        generated, aux_real, aux_gen = [], [np.zeros(0, np.float32)], []
        try:
            with _batch_statistics(G) if batch_statistics else contextlib.nullcontext():
                for start in range(0, len(e), chunk):
                    es = torch.from_numpy(e[start:start + chunk]).to(self.device).view(-1, 1)
                    gs = G(es * torch.from_numpy(z[start:start + chunk]).to(self.device))
                    generated.append((gs / self.cell_scale).contiguous().cpu().numpy())
                    aux_gen.append(self.D(gs)[1].view(-1).cpu().numpy())
                    if real:
                        xs = self._to_network(x[start:start + chunk])
                        if self.channels_last:
                            xs = xs.contiguous(memory_format=torch.channels_last_3d)
                        aux_real.append(self.D(xs)[1].view(-1).cpu().numpy())
        finally:
            for m, mode in modes:
                m.training = mode
        return np.concatenate(generated), np.concatenate(aux_real), np.concatenate(aux_gen)

    def flops_per_sample(self, batch: int = 2, device: torch.device = META) -> float:
        """One whole iteration (4 optimiser steps) per real sample, on copies of the models
        on ``device``: by default shape-only (``META``), the same count without the
        arithmetic (the random draws stay on the CPU), and read from :mod:`.flopcache`
        when counted before."""
        if device != META:
            return self._count(batch, device)
        k = flopcache.key((self.G, self.D), [(batch, 1, 25, 25, 25)],
                          (count_flops, gan3d.gan_iteration), task="3dgan", batch=batch)
        return flopcache.cached(k, lambda: self._count(batch, META))

    def _count(self, batch: int, device: torch.device) -> float:
        G, D = copy.deepcopy(self.G).to(device), copy.deepcopy(self.D).to(device)
        opt_g = eager.optimizer(torch.optim.SGD, G.parameters(), lr=0.0)
        opt_d = eager.optimizer(torch.optim.SGD, D.parameters(), lr=0.0)
        x = torch.rand(batch, 1, 25, 25, 25).to(device)
        e = torch.full((batch,), 1.0).to(device)
        rng = torch.Generator().manual_seed(0)
        return count_flops(lambda: gan3d.gan_iteration(G, D, opt_g, opt_d, x, e, rng)) / batch


class ResNetTask:
    """ResNet-50 (or a tiny ResNet for tests) on image batches, cross-entropy, SGD."""

    loss_keys = ("loss", "accuracy")
    flop_convention = FLOP_CONVENTION

    def __init__(self, cfg: TrainConfig, lr: float,
                 device: torch.device = torch.device("cpu")) -> None:
        torch.manual_seed(cfg.seed)
        net = (resnet.resnet50(num_classes=cfg.classes) if cfg.model == "resnet50"
               else resnet.resnet_tiny(num_classes=cfg.classes)).to(device)
        self.device = device
        self.channels_last = cfg.channels_last
        self.net = net.to(memory_format=torch.channels_last) if cfg.channels_last else net
        self.opt = make_optimizer(cfg.optimizer, self.net.parameters(), lr)
        self.name = cfg.model
        self.image_size = cfg.image_size
        self.precision = cfg.precision

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {"net": self.net}

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"net": self.opt}

    def extra_state(self) -> dict:
        """Nothing beside the network and its optimiser."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        """Nothing to restore."""

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def train_step(self, x: np.ndarray, y: np.ndarray, rng: torch.Generator,
                   backward: Callable[[torch.nn.Module, torch.Tensor], None] | None
                   ) -> dict[str, torch.Tensor]:
        x, y = as_tensor(x, self.device), as_tensor(y, self.device)
        self.net.train()
        self.opt.zero_grad(set_to_none=False)
        with autocast(self.precision, self.device):
            logits = self.net(self._prepare(x))
            loss = F.cross_entropy(logits, y)
        if backward is None:
            loss.backward()
        else:
            backward(self.net, loss)
        self.opt.step()
        with torch.no_grad():
            accuracy = (logits.argmax(1) == y).float().mean()
        return {"loss": loss.detach(), "accuracy": accuracy}

    @torch.no_grad()
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        x, y = as_tensor(x, self.device), as_tensor(y, self.device)
        was = self.net.training
        self.net.eval()
        try:
            logits = self.net(self._prepare(x))
            return {"loss": float(F.cross_entropy(logits, y)),
                    "accuracy": float((logits.argmax(1) == y).float().mean())}
        finally:
            self.net.train(was)

    def flops_per_sample(self, batch: int = 2, device: torch.device = META) -> float:
        """Forward and backward per sample, on a copy of the network on ``device`` (by
        default shape-only, ``META``, and read from :mod:`.flopcache` when counted before)."""
        if device != META:
            return self._count(batch, device)
        k = flopcache.key((self.net,), [(batch, 3, self.image_size, self.image_size)],
                          (count_flops,), task="resnet", batch=batch,
                          channels_last=self.channels_last)
        return flopcache.cached(k, lambda: self._count(batch, META))

    def _count(self, batch: int, device: torch.device) -> float:
        net = copy.deepcopy(self.net).to(device)
        x = self._prepare(torch.randn(batch, 3, self.image_size, self.image_size,
                                      device=device))
        y = torch.zeros(batch, dtype=torch.long, device=device)

        def step() -> None:
            F.cross_entropy(net(x), y).backward()

        return count_flops(step) / batch


def make_task(cfg: TrainConfig, lr: float, device: torch.device = torch.device("cpu")):
    return (GanTask(cfg, lr, device) if cfg.model == "3dgan"
            else ResNetTask(cfg, lr, device))
