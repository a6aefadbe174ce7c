"""The trainer's TensorFlow hooks, for ``--framework tensorflow``: Keras tasks, no torch.

Only the framework hooks differ (see ``trainer.Trainer``): the task (``keras_tasks``), the
initial broadcast and the replica checks (over every Keras variable), the gradient averaging
(``tf_allreduce``: hpcai's buckets over mpi4py, or ``horovod.tensorflow``), learning-rate
setting, checkpoint contents (NumPy arrays of every model and optimiser variable, pickled),
the per-step randomness and the GEMM probe for the peak. Epochs, sharding, records,
checkpoints, preemption and fault handling are the same code as for PyTorch.
"""

from __future__ import annotations

import os
from typing import BinaryIO

import numpy as np
from mpi4py import MPI

from . import checkpoint
from .keras_tasks import is_rng_state, make_keras_task, moving_statistics
from .metrics import best_gemm_gflops
from .trainer import Trainer


def tf_gemm_peak_gflops() -> float:
    """Best-of-8 fp32 2048^3 ``tf.linalg.matmul`` rate with this process's TF threads."""
    import tensorflow as tf

    a = tf.random.normal((2048, 2048))
    b = tf.random.normal((2048, 2048))
    return best_gemm_gflops(lambda: tf.linalg.matmul(a, b).numpy())


def _state_of(model) -> list:
    return [v for v in model.variables if not is_rng_state(v)]


class TfTrainer(Trainer):
    framework = "tensorflow"

    def _threads(self) -> int:
        import tensorflow as tf

        return tf.config.threading.get_intra_op_parallelism_threads() or (os.cpu_count() or 1)

    def _make_task(self):
        return make_keras_task(self.cfg, self.target_lr, rank=self.rank)

    def _variables(self, trainable_only: bool = False) -> list:
        """Every model's state (trainable weights, BatchNorm statistics), not the per-rank
        dropout streams."""
        out = []
        for model in self.task.models.values():
            out.extend(model.trainable_variables if trainable_only else _state_of(model))
        return out

    def _broadcast(self) -> None:
        for v in self._variables():
            array = np.ascontiguousarray(v.numpy())
            self.comm.Bcast(array, root=0)
            v.assign(array)

    def _state_arrays(self, everything: bool) -> list[np.ndarray]:
        return [v.numpy() for v in self._variables(trainable_only=not everything)]

    def _make_reducers(self) -> dict:
        from .tf_allreduce import HorovodTfAverager, TfGradAllreducer

        cfg = self.cfg
        reducers = {}
        for key, model in self.task.models.items():
            if cfg.comm == "horovod":
                reducers[key] = HorovodTfAverager(model.trainable_variables, self.comm,
                                                  overlap=cfg.overlap)
            else:
                reducers[key] = TfGradAllreducer(model.trainable_variables, self.comm,
                                                 bucket_mb=cfg.bucket_mb, overlap=cfg.overlap)
        return reducers

    def _gradients(self, key: str, grads: list) -> list:
        return self.reducers[key].average(grads)

    def _apply_lr(self, lr: float) -> None:
        for opt in self.task.optimizers.values():
            opt.learning_rate = lr

    def _task_state(self) -> dict:
        return {"modules": {k: [v.numpy() for v in _state_of(m)]
                            for k, m in self.task.models.items()},
                "optimizers": {k: [v.numpy() for v in o.variables]
                               for k, o in self.task.optimizers.items()}}

    def _load_task_state(self, state: dict) -> None:
        targets = [("modules", k, _state_of(m)) for k, m in self.task.models.items()]
        targets += [("optimizers", k, o.variables) for k, o in self.task.optimizers.items()]
        for group, key, variables in targets:
            saved = state[group][key]
            if len(saved) != len(variables):
                raise ValueError(f"checkpoint {group}/{key}: {len(saved)} arrays, this model "
                                 f"has {len(variables)} variables")
            for v, array in zip(variables, saved):
                v.assign(array)

    def _write_checkpoint(self, state: dict, handle: BinaryIO) -> None:
        checkpoint.write_pickle(state, handle)

    def _step_rng(self, seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    def _gemm_probe(self) -> tuple[float, str]:
        return tf_gemm_peak_gflops(), "fp32 GEMM 2048^3 (tf.linalg.matmul)"

    def _framework_version(self) -> str:
        import keras
        import tensorflow as tf

        return f"tensorflow {tf.__version__}, keras {keras.__version__}"

    def _moving_statistics(self) -> list:
        """Every BatchNorm's moving mean and variance of the task's models."""
        return [v for model in self.task.models.values() for v in moving_statistics(model)]

    def _local_statistics(self) -> list:
        return [v.numpy() for v in self._moving_statistics()]

    def _load_local_statistics(self, saved: list) -> None:
        for v, array in zip(self._moving_statistics(), saved, strict=True):
            v.assign(array)

    def _average_bn(self) -> None:
        for v in self._moving_statistics():
            array = np.ascontiguousarray(v.numpy())
            self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            v.assign(array / self.world)
