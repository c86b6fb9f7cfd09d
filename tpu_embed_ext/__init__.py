"""tpu_embed_ext: per-table optimizers, schedule-to-tag mapping and a training
CPU emulator for ``tf.tpu.experimental.embedding``.

Public names are loaded on first use, so ``import tpu_embed_ext`` stays cheap
and a missing TensorFlow is reported with the fix instead of a bare
ImportError deep inside a submodule.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# name -> module that defines it.
_EXPORTS = {
    "Error": "errors", "ConfigError": "errors", "ConfigTypeError": "errors",
    "InputError": "errors", "InputTypeError": "errors",
    "SGD": "spec.optimizers", "Adagrad": "spec.optimizers",
    "AdagradMomentum": "spec.optimizers", "Adam": "spec.optimizers",
    "FTRL": "spec.optimizers",
    "TableSpec": "spec.entries", "FeatureSpec": "spec.entries",
    "EmbeddingSpec": "spec.embedding_spec",
    "plan": "cli.plan", "Plan": "cli.plan",
    "Schedule": "spec.schedules",
    "from_keras_optimizer": "tf.keras_optimizers",
    "CPUEmbedding": "emulation.engine", "create_embedding": "emulation.dispatch",
    "EmbeddingLayer": "keras.layer",
    "emulate_tpu": "emulated_tpu",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

# Former module paths -> where the module lives now. ``import
# tpu_embed_ext.keras.layer`` (and ``from tpu_embed_ext import layer``) give the
# module at its new path, the same object, so existing code and patches work.
MOVED = {
    "optimizers": "spec.optimizers", "numeric_traps": "spec.numeric_traps",
    "learning_rates": "spec.schedules", "spec_fields": "spec.fields",
    "derived_names": "spec.names", "config_files": "spec.files",
    "atomic": "host.atomic", "model_dir": "host.model_dir",
    "checkpoint_scan": "host.checkpoint_scan", "host_memory": "host.memory",
    "library_log": "host.library_log",
    "tf_config": "tf.config", "tf_optimizers": "tf.optimizers",
    "keras_optimizers": "tf.keras_optimizers",
    "layer": "keras.layer", "layer_gradients": "keras.gradients",
    "layer_weights": "keras.weights", "model": "keras.model",
    "serving": "keras.serving",
    "console": "cli.console", "plan": "cli.plan", "text_table": "cli.text_table",
    "install_fixes": "cli.install_fixes",
    "sparsecore.report": "cli.sparsecore_report",
    "train": "job", "job.memory": "host.memory",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds a former path of ``MOVED`` and loads the module from its new one."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname.startswith("tpu_embed_ext."):
      if fullname[len("tpu_embed_ext."):] in MOVED:
        return importlib.util.spec_from_loader(fullname, self)
    return None

  def create_module(self, spec):
    return importlib.import_module(
        f"tpu_embed_ext.{MOVED[spec.name[len('tpu_embed_ext.'):]]}")

  def exec_module(self, module):
    del module  # Already executed at its new path.


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
  sys.meta_path.append(_MovedModules())


def _require_tensorflow():
  if importlib.util.find_spec("tensorflow") is None:
    raise ImportError(
        "tpu_embed_ext needs TensorFlow >= 2.16, which is not installed. "
        "Install the flavour for your machine: `pip install "
        "tpu_embed_ext[cpu]` (tensorflow-cpu), `[tf]` (tensorflow) or `[tpu]` "
        "(tensorflow-tpu, on Cloud TPU VMs).")


def __getattr__(name):
  module = _EXPORTS.get(name)
  if module is None and name in MOVED:  # `tee.optimizers`: a former module.
    return importlib.import_module(f"tpu_embed_ext.{name}")
  if module is None:
    raise AttributeError(f"module 'tpu_embed_ext' has no attribute '{name}'")
  if module not in ("errors", "spec.optimizers"):
    _require_tensorflow()
  value = getattr(importlib.import_module(f"tpu_embed_ext.{module}"), name)
  globals()[name] = value
  return value


def __dir__():
  return __all__
