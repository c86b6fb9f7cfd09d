"""Learning rates bound to a step: what TensorFlow's optimizers take.

A spec's rate is a number, a ``Schedule`` (spec/schedules.py) or a user's
zero-arg callable; TensorFlow takes a float or a zero-arg callable. The TPU
identifies dynamic learning rates by *tags*, and TensorFlow assigns tags by
callable identity, in table order (tf/tags.py). ``RateBinder`` therefore
hands out one zero-arg callable per distinct (schedule, step, bias
correction) and the same object to every table that uses it: TensorFlow's own
assignment then yields the fewest tags.

``value_at`` and ``describe`` read such a callable back (its ``schedule`` and
``bias_correction`` attributes, set here): the job's TensorBoard series and
``plan`` print them.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, Optional

import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.spec.schedules import Schedule, milestones

__all__ = ["RateBinder", "bias_correction", "value_at", "describe"]


def bias_correction(t, beta_1: float, beta_2: float):
  """``sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1))`` at step t (float32)."""
  t1 = tf.cast(t, tf.float64) + 1.0
  factor = tf.sqrt(1.0 - tf.pow(tf.constant(beta_2, tf.float64), t1)) / (
      1.0 - tf.pow(tf.constant(beta_1, tf.float64), t1))
  return tf.cast(factor, tf.float32)


class RateBinder:
  """Turns optimizer specs' learning rates into what TensorFlow takes.

  ``rate(spec)`` is a float for a constant rate, else a zero-arg callable that
  reads ``step``. Equal (schedule, bias-correction betas) get the same callable
  object, so tables sharing a rate share a tag.
  """

  def __init__(self, step: Optional[tf.Variable]):
    self.step = step
    self._rates: Dict[Any, Callable[[], tf.Tensor]] = {}

  def rate(self, spec):
    """``spec``: an optimizer spec (spec/optimizers.py)."""
    lr = spec.learning_rate
    betas = spec.bias_correction_betas
    if betas is None and not isinstance(lr, Schedule):
      return lr if callable(lr) else float(lr)
    key = (lr if isinstance(lr, (Schedule, numbers.Real)) else id(lr), betas)
    if key not in self._rates:
      if self.step is None:
        raise errors.ConfigError(
            f"learning rate {lr!r}{' with bias correction' if betas else ''} is "
            "dynamic and needs a step variable. Fix: pass step= (the engine's "
            "step or a Keras optimizer's iterations).", path="learning_rate")
      self._rates[key] = _dynamic(lr, betas, self.step)
    return self._rates[key]

  def schedule(self, schedule: Schedule):
    """``schedule`` alone (no bias correction) as a zero-arg callable reading
    ``step``: one callable per distinct schedule."""
    key = (schedule, None)
    if key not in self._rates:
      self._rates[key] = _dynamic(schedule, None, self.step)
    return self._rates[key]


def _dynamic(lr, betas, step):
  def base():
    if isinstance(lr, Schedule):
      return lr(step)
    if callable(lr):
      return tf.cast(lr(), tf.float32)
    return tf.constant(lr, tf.float32)

  def rate():
    value = base()
    return value * bias_correction(step, *betas) if betas else value

  rate.schedule = lr
  rate.bias_correction = betas
  return rate


def describe(rate) -> str:
  """One line for the plan: what the rate is and its value at a few steps."""
  schedule = getattr(rate, "schedule", rate)
  betas = getattr(rate, "bias_correction", None)
  if isinstance(schedule, Schedule):
    steps = milestones(schedule)
    text = repr(schedule)
  elif callable(schedule):
    return f"{getattr(schedule, '__name__', 'callable')} (user callable)"
  else:
    steps, text = [0], f"{schedule:g}"
  if betas:
    text += f" x Adam bias correction (beta_1={betas[0]}, beta_2={betas[1]})"
    steps = sorted(set(steps) | {1, 10})
  values = [f"t={t}: {value_at(rate, t):.4g}" for t in steps]
  return f"{text}; {', '.join(values)}"


def value_at(rate, step: int) -> float:
  """The learning rate a table applies at table step ``step`` (0 = first update).

  ``rate`` is a number or a callable from ``RateBinder`` (a schedule, maybe
  times Adam's bias correction); the step variable it reads is not touched.
  A user's zero-arg callable cannot be asked about another step: its current
  value is returned.
  """
  schedule = getattr(rate, "schedule", rate)
  betas = getattr(rate, "bias_correction", None)
  if isinstance(schedule, Schedule):
    base = float(schedule(step))
  else:
    base = float(schedule()) if callable(schedule) else float(schedule)
  return base * (float(bias_correction(step, *betas)) if betas else 1.0)
