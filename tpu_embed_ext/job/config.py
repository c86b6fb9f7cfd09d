"""The ``train:`` section of a config file: parsing and validation.

Every field is checked before any work starts; a ConfigError names
``train.<field>`` (and the file, through ``in_file``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Mapping, Optional

import keras

from tpu_embed_ext import errors
from tpu_embed_ext.data.pipeline import FORMATS
from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["TrainConfig", "keras_config", "check_steps", "load", "in_file"]


_MODEL_FIELDS = ("bottom", "top", "interaction")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """The ``train:`` section of a config file."""

  dataset: str = "synthetic_clicks/default"
  """tfds name (``name/config``); ``synthetic_clicks`` builds offline."""
  data_dir: Optional[str] = None
  """tfds data_dir; None: tfds's default (~/tensorflow_datasets)."""
  batch_size: int = 512
  steps: int = 2000
  """Train until the tables have taken this many steps (a resumed run counts
  the steps before it)."""
  steps_per_checkpoint: int = 200
  """Checkpoints at multiples of this table step (and the last step); also
  the interval of held-out evaluations, history rows and log lines."""
  eval_batches: Optional[int] = None
  """Batches of the held-out split to evaluate on; None: all of it."""
  seed: int = 0
  dense_optimizer: Any = dataclasses.field(
      default_factory=lambda: {"class_name": "Adam",
                               "config": {"learning_rate": 0.001}})
  """A Keras optimizer for the dense weights (``keras.optimizers.get`` form,
  or ``{class: Adam, learning_rate: ...}``)."""
  model: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  """RankingModel arguments: bottom, top, interaction."""
  features: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  """``{feature: {column: c0, format: dense|ragged|sparse}}``; default: the
  column named like the feature, dense for single-hot, ragged otherwise."""
  label: str = "label"
  dense_column: str = "dense"
  train_split: str = "train"
  eval_split: str = "test"
  """tfds split strings, e.g. ``train[:90%]`` / ``train[90%:]``."""

  @classmethod
  def from_dict(cls, config: Optional[Mapping[str, Any]]) -> "TrainConfig":
    """Validates every field; a ConfigError names ``train.<field>``."""
    config = dict(config or {})
    names = [f.name for f in dataclasses.fields(cls)]
    for key in config:
      if key not in names:
        raise errors.ConfigError(
            f'unknown field "{key}".{errors.did_you_mean(key, names)} Valid: '
            f"{errors.one_of(names)}.", path=f"train.{key}")
    for key in ("batch_size", "steps", "steps_per_checkpoint", "eval_batches"):
      if key in config and not (key == "eval_batches" and config[key] is None):
        _positive(config[key], f"train.{key}", key)
    seed = config.get("seed", 0)
    if not _is_int(seed) or seed < 0:
      raise errors.ConfigError(
          f"seed must be an integer >= 0, got seed={seed!r}. Fix: write e.g. 0.",
          path="train.seed")
    for key in ("dataset", "label", "dense_column", "train_split", "eval_split"):
      if key in config:
        errors.require_name(config[key], f"train.{key}", key)
    if config.get("data_dir") is not None:
      errors.require_name(config["data_dir"], "train.data_dir", "data_dir")
    _check_dense_optimizer(config.get("dense_optimizer"))
    _check_model(config.get("model", {}))
    _check_features(config.get("features", {}))
    return cls(**config)


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _positive(value, path: str, name: str) -> None:
  if not _is_int(value) or value <= 0:
    raise errors.ConfigError(
        f"{name} must be a positive integer, got {name}={value!r}. Fix: write "
        "e.g. 512.", path=path)


def _check_dense_optimizer(optimizer) -> None:
  if optimizer is None:
    return
  names = sorted(n for n, c in vars(keras.optimizers).items()
                 if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)
                 and c is not keras.optimizers.Optimizer)
  fix = (f"Fix: write e.g. {{class: Adam, learning_rate: 0.001}}; classes: "
         f"{', '.join(names)}.")
  path = "train.dense_optimizer"
  if isinstance(optimizer, Mapping) and not ({"class", "class_name"} & set(optimizer)):
    raise errors.ConfigError(
        f"the dense optimizer {dict(optimizer)!r} has no `class`. {fix}", path=path)
  try:
    built = keras.optimizers.get(keras_config(optimizer))
  except (ValueError, TypeError, KeyError) as e:
    given = (optimizer.get("class") or optimizer.get("class_name")
             if isinstance(optimizer, Mapping) else optimizer)
    hint = (errors.did_you_mean(given, names)
            if isinstance(given, str) and given not in names else "")
    # A KeyError is an argument the class needs (LossScaleOptimizer's
    # inner_optimizer), whose str() is only the quoted name.
    why = (f"it needs the argument {e}, which the job cannot give"
           if isinstance(e, KeyError) else str(e).splitlines()[0].rstrip("."))
    raise errors.ConfigError(
        f"Keras cannot build the dense optimizer {optimizer!r}: {why}.{hint} "
        f"{fix}", path=path) from None
  _check_keras_bools(type(built), keras_config(optimizer), path)


def _check_keras_bools(cls, config, path: str) -> None:
  """Keras takes any truthy value for a flag (``amsgrad: "false"`` turns it
  on); an argument whose default is a bool must be one."""
  args = config.get("config", {}) if isinstance(config, Mapping) else {}
  params = inspect.signature(cls.__init__).parameters
  for key, value in (args.items() if isinstance(args, Mapping) else ()):
    if key in params and isinstance(params[key].default, bool):
      errors.require_bool(value, f"{path}.{key}", key)


def _check_model(model) -> None:
  if not isinstance(model, Mapping):
    raise errors.ConfigTypeError(
        f"model must be a mapping of {', '.join(_MODEL_FIELDS)}, got {model!r}.",
        path="train.model")
  for key, value in model.items():
    path = f"train.model.{key}"
    if key not in _MODEL_FIELDS:
      raise errors.ConfigError(
          f'unknown field "{key}".{errors.did_you_mean(key, _MODEL_FIELDS)} '
          f"Valid: {errors.one_of(_MODEL_FIELDS)}.", path=path)
    if key == "interaction":
      if value not in ("dot", "concat"):
        raise errors.ConfigError(
            f'interaction must be "dot" or "concat", got {value!r}.', path=path)
    elif (not isinstance(value, (list, tuple)) or not value
          or not all(_is_int(u) and u > 0 for u in value)):
      raise errors.ConfigError(
          f"{key} must be a list of layer widths (positive integers), got "
          f"{value!r}. Fix: write e.g. [64, 16].", path=path)


def _check_features(features) -> None:
  if not isinstance(features, Mapping):
    raise errors.ConfigTypeError(
        f"features must be a mapping of feature -> {{column, format}}, got "
        f"{features!r}.", path="train.features")
  for name, entry in features.items():
    path = f"train.features.{name}"
    if not isinstance(entry, Mapping) or set(entry) - {"column", "format"}:
      raise errors.ConfigError(
          f"each feature takes {{column, format}}, got {entry!r}.", path=path)
    if "format" in entry and entry["format"] not in FORMATS:
      raise errors.unknown_name("format", entry["format"], FORMATS,
                                path=f"{path}.format")


def keras_config(optimizer):
  if isinstance(optimizer, Mapping) and "class" in optimizer:
    config = dict(optimizer)
    return {"class_name": config.pop("class"), "config": config}
  return optimizer


def check_steps(steps: Optional[int], default: int) -> int:
  if steps is None:
    return default
  if not _is_int(steps) or steps <= 0:
    raise errors.ConfigError(
        f"--steps must be a positive integer (the table step to train to), got "
        f"{steps!r}. Fix: pass e.g. --steps {default}, or leave it out for the "
        "config's train.steps.", path="--steps")
  return steps


def load(config_path: str, overrides: Optional[Mapping[str, Any]]):
  spec = EmbeddingSpec.from_file(config_path)
  return spec, TrainConfig.from_dict({**(spec.train or {}), **(overrides or {})})


@contextlib.contextmanager
def in_file(config_path: str):
  """Locates config errors raised after loading (train: section) in the file."""
  try:
    yield
  except errors.ConfigError as e:
    if e.file or e.path.startswith("--"):
      raise
    raise e.at(file=config_path) from None
