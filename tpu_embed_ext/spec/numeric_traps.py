"""Values the TPU accepts that would write NaN or Inf: caught when a spec is made.

The TPU's update rules (docs/semantics.md) divide by the learning rate
(FTRL), by a slot that starts at a hyperparameter (Adagrad, FTRL), raise a
slot plus a hyperparameter to a negative power (AdagradMomentum), and run in
float32. Values that pass the range checks of the optimizer classes can then
write NaN or Inf into a table on its first steps: silently on a TPU; on CPU
the emulator rejects the step, but only once training has started. Every
check here is one row of the audit in docs/numeric-traps.md (formula, trap,
check, test).

``check_optimizer`` runs from every optimizer spec's ``__post_init__``, so
``EmbeddingSpec.from_dict`` / ``from_file`` and optimizer specs built in
Python are checked. A learning-rate schedule is checked over its whole range,
at the steps ``schedules.check_steps`` lists; a user's zero-arg callable
cannot be asked about other steps and is not range-checked. A TensorFlow
optimizer object handed to ``CPUEmbedding`` is taken as ``TPUEmbedding``
takes it, without these checks (``skip_checks``); the engine then rejects the
step that would write NaN or Inf, as for any other cause.

Errors are ``NumericTrapError`` (a ``ConfigError``); where the TPU's result is
defined but surprising, a ``NumericTrapWarning``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import warnings
from typing import List, Optional, Sequence, Tuple

import numpy as np

from tpu_embed_ext import errors
from tpu_embed_ext.spec import schedules

__all__ = ["NumericTrapError", "NumericTrapWarning", "check_optimizer", "skip_checks",
           "checks_for", "rate_samples", "CHECKS", "COMMON", "MAX_LEARNING_RATE",
           "adam", "adagrad_momentum", "accumulator_start", "ftrl"]

F32_MAX = float(np.finfo(np.float32).max)
F32_NORMAL_MIN = float(np.finfo(np.float32).tiny)  # 1.18e-38
MAX_LEARNING_RATE = 1e6
"""Above it one step moves a weight by more than a million times its
gradient (Adagrad: by up to the rate itself); the forward pass then squares
such weights and float32 overflows. No embedding optimizer needs it: it is
treated as a typo."""

# id -> what it checks: plan lists these. The first three apply to every
# optimizer (COMMON); the others are an optimizer's own, named by its
# class's numeric_traps (spec/optimizers.py).
CHECKS = {
    "float32_range": "every hyperparameter is finite in float32",
    "learning_rate_bound": f"learning rate <= {MAX_LEARNING_RATE:g} at every step",
    "weight_decay": "weight decay factor (x lr) < 2 at every step, warned from 1",
    "beta_rounds_to_one": "betas stay below 1 in float32",
    "accumulator_start": "initial_accumulator_value is a normal float32",
    "epsilon_power": "epsilon^(-1/exponent) is finite in float32",
    "momentum_growth": "momentum <= 1, warned at 1",
    "adam_epsilon": "epsilon^2 (or epsilon) is a normal float32",
    "ftrl_divides_by_lr": ("learning rate > 0 at every step unless "
                           "multiply_linear_by_learning_rate"),
    "ftrl_power": ("initial_accumulator_value^(-learning_rate_power) is a normal "
                   "float32; warned for a power below -1"),
}
COMMON = ("float32_range", "learning_rate_bound", "weight_decay")

_unchecked = contextvars.ContextVar("tpu_embed_ext_numeric_unchecked",
                                    default=False)


class NumericTrapError(errors.ConfigError):
  """A value that would make the TPU write NaN or Inf into a table."""


class NumericTrapWarning(UserWarning):
  """A value whose result on the TPU is defined but surprising."""


@contextlib.contextmanager
def skip_checks():
  """Builds specs without these checks: TF optimizer objects (as
  TPUEmbedding takes them), and tests that show on CPU that a trap's step
  indeed writes a non-finite value."""
  token = _unchecked.set(True)
  try:
    yield
  finally:
    _unchecked.reset(token)


def _f32(x: float) -> float:
  with np.errstate(over="ignore", under="ignore", invalid="ignore"):
    return float(np.float32(x))


def _fail(name, message, fix) -> NumericTrapError:
  return NumericTrapError(f"{message}. Fix: {fix}.", path=name)


# --- the learning rate over its range -------------------------------------------

def _bias_factor(t: int, beta_1: float, beta_2: float) -> float:
  t1 = t + 1.0
  return math.sqrt(1.0 - beta_2 ** t1) / (1.0 - beta_1 ** t1)


@functools.lru_cache(maxsize=256)
def _schedule_samples(schedule) -> Tuple[Tuple[int, float], ...]:
  return schedule.samples()  # Cached by value here, per object there.


def rate_samples(learning_rate, betas=None) -> Optional[List[Tuple[int, float]]]:
  """``[(step, float32 rate)]`` at the steps that bound the rate, or None.

  ``learning_rate``: a number, a ``schedules.Schedule``, a Keras
  schedule, or a callable from ``tf/rates.py``'s ``RateBinder`` (which carries
  its schedule and Adam betas). ``betas``: Adam's ``(beta_1, beta_2)`` when
  the rate carries bias correction. None for a user's zero-arg callable.
  """
  schedule = getattr(learning_rate, "schedule", learning_rate)
  betas = getattr(learning_rate, "bias_correction", None) or betas
  if schedules.is_keras_schedule(schedule):
    try:
      schedule = schedules.Schedule.from_keras(schedule)
    except errors.ConfigError:
      return None  # Its own range check reports it where it is parsed.
  if isinstance(schedule, schedules.Schedule):
    samples = list(_schedule_samples(schedule))
  elif isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
    samples = [(0, float(schedule))]
  else:
    return None
  if betas:
    steps = sorted({t for t, _ in samples} | set(range(11)) | {100, 1000, 10 ** 4})
    if isinstance(schedule, schedules.Schedule):
      known = dict(samples)
      base = {t: known[t] if t in known else schedule.value(t) for t in steps}
    else:
      base = {t: samples[0][1] for t in steps}
    samples = [(t, base[t] * _bias_factor(t, *betas)) for t in steps]
  return [(t, _f32(v)) for t, v in samples]


def _describe_rate(learning_rate, step: int, value: float) -> str:
  schedule = getattr(learning_rate, "schedule", learning_rate)
  if isinstance(schedule, (int, float)):
    return f"learning_rate={schedule!r}"
  name = getattr(schedule, "name", None)
  label = f"{name} ({schedule!r})" if name else repr(schedule)
  return f"the learning rate {label} is {value:g} at step {step}"


# --- the checks -----------------------------------------------------------------

def _float32_range(spec):
  for name in ("learning_rate", "weight_decay_factor", "initial_accumulator_value",
               "momentum", "exponent", "epsilon", "beta2", "beta_1", "beta_2",
               "l1_regularization_strength", "l2_regularization_strength", "beta"):
    value = getattr(spec, name, None)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      if abs(value) > F32_MAX:
        raise _fail(name, f"{name}={value!r} is beyond float32's range "
                    f"(+-{F32_MAX:.4g}): the TPU stores it as Inf and writes "
                    "Inf or NaN into the table on the first step",
                    f"use a value of the usual magnitude for {name}")


def _learning_rate(spec, samples):
  for t, value in samples:
    if not math.isfinite(value) or value > MAX_LEARNING_RATE:
      raise _fail(
          "learning_rate",
          f"{_describe_rate(spec.learning_rate, t, value)}, above "
          f"{MAX_LEARNING_RATE:g}: one step moves a weight by lr * g, and "
          "float32 overflows (Inf, then NaN) within a few steps",
          "use a rate such as 0.01 (embedding tables train with rates up to "
          "about 1)")


def _weight_decay(spec, samples):
  wd = spec.weight_decay_factor
  if not wd:
    return
  by_lr = spec.multiply_weight_decay_factor_by_learning_rate
  worst = max(samples, key=lambda s: s[1]) if by_lr and samples else (0, 1.0)
  effective = wd * worst[1] if by_lr else wd
  what = (f"weight_decay_factor * learning rate = {wd:g} * {worst[1]:g} = "
          f"{effective:g} at step {worst[0]}" if by_lr
          else f"weight_decay_factor={wd!r}")
  if effective >= 2.0:
    raise _fail("weight_decay_factor",
                f"{what}: decay is w <- (1 - wd) w, so |w| grows by "
                f"{abs(1 - effective):g} on every touched step and float32 "
                "overflows to Inf", "use a decay factor well below 1, such as 1e-4")
  if effective >= 1.0:
    warnings.warn(
        f"{what}: decay is w <- (1 - wd) w, which zeroes or flips the sign of "
        "every touched row before the update. Fix: use a decay factor well "
        "below 1, such as 1e-4.", NumericTrapWarning, stacklevel=4)


def _beta_below_one(spec, name, fix):
  value = getattr(spec, name)
  if value < 1.0 and _f32(value) >= 1.0:
    raise _fail(name, f"{name}={value!r} is 1.0 in float32, the TPU's precision: "
                f"{fix}", "use at most 0.9999999 (or exactly 1 where allowed)")


def adam(spec):
  """Adam's traps: betas that round to 1, an epsilon that flushes to 0."""
  _beta_below_one(spec, "beta_1", "the first moment m <- 1 * m + 0 * g never "
                  "leaves 0 and the table never trains")
  _beta_below_one(spec, "beta_2", "the second moment v <- 1 * v + 0 * g^2 stays 0, "
                  "so each step divides m by epsilon alone")
  eps = spec.epsilon
  floor = _f32(eps * eps) if spec.sum_inside_sqrt else _f32(eps)
  if floor < F32_NORMAL_MIN:
    formula = "sqrt(v + epsilon^2)" if spec.sum_inside_sqrt else "sqrt(v) + epsilon"
    raise _fail("epsilon",
                f"epsilon={eps!r}: the denominator {formula} is {floor:g} in "
                "float32 (the TPU flushes values below 1.2e-38 to 0) for a row "
                "whose v is 0, so a zero gradient on a fresh row writes "
                "m / 0 = 0 / 0 = NaN on the first step",
                "use epsilon >= 1e-19 with sum_inside_sqrt (>= 1.2e-38 "
                "without); the default is 1e-7")


def adagrad_momentum(spec):
  """AdagradMomentum's traps: beta2, epsilon^(-1/exponent), momentum."""
  if spec.beta2 != 1.0:
    _beta_below_one(spec, "beta2", "the TPU then sums squares (its beta2 == 1 "
                    "branch, Adagrad) while the spec asks for a moving average")
  eps, exponent = spec.epsilon, spec.exponent
  with np.errstate(over="ignore", under="ignore", divide="ignore"):
    scale = float(np.power(np.float32(eps), np.float32(-1.0 / exponent)))
  if _f32(eps) < F32_NORMAL_MIN or not scale < F32_MAX:
    raise _fail("epsilon",
                f"epsilon={eps!r} with exponent={exponent!r}: the accumulator "
                "starts at 0, so the first step scales the gradient by "
                f"(0 + epsilon)^(-1/exponent) = {scale:g} in float32, and a "
                "zero gradient on a fresh row writes Inf * 0 = NaN",
                "use a larger epsilon (the default is 1e-10) or exponent 2, "
                "so that epsilon^(-1/exponent) stays below 3.4e38")
  if spec.momentum > 1.0:
    # m_t is about momentum^(t-1) * s, s about 1 (Adagrad-scaled).
    steps = int(math.log(F32_MAX) / math.log(spec.momentum)) + 2
    raise _fail("momentum",
                f"momentum={spec.momentum!r} > 1: m <- momentum * m + s grows "
                f"as momentum^t and overflows float32 (Inf) within about "
                f"{steps} steps of a row", "use a momentum in [0, 1), such as 0.9")
  if spec.momentum == 1.0:
    warnings.warn(
        "momentum=1.0: m <- m + s never decays, every past scaled gradient "
        "keeps moving the row. Fix: use a momentum in [0, 1), such as 0.9.",
        NumericTrapWarning, stacklevel=4)


def accumulator_start(spec, nan_formula: str):
  """Adagrad's and FTRL's trap: an accumulator start that flushes to 0
  (``nan_formula``: the division that then writes NaN)."""
  init = spec.initial_accumulator_value
  if _f32(init) < F32_NORMAL_MIN:
    raise _fail("initial_accumulator_value",
                f"initial_accumulator_value={init!r} is {_f32(init):g} in float32 "
                "(the TPU flushes values below 1.2e-38 to 0): the accumulator "
                f"starts at 0 and a zero gradient on a fresh row writes {nan_formula}",
                "use a small positive value such as 0.1")


def ftrl(spec, samples):
  """FTRL's traps: its power of the accumulator start, division by lr."""
  init, k = spec.initial_accumulator_value, -spec.learning_rate_power
  with np.errstate(over="ignore", under="ignore"):
    start = float(np.power(np.float32(init), np.float32(k)))
  regularized = spec.beta > 0 or spec.l2_regularization_strength > 0
  if not math.isfinite(start) or (start < F32_NORMAL_MIN and not regularized):
    raise _fail("learning_rate_power",
                f"initial_accumulator_value^(-learning_rate_power) = {init!r}^{k!r}"
                f" is {start:g} in float32: the denominator D (acc^k + beta ...) "
                + ("overflows, and dp = Inf - Inf = NaN" if not math.isfinite(start)
                   else "is 0 with beta = l2 = 0, so w = N / D = 0 / 0 = NaN")
                + " on the first step",
                "use learning_rate_power -0.5 (the default) or an accumulator "
                "start nearer 1")
  if k > 1:
    limit = F32_MAX ** (1.0 / k)
    warnings.warn(
        f"learning_rate_power={spec.learning_rate_power!r}: acc^{k:g} overflows "
        f"float32 once the accumulator (a sum of squared gradients) passes "
        f"{limit:.3g}, and the row becomes NaN. Fix: use a power in [-1, 0] "
        "such as -0.5.", NumericTrapWarning, stacklevel=4)
  if spec.multiply_linear_by_learning_rate or samples is None:
    return

  def bad(lr):
    return lr <= 0 or not math.isfinite(_f32((start + spec.beta) / lr))

  for i, (t, lr) in enumerate(samples):
    if bad(lr):
      if i > 0:  # The first bad step: monotone between the checked steps.
        t, lr = _first_bad(spec.learning_rate, samples[i - 1][0], t, lr, bad)
      denominator = _f32((start + spec.beta) / lr) if lr > 0 else math.inf
      raise _fail(
          "learning_rate",
          f"{_describe_rate(spec.learning_rate, t, lr)}, and FTRL without "
          "multiply_linear_by_learning_rate divides by it (lin += g - (dp / lr) w; "
          f"D = (acc^k + beta) / lr = {denominator:g}): the step writes "
          "NaN or Inf into the table",
          "set multiply_linear_by_learning_rate: true (the linear slot then "
          "holds linear * lr and nothing is divided by lr), or use a learning "
          "rate that stays above 0")


def _first_bad(learning_rate, good: int, t: int, lr: float, bad):
  """The first step in (good, t] whose rate is ``bad``, by bisection."""
  schedule = getattr(learning_rate, "schedule", learning_rate)
  if not callable(schedule):
    return t, lr
  while t - good > 1:
    mid = (good + t) // 2
    value = _f32(schedule.value(mid) if isinstance(schedule, schedules.Schedule)
                 else float(schedule(mid)))  # The samples' values, as above.
    if bad(value):
      t, lr = mid, value
    else:
      good = mid
  return t, lr


def check_optimizer(spec) -> None:
  """Raises NumericTrapError (warns NumericTrapWarning) for ``spec``'s traps:
  those of every optimizer, then its own (``spec.check_own_traps``)."""
  if _unchecked.get():
    return
  _float32_range(spec)
  betas = spec.bias_correction_betas
  # The bound is on the rate itself: Adam's bias correction multiplies it by
  # sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1)) but m by (1 - beta_1^(t+1)),
  # so the step stays about lr (and the factor is finite: beta_1 < 1).
  base = rate_samples(spec.learning_rate)
  if base is not None:
    _learning_rate(spec, base)
  samples = rate_samples(spec.learning_rate, betas) if betas else base
  _weight_decay(spec, samples or [])
  spec.check_own_traps(samples)


def checks_for(spec) -> Sequence[str]:
  """The ids of ``CHECKS`` that apply to ``spec`` (for the plan)."""
  return [name for name in CHECKS
          if name in COMMON or name in spec.numeric_traps]
