"""Keras's six schedule families without Keras: their arguments, and the
values of the five decay schedules, computed in numpy as Keras computes them.

The spec checks a schedule's rate over its whole range when it is parsed
(schedules.py, numeric_traps.py), and the spec loads without TensorFlow or
Keras: so the checks read these values. Each function follows its Keras 3
class (keras/src/optimizers/schedules/learning_rate_schedule.py) op by op in
float32: arithmetic in np.float32 (IEEE, as TensorFlow's kernels), each cos,
log and pow evaluated in float64 and rounded once to float32, and results
below float32's normal range flushed to zero, as TensorFlow's CPU kernels do
(a rate that decays into that range is 0 for them, and for FTRL's check).
TensorFlow's cos, log and pow are not correctly rounded, so a value may differ
from Keras's by one float32 ulp (about 1.5% of cos values); the checks read
these values only against 0, 1e6 and the weight-decay bounds, where one ulp
decides nothing that is not already an exact tie. tests/test_learning_rates.py
compares them with Keras at every step the range check reads. Training reads
Keras's own schedule (tf/rates.py).

``supports`` says which configs these functions compute: a float
``initial_learning_rate`` (Keras then computes in float32; an integer one
makes Keras compute in int32) and real numbers for every numeric argument.
Any other config is left to Keras, whose verdict (a value or an error) is
then the spec's: ``Schedule.value`` builds the Keras object for it.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Mapping

import numpy as np

__all__ = ["ARGUMENTS", "REQUIRED", "supports", "value"]

F = np.float32
_PI = F(math.pi)
REQUIRED = inspect.Parameter.empty

# Keras 3's constructor arguments of each family, in signature order, with
# their defaults (``name`` left out). tests/test_learning_rates.py compares
# them with the classes' signatures.
ARGUMENTS = {
    "ExponentialDecay": {"initial_learning_rate": REQUIRED, "decay_steps": REQUIRED,
                         "decay_rate": REQUIRED, "staircase": False},
    "PiecewiseConstantDecay": {"boundaries": REQUIRED, "values": REQUIRED},
    "PolynomialDecay": {"initial_learning_rate": REQUIRED, "decay_steps": REQUIRED,
                        "end_learning_rate": 0.0001, "power": 1.0, "cycle": False},
    "InverseTimeDecay": {"initial_learning_rate": REQUIRED, "decay_steps": REQUIRED,
                         "decay_rate": REQUIRED, "staircase": False},
    "CosineDecay": {"initial_learning_rate": REQUIRED, "decay_steps": REQUIRED,
                    "alpha": 0.0, "warmup_target": None, "warmup_steps": 0},
    "CosineDecayRestarts": {"initial_learning_rate": REQUIRED,
                            "first_decay_steps": REQUIRED, "t_mul": 2.0,
                            "m_mul": 1.0, "alpha": 0.0},
}


def supports(class_name: str, config: Mapping[str, Any]) -> bool:
  """True when ``value`` computes this schedule as Keras does."""
  if class_name not in _FUNCTIONS:
    return False
  if type(config.get("initial_learning_rate")) is not float:  # pylint: disable=unidiomatic-typecheck
    return False
  for key, item in config.items():
    if key in ("staircase", "cycle"):
      continue
    if key == "warmup_target" and item is None:
      continue
    if isinstance(item, bool) or not isinstance(item, numbers.Real):
      return False
  return True


def value(class_name: str, config: Mapping[str, Any], step: int) -> float:
  """The float32 rate at ``step`` (only where ``supports``), as a float."""
  with np.errstate(all="ignore"):
    return float(_ftz(_FUNCTIONS[class_name](dict(config), F(step))))


_TINY = np.finfo(np.float32).tiny


def _ftz(x):
  """TensorFlow's CPU kernels flush float32 subnormals to (signed) zero."""
  x = F(x)
  return F(0.0) * np.sign(x) if abs(x) < _TINY else x


def _cos(x):
  return _ftz(np.cos(np.float64(x)))


def _log(x):
  return _ftz(np.log(np.float64(x)))


def _pow(a, b):
  return _ftz(np.power(np.float64(a), np.float64(b)))


def _exponential(c, t):
  p = t / F(c["decay_steps"])
  if c.get("staircase", False):
    p = np.floor(p)
  return F(c["initial_learning_rate"]) * _pow(F(c["decay_rate"]), p)


def _inverse_time(c, t):
  p = t / F(c["decay_steps"])
  if c.get("staircase", False):
    p = np.floor(p)
  return F(c["initial_learning_rate"]) / (F(1) + F(c["decay_rate"]) * p)


def _polynomial(c, t):
  initial = F(c["initial_learning_rate"])
  end = F(c.get("end_learning_rate", 0.0001))
  decay_steps = F(c["decay_steps"])
  if c.get("cycle", False):
    multiplier = F(1.0) if t == 0 else np.ceil(t / F(c["decay_steps"]))
    decay_steps = decay_steps * multiplier
  else:
    t = np.minimum(t, decay_steps)
  p = t / decay_steps
  return (initial - end) * _pow(F(1) - p, F(c.get("power", 1.0))) + end


def _cosine_part(t, decay_steps, start, alpha):
  cosine = F(0.5) * (F(1.0) + _cos(_PI * (t / decay_steps)))
  return start * (F(1 - alpha) * cosine + F(alpha))


def _cosine(c, t):
  initial = F(c["initial_learning_rate"])
  decay_steps = F(c["decay_steps"])
  alpha = c.get("alpha", 0.0)
  if c.get("warmup_target") is None:
    return _cosine_part(np.minimum(t, decay_steps), decay_steps, initial, alpha)
  target = F(c["warmup_target"])
  warmup = F(c.get("warmup_steps", 0))
  t = np.minimum(t, decay_steps + warmup)
  if t < warmup:
    return (target - initial) * (t / warmup) + initial
  return _cosine_part(t - warmup, decay_steps, target, alpha)


def _cosine_restarts(c, t):
  alpha = F(c.get("alpha", 0.0))
  t_mul = F(c.get("t_mul", 2.0))
  m_mul = F(c.get("m_mul", 1.0))
  fraction = t / F(c["first_decay_steps"])
  if t_mul == F(1.0):
    restart = np.floor(fraction)
    fraction = fraction - restart
  else:
    restart = np.floor(_log(F(1.0) - fraction * (F(1.0) - t_mul)) / _log(t_mul))
    done = (F(1.0) - _pow(t_mul, restart)) / (F(1.0) - t_mul)
    fraction = (fraction - done) / _pow(t_mul, restart)
  cosine = F(0.5) * _pow(m_mul, restart) * (F(1.0) + _cos(_PI * fraction))
  return F(c["initial_learning_rate"]) * ((F(1) - alpha) * cosine + alpha)


_FUNCTIONS = {
    "ExponentialDecay": _exponential,
    "InverseTimeDecay": _inverse_time,
    "PolynomialDecay": _polynomial,
    "CosineDecay": _cosine,
    "CosineDecayRestarts": _cosine_restarts,
}
