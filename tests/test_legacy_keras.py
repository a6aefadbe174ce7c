"""Horovod's upstream TF2 scripts need Keras 2 as ``tf.keras`` (the ``tf-keras`` package and
``TF_USE_LEGACY_KERAS=1``, used by ``bench/tf_baselines.py``); hpcai's own TensorFlow path
imports ``keras`` (Keras 3) and must get Keras 3 either way."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

# scripts/install.sh installs it (--no-deps); found, not imported (TensorFlow is ~7 CPU-s
# for each pytest-xdist worker that collects this file)
assert importlib.util.find_spec("tf_keras"), "tf_keras is not installed"

PROBE = ("import json, keras, tensorflow as tf; "
         "print(json.dumps([keras.__version__, tf.keras.__name__]))")


def _probe(**env: str) -> tuple[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env},
                         capture_output=True, text=True, timeout=300, check=True)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def test_legacy_keras_for_horovod_scripts_keeps_keras3_for_hpcai():
    keras_version, tf_keras_name = _probe(TF_USE_LEGACY_KERAS="1")
    assert keras_version.startswith("3."), keras_version        # hpcai's path unchanged
    assert tf_keras_name.startswith("tf_keras"), tf_keras_name   # Horovod's scripts get Keras 2
    # negative control: without the variable tf.keras is Keras 3 (the upstream script fails)
    keras_version, tf_keras_name = _probe()
    assert keras_version.startswith("3.") and not tf_keras_name.startswith("tf_keras")
