"""Models: 3DGAN (docs/3dgan.md) and ResNet50."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hpcai.models import gan3d, gan3d_spec
from hpcai.models.gan3d import Discriminator, Generator
from hpcai.models.resnet import Bottleneck, resnet50, resnet_tiny


def rng(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def G() -> Generator:
    return Generator(rng=rng(1))


@pytest.fixture(scope="module")
def D() -> Discriminator:
    return Discriminator(rng=rng(2))


def n_trainable(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters() if p.requires_grad)


def n_keras(m: nn.Module) -> int:
    """Keras' parameter count: weights plus the BatchNorm moving mean/variance."""
    bn_stats = sum(b.numel() for name, b in m.named_buffers()
                   if name.endswith(("running_mean", "running_var")))
    return n_trainable(m) + bn_stats


# --------------------------------------------------------------------------- parameter counts

def test_parameter_counts(G, D):
    # docs/3dgan.md's counts are Keras' (they include the BN moving mean/var, 2 per channel).
    assert n_keras(G) == 872_948
    assert n_keras(D) == 73_450
    assert n_keras(G) + n_keras(D) == 946_398
    # Trainable (torch parameters) = Keras count minus the moving statistics.
    assert n_trainable(G) == 872_948 - 2 * (64 + 6) == 872_808
    assert n_trainable(D) == 73_450 - 2 * (3 * 8) == 73_402


def test_per_layer_parameter_counts(G, D):
    convs = [m for m in G.body if isinstance(m, nn.Conv3d)]
    assert sum(p.numel() for p in G.dense.parameters()) == 630_336
    assert [sum(p.numel() for p in c.parameters()) for c in convs] == [147_520, 92_166, 2_598, 48]
    assert convs[-1].bias is None
    dconvs = [m for m in D.modules() if isinstance(m, nn.Conv3d)]
    assert [sum(p.numel() for p in c.parameters()) for c in dconvs] == [4_032, 32_008, 8_008, 8_008]
    assert sum(p.numel() for p in D.fake.parameters()) == 10_649
    assert sum(p.numel() for p in D.aux.parameters()) == 10_649


# --------------------------------------------------------------------------- shapes

def test_generator_intermediate_shapes(G):
    G.eval()
    n = 2
    with torch.no_grad():
        h = G.project(torch.randn(n, gan3d.LATENT, generator=rng()))
        assert h.shape == (n, 8, 7, 7, 8)
        shapes = {}
        for i, layer in enumerate(G.body):
            h = layer(h)
            shapes[i] = tuple(h.shape[1:])
    assert shapes[0] == (64, 7, 7, 8)        # conv1 (same)
    assert shapes[3] == (64, 14, 14, 16)     # upsample (2,2,2)
    assert shapes[4] == (64, 18, 18, 16)     # pad (2,2,0)
    assert shapes[5] == (6, 13, 14, 9)       # conv2 (6,5,8) valid
    assert shapes[8] == (6, 26, 28, 27)      # upsample (2,2,3)
    assert shapes[9] == (6, 28, 28, 33)      # pad (1,0,3)
    assert shapes[10] == (6, 26, 26, 26)     # conv3 (3,3,8) valid
    assert shapes[len(G.body) - 1] == (1, 25, 25, 25)
    assert isinstance(G.body[-1], nn.ReLU)


def test_generator_output_nonnegative(G):
    G.eval()
    with torch.no_grad():
        _, _, latent = gan3d.sample_inputs(3, rng(5))
        out = G(latent)
    assert out.shape == (3, 1, 25, 25, 25)
    assert (out >= 0).all()


def test_discriminator_intermediate_shapes_and_outputs(D):
    D.eval()
    x = torch.rand(2, 1, 25, 25, 25, generator=rng(3))
    with torch.no_grad():
        h, shapes = x, []
        for block in D.features:
            h = block(h)
            shapes.append(tuple(h.shape[1:]))
        flat = D.flat_features(x)
        fake, aux, ecal = D(x)
    assert shapes == [(32, 25, 25, 25), (8, 25, 25, 25), (8, 25, 25, 25), (8, 23, 23, 23)]
    assert flat.shape == (2, 10_648)
    assert fake.shape == aux.shape == ecal.shape == (2, 1)
    assert ((fake > 0) & (fake < 1)).all()
    torch.testing.assert_close(ecal[:, 0], x.sum(dim=(1, 2, 3, 4)))
    # first block has no BatchNorm, the others do; every block ends in Dropout(0.2)
    assert not any(isinstance(m, nn.BatchNorm3d) for m in D.features[0])
    for block in D.features:
        assert isinstance(block[-1], nn.Dropout) and block[-1].p == 0.2
    for block in D.features[1:]:
        assert any(isinstance(m, nn.BatchNorm3d) for m in block)


# --------------------------------------------------------------------------- Keras conventions

def test_keras_defaults(G, D):
    bns = [m for m in list(G.modules()) + list(D.modules()) if isinstance(m, nn.BatchNorm3d)]
    assert len(bns) == 5
    for bn in bns:
        assert bn.eps == 1e-3
        assert bn.momentum == pytest.approx(0.01)  # Keras momentum 0.99
    relus = [m for m in list(G.modules()) + list(D.modules()) if isinstance(m, nn.LeakyReLU)]
    assert len(relus) == 3 + 4
    assert all(m.negative_slope == 0.3 for m in relus)
    for m in list(G.modules()) + list(D.modules()):
        if isinstance(m, (nn.Conv3d, nn.Linear)) and m.bias is not None:
            assert (m.bias == 0).all()


def test_keras_reshape_order(G):
    """Dense output is laid out channels-last (D1,D2,D3,C) as Keras Reshape((7,7,8,8)) does."""
    z = torch.randn(2, gan3d.LATENT, generator=rng(4))
    with torch.no_grad():
        h = G.dense(z)
        p = G.project(z)
    n, c, d1, d2, d3 = 1, 5, 3, 6, 2
    assert p[n, c, d1, d2, d3] == h[n, ((d1 * 7 + d2) * 8 + d3) * 8 + c]
    torch.testing.assert_close(p, h.view(2, 7, 7, 8, 8).permute(0, 4, 1, 2, 3))


def test_same_padding_matches_keras():
    """Keras 'same', even kernel: before = (k-1)//2, after = the rest; torch 'same' agrees."""
    conv = gan3d.Conv3dSame(3, 4, (6, 6, 8))
    assert conv.same_pad == (3, 4, 2, 3, 2, 3)
    x = torch.randn(1, 3, 7, 7, 8, generator=rng(6))
    with torch.no_grad():
        y = conv(x)
        explicit = F.conv3d(F.pad(x, (3, 4, 2, 3, 2, 3)), conv.weight, conv.bias)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch_same = F.conv3d(x, conv.weight, conv.bias, padding="same")
    assert y.shape == x.shape[:1] + (4,) + x.shape[2:]
    torch.testing.assert_close(y, explicit)
    torch.testing.assert_close(y, torch_same)
    # single-voxel input: output[i] sees kernel tap (before + 0 - i) -> check one corner exactly
    conv1 = gan3d.Conv3dSame(1, 1, (6, 1, 1), bias=False)
    with torch.no_grad():
        conv1.weight.copy_(torch.arange(6.0).view(1, 1, 6, 1, 1))
        e = torch.zeros(1, 1, 6, 1, 1)
        e[0, 0, 0] = 1.0
        out = conv1(e)[0, 0, :, 0, 0]
    # out[i] = sum_k w[k] x[i + k - 2]  ->  x[0]=1 hits k = 2 - i
    assert out.tolist() == [2.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_upsample_and_zeropad():
    x = torch.randn(1, 2, 3, 4, 5, generator=rng(7))
    up = gan3d.Upsample3d((2, 2, 3))(x)
    assert up.shape == (1, 2, 6, 8, 15)
    torch.testing.assert_close(up, F.interpolate(x, scale_factor=(2, 2, 3), mode="nearest"))
    assert up[0, 1, 5, 7, 14] == x[0, 1, 2, 3, 4]
    pad = gan3d.ZeroPad3d((1, 0, 3))(x)
    assert pad.shape == (1, 2, 5, 4, 11)
    torch.testing.assert_close(pad[:, :, 1:-1, :, 3:-3], x)
    assert pad[:, :, 0].abs().sum() == 0 and pad[..., :3].abs().sum() == 0


def test_initialisers():
    g = rng(8)
    w = torch.empty(64, 8, 6, 6, 8)  # fan_in = 2304
    gan3d.he_uniform_(w, g)
    limit = math.sqrt(6 / 2304)
    assert w.abs().max() <= limit and w.abs().max() > 0.99 * limit
    w = torch.empty(200, 300, 3)   # fan_in 900, fan_out 600
    gan3d.glorot_normal_(w, g)
    std = math.sqrt(2 / 1500)
    assert w.std().item() == pytest.approx(std, rel=0.02)  # truncation is compensated
    assert w.abs().max() <= 2 * std / 0.87962566103423978 + 1e-7  # truncated at 2 sd
    w = torch.empty(3136, 200)
    gan3d.glorot_uniform_(w, g)
    limit = math.sqrt(6 / 3336)
    assert w.abs().max() <= limit and w.abs().max() > 0.99 * limit
    # the same rng seed gives the same model
    a, b = Generator(rng=rng(9)), Generator(rng=rng(9))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


# --------------------------------------------------------------------------- losses

def test_constants_and_sampling_fraction():
    assert gan3d.LATENT == gan3d_spec.LATENT == 200
    assert gan3d_spec.LOSS_WEIGHTS == (8.0, 0.2, 0.1)
    f1 = gan3d_spec.sampling_fraction(torch.tensor(1.0))
    assert f1.item() == pytest.approx(1 * (0.0018 - 0.023 + 0.11 - 0.28 + 2.21))
    e = torch.tensor([0.5, 2.0])
    ref = e * (0.0018 * e**4 - 0.023 * e**3 + 0.11 * e**2 - 0.28 * e + 2.21)
    torch.testing.assert_close(gan3d_spec.sampling_fraction(e), ref)
    # the same f(E') for NumPy (the Keras tasks and the shower data use it that way)
    np_e = e.numpy().astype("float64")
    assert gan3d_spec.sampling_fraction(np_e) == pytest.approx(ref.double().numpy(), rel=1e-6)


def test_bce_clipping():
    big = -math.log(1e-7)
    low = gan3d.bce(torch.tensor([0.0]), torch.tensor([1.0])).item()
    assert low == pytest.approx(big, rel=1e-4)
    # in float32, 1 - 1e-7 rounds to 1 - 2**-23 (as in Keras' float32 clip), so the cap is
    # -log(2**-23) rather than -log(1e-7)
    hi = torch.tensor(1 - 1e-7, dtype=torch.float32).item()
    capped = gan3d.bce(torch.tensor([1.0]), torch.tensor([0.0])).item()
    assert capped == pytest.approx(-math.log(1 - hi), rel=1e-4)
    assert math.isfinite(capped) and capped > 15.9
    p = torch.tensor([[0.9], [0.2]])
    y = torch.tensor([1.0, 0.0])
    assert gan3d.bce(p, y).item() == pytest.approx(-(math.log(0.9) + math.log(0.8)) / 2, rel=1e-6)


def test_mape_formula():
    y = torch.tensor([1.0, 2.0, -4.0])
    yhat = torch.tensor([1.5, 1.0, -2.0])
    assert gan3d.mape(y, yhat).item() == pytest.approx(50.0)
    # |y| floored at 1e-7
    assert gan3d.mape(torch.tensor([0.0]), torch.tensor([1e-7])).item() == pytest.approx(100.0)


def test_bit_flip_rate():
    labels = torch.ones(100_000)
    flipped = gan3d.bit_flip(labels, 0.05, rng(10))
    frac = (flipped == 0).float().mean().item()
    assert 0.04 < frac < 0.06
    assert set(flipped.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(labels, torch.ones(100_000))  # input untouched
    zeros = gan3d.bit_flip(torch.zeros(100_000), 0.05, rng(11))
    assert 0.04 < zeros.mean().item() < 0.06
    torch.testing.assert_close(gan3d.bit_flip(labels, 0.05, rng(10)), flipped)


def test_sample_inputs():
    e, z, prod = gan3d.sample_inputs(1000, rng(12))
    assert e.shape == (1000, 1) and z.shape == prod.shape == (1000, 200)
    assert e.min() >= 0.1 and e.max() <= 5.0
    torch.testing.assert_close(prod, e * z)
    assert abs(z.mean().item()) < 0.02 and z.std().item() == pytest.approx(1.0, abs=0.02)
    e2, z2, _ = gan3d.sample_inputs(1000, rng(12))
    assert torch.equal(e, e2) and torch.equal(z, z2)


def test_discriminator_real_loss_parts(D):
    D.eval()
    x = torch.rand(2, 1, 25, 25, 25, generator=rng(13))
    e = torch.tensor([1.0, 2.0])
    total, parts = gan3d.discriminator_real_loss(D, x, e, rng(14))
    assert len(parts) == 3
    assert parts[2].item() == 0.0  # ecal output is exactly the sum of the input
    w = gan3d_spec.LOSS_WEIGHTS
    assert total.item() == pytest.approx(sum(wi * p.item() for wi, p in zip(w, parts)), rel=1e-6)


def test_discriminator_fake_loss_uses_inference_generator(G, D):
    G.train()
    D.train()
    state = copy.deepcopy(G.state_dict())
    total, parts = gan3d.discriminator_fake_loss(D, G, torch.ones(2), rng(15))
    assert torch.isfinite(total)
    total.backward()
    assert G.training  # mode restored
    assert all(p.grad is None for p in G.parameters())  # output detached
    for k, v in G.state_dict().items():  # eval mode: BN statistics untouched
        assert torch.equal(v, state[k]), k
    assert all(p.grad is not None for p in D.parameters())
    D.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- training step

def _fresh(seed: int = 20):
    torch.manual_seed(seed)  # dropout draws from the global RNG
    G, D = Generator(rng=rng(seed)), Discriminator(rng=rng(seed + 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    x = torch.rand(2, 1, 25, 25, 25, generator=rng(seed + 2)) * 0.05
    e = torch.tensor([0.5, 3.0])
    return G, D, opt_g, opt_d, x, e


def test_generator_step_leaves_discriminator_untouched():
    G, D, opt_g, opt_d, x, e = _fresh()
    D.train()
    d_state = copy.deepcopy(D.state_dict())
    g_before = [p.detach().clone() for p in G.parameters()]
    opt_g.zero_grad()
    with gan3d.frozen(D):
        total, _ = gan3d.generator_loss(D, G, e, rng(30))
        total.backward()
        opt_g.step()
    assert D.training
    assert all(p.requires_grad for p in D.parameters())  # restored after the context
    assert all(p.grad is None for p in D.parameters())
    for k, v in D.state_dict().items():  # weights and BN moving statistics
        assert torch.equal(v, d_state[k]), k
    assert any(not torch.equal(a, b) for a, b in zip(g_before, G.parameters()))


@pytest.fixture(scope="module")
def default_iteration() -> dict:
    """The losses of one iteration of fresh models with [CERN]'s weights (run once, shared:
    the reference of the reproducibility check and the control of the weights' test)."""
    G, D, opt_g, opt_d, x, e = _fresh()
    return gan3d.gan_iteration(G, D, opt_g, opt_d, x, e, rng(40))


def test_gan_iteration(default_iteration):
    G, D, opt_g, opt_d, x, e = _fresh()
    g0 = [p.detach().clone() for p in G.parameters()]
    d0 = [p.detach().clone() for p in D.parameters()]
    calls: list[tuple[str, bool]] = []
    d_after_d_steps: list[torch.Tensor] = []

    def backward(module: nn.Module, loss: torch.Tensor) -> None:
        loss.backward()
        has_grads = all(p.grad is not None for p in module.parameters())
        other = D if module is G else G
        calls.append(("G" if module is G else "D", has_grads))
        if module is G:
            # D is frozen during the G steps: no gradient reaches it (grads are zeroed in
            # place, not dropped, so that the engine's bucket views survive)
            assert all(p.grad is None or not p.grad.any() for p in other.parameters())
            if not d_after_d_steps:
                d_after_d_steps.extend(p.detach().clone() for p in D.parameters())

    losses = gan3d.gan_iteration(G, D, opt_g, opt_d, x, e, rng(40), backward)
    assert calls == [("D", True), ("D", True), ("G", True), ("G", True)]
    for key in ("d_real", "d_fake", "g1", "g2", "g"):
        assert math.isfinite(losses[key]), key
        if key != "g":
            for part in ("bce", "aux", "ecal"):
                assert math.isfinite(losses[f"{key}_{part}"])
    assert any(not torch.equal(a, b) for a, b in zip(g0, G.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(d0, D.parameters()))
    # D did not move during the two G steps
    for a, b in zip(d_after_d_steps, D.parameters()):
        assert torch.equal(a, b)

    # reproducible: same seeds, same losses (another run of fresh models)
    assert default_iteration == losses


def test_gan_iteration_loss_weights(default_iteration):
    """--loss-weights reach all four losses: every total is the given weights times its
    parts; the control, the same iteration with [CERN]'s weights, gives other totals."""
    weights = (8.0, 0.2, 1.0)
    G, D, opt_g, opt_d, x, e = _fresh()
    losses = gan3d.gan_iteration(G, D, opt_g, opt_d, x, e, rng(40), loss_weights=weights)
    for key in ("d_real", "d_fake", "g1", "g2"):
        parts = [losses[f"{key}_{part}"] for part in ("bce", "aux", "ecal")]
        assert losses[key] == pytest.approx(sum(w * p for w, p in zip(weights, parts)),
                                            rel=1e-5), key
    default = default_iteration
    assert default["d_real_ecal"] == losses["d_real_ecal"] == 0   # ecal(x) is the sum of x
    assert default["d_fake_ecal"] == losses["d_fake_ecal"] > 0      # the same parts, and
    assert default["d_fake"] != pytest.approx(losses["d_fake"], rel=1e-3)   # other totals
    assert default["g1"] != pytest.approx(losses["g1"], rel=1e-3)


# --------------------------------------------------------------------------- cost

def _flops(model: nn.Module, inp: torch.Tensor) -> int:
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(inp)
    return counter.get_total_flops()


def test_forward_macs_match_spec(G, D):
    g_flops = _flops(G, torch.randn(1, gan3d.LATENT))
    d_flops = _flops(D, torch.rand(1, 1, 25, 25, 25))
    # FlopCounterMode counts 2 FLOP per multiply-accumulate
    assert g_flops / 2 == pytest.approx(255.7e6, rel=0.03)
    assert d_flops / 2 == pytest.approx(784.9e6, rel=0.03)
    # exact counts of convolutions + dense layers
    assert g_flops == 511_390_048
    assert d_flops == 1_569_714_592


# --------------------------------------------------------------------------- ResNet

def test_resnet50():
    torch.manual_seed(0)
    model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    # v1.5: the stride sits in the 3x3 conv of the first block of stages 2-4
    first = model.layer2[0]
    assert first.conv1.stride == (1, 1) and first.conv2.stride == (2, 2)
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 224, 224))
    assert out.shape == (2, 1000)
    assert torch.isfinite(out).all()
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all((m.weight == 1).all() and (m.bias == 0).all() for m in bns)


def test_resnet_zero_init_residual():
    model = resnet_tiny(zero_init_residual=True)
    blocks = [m for m in model.modules() if isinstance(m, Bottleneck)]
    assert len(blocks) == 4
    assert all((b.bn3.weight == 0).all() for b in blocks)
    assert all((b.bn2.weight == 1).all() for b in blocks)


def test_resnet_tiny_forward_backward():
    torch.manual_seed(0)
    model = resnet_tiny(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    y = torch.tensor([0, 1, 2, 3])
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# --------------------------------------------------------------------------- [CERN]'s semantics

def test_batchnorm_over_depth_reproduces_cerns_parameter_counts():
    Gd = Generator(rng=rng(0), bn_axis="depth")
    Dd = Discriminator(rng=rng(1), bn_axis="depth")
    assert n_keras(Gd) == 872_736 and n_keras(Dd) == 73_646   # [CERN] channels-first
    assert [m.num_features for m in Gd.modules() if isinstance(m, nn.BatchNorm3d)] == [8, 9]
    assert [m.num_features for m in Dd.modules() if isinstance(m, nn.BatchNorm3d)] == [25, 25, 23]
    # it normalises each depth layer over batch, channels and the transverse axes
    bn = gan3d.DepthBatchNorm3d(9, eps=1e-3).train()
    y = bn(torch.randn(4, 6, 13, 14, 9) * 3 + torch.arange(9.0))
    assert torch.allclose(y.mean(dim=(0, 1, 2, 3)), torch.zeros(9), atol=1e-5)
    assert torch.allclose(y.var(dim=(0, 1, 2, 3), unbiased=False), torch.ones(9), atol=1e-2)
    assert not torch.allclose(y.mean(dim=(0, 2, 3, 4)), torch.zeros(6), atol=1e-3)   # channels
    assert Gd(torch.randn(2, 200)).shape == (2, 1, 25, 25, 25)


@pytest.mark.parametrize("mode", ["freeze", "update"])
def test_discriminator_bn_statistics_in_generator_steps(mode, G, D):
    G, D = copy.deepcopy(G).train(), copy.deepcopy(D).train()   # as in gan_iteration
    stats = lambda: [b.clone() for n, b in D.named_buffers() if "running" in n]  # noqa: E731
    before = stats()
    with gan3d.frozen(D, mode):
        gan3d.generator_loss(D, G, torch.ones(2), rng(3))[0].backward()
    changed = [not torch.equal(a, b) for a, b in zip(before, stats())]
    assert all(changed) if mode == "update" else not any(changed)   # update: [CERN]'s
    assert all(p.grad is None or not p.grad.any() for p in D.parameters())


def test_cell_scale_is_the_loss_of_scaling_f_by_the_same_factor(D):
    """``Discriminator(cell_scale=S)`` on cells x S reports ``ecal`` in GeV, so MAPE(f, ecal)
    is [CERN] 2020's MAPE(S f, S Σcells) (MAPE is relative), and the real loss's ecal part stays
    0. Control: the unscaled D on the scaled cells puts the ecal term off by S."""
    D.eval()
    scaled = copy.deepcopy(D)
    scaled.cell_scale = 100.0
    x = torch.rand(3, 1, 25, 25, 25, generator=rng(21)) * 0.01
    e = torch.tensor([0.5, 1.0, 4.0])
    f = gan3d_spec.sampling_fraction(e.view(-1, 1))
    ecal = scaled(x * 100.0)[2]
    assert torch.allclose(ecal, D(x)[2], rtol=1e-5)
    cern_2020 = gan3d.mape(f * 100.0, x.sum(dim=(1, 2, 3, 4)).view(-1, 1) * 100.0).item()
    assert gan3d.mape(f, ecal).item() == pytest.approx(cern_2020, rel=1e-5)
    assert gan3d.mape(f, D(x)[2]).item() == pytest.approx(cern_2020, rel=1e-5)
    assert gan3d.discriminator_real_loss(scaled, x * 100.0, e, rng(22))[1][2].item() == 0.0
    control = gan3d.mape(f, D(x * 100.0)[2]).item()
    assert control > 10 * cern_2020


# --- FLOPs per sample: counted on shape-only copies -----------------------------------------

@pytest.mark.parametrize("argv", [
    ["3dgan"], ["3dgan", "--bn-axis", "depth", "--channels-first"],
    ["resnet-tiny", "--image-size", "32"],
    ["resnet-tiny", "--image-size", "32", "--channels-first"]])
def test_the_flop_count_on_meta_tensors_equals_a_real_iterations(argv, tmp_path, monkeypatch):
    """The trainer's count (``META`` copies, nothing computed) equals FlopCounterMode's count
    of the same iteration run on the CPU, whose losses are real numbers (the meta one's are
    NaN: it computed nothing). Control: a ResNet at another image size counts differently,
    so an equality here can fail. An empty FLOP cache: the meta count really runs."""
    monkeypatch.setenv("HPCAI_CACHE", str(tmp_path))
    from hpcai.training.config import parse
    from hpcai.training.tasks import make_task

    task = make_task(parse([*argv, "--generate", "8"] if argv[0] == "3dgan" else argv), 1e-3)
    meta = task.flops_per_sample()
    real = task.flops_per_sample(device=torch.device("cpu"))
    assert meta == real and meta > 0
    if argv[0] == "3dgan":   # the meta iteration really ran nothing; the real one did
        G, D = copy.deepcopy(task.G), copy.deepcopy(task.D)
        args = (torch.optim.SGD(G.parameters(), lr=0.0), torch.optim.SGD(D.parameters(), lr=0.0))
        losses = gan3d.gan_iteration(G, D, *args, torch.rand(2, 1, 25, 25, 25),
                                     torch.ones(2), rng())
        assert all(math.isfinite(v) for v in losses.values())
        G, D = G.to("meta"), D.to("meta")
        args = (torch.optim.SGD(G.parameters(), lr=0.0), torch.optim.SGD(D.parameters(), lr=0.0))
        losses = gan3d.gan_iteration(G, D, *args, torch.empty(2, 1, 25, 25, 25, device="meta"),
                                     torch.empty(2, device="meta"), rng())
        assert all(math.isnan(v) for v in losses.values())
    else:                    # control: another image size, another count
        other = make_task(parse([*argv[:2], "48", *argv[3:]]), 1e-3)
        assert other.flops_per_sample() != meta


def test_a_counted_model_is_read_from_the_flop_cache_and_a_changed_one_is_not(tmp_path,
                                                                                  monkeypatch):
    """The second task built the same way reads its count from the cache without counting;
    controls: another image size, a changed layer flag, a corrupt entry and an unwritable
    cache are each counted again (the corrupt entry is rewritten with the true count)."""
    from hpcai.training import tasks
    from hpcai.training.config import parse

    monkeypatch.setenv("HPCAI_CACHE", str(tmp_path / "cache"))
    argv = ["resnet-tiny", "--image-size", "32"]
    counted = []
    real_count = tasks.count_flops
    monkeypatch.setattr(tasks, "count_flops", lambda fn: counted.append(1) or real_count(fn))
    first = tasks.make_task(parse(argv), 1e-3).flops_per_sample()
    (entry,) = (tmp_path / "cache" / "flops").glob("*.json")
    assert counted == [1] and first > 0

    assert tasks.make_task(parse(argv), 1e-3).flops_per_sample() == first
    assert counted == [1], "the same model was counted again"

    other = tasks.make_task(parse(["resnet-tiny", "--image-size", "48"]), 1e-3)
    assert other.flops_per_sample() != first and counted == [1, 1]

    flagged = tasks.make_task(parse(argv), 1e-3)
    flagged.net.layer1[0].skip_this_block = True      # a flag a forward could branch on
    assert flagged.flops_per_sample() == first and counted == [1, 1, 1]

    entry.write_text("{not json")
    assert tasks.make_task(parse(argv), 1e-3).flops_per_sample() == first
    assert counted == [1, 1, 1, 1] and json.loads(entry.read_text())["flops_per_sample"] == first

    monkeypatch.setenv("HPCAI_CACHE", "/proc/no-cache-here")
    assert tasks.make_task(parse(argv), 1e-3).flops_per_sample() == first
    assert counted == [1, 1, 1, 1, 1]
