"""3DGAN (CERN's calorimeter-shower GAN) in Keras 3, as described in docs/3dgan.md.

The same network as ``models/gan3d.py`` (PyTorch), built with the Keras functional API, with
the constants both share from ``gan3d_spec``.
Keras (and so TensorFlow) is imported lazily inside the builders: importing this module does
not need either.

Conventions
-----------
* ``data_format="channels_last"``: images ``(N, 25, 25, 25, 1)``; ``"channels_first"``:
  ``(N, 1, 25, 25, 25)``.  The last spatial axis is depth (the 25 calorimeter layers).
* Keras defaults written out explicitly: LeakyReLU 0.3, BatchNormalization momentum 0.99 and
  epsilon 1e-3 (on the channel axis), zero biases, stride 1, Dense/Conv3D ``glorot_uniform``
  except where docs/3dgan.md says ``he_uniform`` / ``glorot_normal``.
* Generator: ``Dense(3136)`` -> ``Reshape((7, 7, 8, 8))`` is channels-last (D1, D2, D3, C), as
  in the docs/3dgan.md table and in ``gan3d.Generator.project``.  For channels_first a
  ``Permute((4, 1, 2, 3))`` follows, so both formats share one weight layout (the Dense
  weights of either format can be copied into the other unchanged).
* Discriminator: ``Flatten(data_format=...)`` flattens in channels-last order for both formats,
  so the ``fake``/``aux`` Dense weights also line up between formats (and with the torch model).
* Parameter counts are Keras' ``count_params()``, which include the BatchNorm moving mean and
  variance: generator 872,948, discriminator 73,450.

Layer names (``g_conv1`` ... ``g_conv4``, ``g_up1``, ``g_pad1``, ``d_conv1`` ...) are fixed so
that tests and weight-transfer code can find layers by name.
"""

from __future__ import annotations

from .gan3d_spec import BN_EPS, DROPOUT, GRID, LATENT, LEAKY_ALPHA

IMAGE = (GRID, GRID, GRID)
BN_MOMENTUM = 0.99  # Keras convention

GENERATOR_PARAMS = 872_948
DISCRIMINATOR_PARAMS = 73_450

_FORMATS = ("channels_last", "channels_first")


def _check_format(data_format: str) -> str:
    if data_format not in _FORMATS:
        raise ValueError(f"data_format must be one of {_FORMATS}, got {data_format!r}")
    return data_format


def image_shape(data_format: str = "channels_last") -> tuple[int, int, int, int]:
    """Per-sample image shape (no batch axis) for ``data_format``."""
    if _check_format(data_format) == "channels_last":
        return (*IMAGE, 1)
    return (1, *IMAGE)


def ecal_sum(x):
    """Sum of an image batch over all cells and channels: (N, ...) -> (N, 1)."""
    from keras import ops

    return ops.sum(x, axis=(1, 2, 3, 4), keepdims=False)[:, None]


def build_generator(latent: int = LATENT, data_format: str = "channels_last",
                    name: str = "generator"):
    """Generator: input ``E' * z`` (N, latent) -> shower image, values >= 0 (docs/3dgan.md)."""
    import keras
    from keras import layers

    df = _check_format(data_format)
    ch_axis = -1 if df == "channels_last" else 1

    def conv(filters, kernel, padding, init, lname, use_bias=True):
        return layers.Conv3D(filters, kernel, strides=1, padding=padding, data_format=df,
                             use_bias=use_bias, kernel_initializer=init,
                             bias_initializer="zeros", name=lname)

    def bn(lname):
        return layers.BatchNormalization(axis=ch_axis, momentum=BN_MOMENTUM, epsilon=BN_EPS,
                                         name=lname)

    def lrelu(lname):
        return layers.LeakyReLU(negative_slope=LEAKY_ALPHA, name=lname)

    inp = keras.Input(shape=(latent,), name="latent")
    x = layers.Dense(7 * 7 * 8 * 8, kernel_initializer="glorot_uniform",
                     bias_initializer="zeros", name="g_dense")(inp)                 # 1
    x = layers.Reshape((7, 7, 8, 8), name="g_reshape")(x)                           # 2
    if df == "channels_first":
        x = layers.Permute((4, 1, 2, 3), name="g_to_channels_first")(x)
    x = conv(64, (6, 6, 8), "same", "he_uniform", "g_conv1")(x)                     # 3
    x = lrelu("g_lrelu1")(x)                                                        # 4
    x = bn("g_bn1")(x)                                                              # 5
    x = layers.UpSampling3D((2, 2, 2), data_format=df, name="g_up1")(x)             # 6
    x = layers.ZeroPadding3D((2, 2, 0), data_format=df, name="g_pad1")(x)           # 7
    x = conv(6, (6, 5, 8), "valid", "he_uniform", "g_conv2")(x)                     # 8
    x = lrelu("g_lrelu2")(x)                                                        # 9
    x = bn("g_bn2")(x)                                                              # 10
    x = layers.UpSampling3D((2, 2, 3), data_format=df, name="g_up2")(x)             # 11
    x = layers.ZeroPadding3D((1, 0, 3), data_format=df, name="g_pad2")(x)           # 12
    x = conv(6, (3, 3, 8), "valid", "he_uniform", "g_conv3")(x)                     # 13
    x = lrelu("g_lrelu3")(x)                                                        # 14
    x = conv(1, (2, 2, 2), "valid", "glorot_normal", "g_conv4", use_bias=False)(x)  # 15
    out = layers.ReLU(name="g_relu")(x)                                             # 16
    return keras.Model(inp, out, name=name)


def build_discriminator(data_format: str = "channels_last", name: str = "discriminator"):
    """Discriminator: image -> [fake (N,1) sigmoid, aux (N,1) linear, ecal (N,1) = sum of input].

    Blocks: Conv -> LeakyReLU -> (BatchNorm, not in block 1) -> Dropout 0.2; then
    AveragePooling3D(2) and Flatten (10,648 features).
    """
    import keras
    from keras import layers

    df = _check_format(data_format)
    ch_axis = -1 if df == "channels_last" else 1

    inp = keras.Input(shape=image_shape(df), name="image")
    x = inp
    blocks = (  # (padding before the conv, filters, conv padding, batchnorm)
        (None, 32, "same", False),
        (2, 8, "valid", True),
        (2, 8, "valid", True),
        (1, 8, "valid", True),
    )
    for i, (pad, filters, conv_pad, use_bn) in enumerate(blocks, start=1):
        if pad is not None:
            x = layers.ZeroPadding3D(pad, data_format=df, name=f"d_pad{i}")(x)
        x = layers.Conv3D(filters, 5, strides=1, padding=conv_pad, data_format=df,
                          kernel_initializer="glorot_uniform", bias_initializer="zeros",
                          name=f"d_conv{i}")(x)
        x = layers.LeakyReLU(negative_slope=LEAKY_ALPHA, name=f"d_lrelu{i}")(x)
        if use_bn:
            x = layers.BatchNormalization(axis=ch_axis, momentum=BN_MOMENTUM, epsilon=BN_EPS,
                                          name=f"d_bn{i}")(x)
        x = layers.Dropout(DROPOUT, name=f"d_drop{i}")(x)
    x = layers.AveragePooling3D(pool_size=2, data_format=df, name="d_pool")(x)
    h = layers.Flatten(data_format=df, name="d_flatten")(x)
    fake = layers.Dense(1, activation="sigmoid", kernel_initializer="glorot_uniform",
                        bias_initializer="zeros", name="fake")(h)
    aux = layers.Dense(1, activation="linear", kernel_initializer="glorot_uniform",
                       bias_initializer="zeros", name="aux")(h)
    ecal = layers.Lambda(ecal_sum, output_shape=(1,), name="ecal")(inp)
    return keras.Model(inp, [fake, aux, ecal], name=name)
