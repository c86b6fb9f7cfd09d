"""tpu_embed_ext: per-table optimizers, schedule-to-tag mapping and a training
CPU emulator for ``tf.tpu.experimental.embedding``.

Public names are loaded on first use, so ``import tpu_embed_ext`` stays cheap
and a missing TensorFlow is reported with the fix instead of a bare
ImportError deep inside a submodule.
"""

import importlib
import importlib.util

__version__ = "0.1.0"

# name -> module that defines it.
_EXPORTS = {
    "Error": "errors", "ConfigError": "errors", "ConfigTypeError": "errors",
    "InputError": "errors", "InputTypeError": "errors",
    "SGD": "optimizers", "Adagrad": "optimizers",
    "AdagradMomentum": "optimizers", "Adam": "optimizers", "FTRL": "optimizers",
    "TableSpec": "spec", "FeatureSpec": "spec", "EmbeddingSpec": "spec",
    "plan": "plan", "Plan": "plan",
    "Schedule": "learning_rates",
    "from_keras_optimizer": "keras_optimizers",
    "CPUEmbedding": "emulation.engine", "create_embedding": "emulation.dispatch",
    "EmbeddingLayer": "layer",
    "emulate_tpu": "emulated_tpu",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def _require_tensorflow():
  if importlib.util.find_spec("tensorflow") is None:
    raise ImportError(
        "tpu_embed_ext needs TensorFlow >= 2.16, which is not installed. "
        "Install the flavour for your machine: `pip install "
        "tpu_embed_ext[cpu]` (tensorflow-cpu), `[tf]` (tensorflow) or `[tpu]` "
        "(tensorflow-tpu, on Cloud TPU VMs).")


def __getattr__(name):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'tpu_embed_ext' has no attribute '{name}'")
  if module not in ("errors", "optimizers"):
    _require_tensorflow()
  value = getattr(importlib.import_module(f"tpu_embed_ext.{module}"), name)
  globals()[name] = value
  return value


def __dir__():
  return __all__
