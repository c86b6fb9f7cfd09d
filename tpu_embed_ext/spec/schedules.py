"""Learning-rate schedules as values: parsed, range-checked, compared by value.

A schedule is a pure ``step -> rate`` function (a Keras 3
``LearningRateSchedule``); something else owns the step: the CPU engine's
``step``, or a Keras optimizer's ``iterations``. ``Schedule`` is its value
form: class name plus config, compared by value, so one schedule written twice
in a config is still one schedule.

Binding a schedule to a step (and Adam's bias correction) is tf/rates.py;
the TPU's tags for dynamic rates are tf/tags.py. This module imports neither
TensorFlow nor Keras at import time, and parsing a schedule imports neither:
its arguments and its values at the checked steps come from
schedule_values.py (numpy, as Keras computes them). Keras schedule objects
are built, inside the functions that need them, for training (``__call__``)
and for a config that module leaves to Keras.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import numbers
import sys
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from tpu_embed_ext import errors
from tpu_embed_ext.spec import schedule_values

__all__ = ["Schedule", "parse_schedules", "parse_learning_rate",
           "learning_rate_to_config", "check_steps", "milestones",
           "SCHEDULE_NAMES", "schedule_classes", "is_keras_schedule"]

# The Keras 3 schedule families a config may name (keras.optimizers.schedules).
SCHEDULE_NAMES = tuple(schedule_values.ARGUMENTS)


@functools.lru_cache(maxsize=None)
def schedule_classes() -> Dict[str, type]:
  """``{name: Keras schedule class}``; imports Keras, hence a function."""
  import keras  # pylint: disable=g-import-not-at-top
  schedules = keras.optimizers.schedules
  return {name: getattr(schedules, name) for name in SCHEDULE_NAMES}


def is_keras_schedule(value) -> bool:
  """A Keras schedule object exists only once Keras is imported: no import."""
  keras = sys.modules.get("keras")
  return keras is not None and isinstance(
      value, keras.optimizers.schedules.LearningRateSchedule)


def _rejections() -> tuple:
  """The errors that mean Keras rejects a schedule's arguments. TensorFlow's
  OpError only once TensorFlow is loaded: before, nothing can raise it."""
  tf = sys.modules.get("tensorflow")
  found = (ValueError, TypeError, ArithmeticError)
  return found + (tf.errors.OpError,) if tf is not None else found


def _tf():
  """TensorFlow, imported where a rate is computed, not when the spec loads."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf


def _freeze(value):
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  if isinstance(value, numbers.Integral) and not isinstance(value, bool):
    return int(value)
  if isinstance(value, numbers.Real) and not isinstance(value, bool):
    return float(value)
  return value


def _thaw(value):
  return [_thaw(v) for v in value] if isinstance(value, tuple) else value


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A Keras 3 learning-rate schedule as a value: ``Schedule(t) -> rate``."""

  class_name: str
  config: Tuple[Tuple[str, Any], ...]
  """Sorted ``(argument, value)`` pairs; Keras's ``name`` argument excluded."""
  name: Optional[str] = dataclasses.field(default=None, compare=False)
  """The ``schedules:`` entry it came from (kept for round trips)."""

  def __post_init__(self):
    if self.class_name not in SCHEDULE_NAMES:
      raise errors.unknown_name("schedule class", self.class_name,
                                SCHEDULE_NAMES, path="class")

  @classmethod
  def from_config(cls, config: Mapping[str, Any], name: Optional[str] = None
                  ) -> "Schedule":
    """From ``{class: X, arg: ...}`` or Keras's ``{class_name, config}``."""
    if not isinstance(config, Mapping):
      raise errors.ConfigTypeError(
          f"a schedule must be a mapping with a `class`, got {config!r}. Fix: "
          "write e.g. {class: ExponentialDecay, initial_learning_rate: 0.1, "
          "decay_steps: 1000, decay_rate: 0.9}.")
    config = dict(config)
    if "class_name" in config:
      class_name, args = config["class_name"], dict(config.get("config", {}))
    elif "class" in config:
      class_name = config.pop("class")
      args = config
    else:
      raise errors.ConfigError(
          "schedule has no `class`. Fix: add `class:` with one of "
          f"{errors.one_of(SCHEDULE_NAMES)}.", path="class")
    errors.require_name(class_name, "class", "a schedule class")
    if not isinstance(args, Mapping):
      raise errors.ConfigTypeError(
          f"a schedule's config must be a mapping, got {args!r}.", path="config")
    if class_name not in SCHEDULE_NAMES:
      raise errors.unknown_name("schedule class", class_name, SCHEDULE_NAMES,
                                path="class")
    args = dict(args)
    args.pop("name", None)
    params = schedule_values.ARGUMENTS[class_name]
    allowed = list(params)
    for key in args:
      if key not in allowed:
        raise errors.ConfigError(
            f'unknown argument "{key}" for {class_name}.'
            f"{errors.did_you_mean(key, allowed)} Valid: "
            f"{errors.one_of(allowed)}.", path=str(key))
    missing = [p for p in allowed if params[p] is schedule_values.REQUIRED
               and p not in args]
    if missing:
      raise errors.ConfigError(
          f"{class_name} needs {', '.join(missing)}. Fix: add "
          f"{', '.join(f'{m}: ...' for m in missing)}.", path=missing[0])
    _check_step_counts(class_name, args)
    if class_name == "PiecewiseConstantDecay":
      _check_piecewise(args)
    for key, value in args.items():  # staircase, cycle
      if isinstance(params[key], bool):
        errors.require_bool(value, str(key), f"{class_name} {key}")
    schedule = cls(class_name, tuple(sorted((k, _freeze(v)) for k, v in args.items())),
                   name=name)
    try:
      if class_name == "PiecewiseConstantDecay":
        _piecewise_lengths(args)
      elif not schedule_values.supports(class_name, dict(schedule.config)):
        schedule.keras()  # Keras's own verdict on a config Keras computes.
      schedule.value(0)
    except Exception as e:  # pylint: disable=broad-except
      if not isinstance(e, _rejections()):
        raise
      raise errors.ConfigError(
          f"{class_name} rejects its arguments {dict(args)}: {e}. Fix: correct "
          "the values (see keras.optimizers.schedules."
          f"{class_name}).") from e
    _check_range(schedule)
    return schedule

  @classmethod
  def from_keras(cls, schedule) -> "Schedule":
    """From a ``keras.optimizers.schedules.LearningRateSchedule`` object."""
    return cls.from_config({"class": type(schedule).__name__,
                            **schedule.get_config()})

  def keras(self):
    """A fresh Keras schedule object."""
    return schedule_classes()[self.class_name](**{k: _thaw(v) for k, v in self.config})

  def __call__(self, step):
    if self.class_name == "PiecewiseConstantDecay":
      return self._piecewise()(step)
    tf = _tf()
    return tf.cast(self._cached_keras()(step), tf.float32)

  def value(self, step: int) -> float:
    """The rate at a whole step, as a Python float (of float32)."""
    if self.class_name == "PiecewiseConstantDecay":
      return self._piecewise().at(step)
    config = dict(self.config)
    if schedule_values.supports(self.class_name, config):
      return schedule_values.value(self.class_name, config, step)
    tf = _tf()
    return float(tf.cast(self._cached_keras()(step), tf.float32))

  def _piecewise(self) -> "_Piecewise":
    cached = self.__dict__.get("_piecewise_rate")
    if cached is None:
      config = dict(self.config)
      cached = _Piecewise(config["boundaries"], config["values"])
      object.__setattr__(self, "_piecewise_rate", cached)
    return cached

  def _cached_keras(self):
    cached = self.__dict__.get("_keras")
    if cached is None:
      cached = self.keras()
      object.__setattr__(self, "_keras", cached)
    return cached

  def samples(self) -> Tuple[Tuple[int, float], ...]:
    """``((step, rate), ...)`` at ``check_steps``: computed once per object
    (the range check and numeric_traps.py both read them)."""
    cached = self.__dict__.get("_samples")
    if cached is None:
      cached = tuple((t, self.value(t)) for t in check_steps(self))
      object.__setattr__(self, "_samples", cached)
    return cached

  def to_config(self) -> Dict[str, Any]:
    return {"class": self.class_name, **{k: _thaw(v) for k, v in self.config}}

  def __repr__(self):
    args = ", ".join(f"{k}={_thaw(v)!r}" for k, v in self.config)
    return f"{self.class_name}({args})"


class _Piecewise:
  """``PiecewiseConstantDecay`` in O(log n) a step: Keras's builds one
  comparison per boundary and evaluates all of them at every step (O(n)), so
  checking its range at the ~3n steps that bound it was O(n^2): 1,000
  boundaries took minutes. Same values: step <= b[0] gives values[0],
  b[i-1] < step <= b[i] values[i], step > b[-1] values[-1]; boundaries are
  cast to the step's integer type (truncated), values to float32 (every
  value is finite: Keras's sum of ``cast(in range) * value`` would turn one
  Inf into NaN at every step, and the range check refuses non-finite rates).
  """

  def __init__(self, boundaries, values):
    self.boundaries = [int(b) for b in boundaries]
    self.values = [float(np.float32(v)) for v in values]
    self._arrays = (np.array(self.boundaries, np.int64),
                    np.array(self.values, np.float32))

  def at(self, step: int) -> float:
    return self.values[bisect.bisect_left(self.boundaries, int(step))]

  def __call__(self, step):
    tf = _tf()
    if isinstance(step, numbers.Integral):
      return tf.constant(self.at(step), tf.float32)
    boundaries, values = (tf.constant(a) for a in self._arrays)
    step = tf.reshape(tf.cast(step, tf.int64), [1])
    return tf.gather(values, tf.searchsorted(boundaries, step, side="left")[0])


def _piecewise_lengths(args: Mapping[str, Any]) -> None:
  """Keras's PiecewiseConstantDecay constructor check, with its message."""
  boundaries, values = args["boundaries"], args["values"]
  if len(boundaries) != len(values) - 1:
    raise ValueError(
        "The length of boundaries should be 1 less than the length of "
        f"values. Received: boundaries={boundaries} of length "
        f"{len(boundaries)}, and values={values} of length {len(values)}.")


def _check_piecewise(args: Mapping[str, Any]) -> None:
  """Boundaries and values are lists of numbers, at least one boundary (Keras
  indexes boundaries[0]: an empty list is an IndexError at the first step)."""
  for key in ("boundaries", "values"):
    value = args[key]
    if (not isinstance(value, (list, tuple))
        or any(isinstance(v, bool) or not isinstance(v, numbers.Real) for v in value)):
      raise errors.ConfigTypeError(
          f"PiecewiseConstantDecay {key} must be a list of numbers, got "
          f"{value!r}. Fix: write e.g. boundaries: [1000, 2000], values: "
          "[0.1, 0.05, 0.01].", path=key)
  if not args["boundaries"]:
    raise errors.ConfigError(
        "PiecewiseConstantDecay needs at least one boundary, got boundaries=[]. "
        "Fix: for a constant rate write the number (learning_rate: "
        f"{args['values'][0] if len(args['values']) == 1 else 0.01}), or list the "
        "steps where the rate changes, e.g. boundaries: [1000], values: "
        "[0.1, 0.01].", path="boundaries")
  if any(not math.isfinite(b) or abs(b) > _MAX_STEPS for b in args["boundaries"]):
    raise errors.ConfigError(
        f"PiecewiseConstantDecay boundaries must be steps in [-{_MAX_STEPS:.0e}, "
        f"{_MAX_STEPS:.0e}]. Fix: write whole step numbers such as 1000.",
        path="boundaries")


# Step counts of the Keras schedules: (argument, smallest value allowed).
_STEP_COUNTS = (("decay_steps", 1), ("first_decay_steps", 1), ("warmup_steps", 0))
_MAX_STEPS = 10 ** 12


def _check_step_counts(class_name: str, args: Mapping[str, Any]) -> None:
  """Step counts are whole numbers in range, before Keras sees them (a
  negative warm-up makes CosineDecay divide by a negative count)."""
  for name, low in _STEP_COUNTS:
    if name not in args:
      continue
    value = args[name]
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
        or not abs(value) < math.inf or value != int(value)):
      raise errors.ConfigTypeError(
          f"{class_name} {name} must be a whole number of steps, got "
          f"{value!r}. Fix: write e.g. {name}: 1000.", path=name)
    if not low <= value <= _MAX_STEPS:
      raise errors.ConfigError(
          f"{class_name} {name} must be in [{low}, {_MAX_STEPS:.0e}] steps, got "
          f"{name}={value!r}. Fix: use "
          + ("0 for no warm-up, or a positive count such as 100."
             if low == 0 else "a positive count such as 1000."), path=name)


def _check_range(schedule: "Schedule") -> None:
  """ConfigError unless the rate is finite and >= 0 at every step.

  Evaluated at every milestone (warm-up end, decay ends and their multiples,
  boundaries), one step either side of each, and 10^k up to 10^9: the six
  Keras families are monotone or piecewise monotone between these points, so
  their extremes lie there. PiecewiseConstantDecay's boundaries must increase
  (Keras takes the first matching interval, so unsorted ones silently skip
  values).
  """
  config = dict(schedule.config)
  boundaries = list(config.get("boundaries", ()))
  for i in range(1, len(boundaries)):
    if not boundaries[i] > boundaries[i - 1]:
      raise errors.ConfigError(
          f"{schedule.class_name} boundaries must increase, got "
          f"boundaries={boundaries} (boundaries[{i}]={boundaries[i]} is not after "
          f"{boundaries[i - 1]}). Fix: sort them, and their values with them.",
          path="boundaries")
  for t, value in schedule.samples():
    if not math.isfinite(value) or value < 0:
      raise errors.ConfigError(
          f"{schedule.class_name} gives the learning rate {value:g} at step {t}; "
          "a learning rate must be a finite number >= 0 at every step. Fix: "
          "change the values that lead there (targets, values, end rate, "
          "decay_rate, alpha, m_mul).")


def check_steps(schedule: "Schedule") -> List[int]:
  """The steps that bound a schedule's values: every milestone (warm-up end,
  decay ends and their first five multiples, boundaries), one step either
  side of each, and 10^k up to 10^9. The six Keras families are monotone or
  piecewise monotone between these points, so their extremes lie there."""
  config = dict(schedule.config)
  steps = set(milestones(schedule)) | {10 ** k for k in range(10)}
  period = config.get("decay_steps") or config.get("first_decay_steps")
  if period:
    steps |= {int(period) * k for k in range(1, 6)}
  return sorted({max(0, t + d) for t in steps for d in (-1, 0, 1)})


def parse_schedules(config: Optional[Mapping[str, Any]]) -> Dict[str, Schedule]:
  """The ``schedules:`` section: ``{name: schedule config}``."""
  if config is None:
    return {}
  if not isinstance(config, Mapping):
    raise errors.ConfigTypeError(
        f"schedules must be a mapping of names to schedules, got {config!r}.",
        path="schedules")
  out = {}
  for name, value in config.items():
    try:
      out[str(name)] = Schedule.from_config(value, name=str(name))
    except errors.ConfigError as e:
      raise e.at(f"schedules.{name}") from None
  return out


def parse_learning_rate(value, schedules: Mapping[str, Schedule]):
  """A number, a Schedule, a schedule name or config, or a zero-arg callable."""
  if isinstance(value, bool):
    raise errors.ConfigTypeError(
        f"learning_rate must be a number or a schedule, got {value!r}.",
        path="learning_rate")
  if isinstance(value, numbers.Real):
    try:
      return float(value)
    except OverflowError:  # An integer beyond float64 (a 400-digit literal).
      raise errors.ConfigError(
          f"learning_rate {str(value)[:20]}... is beyond any float. Fix: write "
          "a rate such as 0.01.", path="learning_rate") from None
  if isinstance(value, Schedule):
    return value
  if isinstance(value, str):
    if value not in schedules:
      raise errors.unknown_name("schedule", value, schedules,
                                path="learning_rate")
    return schedules[value]
  if isinstance(value, Mapping):
    try:
      return Schedule.from_config(value)
    except errors.ConfigError as e:
      raise e.at("learning_rate") from None
  if is_keras_schedule(value):
    return Schedule.from_keras(value)
  if callable(value):
    return value
  raise errors.ConfigTypeError(
      f"learning_rate must be a number, a schedule or a zero-arg callable, got "
      f"{type(value).__name__} {value!r}. Fix: write e.g. 0.01 or the name of "
      "a schedule.", path="learning_rate")


def learning_rate_to_config(lr):
  """Inverse of parse_learning_rate for what a file can hold."""
  if isinstance(lr, Schedule):
    return lr.name if lr.name else lr.to_config()
  if isinstance(lr, numbers.Real):
    return lr
  raise errors.ConfigTypeError(
      f"learning_rate {lr!r} is a Python callable and cannot be written to a "
      "config. Fix: use a number or a Keras schedule.", path="learning_rate")


def milestones(schedule: Schedule) -> List[int]:
  """Step 0, the warm-up end, the first decay end and every boundary: where a
  schedule changes course (the plan describes the rate there)."""
  config = dict(schedule.config)
  steps = {0}
  warmup = config.get("warmup_steps") or 0
  if warmup:
    steps.add(int(warmup))
  decay = config.get("decay_steps") or config.get("first_decay_steps")
  if decay:
    steps.add(int(warmup) + int(decay))
  for boundary in config.get("boundaries", ()):
    steps.add(int(boundary))
  return sorted(steps)


