"""Keras 3 optimizer -> TPU embedding optimizer spec, mapping semantics.

Each Keras optimizer is translated to the TPU optimizer whose update is the
same math, not the one with the same argument names:

* Keras ``weight_decay`` decays ``w <- w - lr * wd * w`` before the step, so it
  maps to ``weight_decay_factor=wd`` with
  ``multiply_weight_decay_factor_by_learning_rate=True`` (without the flag the
  TPU would decay by ``wd`` alone). For Adam, whose TPU rate carries the bias
  correction, a constant ``lr`` is folded in instead (``weight_decay_factor =
  wd * lr``, flag off); a schedule with weight decay is refused. Keras decays
  every row of the table; the TPU decays the rows a step touches.
* Keras ``Adam`` bias-corrects with ``lr * sqrt(1 - b2^t) / (1 - b1^t)`` and
  divides by ``sqrt(v) + epsilon``: ``bias_correction=True`` and
  ``sum_inside_sqrt=False`` reproduce it exactly. Keras updates every row
  (the moments of untouched rows decay too), which is the TPU's
  ``lazy_adam=False``; pass ``lazy_adam=True`` to trade that for sparse steps.
* Keras ``Adagrad`` divides by ``sqrt(acc + epsilon)``; the TPU has no
  epsilon. The translation drops it when it is below 1e-3 of
  ``initial_accumulator_value`` (the relative difference is then below
  5e-4 at the first step and shrinks as the accumulator grows) and refuses
  otherwise.
* Keras ``Ftrl``'s ``beta`` adds ``beta / (2 lr)`` to l2, as the TPU's does;
  ``l2_shrinkage_regularization_strength`` has no TPU equivalent.

Options with no TPU equivalent raise ``ConfigError`` naming the option.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import keras
import numpy as np

from tpu_embed_ext import errors
from tpu_embed_ext.spec import optimizers
from tpu_embed_ext.spec.schedules import Schedule

__all__ = ["from_keras_optimizer"]

# Option -> value that means "off" in Keras. Anything else has no TPU equivalent.
_UNSUPPORTED_COMMON = {"clipnorm": None, "global_clipnorm": None, "use_ema": False,
                       "loss_scale_factor": None, "gradient_accumulation_steps": None}


def _learning_rate(opt):
  lr = opt._learning_rate  # pylint: disable=protected-access
  if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
    return Schedule.from_keras(lr)
  if callable(lr) and not hasattr(lr, "numpy"):
    return lr
  # Keras keeps the rate in a float32 variable: recover the value as written
  # (0.3, not 0.30000001192092896) from its shortest float32 representation.
  return float(str(np.float32(keras.ops.convert_to_numpy(opt.learning_rate))))


def _common(opt) -> Dict[str, Any]:
  kwargs = {"learning_rate": _learning_rate(opt)}
  if opt.clipvalue is not None:
    kwargs["clipvalue"] = float(opt.clipvalue)
  if opt.weight_decay:
    kwargs["weight_decay_factor"] = float(opt.weight_decay)
    kwargs["multiply_weight_decay_factor_by_learning_rate"] = True
  return kwargs


def _reject(opt, name, value, off):
  if value != off:
    raise errors.ConfigError(
        f"Keras {type(opt).__name__} option {name}={value!r} has no TPU embedding "
        f"equivalent. Fix: set {name}={off!r} for the embedding tables (keep it "
        "for the dense layers' optimizer).", path=name)


def _sgd(opt, **_):
  _reject(opt, "momentum", opt.momentum, 0.0)
  _reject(opt, "nesterov", opt.nesterov, False)
  return optimizers.SGD(**_common(opt))


def _adagrad(opt, **_):
  if opt.epsilon > 1e-3 * opt.initial_accumulator_value:
    raise errors.ConfigError(
        f"Keras Adagrad epsilon={opt.epsilon!r} is too large to drop (the TPU's "
        "Adagrad has no epsilon; dropped only below 1e-3 x "
        f"initial_accumulator_value={opt.initial_accumulator_value!r}). Fix: use "
        "epsilon=1e-7 or raise initial_accumulator_value.", path="epsilon")
  return optimizers.Adagrad(initial_accumulator_value=float(opt.initial_accumulator_value),
                            **_common(opt))


def _adam(opt, lazy_adam=False, **_):
  _reject(opt, "amsgrad", opt.amsgrad, False)
  kwargs = _common(opt)
  if kwargs.get("multiply_weight_decay_factor_by_learning_rate"):
    # The TPU would multiply the decay by the bias-corrected dynamic rate; Keras
    # by the plain rate. For a constant rate, fold it into the factor instead.
    if callable(kwargs["learning_rate"]):
      raise errors.ConfigError(
          f"Keras {type(opt).__name__} weight_decay={opt.weight_decay!r} with a "
          "learning-rate schedule has no exact TPU equivalent: the TPU would scale "
          "the decay by the bias-corrected rate. Fix: use a constant rate, or set "
          "weight_decay on a tpu_embed_ext Adam spec directly.", path="weight_decay")
    kwargs["weight_decay_factor"] *= kwargs["learning_rate"]
    kwargs["multiply_weight_decay_factor_by_learning_rate"] = False
  return optimizers.Adam(beta_1=float(opt.beta_1), beta_2=float(opt.beta_2),
                         epsilon=float(opt.epsilon), bias_correction=True,
                         sum_inside_sqrt=False, lazy_adam=lazy_adam, **kwargs)


def _ftrl(opt, **_):
  _reject(opt, "l2_shrinkage_regularization_strength",
          opt.l2_shrinkage_regularization_strength, 0.0)
  return optimizers.FTRL(
      learning_rate_power=float(opt.learning_rate_power),
      initial_accumulator_value=float(opt.initial_accumulator_value),
      l1_regularization_strength=float(opt.l1_regularization_strength),
      l2_regularization_strength=float(opt.l2_regularization_strength),
      beta=float(opt.beta), **_common(opt))


# Most specific first: subclasses of these map like their base.
_TRANSLATIONS: Tuple[Tuple[type, Callable], ...] = (
    (keras.optimizers.SGD, _sgd), (keras.optimizers.Adagrad, _adagrad),
    (keras.optimizers.Adam, _adam), (keras.optimizers.Ftrl, _ftrl))


def from_keras_optimizer(opt, *, lazy_adam: bool = False) -> optimizers.OptimizerSpec:
  """The TPU embedding optimizer spec with ``opt``'s math (see module doc)."""
  for cls, translate in _TRANSLATIONS:
    if isinstance(opt, cls):  # AdamW is Adam with weight_decay: same mapping.
      for name, off in _UNSUPPORTED_COMMON.items():
        _reject(opt, name, getattr(opt, name, off), off)
      return translate(opt, lazy_adam=lazy_adam)
  raise errors.ConfigTypeError(
      f"no TPU embedding equivalent for Keras {type(opt).__name__}. Fix: use "
      "keras.optimizers.SGD, Adagrad, Adam or Ftrl, or a tpu_embed_ext spec.")
