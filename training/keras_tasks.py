"""The models as TensorFlow/Keras 3 training tasks, with the PyTorch tasks' semantics.

:class:`KerasGanTask` runs the 3DGAN iteration of ``models/gan3d.py`` step for step: D on the
real batch, D on a generated batch (G in inference mode), then G twice with fresh E' and z
while D is frozen. "Frozen" means what it means for PyTorch here (and for the Keras 2
reference): only G's gradients are taken, D still applies dropout and normalises with batch
statistics, and D's BatchNorm moving averages are restored after the generator steps.

Gradients are computed in ``tf.function``; between computing and applying them the engine's
``average(key, grads)`` callback averages them across ranks (mpi4py buckets or Horovod).
E', z and the bit flips come from a NumPy generator seeded per rank and step, so a resumed
run draws the same inputs; dropout masks come from Keras' seeded generator. The 3DGAN's
constants and f(E') are ``models/gan3d_spec``'s, shared with the PyTorch model without
importing it.

FLOPs are counted analytically per layer (Conv and Dense multiply-adds from the built
layers' shapes), with the PyTorch convention: 1 multiply-add = 2 FLOP, backward = weight
gradient (layers that train in that step) + input gradient (layers with trainable layers or
trainable inputs below them), one full iteration per real sample.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..models.gan3d_spec import (E_MAX, E_MIN, EPS, FLIP_PROB, GRID, LATENT,
                                 sampling_fraction, weighted_loss)

FLOP_CONVENTION_TF = (
    "1 multiply-add = 2 FLOP, counted analytically per Conv/Dense layer of the Keras model; "
    "training FLOPs = forward + backward (weight gradients of the layers being trained, "
    "input gradients where they are needed) of one full iteration")


def make_keras_optimizer(name: str, lr: float):
    import keras

    if name == "adam":
        return keras.optimizers.Adam(learning_rate=lr)
    if name == "rmsprop":
        return keras.optimizers.RMSprop(learning_rate=lr, rho=0.9)
    return keras.optimizers.SGD(learning_rate=lr, momentum=0.9, weight_decay=1e-4)


def _bce(p, y):
    import tensorflow as tf

    p = tf.clip_by_value(p, EPS, 1.0 - EPS)
    return -tf.reduce_mean(y * tf.math.log(p) + (1.0 - y) * tf.math.log(1.0 - p))


def _mape(y, yhat):
    import tensorflow as tf

    return 100.0 * tf.reduce_mean(tf.abs(y - yhat) / tf.maximum(tf.abs(y), EPS))


def moving_statistics(model) -> list:
    """The BatchNorm moving means and variances of ``model``."""
    import keras

    return [v for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)]


def is_rng_state(variable) -> bool:
    """Keras keeps each dropout layer's random stream in a variable: per rank, never
    broadcast, compared or checkpointed (PyTorch's dropout draws per rank as well)."""
    return "seed_generator" in variable.path


# -- analytic FLOPs --------------------------------------------------------------------------
def layer_macs(model) -> list[tuple[str, int]]:
    """(layer name, forward multiply-adds per sample) of every Conv/Dense layer, in order."""
    import keras

    out = []
    for layer in model.layers:
        if isinstance(layer, (keras.layers.Conv3D, keras.layers.Conv2D)):
            kernel = layer.kernel.shape            # (*k, cin, cout)
            shape = layer.output.shape[1:]
            spatial = shape[:-1] if layer.data_format == "channels_last" else shape[1:]
            macs = int(np.prod(spatial)) * int(np.prod(kernel))
        elif isinstance(layer, keras.layers.Dense):
            macs = int(np.prod(layer.kernel.shape))
        else:
            continue
        out.append((layer.name, macs))
    return out


def pass_flops(model, *, train_weights: bool, input_grad: bool, backward: bool = True) -> int:
    """FLOPs of one forward (+ backward) pass of ``model`` per sample.

    ``train_weights``: weight gradients are computed; ``input_grad``: the gradient reaches the
    model's input (a frozen D under G), otherwise the first layer needs no input gradient.
    """
    total = 0
    for i, (_, macs) in enumerate(layer_macs(model)):
        total += 2 * macs
        if backward:
            total += 2 * macs if train_weights else 0
            total += 2 * macs if (i > 0 or input_grad) else 0
    return total


# -- 3DGAN ---------------------------------------------------------------------------------
class KerasGanTask:
    name = "3dgan"
    loss_keys = ("g", "d_real", "d_fake")   # the epoch line's; epochs.jsonl has all
    flop_convention = FLOP_CONVENTION_TF
    generators = ("raw",)   # no --generator-ema with TensorFlow

    def __init__(self, cfg, lr: float, seed_offset: int = 0) -> None:
        import keras
        import tensorflow as tf

        from ..models import gan3d_keras as gk

        self.tf = tf
        keras.utils.set_random_seed(cfg.seed)
        self.data_format = "channels_last" if cfg.channels_last else "channels_first"
        self.G = gk.build_generator(data_format=self.data_format)
        self.D = gk.build_discriminator(data_format=self.data_format)
        self.models = {"generator": self.G, "discriminator": self.D}
        self.optimizers = {"generator": make_keras_optimizer(cfg.optimizer, lr),
                           "discriminator": make_keras_optimizer(cfg.optimizer, lr)}
        for key, opt in self.optimizers.items():
            opt.build(self.models[key].trainable_variables)
        # dropout masks differ between ranks (as PyTorch's per-rank global generator)
        keras.utils.set_random_seed(cfg.seed + 7919 * (seed_offset + 1))
        self._d_moving = moving_statistics(self.D)
        self._d_grads = tf.function(self._d_grads_py, reduce_retracing=True)
        self._g_grads = tf.function(self._g_grads_py, reduce_retracing=True)
        self._generate = tf.function(lambda z: self.G(z, training=False), reduce_retracing=True)

    # the three gradient computations (traced once each)
    def _d_grads_py(self, x, labels, aux_target, ecal_target):
        tf = self.tf
        with tf.GradientTape() as tape:
            fake, aux, ecal = self.D(x, training=True)
            parts = (_bce(fake, labels), _mape(aux_target, aux), _mape(ecal_target, ecal))
            total = weighted_loss(parts)
        return total, parts, tape.gradient(total, self.D.trainable_variables)

    def _g_grads_py(self, latent, e_s):
        tf = self.tf
        saved = [tf.identity(v) for v in self._d_moving]
        with tf.GradientTape() as tape:
            x_hat = self.G(latent, training=True)
            fake, aux, ecal = self.D(x_hat, training=True)
            parts = (_bce(fake, tf.ones_like(fake)), _mape(e_s, aux),
                     _mape(sampling_fraction(e_s), ecal))
            total = weighted_loss(parts)
        grads = tape.gradient(total, self.G.trainable_variables)
        with tf.control_dependencies(grads):
            for v, s in zip(self._d_moving, saved):   # frozen D: moving stats unchanged
                v.assign(s)
        return total, parts, grads

    def _image(self, x: np.ndarray) -> np.ndarray:
        """(N, 1, 25, 25, 25) from the reader -> this model's layout (the channel axis is 1)."""
        if self.data_format == "channels_last":
            return x.reshape(x.shape[0], *x.shape[2:], 1)
        return x

    @staticmethod
    def _inputs(rng: np.random.Generator, n: int):
        e = (rng.random((n, 1)) * (E_MAX - E_MIN) + E_MIN).astype(np.float32)
        z = rng.standard_normal((n, LATENT)).astype(np.float32)
        return e, e * z

    @staticmethod
    def _flip(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
        flip = rng.random(labels.shape) < FLIP_PROB
        return np.where(flip, 1 - labels, labels).astype(np.float32)

    def train_step(self, x, e, rng: np.random.Generator,
                   average: Callable[[str, list], list] | None) -> dict[str, float]:
        tf = self.tf
        x = self._image(np.asarray(x, dtype=np.float32))
        n = x.shape[0]
        e = np.asarray(e, dtype=np.float32).reshape(n, 1)
        out: dict[str, float] = {}

        def step(key: str, name: str, total, parts, grads) -> None:
            grads = average(key, grads) if average is not None else grads
            model = self.models[key]
            self.optimizers[key].apply_gradients(zip(grads, model.trainable_variables))
            out[name] = float(total)
            for part_name, part in zip(("bce", "aux", "ecal"), parts):
                out[f"{name}_{part_name}"] = float(part)

        # 1. D on the real batch
        labels = self._flip(rng, np.ones((n, 1), np.float32))
        ecal_real = x.reshape(n, -1).sum(axis=1, keepdims=True)
        step("discriminator", "d_real", *self._d_grads(tf.constant(x), labels, e, ecal_real))
        # 2. D on a generated batch, G in inference mode
        e_s, latent = self._inputs(rng, n)
        x_hat = self._generate(tf.constant(latent))
        labels = self._flip(rng, np.zeros((n, 1), np.float32))
        step("discriminator", "d_fake",
             *self._d_grads(x_hat, labels, e_s, sampling_fraction(e_s)))
        # 3./4. G twice, fresh E' and z, D frozen
        for name in ("g1", "g2"):
            e_s, latent = self._inputs(rng, n)
            step("generator", name, *self._g_grads(tf.constant(latent), e_s))
        out["g"] = 0.5 * (out["g1"] + out["g2"])
        return out

    def evaluate(self, x, e) -> dict[str, float]:
        """As GanTask.evaluate: no dropout, batch statistics, nothing updated."""
        x = self._image(np.asarray(x, dtype=np.float32))
        n = x.shape[0]
        ev = np.asarray(e, dtype=np.float32).reshape(n, 1)
        restore = moving_statistics(self.G) + self._d_moving
        saved = [v.numpy() for v in restore]
        try:
            _, aux, _ = self._forward_batch_stats(self.D, x)
            e_gen, latent = self._inputs(np.random.default_rng(4321), n)
            generated = self._forward_batch_stats(self.G, latent).numpy()
        finally:
            for v, s in zip(restore, saved):
                v.assign(s)
        f_gen = sampling_fraction(e_gen).reshape(-1)
        f_real = sampling_fraction(ev).reshape(-1)
        axes = tuple(range(1, generated.ndim))
        return {
            "aux_rel_error": float(np.mean(np.abs(aux.numpy() - ev) / ev)),
            "gen_sum_over_f": float(np.mean(generated.sum(axis=axes) / f_gen)),
            "real_sum_over_f": float(np.mean(x.sum(axis=axes) / f_real)),
        }

    def physics_pass(self, x, e, z, chunk: int = 32, generator: str = "raw", real: bool = True):
        """As ``GanTask.physics_pass``: (G(E' z), aux of D on x, aux of D on G(E' z)), both
        networks in inference mode (moving statistics, no dropout); showers (n,1,25,25,25)."""
        if generator not in self.generators:
            raise ValueError(f"no generator {generator!r} here: {self.generators}")
        tf = self.tf
        generated, aux_real, aux_gen = [], [np.zeros(0, np.float32)], []
        for start in range(0, len(e), chunk):
            es = np.asarray(e[start:start + chunk], dtype=np.float32).reshape(-1, 1)
            gs = self.G(tf.constant(es * z[start:start + chunk]), training=False)
            if real:
                xs = self._image(np.asarray(x[start:start + chunk], dtype=np.float32))
                aux_real.append(self.D(tf.constant(xs), training=False)[1].numpy().reshape(-1))
            aux_gen.append(self.D(gs, training=False)[1].numpy().reshape(-1))
            generated.append(gs.numpy().reshape(len(es), 1, GRID, GRID, GRID))   # 1 channel
        return np.concatenate(generated), np.concatenate(aux_real), np.concatenate(aux_gen)

    def _forward_batch_stats(self, model, inputs):
        """Batch statistics in BatchNorm and no dropout: BN layers called in training mode,
        dropout layers set to rate 0 for the call (moving stats restored by the caller)."""
        import keras

        drops = [layer for layer in model.layers if isinstance(layer, keras.layers.Dropout)]
        rates = [layer.rate for layer in drops]
        for layer in drops:
            layer.rate = 0.0
        try:
            return model(self.tf.constant(inputs), training=True)
        finally:
            for layer, rate in zip(drops, rates):
                layer.rate = rate

    def flops_per_sample(self) -> float:
        G, D = self.G, self.D
        d_train = pass_flops(D, train_weights=True, input_grad=False)
        d_frozen = pass_flops(D, train_weights=False, input_grad=True)
        g_train = pass_flops(G, train_weights=True, input_grad=False)
        g_infer = pass_flops(G, train_weights=False, input_grad=False, backward=False)
        return float(2 * d_train + g_infer + 2 * (g_train + d_frozen))


# -- ResNet50 ------------------------------------------------------------------------------
class KerasResNetTask:
    """keras.applications.ResNet50 (weights=None: nothing is downloaded), cross-entropy."""

    loss_keys = ("loss", "accuracy")
    flop_convention = FLOP_CONVENTION_TF

    def __init__(self, cfg, lr: float, seed_offset: int = 0) -> None:
        import keras
        import tensorflow as tf

        self.tf = tf
        self.name = cfg.model
        keras.utils.set_random_seed(cfg.seed)
        self.data_format = "channels_last" if cfg.channels_last else "channels_first"
        keras.config.set_image_data_format(self.data_format)
        s = cfg.image_size
        shape = (s, s, 3) if cfg.channels_last else (3, s, s)
        self.net = keras.applications.ResNet50(weights=None, input_shape=shape,
                                               classes=cfg.classes)
        self.models = {"net": self.net}
        self.optimizers = {"net": make_keras_optimizer(cfg.optimizer, lr)}
        self.optimizers["net"].build(self.net.trainable_variables)
        self._loss = keras.losses.SparseCategoricalCrossentropy()
        keras.utils.set_random_seed(cfg.seed + 7919 * (seed_offset + 1))
        self._grads = tf.function(self._grads_py, reduce_retracing=True)

    def _grads_py(self, x, y):
        tf = self.tf
        with tf.GradientTape() as tape:
            probs = self.net(x, training=True)
            loss = self._loss(y, probs)
        correct = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(probs, 1), y), tf.float32))
        return loss, correct, tape.gradient(loss, self.net.trainable_variables)

    def _image(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        return np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if self.data_format == \
            "channels_last" else x

    def train_step(self, x, y, rng, average) -> dict[str, float]:
        loss, accuracy, grads = self._grads(self.tf.constant(self._image(x)),
                                            self.tf.constant(np.asarray(y, dtype=np.int64)))
        grads = average("net", grads) if average is not None else grads
        self.optimizers["net"].apply_gradients(zip(grads, self.net.trainable_variables))
        return {"loss": float(loss), "accuracy": float(accuracy)}

    def evaluate(self, x, y) -> dict[str, float]:
        probs = self.net(self.tf.constant(self._image(x)), training=False).numpy()
        y = np.asarray(y, dtype=np.int64)
        loss = float(-np.mean(np.log(np.clip(probs[np.arange(len(y)), y], 1e-7, 1.0))))
        return {"loss": loss, "accuracy": float(np.mean(probs.argmax(1) == y))}

    def flops_per_sample(self) -> float:
        return float(pass_flops(self.net, train_weights=True, input_grad=False))


def make_keras_task(cfg, lr: float, rank: int = 0):
    if cfg.model == "3dgan":
        return KerasGanTask(cfg, lr, seed_offset=rank)
    return KerasResNetTask(cfg, lr, seed_offset=rank)
