"""Optimizer specs for TPU embedding tables.

Each spec is a frozen, keyword-only dataclass with the same field names as the
``tf.tpu.experimental.embedding`` optimizer of the same name, validated in
``__post_init__`` (TensorFlow's checks, with messages that name the right field
and the right fix, plus the ones TensorFlow leaves to the TPU runtime, and the
numeric traps of numeric_traps.py: values that would write NaN or Inf).

Specs are values: equal fields mean equal specs, they can be hashed, and
nothing here ever mutates a TensorFlow object. tf_optimizers.py, which
imports this module (never the reverse), builds a fresh TF optimizer from a
spec (``to_tf``) and reads one back (``from_tf``), so the CPU engine accepts
either.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import sys
from typing import Any, Callable, ClassVar, Mapping, Optional, Tuple, Union

from tpu_embed_ext import errors
from tpu_embed_ext.spec import numeric_traps

# A learning rate: a constant, a zero-arg callable, or a schedule (a Keras 3
# LearningRateSchedule or spec.schedules.Schedule, both called with a step).
LearningRate = Union[float, Callable[..., Any]]
ClipValue = Union[float, Tuple[Optional[float], Optional[float]]]

__all__ = [
    "OptimizerSpec", "SGD", "Adagrad", "AdagradMomentum", "Adam", "FTRL",
    "TYPES", "from_dict",
]


def _is_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _isfinite(x) -> bool:
  # abs() first: math.isfinite raises OverflowError on an int beyond float64.
  return abs(x) <= sys.float_info.max and math.isfinite(x)


def _isnan(x) -> bool:
  return isinstance(x, float) and math.isnan(x)


def _fail(name: str, value, requirement: str, fix: str) -> errors.ConfigError:
  return errors.ConfigError(
      f"{name} {requirement}, got {name}={value!r}. Fix: {fix}.", path=name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
  """Fields shared by every TPU embedding optimizer."""

  learning_rate: LearningRate = 0.001
  """Constant rate, zero-arg callable, or schedule (see schedules.py)."""
  use_gradient_accumulation: bool = True
  """Sum all gradient contributions of an id before one update (TPU default)."""
  clip_weight_min: Optional[float] = None
  """Lower bound applied to updated rows after the update; None: no bound."""
  clip_weight_max: Optional[float] = None
  """Upper bound applied to updated rows after the update; None: no bound."""
  weight_decay_factor: Optional[float] = None
  """Decoupled weight decay ``w <- w - wd * w`` on touched rows; None: off."""
  multiply_weight_decay_factor_by_learning_rate: bool = False
  """Use ``wd * lr`` as the decay (the DecoupledWeightDecayExtension note)."""
  clipvalue: Optional[ClipValue] = None
  """Gradient clipping: ``c`` means ``(-c, c)``; or ``(min, max)``, None sides
  open. Stored as the ``(min, max)`` tuple."""
  low_dimensional_packing_status: bool = False
  """Pack 1/2/4-wide tables into 8-float chunks on the TPU (Engine A)."""
  clip_gradient_min: dataclasses.InitVar[Optional[float]] = None
  """TPUEstimator-era (v1 ``*Parameters``) lower side of ``clipvalue``; only
  an argument: stored in ``clipvalue``. Not with ``clipvalue``
  (docs/v1_parameters.md)."""
  clip_gradient_max: dataclasses.InitVar[Optional[float]] = None
  """The v1 upper side of ``clipvalue``, as ``clip_gradient_min``."""

  # The optimizer's facts, each held here once (tests/test_optimizer_rows.py
  # fails when an optimizer lacks one; its update math is
  # emulation/optimizer_rows.py's row of the class):
  type_name: ClassVar[str] = ""
  """Its name in configs (``type:``) and in the plan."""
  slot_names: ClassVar[Tuple[str, ...]] = ()
  """Its slot variables, in TensorFlow's order and names."""
  tf_class: ClassVar[str] = ""
  """Its class in ``tf.tpu.experimental.embedding`` (tf/optimizers.py)."""
  plan_settings: ClassVar[Tuple[str, ...]] = ()
  """Its own fields the plan always shows (others only when not default)."""
  numeric_traps: ClassVar[Tuple[str, ...]] = ()
  """The ids of its own numeric traps (``numeric_traps.CHECKS``), which
  ``check_own_traps`` checks after those of every optimizer."""

  def __post_init__(self, clip_gradient_min=None, clip_gradient_max=None):
    self._merge_v1_clip(clip_gradient_min, clip_gradient_max)
    self._check_learning_rate()
    for name in ("use_gradient_accumulation",
                 "multiply_weight_decay_factor_by_learning_rate",
                 "low_dimensional_packing_status"):
      self._check_bool(name)
    lo = self._check_optional_number("clip_weight_min")
    hi = self._check_optional_number("clip_weight_max")
    if lo is not None and hi is not None and lo > hi:
      raise errors.ConfigError(
          f"clip_weight_min must not exceed clip_weight_max, got "
          f"clip_weight_min={lo!r} > clip_weight_max={hi!r}. "
          "Fix: swap them or widen the range.", path="clip_weight_min")
    wd = self._check_optional_number("weight_decay_factor")
    if wd is not None and wd < 0:
      raise _fail("weight_decay_factor", wd, "must be >= 0",
                  "use a small positive factor such as 1e-4, or None for no decay")
    self._check_clipvalue()
    self._check_fields()
    numeric_traps.check_optimizer(self)

  def check_own_traps(self, samples) -> None:
    """Its own numeric traps (``numeric_traps``), given the rate's samples."""
    del samples

  def _check_fields(self):
    """The checks of a subclass's own fields (TensorFlow's, with our messages)."""

  # --- validation helpers -------------------------------------------------

  def _merge_v1_clip(self, lo, hi):
    """``clip_gradient_min/max`` (v1 ``_OptimizationParameters``) -> clipvalue.

    The v1 classes stored the two bounds; TF 2's optimizers take
    ``clipvalue`` and keep them as ``clip_gradient_min/max``
    (``tpu_embedding_v2_utils.py`` ``_Optimizer.__init__``): ``(lo, hi)``,
    None an open side. Both forms at once would be ambiguous.
    """
    if lo is None and hi is None:
      return
    if self.clipvalue is not None:
      raise errors.ConfigError(
          f"clipvalue={self.clipvalue!r} and clip_gradient_min={lo!r} / "
          f"clip_gradient_max={hi!r} both set gradient clipping. Fix: keep one "
          "form: clipvalue=(min, max), or the TPUEstimator-era "
          "clip_gradient_min / clip_gradient_max.", path="clip_gradient_min"
          if lo is not None else "clip_gradient_max")
    for name, value in (("clip_gradient_min", lo), ("clip_gradient_max", hi)):
      if value is not None and (not _is_number(value) or _isnan(value)):
        raise errors.ConfigTypeError(
            f"{name} must be a number or None, got {type(value).__name__} "
            f"{value!r}. Fix: write a number such as 1.0.", path=name)
    object.__setattr__(self, "clipvalue", (lo, hi))

  def _check_learning_rate(self):
    lr = self.learning_rate
    if _is_number(lr):
      if not _isfinite(lr) or lr < 0:
        raise _fail("learning_rate", lr, "must be a finite number >= 0",
                    "use a positive rate such as 0.01, or a schedule")
    elif not callable(lr):
      raise errors.ConfigTypeError(
          f"learning_rate must be a number, a schedule or a zero-arg callable, "
          f"got {type(lr).__name__} {lr!r}. Fix: write a number such as 0.01, "
          "or a schedule (a Keras LearningRateSchedule, its config dict, or "
          "the name of an entry under `schedules:`).", path="learning_rate")

  def _check_bool(self, name: str):
    errors.require_bool(getattr(self, name), name, name)

  def _check_number(self, name: str) -> float:
    value = getattr(self, name)
    if not _is_number(value) or not _isfinite(value):
      raise errors.ConfigTypeError(
          f"{name} must be a finite number, got {type(value).__name__} "
          f"{value!r}. Fix: write a number.", path=name)
    return value

  def _check_optional_number(self, name: str) -> Optional[float]:
    return None if getattr(self, name) is None else self._check_number(name)

  def _check_clipvalue(self):
    c = self.clipvalue
    if c is None:
      return
    if _is_number(c):
      if not c > 0 or not _isfinite(c):
        raise _fail("clipvalue", c, "must be a positive number",
                    "use e.g. 1.0 to clip gradients to [-1, 1], or a (min, max) pair")
      # One canonical form, so specs built from TF objects compare equal.
      object.__setattr__(self, "clipvalue", (-float(c), float(c)))
    elif isinstance(c, (tuple, list)) and len(c) == 2 and all(
        x is None or (_is_number(x) and not _isnan(x)
                      and (isinstance(x, float) or abs(x) <= sys.float_info.max))
        for x in c):
      if c[0] is not None and c[1] is not None and c[0] > c[1]:
        raise _fail("clipvalue", tuple(c), "must be (min, max) with min <= max",
                    "swap the two bounds")
      # Lists from YAML become tuples: the spec stays hashable.
      object.__setattr__(self, "clipvalue", tuple(
          None if x is None else float(x) for x in c))
    else:
      raise errors.ConfigTypeError(
          f"clipvalue must be a positive number or a (min, max) pair, got "
          f"{c!r}. Fix: write e.g. 1.0 or [-1.0, 2.0].", path="clipvalue")
    if not self.use_gradient_accumulation:
      raise errors.ConfigError(
          f"clipvalue={self.clipvalue!r} needs gradient accumulation, got "
          "use_gradient_accumulation=False. Fix: set "
          "use_gradient_accumulation=True, or remove clipvalue.",
          path="clipvalue")

  def _check_positive(self, name: str, fix: str):
    if self._check_number(name) <= 0:
      raise _fail(name, getattr(self, name), "must be > 0", fix)

  def _check_unit_interval(self, name: str, fix: str):
    value = self._check_number(name)
    if not 0.0 <= value < 1.0:
      raise _fail(name, value, "must be in [0, 1)", fix)

  # --- derived values -----------------------------------------------------

  def slot_initial_values(self) -> Tuple[float, ...]:
    """Initial value of each slot, in ``slot_names`` order."""
    return tuple(0.0 for _ in self.slot_names)

  @property
  def gradient_clip_limits(self) -> Tuple[Optional[float], Optional[float]]:
    """``(lower, upper)`` gradient clipping bounds; None means unbounded."""
    return (None, None) if self.clipvalue is None else self.clipvalue

  @property
  def has_dynamic_learning_rate(self) -> bool:
    return callable(self.learning_rate)

  @property
  def bias_correction_betas(self) -> Optional[Tuple[float, float]]:
    """``(beta_1, beta_2)`` when the rate carries Adam's bias correction."""
    return None

  def with_bound_rate(self, rate) -> "OptimizerSpec":
    """This spec with ``rate``, the number or zero-arg callable tf/rates.py's
    ``RateBinder`` made of its rate (a schedule bound to a step, Adam's bias
    correction folded in), for the engine's tables. No check runs again: they
    ran on this spec's own rate, which ``rate`` computes."""
    bound = copy.copy(self)
    object.__setattr__(bound, "learning_rate", rate)
    return bound

  def replace(self, **changes) -> "OptimizerSpec":
    return dataclasses.replace(self, **changes)

  def to_dict(self, *, full: bool = False) -> dict:
    """``{"type": ..., field: value}``; only non-default fields unless ``full``."""
    out = {"type": self.type_name}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if full or value != f.default:
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD(OptimizerSpec):
  """``w <- w - lr * g`` (docs/semantics.md, SGD)."""

  learning_rate: LearningRate = 0.01
  type_name: ClassVar[str] = "sgd"
  tf_class: ClassVar[str] = "SGD"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adagrad(OptimizerSpec):
  """``acc <- acc + g^2; w <- w - lr * g / sqrt(acc)`` (docs/semantics.md)."""

  initial_accumulator_value: float = 0.1
  """Initial value of the ``accumulators`` slot; must be > 0."""

  type_name: ClassVar[str] = "adagrad"
  slot_names: ClassVar[Tuple[str, ...]] = ("accumulators",)
  tf_class: ClassVar[str] = "Adagrad"
  plan_settings: ClassVar[Tuple[str, ...]] = ("initial_accumulator_value",)
  numeric_traps: ClassVar[Tuple[str, ...]] = ("accumulator_start",)

  def check_own_traps(self, samples):
    numeric_traps.accumulator_start(self, "g / sqrt(acc) = 0 / 0 = NaN")

  def _check_fields(self):
    self._check_positive("initial_accumulator_value",
                         "use a small positive value such as 0.1")

  def slot_initial_values(self):
    return (float(self.initial_accumulator_value),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdagradMomentum(OptimizerSpec):
  """Adagrad preconditioning with (Nesterov) momentum (docs/semantics.md)."""

  momentum: float = 0.0
  """Moving-average factor of the ``momenta`` slot."""
  use_nesterov: bool = False
  """Use Nesterov momentum: the update is ``momentum * mom + sg``."""
  exponent: float = 2.0
  """The gradient is scaled by ``(acc + epsilon)^(-1/exponent)``."""
  beta2: float = 1.0
  """1: ``acc += g^2`` (Adagrad); < 1: ``acc = beta2*acc + (1-beta2)*g^2``."""
  epsilon: float = 1e-10
  """Offset added to the accumulator before the power (not an initial value)."""

  type_name: ClassVar[str] = "adagrad_momentum"
  slot_names: ClassVar[Tuple[str, ...]] = ("accumulators", "momenta")
  tf_class: ClassVar[str] = "AdagradMomentum"
  plan_settings: ClassVar[Tuple[str, ...]] = ("momentum", "use_nesterov", "exponent",
                                               "beta2", "epsilon")
  numeric_traps: ClassVar[Tuple[str, ...]] = ("beta_rounds_to_one", "epsilon_power",
                                               "momentum_growth")

  def check_own_traps(self, samples):
    numeric_traps.adagrad_momentum(self)

  def _check_fields(self):
    self._check_bool("use_nesterov")
    if self._check_number("momentum") < 0:
      raise _fail("momentum", self.momentum, "must be >= 0",
                  "use a value in [0, 1) such as 0.9")
    self._check_positive("exponent", "use 2 for Adagrad's square root")
    beta2 = self._check_number("beta2")
    if not 0.0 < beta2 <= 1.0:
      raise _fail("beta2", beta2, "must be in (0, 1]",
                  "use 1 for a plain sum of squares, or e.g. 0.999")
    self._check_positive("epsilon", "use a small positive value such as 1e-10")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adam(OptimizerSpec):
  """Adam without bias correction, as the TPU runs it (docs/semantics.md).

  ``bias_correction=True`` is ours: the TPU applies none, so the learning rate
  becomes the dynamic rate ``lr(t) * sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1))``
  (see schedules.py). It never reaches the TF optimizer as a field.
  """

  beta_1: float = 0.9
  beta_2: float = 0.999
  epsilon: float = 1e-7
  lazy_adam: bool = True
  """Update only looked-up rows; False updates every row each step (Engine A)."""
  sum_inside_sqrt: bool = True
  """Denominator ``sqrt(v + eps^2)``; False: ``sqrt(v) + eps``."""
  bias_correction: bool = False
  """Fold Adam's bias correction into a dynamic learning rate."""

  type_name: ClassVar[str] = "adam"
  slot_names: ClassVar[Tuple[str, ...]] = ("momenta", "velocities")
  tf_class: ClassVar[str] = "Adam"
  plan_settings: ClassVar[Tuple[str, ...]] = ("beta_1", "beta_2", "epsilon",
                                               "lazy_adam", "bias_correction")
  numeric_traps: ClassVar[Tuple[str, ...]] = ("beta_rounds_to_one", "adam_epsilon")

  def check_own_traps(self, samples):
    numeric_traps.adam(self)

  def _check_fields(self):
    for name in ("lazy_adam", "sum_inside_sqrt", "bias_correction"):
      self._check_bool(name)
    self._check_unit_interval("beta_1", "use a value such as 0.9")
    self._check_unit_interval("beta_2", "use a value such as 0.999")
    self._check_positive("epsilon", "use a small positive value such as 1e-7")
    if not self.lazy_adam and not self.use_gradient_accumulation:
      raise errors.ConfigError(
          "lazy_adam=False (update every row) needs gradient accumulation, got "
          "use_gradient_accumulation=False. Fix: set "
          "use_gradient_accumulation=True, or lazy_adam=True.",
          path="lazy_adam")

  @property
  def bias_correction_betas(self) -> Optional[Tuple[float, float]]:
    return (self.beta_1, self.beta_2) if self.bias_correction else None

  def with_bound_rate(self, rate) -> "Adam":
    """The bias correction is folded into ``rate``, so it is off here."""
    bound = super().with_bound_rate(rate)
    object.__setattr__(bound, "bias_correction", False)
    return bound


@dataclasses.dataclass(frozen=True, kw_only=True)
class FTRL(OptimizerSpec):
  """Follow-the-regularized-leader as the TPU runs it (docs/semantics.md)."""

  learning_rate_power: float = -0.5
  """``-k``: the accumulator enters as ``acc^k``; must be <= 0."""
  l1_regularization_strength: float = 0.0
  l2_regularization_strength: float = 0.0
  beta: float = 0.0
  """Adds ``beta / lr`` to the denominator (``beta/(2 lr)`` of extra l2)."""
  initial_accumulator_value: float = 0.1
  """Initial value of the ``accumulators`` slot; must be > 0 (TF 2.21)."""
  multiply_linear_by_learning_rate: bool = False
  """Store ``linear * lr``: safe with zero or near-zero learning rates."""
  allow_zero_accumulator: bool = False
  """Deprecated by TensorFlow; kept for the proto, has no effect."""

  type_name: ClassVar[str] = "ftrl"
  slot_names: ClassVar[Tuple[str, ...]] = ("accumulators", "linears")
  tf_class: ClassVar[str] = "FTRL"
  plan_settings: ClassVar[Tuple[str, ...]] = (
      "learning_rate_power", "l1_regularization_strength",
      "l2_regularization_strength", "beta", "multiply_linear_by_learning_rate")
  numeric_traps: ClassVar[Tuple[str, ...]] = ("accumulator_start", "ftrl_divides_by_lr",
                                               "ftrl_power")

  def check_own_traps(self, samples):
    numeric_traps.accumulator_start(self, "w = N / D = 0 / 0 = NaN")
    numeric_traps.ftrl(self, samples)

  def _check_fields(self):
    for name in ("multiply_linear_by_learning_rate", "allow_zero_accumulator"):
      self._check_bool(name)
    if self._check_number("learning_rate_power") > 0:
      raise _fail("learning_rate_power", self.learning_rate_power, "must be <= 0",
                  "use -0.5 (Adagrad-like), or 0 for a fixed rate")
    for name in ("l1_regularization_strength", "l2_regularization_strength",
                 "beta"):
      if self._check_number(name) < 0:
        raise _fail(name, getattr(self, name), "must be >= 0", "use 0 or more")
    self._check_positive("initial_accumulator_value",
                         "use a small positive value such as 0.1")

  def slot_initial_values(self):
    return (float(self.initial_accumulator_value), 0.0)


TYPES: Mapping[str, type] = {
    cls.type_name: cls for cls in (SGD, Adagrad, AdagradMomentum, Adam, FTRL)
}


# TPUEstimator-era names accepted beside the fields (docs/v1_parameters.md).
V1_CLIP_FIELDS = ("clip_gradient_min", "clip_gradient_max")


def field_names(cls: type) -> Tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls))


def from_dict(config: Mapping[str, Any]) -> OptimizerSpec:
  """Builds a spec from ``{"type": name, field: value, ...}``.

  Raises ConfigError (with the offending key as its path) for an unknown type
  or field; learning-rate schedules must already be resolved by the caller.
  """
  if not isinstance(config, Mapping):
    raise errors.ConfigTypeError(
        f"an optimizer must be a mapping with a `type`, got "
        f"{type(config).__name__} {config!r}. Fix: write e.g. "
        "{type: adagrad, learning_rate: 0.05}.")
  if "type" not in config:
    raise errors.ConfigError(
        f"optimizer has no `type`. Fix: add `type:` with one of "
        f"{errors.one_of(TYPES)}.", path="type")
  name = config["type"]
  errors.require_name(name, "type", "an optimizer type")
  if name not in TYPES:
    raise errors.unknown_name("optimizer type", name, TYPES, path="type")
  cls = TYPES[name]
  allowed = field_names(cls)
  kwargs = {}
  for key, value in config.items():
    if key == "type":
      continue
    if key not in allowed and key not in V1_CLIP_FIELDS:
      raise errors.ConfigError(
          f'unknown field "{key}" for optimizer type "{name}".'
          f"{errors.did_you_mean(key, allowed)} Valid: "
          f"{errors.one_of(allowed)}.", path=str(key))
    kwargs[key] = value
  return cls(**kwargs)

