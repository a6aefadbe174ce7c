"""3DGAN (CERN's calorimeter-shower GAN) in PyTorch, as described in docs/3dgan.md.

The constants it shares with the Keras model (loss weights, E' range, latent size, layer
hyper-parameters) and f(E') come from ``gan3d_spec``.

Conventions
-----------
* Images are channels-first ``(N, 1, 25, 25, 25)``; the last spatial axis is depth (the 25
  calorimeter layers).  ``E'`` is the primary energy / 100 GeV, shape ``(N, 1)``.
* Keras defaults are reproduced: LeakyReLU alpha 0.3, BatchNorm momentum 0.99 (torch
  ``momentum=0.01``) and eps 1e-3, zero biases, Keras 'same' padding (extra pad after),
  symmetric ``ZeroPadding3D`` per axis, ``UpSampling3D`` = repeat each value per axis.
* All randomness of the training step (E', z, bit flips) comes from an explicit
  ``torch.Generator``; weight initialisation takes an optional one too.  Dropout uses torch's
  global RNG (``nn.Dropout`` takes no generator): seed it with ``torch.manual_seed``.

Training step (``gan_iteration``): four optimiser steps per iteration, D on a real batch,
D on a generated batch (G in inference mode), then G twice with fresh E' and z while D is
frozen.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gan3d_spec import (BN_EPS, DROPOUT, E_MAX, E_MIN, EPS, FLIP_PROB, LATENT, LEAKY_ALPHA,
                         LOSS_WEIGHTS, sampling_fraction, weighted_loss)

BN_MOMENTUM = 0.01  # torch convention: Keras momentum 0.99 -> 1 - 0.99


# ---------------------------------------------------------------------------------------------
# Keras-style building blocks and initialisers


class ZeroPad3d(nn.Module):
    """Keras ``ZeroPadding3D((a, b, c))``: pad spatial axis i by ``p[i]`` on both sides."""

    def __init__(self, padding: int | tuple[int, int, int]):
        super().__init__()
        p = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        self.padding = p
        # F.pad orders the pads last axis first: (d3_lo, d3_hi, d2_lo, d2_hi, d1_lo, d1_hi)
        self._pad = (p[2], p[2], p[1], p[1], p[0], p[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, self._pad)

    def extra_repr(self) -> str:
        return f"padding={self.padding}"


class Upsample3d(nn.Module):
    """Keras ``UpSampling3D(size)``: repeat every value ``size[i]`` times along spatial axis i.

    Implemented with ``repeat_interleave`` so that it is exact (no float scale arithmetic);
    this equals nearest-neighbour upsampling with integer factors.
    """

    def __init__(self, size: tuple[int, int, int]):
        super().__init__()
        self.size = tuple(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for axis, s in zip((2, 3, 4), self.size):
            if s != 1:
                x = x.repeat_interleave(s, dim=axis)
        return x

    def extra_repr(self) -> str:
        return f"size={self.size}"


class Conv3dSame(nn.Conv3d):
    """Stride-1 ``Conv3D(padding='same')`` as Keras/TF pads it: per axis the total padding is
    ``k - 1``, split ``before = (k - 1) // 2``, ``after = (k - 1) - before`` (the extra zero goes
    after).  torch's ``padding='same'`` does the same but warns for even
    kernels, so the padding is applied explicitly here.
    """

    def __init__(self, cin: int, cout: int, kernel_size, bias: bool = True):
        super().__init__(cin, cout, kernel_size, padding=0, bias=bias)
        pads: list[int] = []
        for k in reversed(self.kernel_size):  # F.pad order: last axis first
            total = k - 1
            pads += [total // 2, total - total // 2]
        self.same_pad = tuple(pads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, self.same_pad))


BN_AXES = ("channels", "depth")


class DepthBatchNorm3d(nn.BatchNorm3d):
    """Keras ``BatchNormalization()`` (default axis -1) on channels-first data, as in the run
    behind the papers [CERN]: one mean, variance, scale and offset per calorimeter layer (the
    last spatial axis), over the batch, the channels and the two transverse axes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 4)).transpose(1, 4)


def _bn(channels: int, depth: int, axis: str) -> nn.BatchNorm3d:
    """BatchNorm over ``channels`` (``axis`` "channels") or the ``depth`` layers ("depth")."""
    if axis == "depth":
        return DepthBatchNorm3d(depth, eps=BN_EPS, momentum=BN_MOMENTUM)
    return nn.BatchNorm3d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)


def glorot_uniform_(w: torch.Tensor, rng: torch.Generator | None = None) -> torch.Tensor:
    """Keras glorot_uniform: U(-l, l), l = sqrt(6 / (fan_in + fan_out))."""
    return nn.init.xavier_uniform_(w, gain=1.0, generator=rng)


def he_uniform_(w: torch.Tensor, rng: torch.Generator | None = None) -> torch.Tensor:
    """Keras he_uniform: U(-l, l), l = sqrt(6 / fan_in) (kaiming uniform, fan_in, gain sqrt 2)."""
    return nn.init.kaiming_uniform_(w, a=0.0, mode="fan_in", nonlinearity="relu", generator=rng)


def glorot_normal_(w: torch.Tensor, rng: torch.Generator | None = None) -> torch.Tensor:
    """Keras glorot_normal: truncated normal (cut at +-2 sd), sd = sqrt(2/(fan_in+fan_out))/0.8796..

    The divisor is the std of a unit normal truncated at +-2, so the result has the Glorot
    variance.
    """
    fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(w)
    std = math.sqrt(2.0 / (fan_in + fan_out)) / 0.87962566103423978
    return nn.init.trunc_normal_(w, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std, generator=rng)


def _init(layer: nn.Module, fn, rng: torch.Generator | None) -> None:
    fn(layer.weight, rng)
    if getattr(layer, "bias", None) is not None:
        nn.init.zeros_(layer.bias)


# ---------------------------------------------------------------------------------------------
# Models


class Generator(nn.Module):
    """Generator: input ``E' * z`` of shape (N, 200) -> shower (N, 1, 25, 25, 25), values >= 0.

    ``dense`` -> Keras Reshape((7,7,8,8)) on channels-last data, then ``body`` (layers 3-16 of
    docs/3dgan.md). ``bn_axis`` "depth": BatchNorm per calorimeter layer (``DepthBatchNorm3d``).
    """

    def __init__(self, latent: int = LATENT, rng: torch.Generator | None = None,
                 bn_axis: str = "channels"):
        super().__init__()
        self.latent = latent
        self.dense = nn.Linear(latent, 7 * 7 * 8 * 8)                            # 1
        self.body = nn.Sequential(
            Conv3dSame(8, 64, (6, 6, 8)),                                        # 3
            nn.LeakyReLU(LEAKY_ALPHA),                                           # 4
            _bn(64, 8, bn_axis),                                                 # 5
            Upsample3d((2, 2, 2)),                                               # 6
            ZeroPad3d((2, 2, 0)),                                                # 7
            nn.Conv3d(64, 6, (6, 5, 8)),                                         # 8
            nn.LeakyReLU(LEAKY_ALPHA),                                           # 9
            _bn(6, 9, bn_axis),                                                  # 10
            Upsample3d((2, 2, 3)),                                               # 11
            ZeroPad3d((1, 0, 3)),                                                # 12
            nn.Conv3d(6, 6, (3, 3, 8)),                                          # 13
            nn.LeakyReLU(LEAKY_ALPHA),                                           # 14
            nn.Conv3d(6, 1, (2, 2, 2), bias=False),                              # 15
            nn.ReLU(),                                                           # 16
        )
        _init(self.dense, glorot_uniform_, rng)
        convs = [m for m in self.body if isinstance(m, nn.Conv3d)]
        for conv in convs[:3]:
            _init(conv, he_uniform_, rng)
        _init(convs[3], glorot_normal_, rng)

    def project(self, latent: torch.Tensor) -> torch.Tensor:
        """Dense + Keras Reshape((7,7,8,8)): (N, 200) -> channels-first (N, 8, 7, 7, 8)."""
        h = self.dense(latent)
        # Keras reshapes the 3136 vector channels-last (D1, D2, D3, C) in C order.
        return h.view(-1, 7, 7, 8, 8).permute(0, 4, 1, 2, 3)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.body(self.project(latent))


class InGeV(nn.Module):
    """A generator trained with ``train --cell-scale S``, its showers divided by S (GeV)."""

    def __init__(self, generator: Generator, cell_scale: float):
        super().__init__()
        self.generator = generator
        self.cell_scale = float(cell_scale)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.generator(latent) / self.cell_scale


class Discriminator(nn.Module):
    """Discriminator: image (N,1,25,25,25) -> (fake prob (N,1), aux E' (N,1), ecal sum (N,1)).

    ``bn_axis`` as for :class:`Generator`. ``cell_scale``: the images' cells are in units of
    GeV / ``cell_scale`` ([CERN]'s 2020 trainer multiplies them by 100); the ``ecal`` output
    is always in GeV, Σcells / ``cell_scale``, so the losses compare it with f(E') unchanged.
    MAPE is relative, so this is the very loss of scaling f(E') by ``cell_scale`` instead."""

    def __init__(self, rng: torch.Generator | None = None, bn_axis: str = "channels",
                 cell_scale: float = 1.0):
        super().__init__()
        self.cell_scale = float(cell_scale)
        lrelu = lambda: nn.LeakyReLU(LEAKY_ALPHA)  # noqa: E731
        self.features = nn.Sequential(
            nn.Sequential(                                                       # block 1
                Conv3dSame(1, 32, 5), lrelu(), nn.Dropout(DROPOUT)),
            nn.Sequential(                                                       # block 2
                ZeroPad3d(2), nn.Conv3d(32, 8, 5), lrelu(), _bn(8, 25, bn_axis),
                nn.Dropout(DROPOUT)),
            nn.Sequential(                                                       # block 3
                ZeroPad3d(2), nn.Conv3d(8, 8, 5), lrelu(), _bn(8, 25, bn_axis),
                nn.Dropout(DROPOUT)),
            nn.Sequential(                                                       # block 4
                ZeroPad3d(1), nn.Conv3d(8, 8, 5), lrelu(), _bn(8, 23, bn_axis),
                nn.Dropout(DROPOUT)),
        )
        self.pool = nn.AvgPool3d(2)  # Keras 'valid': 23 -> 11
        self.fake = nn.Linear(11 * 11 * 11 * 8, 1)
        self.aux = nn.Linear(11 * 11 * 11 * 8, 1)
        for m in self.modules():
            if isinstance(m, (nn.Conv3d, nn.Linear)):
                _init(m, glorot_uniform_, rng)

    def flat_features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.features(x))
        # Flatten in Keras (channels-last) order so the Dense weights line up with a Keras model.
        return h.permute(0, 2, 3, 4, 1).flatten(1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.flat_features(x)
        fake = torch.sigmoid(self.fake(h))
        aux = self.aux(h)
        ecal = x.sum(dim=(1, 2, 3, 4)).unsqueeze(1)
        if self.cell_scale != 1.0:
            ecal = ecal / self.cell_scale
        return fake, aux, ecal


# ---------------------------------------------------------------------------------------------
# Loss pieces


def bce(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of probabilities ``p`` against ``y``; p clipped to [1e-7, 1-1e-7]
    in float32 (a bfloat16 ``p`` from autocast is widened first: 1 - 1e-7 rounds to 1 there)."""
    p = p.float()
    y = y.reshape(p.shape).to(p.dtype)
    p = p.clamp(EPS, 1.0 - EPS)
    return -(y * torch.log(p) + (1.0 - y) * torch.log(1.0 - p)).mean()


def mape(y: torch.Tensor, yhat: torch.Tensor) -> torch.Tensor:
    """MAPE(y, yhat) = 100 * mean(|y - yhat| / max(|y|, 1e-7)), in float32 at least."""
    yhat = yhat.float()
    y = y.reshape(yhat.shape).to(yhat.dtype)
    return 100.0 * ((y - yhat).abs() / y.abs().clamp_min(EPS)).mean()


def bit_flip(labels: torch.Tensor, prob: float, generator: torch.Generator) -> torch.Tensor:
    """Return a copy of 0/1 ``labels`` with each entry flipped with probability ``prob``."""
    u = torch.rand(labels.shape, generator=generator, device=generator.device)
    flip = (u < prob).to(labels.device)
    return torch.where(flip, 1 - labels, labels)


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def sample_inputs(n: int, gen_rng: torch.Generator, device: torch.device | str | None = None,
                  latent: int = LATENT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``E' ~ U[0.1, 5]`` (n, 1) and ``z ~ N(0, 1)`` (n, latent); return (E', z, E' * z)."""
    e = torch.rand((n, 1), generator=gen_rng, device=gen_rng.device) * (E_MAX - E_MIN) + E_MIN
    z = torch.randn((n, latent), generator=gen_rng, device=gen_rng.device)
    if device is not None:
        e, z = e.to(device), z.to(device)
    return e, z, e * z


def discriminator_real_loss(D: Discriminator, x: torch.Tensor, e: torch.Tensor,
                            gen: torch.Generator, weights=LOSS_WEIGHTS):
    """w0 BCE(fake(x), BitFlip(1)) + w1 MAPE(E'_x, aux(x)) + w2 MAPE(sum x, ecal(x)), the
    sum in GeV as ``ecal`` is (``D.cell_scale``).

    Returns ``(total, (bce, mape_aux, mape_ecal))`` with unweighted parts (as Keras reports).
    """
    n = x.shape[0]
    fake, aux, ecal = D(x)
    labels = bit_flip(torch.ones((n, 1), device=x.device), FLIP_PROB, gen)
    e = e.reshape(n, 1).to(aux.dtype)
    ecal_target = x.detach().sum(dim=(1, 2, 3, 4)).unsqueeze(1) / D.cell_scale
    parts = (bce(fake, labels), mape(e, aux), mape(ecal_target, ecal))
    return weighted_loss(parts, weights), parts


def _generate(G: Generator, n: int, gen_rng: torch.Generator, device) -> tuple:
    e, _, latent = sample_inputs(n, gen_rng, device=device, latent=G.latent)
    return e, latent


def discriminator_fake_loss(D: Discriminator, G: Generator, e: torch.Tensor,
                            gen_rng: torch.Generator, weights=LOSS_WEIGHTS):
    """w0 BCE(fake(G), BitFlip(0)) + w1 MAPE(E', aux(G)) + w2 MAPE(f(E'), sum G).

    ``e`` is the real batch's energy tensor; only its length (the batch size) is used, E' and z
    are drawn fresh from ``gen_rng`` as in the reference trainer.  G runs in inference mode
    (``eval()`` + ``no_grad``, like Keras ``predict``); its previous mode is restored.
    """
    n = e.shape[0]
    device = _device(D)
    e_s, latent = _generate(G, n, gen_rng, device)
    was_training = G.training
    G.eval()
    try:
        with torch.no_grad():
            x_hat = G(latent)
    finally:
        G.train(was_training)
    x_hat = x_hat.detach()
    fake, aux, ecal = D(x_hat)
    labels = bit_flip(torch.zeros((n, 1), device=device), FLIP_PROB, gen_rng)
    parts = (bce(fake, labels), mape(e_s, aux), mape(sampling_fraction(e_s), ecal))
    return weighted_loss(parts, weights), parts


D_BN_IN_G_STEPS = ("freeze", "update")


@contextlib.contextmanager
def frozen(D: nn.Module, bn_statistics: str = "freeze") -> Iterator[None]:
    """Freeze D's weights for a generator step (Keras' ``discriminator.trainable = False``).

    * ``requires_grad`` is switched off for D's parameters, so no gradient is computed or
      accumulated for them (and an optimiser over G cannot touch them anyway).
    * D stays in *train* mode, as in [CERN] (Keras 2 ``train_on_batch`` runs with learning
      phase 1): a frozen discriminator still applies dropout and normalises with the batch
      statistics.
    * ``bn_statistics`` "update" is [CERN]'s behaviour, the reference: its trainer keeps
      updating D's BatchNorm moving averages during the generator steps (its authors'
      "workaround for a k2 bug"). "freeze" (this project's default) leaves them alone, by
      turning ``track_running_stats`` off for the duration (batch statistics, no buffer
      update). See docs/3dgan.md.
    """
    params = [(p, p.requires_grad) for p in D.parameters()]
    bns = ([(m, m.track_running_stats) for m in D.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]
           if bn_statistics == "freeze" else [])
    try:
        for p, _ in params:
            p.requires_grad_(False)
        for m, _ in bns:
            m.track_running_stats = False
        yield
    finally:
        for p, flag in params:
            p.requires_grad_(flag)
        for m, flag in bns:
            m.track_running_stats = flag


def generator_loss(D: Discriminator, G: Generator, e: torch.Tensor, gen_rng: torch.Generator,
                   weights=LOSS_WEIGHTS):
    """w0 BCE(fake(G), 1) + w1 MAPE(E', aux(G)) + w2 MAPE(f(E'), sum G), fresh E' and z.

    Targets are all ones (no bit flip).  ``e`` only gives the batch size.  The caller should
    wrap this in ``frozen(D)`` (``gan_iteration`` does) and step only G's optimiser; D is
    deliberately left in whatever mode it is in (train mode in training, see ``frozen``).
    """
    n = e.shape[0]
    device = _device(G)
    e_s, latent = _generate(G, n, gen_rng, device)
    x_hat = G(latent)
    fake, aux, ecal = D(x_hat)
    ones = torch.ones((n, 1), device=device)
    parts = (bce(fake, ones), mape(e_s, aux), mape(sampling_fraction(e_s), ecal))
    return weighted_loss(parts, weights), parts


# ---------------------------------------------------------------------------------------------
# One training iteration


_PART_NAMES = ("bce", "aux", "ecal")


def _value(loss: torch.Tensor, host: bool = True) -> float | torch.Tensor:
    """The loss as a float (NaN for a shape-only (meta) tensor, which has no value), or with
    ``host`` False detached where it is, so that reading it does not wait for the device."""
    if not host:
        return loss.detach()
    return math.nan if loss.is_meta else float(loss.detach())


def _record(out: dict, key: str, total: torch.Tensor, parts, host: bool = True) -> None:
    out[key] = _value(total, host)
    for name, part in zip(_PART_NAMES, parts):
        out[f"{key}_{name}"] = _value(part, host)


def gan_iteration(G: Generator, D: Discriminator, opt_g: torch.optim.Optimizer,
                  opt_d: torch.optim.Optimizer, x: torch.Tensor, e: torch.Tensor,
                  rng: torch.Generator,
                  backward: Callable[[nn.Module, torch.Tensor], None] | None = None,
                  d_bn_in_g_steps: str = "freeze",
                  loss_weights: tuple[float, float, float] = LOSS_WEIGHTS,
                  host: bool = True) -> dict:
    """Four optimiser steps: D on the real batch, D on a generated batch, G, G.

    ``d_bn_in_g_steps``: D's BatchNorm moving statistics in the G steps (``frozen``);
    ``loss_weights``: (BCE, aux, ecal) of all four losses, [CERN]'s by default;
    ``host`` False: the losses come back as 0-d tensors on the models' device, and nothing
    in the iteration waits for the device (the trainer reads them once per epoch).

    ``backward(module, loss)``, where given, replaces every ``loss.backward()``, with the module
    about to be stepped (D or G): it leaves that module's gradients ready for the matching
    ``step()``, e.g. computed from the loss divided by the world size and summed across ranks.
    Returns float losses: ``d_real``, ``d_fake``, ``g1``, ``g2`` (weighted totals), each with
    ``_bce``, ``_aux``, ``_ecal`` parts, plus ``g`` = mean of the two generator totals.
    """
    G.train()
    D.train()
    out: dict[str, float] = {}

    def step(module: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        if backward is None:
            loss.backward()
        else:
            backward(module, loss)
        opt.step()

    # 1. D on the real batch
    opt_d.zero_grad(set_to_none=False)
    total, parts = discriminator_real_loss(D, x, e, rng, loss_weights)
    step(D, opt_d, total)
    _record(out, "d_real", total, parts, host)

    # 2. D on a generated batch (G in inference mode, output detached)
    opt_d.zero_grad(set_to_none=False)
    total, parts = discriminator_fake_loss(D, G, e, rng, loss_weights)
    step(D, opt_d, total)
    _record(out, "d_fake", total, parts, host)
    opt_d.zero_grad(set_to_none=False)

    # 3./4. G twice with fresh E' and z, D frozen
    for key in ("g1", "g2"):
        opt_g.zero_grad(set_to_none=False)
        with frozen(D, d_bn_in_g_steps):
            total, parts = generator_loss(D, G, e, rng, loss_weights)
            step(G, opt_g, total)
        _record(out, key, total, parts, host)
    opt_g.zero_grad(set_to_none=False)
    out["g"] = 0.5 * (out["g1"] + out["g2"])
    return out
