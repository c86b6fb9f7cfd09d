"""TPU embedding optimizer math as pure functions over rows.

Every rule maps ``(w, slots, g, lr, opt) -> (w, slots)``: ``w`` and each slot
are ``[n, dim]`` float32 rows (only the rows being updated), ``g`` the
accumulated per-id gradient of those rows, ``lr`` this step's learning rate (a
float32 scalar) and ``opt`` the optimizer spec holding the hyperparameters.
No variables, no I/O: the engine gathers, calls, and scatters.
optimizer_rows.py pairs each rule with its spec class, slots and native
encoding; ``apply_update`` wraps a rule in the steps every optimizer shares.

docs/semantics.md is the specification these follow, one section per rule.
"""

from __future__ import annotations

from typing import Callable, Tuple

import tensorflow as tf

from tpu_embed_ext.emulation.rules import EngineRules

__all__ = ["sgd", "adagrad", "adagrad_momentum", "adam", "ftrl", "apply_update"]

Rows = tf.Tensor
Slots = Tuple[tf.Tensor, ...]


def _f32(x) -> tf.Tensor:
  return tf.constant(x, tf.float32) if not isinstance(x, tf.Tensor) else x


def sgd(w, slots, g, lr, opt):
  """``w <- w - lr * g`` (section SGD)."""
  del opt
  return w - lr * g, slots


def adagrad(w, slots, g, lr, opt):
  """``acc <- acc + g^2;  w <- w - lr * g / sqrt(acc)`` (section Adagrad).

  The new accumulator is used and there is no epsilon, so a zero gradient on
  a touched row changes nothing.
  """
  del opt
  (acc,) = slots
  acc = acc + g * g
  return w - lr * g * tf.math.rsqrt(acc), (acc,)


def adagrad_momentum(w, slots, g, lr, opt):
  """Adagrad preconditioning with momentum (section AdagradMomentum).

  ``acc <- acc + g^2`` if ``beta2 == 1`` else ``beta2 acc + (1 - beta2) g^2``;
  ``s = (acc + epsilon)^(-1/exponent) g``; ``m <- momentum m + s``;
  ``w <- w - lr (momentum m + s if nesterov else m)``.
  """
  acc, mom = slots
  if opt.beta2 == 1.0:
    acc = acc + g * g
  else:
    acc = opt.beta2 * acc + (1.0 - opt.beta2) * g * g
  scaled = tf.pow(acc + opt.epsilon, _f32(-1.0 / opt.exponent)) * g
  mom = opt.momentum * mom + scaled
  update = opt.momentum * mom + scaled if opt.use_nesterov else mom
  return w - lr * update, (acc, mom)


def adam(w, slots, g, lr, opt):
  """Adam without bias correction (section Adam).

  ``m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2``;
  ``w <- w - lr m / sqrt(v + eps^2)`` (sum_inside_sqrt) or
  ``w <- w - lr m / (sqrt(v) + eps)``.
  """
  m, v = slots
  m = opt.beta_1 * m + (1.0 - opt.beta_1) * g
  v = opt.beta_2 * v + (1.0 - opt.beta_2) * g * g
  if opt.sum_inside_sqrt:
    denominator = tf.sqrt(v + opt.epsilon * opt.epsilon)
  else:
    denominator = tf.sqrt(v) + opt.epsilon
  return w - lr * m / denominator, (m, v)


def ftrl(w, slots, g, lr, opt):
  """FTRL as the TPU runs it (section FTRL), ``k = -learning_rate_power``.

  ``acc' = acc + g^2;  dp = acc'^k - acc^k``; with ``multiply_linear_by_lr``
  the linear slot holds ``linear * lr``:
  ``lin <- lin + lr g - dp w;  N = clamp(lin, -lr l1, lr l1) - lin;
  D = acc'^k + 2 lr l2 + beta``; otherwise
  ``lin <- lin + g - (dp / lr) w;  N = clamp(lin, -l1, l1) - lin;
  D = (acc'^k + beta) / lr + 2 l2``. Then ``w = N / D`` (the OLD w enters the
  linear update). ``N = -lin`` when ``l1 == 0``.
  """
  acc, lin = slots
  k = _f32(-opt.learning_rate_power)
  acc_new = acc + g * g
  pow_new = tf.pow(acc_new, k)
  dp = pow_new - tf.pow(acc, k)
  l1, l2, beta = (opt.l1_regularization_strength,
                  opt.l2_regularization_strength, opt.beta)
  if opt.multiply_linear_by_learning_rate:
    lin = lin + lr * g - dp * w
    bound = lr * l1
    denominator = pow_new + 2.0 * lr * l2 + beta
  else:
    lin = lin + g - (dp / lr) * w
    bound = _f32(l1)
    denominator = (pow_new + beta) / lr + 2.0 * l2
  numerator = (-lin if l1 == 0 else
               tf.clip_by_value(lin, -bound, bound) - lin)
  return numerator / denominator, (acc_new, lin)


def _clip(x, lower, upper):
  if lower is not None:
    x = tf.maximum(x, lower)
  if upper is not None:
    x = tf.minimum(x, upper)
  return x


def apply_update(rule: Callable, opt, w, slots, g, lr, *, rules: EngineRules):
  """One table step on the touched rows: the whole per-row pipeline around
  ``rule`` (one of the rules above, the row of ``opt``'s optimizer).

  ``rules.clips_and_decays`` (v1, TPUEmbedding; docs/semantics.md, the step): gradient
  clipping -> decoupled weight decay ``w <- w - wd_eff w`` (``wd_eff = wd * lr`` when
  ``multiply_weight_decay_factor_by_learning_rate``) -> the optimizer rule ->
  weight clipping. The placement of weight decay before the rule is the
  DecoupledWeightDecayExtension convention ([I]), and clipping the
  accumulated gradient is [I].

  Otherwise (v2, TPUEmbeddingV2 / SparseCore): the rule only. SparseCore
  passes no weight-clipping bounds and has no gradient clipping; weight decay
  is rejected before this point.
  """
  lr = tf.cast(lr, tf.float32)
  if rules.clips_and_decays:
    g = _clip(g, *opt.gradient_clip_limits)
    if opt.weight_decay_factor:
      decay = opt.weight_decay_factor * (
          lr if opt.multiply_weight_decay_factor_by_learning_rate else 1.0)
      w = w - decay * w
  w, slots = rule(w, tuple(slots), g, lr, opt)
  if rules.clips_and_decays:
    w = _clip(w, opt.clip_weight_min, opt.clip_weight_max)
  return w, tuple(slots)
