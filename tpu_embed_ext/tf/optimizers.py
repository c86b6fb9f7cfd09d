"""TensorFlow's ``tf.tpu.experimental.embedding`` optimizers <-> our specs.

``to_tf`` builds a fresh TF optimizer from a spec; ``from_tf`` reads one back
(so the CPU engine accepts either); ``as_spec`` accepts both. The specs live
in spec/optimizers.py, which does not import this module (specs -> TF objects).
"""

from __future__ import annotations

import numbers
from typing import Optional

from tpu_embed_ext import errors
from tpu_embed_ext.spec import numeric_traps
from tpu_embed_ext.spec.optimizers import (TYPES,
                                      LearningRate, OptimizerSpec, field_names)

__all__ = ["to_tf", "from_tf", "as_spec"]


def _is_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _tf_classes():
  """``{our spec class: TensorFlow's}``, by each class's ``tf_class``."""
  from tensorflow.python.tpu import tpu_embedding_v2_utils as tf_utils
  return {cls: getattr(tf_utils, cls.tf_class) for cls in TYPES.values()}

# Fields of our specs that the TF optimizer does not take, and how their effect
# reaches the TPU instead.
_NOT_IN_TF = {"bias_correction": "folded into the dynamic learning rate"}


def _packing_enum(enabled: bool) -> int:
  # Upstream assigns the bool to an enum proto field, which protobuf rejects
  # with TypeError for both values. The enum value it meant is written instead:
  # True -> ENABLED; False -> UNSPECIFIED (the runtime default, what False
  # meant when protobuf still accepted bools as ints).
  from tensorflow.core.protobuf.tpu import optimization_parameters_pb2 as pb
  status = pb.LowDimensionalPackingStatus.Status
  return status.Value("ENABLED") if enabled else status.Value("UNSPECIFIED")


def to_tf(spec: OptimizerSpec, learning_rate: Optional[LearningRate] = None):
  """A fresh ``tf.tpu.experimental.embedding`` optimizer for ``spec``.

  Args:
    spec: the optimizer spec.
    learning_rate: overrides ``spec.learning_rate``; pass the zero-arg callable
      that tf/rates.py binds to a step when the spec holds a schedule.
  """
  kwargs = {}
  for name in field_names(type(spec)):
    if name in _NOT_IN_TF:
      continue
    kwargs[name] = getattr(spec, name)
  if learning_rate is not None:
    kwargs["learning_rate"] = learning_rate
  if not kwargs["multiply_weight_decay_factor_by_learning_rate"]:
    # TensorFlow's default, None: TPUEmbeddingV2 refuses any value but None
    # ("weight_decay_factor and multiply_weight_decay_factor_by_learning_rate
    # are not supported yet", tpu_embedding_v3.py), and False means the same
    # as None to TPUEmbedding (_set_optimization_parameters sets it if true).
    kwargs["multiply_weight_decay_factor_by_learning_rate"] = None
  if not (isinstance(kwargs["learning_rate"], numbers.Real)
          or _is_zero_arg_callable(kwargs["learning_rate"])):
    raise errors.ConfigTypeError(
        f"a {spec.type_name} learning_rate given to TensorFlow must be a number "
        f"or a zero-arg callable, got {kwargs['learning_rate']!r}. Fix: bind the "
        "schedule to a step first (EmbeddingSpec.feature_config does this).",
        path="learning_rate")
  kwargs["low_dimensional_packing_status"] = _packing_enum(
      spec.low_dimensional_packing_status)
  return _tf_classes()[type(spec)](**kwargs)


def _is_zero_arg_callable(fn) -> bool:
  import inspect
  if not callable(fn):
    return False
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return True  # Builtins without a signature: trust the caller.
  return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
             for p in sig.parameters.values())


def from_tf(optimizer) -> OptimizerSpec:
  """The spec equal to a ``tf.tpu.experimental.embedding`` optimizer object."""
  by_tf = {tf_cls: ours for ours, tf_cls in _tf_classes().items()}
  cls = next((ours for tf_cls, ours in by_tf.items()
              if isinstance(optimizer, tf_cls)), None)
  if cls is None:
    raise TypeError(
        f"unsupported optimizer {type(optimizer).__name__}: expected one of "
        f"{', '.join(c.__name__ for c in by_tf)} from "
        "tf.tpu.experimental.embedding, or a tpu_embed_ext optimizer spec.")
  kwargs = {}
  for name in field_names(cls):
    if name in _NOT_IN_TF or name == "clipvalue":
      continue
    kwargs[name] = getattr(optimizer, name)
  lo, hi = optimizer.clip_gradient_min, optimizer.clip_gradient_max
  kwargs["clipvalue"] = None if lo is None and hi is None else (lo, hi)
  kwargs["multiply_weight_decay_factor_by_learning_rate"] = bool(
      kwargs["multiply_weight_decay_factor_by_learning_rate"])
  packing = kwargs["low_dimensional_packing_status"]
  kwargs["low_dimensional_packing_status"] = (
      packing is True or (not isinstance(packing, bool)
                          and packing == _packing_enum(True)))
  for name in ("exponent", "beta2"):  # TF's int defaults (2, 1) -> floats.
    if name in kwargs and _is_number(kwargs[name]):
      kwargs[name] = float(kwargs[name])
  # A TF optimizer object is taken as TPUEmbedding takes it: without the
  # numeric-trap checks of specs (spec/numeric_traps.py). The engine still rejects
  # a step that would write NaN or Inf, as for any other cause.
  with numeric_traps.skip_checks():
    return cls(**kwargs)


def as_spec(optimizer, where: str = "") -> OptimizerSpec:
  """Accepts our spec or a TF optimizer object; returns a spec.

  Anything else is a ``ConfigError`` (a ``ValueError``), the class
  ``TPUEmbedding.__init__`` raises ("... is an unsupported optimizer
  class", ``tpu_embedding_v2.py``); ``where`` names the table.
  """
  if isinstance(optimizer, OptimizerSpec):
    return optimizer
  if not any(isinstance(optimizer, c) for c in _tf_classes().values()):
    prefix = f"{where}: " if where else ""
    raise errors.ConfigError(
        f"{prefix}{type(optimizer).__name__} is an unsupported optimizer "
        "class. Fix: pass one of tf.tpu.experimental.embedding's SGD, "
        "Adagrad, AdagradMomentum, Adam or FTRL, or a tpu_embed_ext optimizer "
        "spec (a Keras optimizer converts with "
        "tpu_embed_ext.from_keras_optimizer).")
  return from_tf(optimizer)
