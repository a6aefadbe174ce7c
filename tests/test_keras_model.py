"""Keras 3 3DGAN (models/gan3d_keras.py) against docs/3dgan.md."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Keras (with TensorFlow, about 7 CPU-s) is imported by the fixture below when this file's
# tests run, not when pytest collects it: each pytest-xdist worker collects every file.
keras = gk = None


@pytest.fixture(scope="module", autouse=True)
def _keras():
    global keras, gk
    import keras as imported
    from hpcai.models import gan3d_keras
    keras, gk = imported, gan3d_keras

FORMATS = ("channels_last", "channels_first")

# The generator table of docs/3dgan.md, channels_last (D1, D2, D3, C)
GEN_SHAPES = {
    "g_conv1": (7, 7, 8, 64),
    "g_up1": (14, 14, 16, 64),
    "g_pad1": (18, 18, 16, 64),
    "g_conv2": (13, 14, 9, 6),
    "g_up2": (26, 28, 27, 6),
    "g_pad2": (28, 28, 33, 6),
    "g_conv3": (26, 26, 26, 6),
    "g_conv4": (25, 25, 25, 1),
    "g_relu": (25, 25, 25, 1),
}
GEN_PARAMS = {"g_dense": 630_336, "g_conv1": 147_520, "g_bn1": 256, "g_conv2": 92_166,
              "g_bn2": 24, "g_conv3": 2_598, "g_conv4": 48}
DISC_PARAMS = {"d_conv1": 4_032, "d_conv2": 32_008, "d_bn2": 32, "d_conv3": 8_008, "d_bn3": 32,
               "d_conv4": 8_008, "d_bn4": 32, "fake": 10_649, "aux": 10_649}
DISC_SHAPES = {"d_conv1": (25, 25, 25, 32), "d_conv2": (25, 25, 25, 8),
               "d_conv3": (25, 25, 25, 8), "d_conv4": (23, 23, 23, 8),
               "d_pool": (11, 11, 11, 8), "d_flatten": (10_648,)}


def _fmt(shape: tuple, data_format: str) -> tuple:
    """Channels-last spatial shape -> the shape in ``data_format``."""
    if data_format == "channels_last" or len(shape) != 4:
        return shape
    return (shape[3], *shape[:3])


@pytest.fixture(scope="module")
def models():
    keras.utils.set_random_seed(0)
    return {df: (gk.build_generator(data_format=df), gk.build_discriminator(data_format=df))
            for df in FORMATS}


def test_module_imports_without_building():
    assert gk.image_shape("channels_last") == (25, 25, 25, 1)
    assert gk.image_shape("channels_first") == (1, 25, 25, 25)
    with pytest.raises(ValueError):
        gk.image_shape("NCDHW")


@pytest.mark.parametrize("df", FORMATS)
def test_param_counts(models, df):
    G, D = models[df]
    assert G.count_params() == gk.GENERATOR_PARAMS == 872_948
    assert D.count_params() == gk.DISCRIMINATOR_PARAMS == 73_450
    assert G.count_params() + D.count_params() == 946_398
    for name, n in GEN_PARAMS.items():
        assert G.get_layer(name).count_params() == n, name
    for name, n in DISC_PARAMS.items():
        assert D.get_layer(name).count_params() == n, name
    # BatchNorm: 2 trainable + 2 moving statistics per channel
    assert sum(int(np.prod(w.shape)) for w in G.non_trainable_weights) == (256 + 24) // 2
    assert sum(int(np.prod(w.shape)) for w in D.non_trainable_weights) == 3 * 16


@pytest.mark.parametrize("df", FORMATS)
def test_layer_config(models, df):
    G, D = models[df]
    convs = [G.get_layer(f"g_conv{i}") for i in range(1, 5)]
    assert [type(c.kernel_initializer).__name__ for c in convs] == \
        ["HeUniform", "HeUniform", "HeUniform", "GlorotNormal"]
    assert convs[3].use_bias is False
    assert type(G.get_layer("g_dense").kernel_initializer).__name__ == "GlorotUniform"
    for layer in G.layers + D.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            assert layer.momentum == 0.99 and layer.epsilon == 1e-3
            assert layer.axis % 5 == (4 if df == "channels_last" else 1)  # the channel axis
        if isinstance(layer, keras.layers.LeakyReLU):
            assert layer.negative_slope == pytest.approx(0.3)
        if isinstance(layer, keras.layers.Dropout):
            assert layer.rate == 0.2
        if isinstance(layer, (keras.layers.Conv3D, keras.layers.Dense)) and layer.name[0] == "d":
            assert type(layer.kernel_initializer).__name__ == "GlorotUniform"
    assert tuple(G.get_layer("g_up2").size) == (2, 2, 3)
    assert D.get_layer("fake").activation.__name__ == "sigmoid"
    assert D.get_layer("aux").activation.__name__ == "linear"


@pytest.mark.parametrize("df", FORMATS)
def test_symbolic_shapes(models, df):
    G, D = models[df]
    assert tuple(G.input.shape) == (None, 200)
    for name, shape in GEN_SHAPES.items():
        assert tuple(G.get_layer(name).output.shape) == (None, *_fmt(shape, df)), name
    assert tuple(G.output.shape) == (None, *gk.image_shape(df))
    for name, shape in DISC_SHAPES.items():
        assert tuple(D.get_layer(name).output.shape) == (None, *_fmt(shape, df)), name
    assert [tuple(o.shape) for o in D.outputs] == [(None, 1)] * 3


@pytest.mark.parametrize("df", FORMATS)
def test_generator_forward(models, df):
    G, _ = models[df]
    rng = np.random.default_rng(1)
    e = rng.uniform(0.1, 5.0, size=(2, 1)).astype("float32")
    z = rng.standard_normal((2, 200)).astype("float32")
    x = np.asarray(G(e * z, training=False))
    assert x.shape == (2, *gk.image_shape(df))
    assert np.isfinite(x).all() and (x >= 0).all()
    x_train = np.asarray(G(e * z, training=True))
    assert x_train.shape == x.shape and (x_train >= 0).all()


@pytest.mark.parametrize("df", FORMATS)
def test_discriminator_forward(models, df):
    _, D = models[df]
    rng = np.random.default_rng(2)
    x = rng.exponential(0.01, size=(2, *gk.image_shape(df))).astype("float32")
    fake, aux, ecal = (np.asarray(t) for t in D(x, training=False))
    assert fake.shape == aux.shape == ecal.shape == (2, 1)
    assert ((fake > 0) & (fake < 1)).all() and np.isfinite(aux).all()
    np.testing.assert_allclose(ecal[:, 0], x.reshape(2, -1).sum(axis=1), rtol=1e-5)


def test_formats_agree():
    """Same weights in both formats give the same outputs (the weight layouts are shared)."""
    keras.utils.set_random_seed(3)
    g_last, g_first = (gk.build_generator(data_format=df) for df in FORMATS)
    d_last, d_first = (gk.build_discriminator(data_format=df) for df in FORMATS)
    g_first.set_weights(g_last.get_weights())
    d_first.set_weights(d_last.get_weights())
    rng = np.random.default_rng(4)
    latent = rng.standard_normal((2, 200)).astype("float32")
    a = np.asarray(g_last(latent, training=False))
    b = np.asarray(g_first(latent, training=False))
    np.testing.assert_allclose(np.moveaxis(b, 1, -1), a, rtol=1e-4, atol=1e-5)
    x = rng.exponential(0.01, size=(2, 25, 25, 25, 1)).astype("float32")
    out_last = d_last(x, training=False)
    out_first = d_first(np.moveaxis(x, -1, 1), training=False)
    for u, v in zip(out_last, out_first):
        np.testing.assert_allclose(np.asarray(v), np.asarray(u), rtol=1e-4, atol=1e-6)
