"""What the PyTorch and Keras 3DGANs and the shower data share (see docs/3dgan.md).

Constants and f(E') only, no framework (not even NumPy is needed): ``models/gan3d.py``
(PyTorch), ``models/gan3d_keras.py`` and ``training/keras_tasks.py`` (Keras), and the shower
files (``training/showers.py``, ``training/shower_data.py``) all take them from here.
"""

from __future__ import annotations

GRID = 25                       # calorimeter cells per axis: ECAL is 25 x 25 x 25
ENERGY_SCALE_GEV = 100.0        # E' = primary energy / 100 GeV
LATENT = 200                    # generator input E' * z, z ~ N(0, 1)
E_MIN, E_MAX = 0.1, 5.0         # the generator is trained on E' ~ U[E_MIN, E_MAX]
LOSS_WEIGHTS = (8.0, 0.2, 0.1)  # BCE(fake), MAPE(aux), MAPE(ecal)
FLIP_PROB = 0.05                # discriminator labels flipped with this probability
EPS = 1e-7                      # Keras K.epsilon(): BCE clipping and the MAPE denominator floor

LEAKY_ALPHA = 0.3               # Keras LeakyReLU default
BN_EPS = 1e-3                   # Keras BatchNormalization default
DROPOUT = 0.2


def sampling_fraction(e):
    """f(E') = E' (0.0018E'^4 - 0.023E'^3 + 0.11E'^2 - 0.28E' + 2.21): the expected raw sum
    of the ECAL cells in GeV. Plain arithmetic, so NumPy arrays and torch or TensorFlow
    tensors keep their type."""
    return e * (0.0018 * e**4 - 0.023 * e**3 + 0.11 * e**2 - 0.28 * e + 2.21)


def weighted_loss(parts, weights=LOSS_WEIGHTS):
    """w0 BCE + w1 MAPE(aux) + w2 MAPE(ecal) of the (bce, aux, ecal) ``parts``; ``weights``
    default to [CERN]'s (``train --loss-weights`` departs from them)."""
    return sum(w * p for w, p in zip(weights, parts))
