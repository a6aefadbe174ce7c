"""Keras discriminator: 2 SGD steps data-parallel, parameters saved.

The Keras twin of dp_equivalence.py: world W, per-rank batch GLOBAL // W, rank r takes rows
[r*B, (r+1)*B) of each fixed global batch; gradients (tf.GradientTape) are averaged by
hpcai's TfGradAllreducer over mpi4py, then SGD steps. With W = 1 this is plain training on
the global batch, so W = 2 must give the same parameters up to rounding.

Dropout off and BatchNorm on its moving statistics (``training=False``): per-rank batch
statistics and dropout masks are by design not those of the global batch. The second step
starts from the first one's averaged update, through the reducer's reused buffers.

float32, as the engine trains: TensorFlow's CPU convolutions sum in an order that depends on
the batch size and on the CPUs the process may use, so W = 1 and W = 2 agree to a tolerance
(see the test) rather than to the last bit; TF has no float64 AvgPool3D on the CPU.

Saved (by the variant's rank 0): the initial and final variables, so that the test can
compare the updates. ``--no-average`` skips the allreduce (each rank steps on its own half
batch): the control that shows the comparison can fail. ``--alone R``: only world rank R
runs the variant, on ``MPI.COMM_SELF`` (W = 1, the whole global batch), as a 1-rank job
would; the other ranks skip it (``variants.py``, shared with dp_equivalence.py).

``--each RUNS.json`` runs several such variants one after the other in this one MPI job (one
TensorFlow import and MPI start-up for all): RUNS.json is a list of argument lists, each
``[OUT.npz, flags...]``. Each variant starts from a cleared Keras session and the same seeds,
as a process of its own would. Consecutive ``--alone`` variants for different ranks run
at the same time.

usage: keras_dp_equivalence.py OUT.npz [--blocking] [--channels-first] [--no-average]
                               [--alone R]
       keras_dp_equivalence.py --each RUNS.json
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hpcai.models import gan3d_keras as gk  # noqa: E402
from hpcai.models.gan3d_spec import weighted_loss  # noqa: E402
from hpcai.training.keras_tasks import _bce, _mape  # noqa: E402
from hpcai.training.tf_allreduce import TfGradAllreducer  # noqa: E402
from variants import run_each, variant_comm  # noqa: E402

GLOBAL = 2
STEPS = 2


def variant(argv: list[str]) -> None:
    """STEPS steps of one variant (``OUT.npz [flags...]``); its rank 0 saves the variables."""
    out = argv[0]
    comm = variant_comm(argv)
    if comm is None:
        return
    rank, world = comm.Get_rank(), comm.Get_size()
    df = "channels_first" if "--channels-first" in argv else "channels_last"
    keras.backend.clear_session()   # layer names (the saved keys) as in a fresh process
    keras.utils.set_random_seed(1)
    D = gk.build_discriminator(data_format=df)
    opt = keras.optimizers.SGD(learning_rate=1e-3)
    reducer = TfGradAllreducer(D.trainable_variables, comm, bucket_mb=0.05,
                               overlap="--blocking" not in argv)
    data = np.random.default_rng(42)
    b = GLOBAL // world
    initial = {v.path.replace("/", "."): v.numpy() for v in D.trainable_variables}
    for _ in range(STEPS):
        x = (data.random((GLOBAL, *gk.image_shape(df))) * 0.01).astype(np.float32)
        e = (data.random((GLOBAL, 1)) * 4.9 + 0.1).astype(np.float32)
        x, e = x[rank * b:(rank + 1) * b], e[rank * b:(rank + 1) * b]
        with tf.GradientTape() as tape:
            fake, aux, ecal = D(x, training=False)
            parts = (_bce(fake, tf.ones_like(fake)), _mape(e, aux),
                     _mape(x.reshape(b, -1).sum(axis=1, keepdims=True), ecal))
            loss = weighted_loss(parts)
        grads = tape.gradient(loss, D.trainable_variables)
        if "--no-average" not in argv:
            grads = reducer.average(grads)
        opt.apply_gradients(zip(grads, D.trainable_variables))
    assert len(reducer.buckets) > 1 or world == 1, "test should exercise several buckets"
    if rank == 0:
        np.savez(out, **{v.path.replace("/", "."): v.numpy() for v in D.trainable_variables},
                 **{f"init.{k}": a for k, a in initial.items()})


if sys.argv[1] == "--each":
    run_each(Path(sys.argv[2]), variant)
else:
    variant(sys.argv[1:])
