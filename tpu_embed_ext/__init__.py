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
import types

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
    "from_keras_optimizer": "tf.keras_optimizers", "feature_config": "tf.config",
    "CPUEmbedding": "emulation.engine", "create_embedding": "emulation.dispatch",
    "EmbeddingLayer": "keras.layer",
    "emulate_tpu": "emulated_tpu",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

# Former module paths -> where the module lives now. ``import
# tpu_embed_ext.layer`` (and ``from tpu_embed_ext import layer``) give an alias
# of ``tpu_embed_ext.keras.layer``: a module of its own name and spec that
# reads and writes the real module's names, so existing code and patches work
# and the real module's spec is never touched (docs/layout.md).
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

# Public names of a former module that did not move with it: name -> the
# module that defines it now ("module:function()": the function's value).
MOVED_NAMES = {
    "learning_rates": {
        "RateBinder": "tf.rates", "describe": "tf.rates", "value_at": "tf.rates",
        "assign_tags": "tf.tags", "check_tag_rules": "tf.tags",
        "SCHEDULE_CLASSES": "spec.schedules:schedule_classes()"},
    "text_table": {"human_bytes": "host.memory"},
    "sparsecore.report": {"measure_training_data": "cli.training_data"},
}


class _FormerModule(types.ModuleType):
  """A former module path: reads, writes and deletes go to the real module."""

  def _real(self):
    return self.__dict__["__moved_to__"]

  def __getattr__(self, name):
    if "__moved_to__" not in self.__dict__ or name == "__path__":
      raise AttributeError(name)  # Not a package: no second copy of submodules.
    former = self.__name__[len("tpu_embed_ext."):]
    home = MOVED_NAMES.get(former, {}).get(name)
    if home is not None:
      module, _, call = home.partition(":")
      module = importlib.import_module(f"tpu_embed_ext.{module}")
      return getattr(module, call[:-2])() if call else getattr(module, name)
    if name == "__all__":
      return list(getattr(self._real(), "__all__", ())) + list(
          MOVED_NAMES.get(former, ()))
    try:
      return getattr(self._real(), name)
    except AttributeError:
      raise AttributeError(
          f"module {self.__name__!r} (now {self._real().__name__}) has no "
          f"attribute {name!r}") from None

  def __setattr__(self, name, value):
    if name.startswith("__") and name.endswith("__"):  # The import system's.
      super().__setattr__(name, value)
    else:
      setattr(self._real(), name, value)

  def __delattr__(self, name):
    if name.startswith("__") and name.endswith("__"):
      super().__delattr__(name)
    else:
      delattr(self._real(), name)

  def __dir__(self):
    former = self.__name__[len("tpu_embed_ext."):]
    return sorted(set(dir(self._real())) | set(MOVED_NAMES.get(former, ())))

  def __repr__(self):
    real = self.__dict__.get("__moved_to__")
    return (f"<module {self.__name__!r}, former path of "
            f"{getattr(real, '__name__', '?')!r}>")


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds a former path of ``MOVED``: an alias of the module at its new path."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname.startswith("tpu_embed_ext."):
      if fullname[len("tpu_embed_ext."):] in MOVED:
        return importlib.util.spec_from_loader(fullname, self)
    return None

  def create_module(self, spec):
    return _FormerModule(spec.name)

  def exec_module(self, module):
    real = importlib.import_module(
        f"tpu_embed_ext.{MOVED[module.__name__[len('tpu_embed_ext.'):]]}")
    module.__dict__["__moved_to__"] = real
    module.__dict__["__doc__"] = real.__doc__


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
