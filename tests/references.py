"""Numpy references of the TPU embedding optimizers: the one copy the tests use.

Written from docs/semantics.md (each optimizer's formulas), never from the
package's rules: a test compares the package against these, so they must not
share its code. One row per optimizer in ``REFERENCES``
(its rule, slots and TensorFlow's defaults); adding an optimizer is adding
one row here (tests/test_optimizer_rows.py checks both tables list the same
optimizers).

A rule maps ``(w, slots, g, lr, o)`` to ``(w, slots)``: ``w`` the rows (any
shape), ``slots`` a dict by slot name, ``g`` the summed gradient of those
rows, ``lr`` this step's rate and ``o`` every hyperparameter (``hparams``
fills TensorFlow's defaults). Names follow the formulas' symbols.
"""

import dataclasses
from typing import Callable, Dict, Mapping

import numpy as np

__all__ = ["REFERENCES", "Reference", "hparams", "hparams_of", "initial_slots",
           "update",
           "apply", "per_id_sums", "train_step"]


def sgd(w, s, g, lr, o):
  """``w <- w - lr g`` (section 1)."""
  del o
  return w - lr * g, dict(s)


def adagrad(w, s, g, lr, o):
  """``acc <- acc + g^2; w <- w - lr g / sqrt(acc)`` (section 2)."""
  del o
  acc = s["accumulators"] + g ** 2
  return w - lr * g / np.sqrt(acc), {"accumulators": acc}


def adagrad_momentum(w, s, g, lr, o):
  """Section 3: epsilon is an offset, ``exponent`` a root."""
  acc, mom = s["accumulators"], s["momenta"]
  acc = acc + g ** 2 if o["beta2"] == 1 else o["beta2"] * acc + (1 - o["beta2"]) * g ** 2
  sg = (acc + o["epsilon"]) ** (-1.0 / o["exponent"]) * g
  mom = o["momentum"] * mom + sg
  upd = o["momentum"] * mom + sg if o["use_nesterov"] else mom
  return w - lr * upd, {"accumulators": acc, "momenta": mom}


def adam(w, s, g, lr, o):
  """Section 4: no bias correction."""
  m = o["beta_1"] * s["momenta"] + (1 - o["beta_1"]) * g
  v = o["beta_2"] * s["velocities"] + (1 - o["beta_2"]) * g ** 2
  den = (np.sqrt(v + o["epsilon"] ** 2) if o["sum_inside_sqrt"]
         else np.sqrt(v) + o["epsilon"])
  return w - lr * m / den, {"momenta": m, "velocities": v}


def ftrl(w, s, g, lr, o):
  """Section 5, ``k = -learning_rate_power``; the OLD w enters ``lin``."""
  acc, lin = s["accumulators"], s["linears"]
  k = -o["learning_rate_power"]
  l1, l2, beta = (o["l1_regularization_strength"],
                  o["l2_regularization_strength"], o["beta"])
  acc_new = acc + g ** 2
  dp = acc_new ** k - acc ** k
  if o["multiply_linear_by_learning_rate"]:
    lin = lin + lr * g - dp * w
    n = -lin if l1 == 0 else np.clip(lin, -lr * l1, lr * l1) - lin
    d = acc_new ** k + 2 * lr * l2 + beta
  else:
    lin = lin + g - dp / lr * w
    n = -lin if l1 == 0 else np.clip(lin, -l1, l1) - lin
    d = (acc_new ** k + beta) / lr + 2 * l2
  return n / d, {"accumulators": acc_new, "linears": lin}


@dataclasses.dataclass(frozen=True)
class Reference:
  rule: Callable
  slots: Mapping[str, Callable[[dict], float]]  # name -> initial value from o
  defaults: Mapping[str, object]                # TensorFlow's hyperparameters


_ZERO = lambda o: 0.0
_INITIAL_ACCUMULATOR = lambda o: o["initial_accumulator_value"]

# Keyed by the optimizer's type name in configs ("type: adagrad").
REFERENCES: Dict[str, Reference] = {
    "sgd": Reference(sgd, {}, {}),
    "adagrad": Reference(adagrad, {"accumulators": _INITIAL_ACCUMULATOR},
                         {"initial_accumulator_value": 0.1}),
    "adagrad_momentum": Reference(
        adagrad_momentum, {"accumulators": _ZERO, "momenta": _ZERO},
        {"momentum": 0.0, "use_nesterov": False, "exponent": 2.0, "beta2": 1.0,
         "epsilon": 1e-10}),
    "adam": Reference(adam, {"momenta": _ZERO, "velocities": _ZERO},
                      {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7,
                       "sum_inside_sqrt": True, "lazy_adam": True}),
    "ftrl": Reference(
        ftrl, {"accumulators": _INITIAL_ACCUMULATOR, "linears": _ZERO},
        {"learning_rate_power": -0.5, "l1_regularization_strength": 0.0,
         "l2_regularization_strength": 0.0, "beta": 0.0,
         "initial_accumulator_value": 0.1,
         "multiply_linear_by_learning_rate": False}),
}


def hparams(name: str, **given) -> dict:
  """Every hyperparameter of ``name``: TensorFlow's defaults, then ``given``."""
  return {**REFERENCES[name].defaults, **given}


def hparams_of(name: str, spec) -> dict:
  """The hyperparameters of ``name`` that ``spec`` (an optimizer object of
  ours or TensorFlow's) holds, by attribute name: its values, not its code."""
  return hparams(name, **{k: getattr(spec, k) for k in REFERENCES[name].defaults
                          if hasattr(spec, k)})


def initial_slots(name: str, shape, **given) -> Dict[str, np.ndarray]:
  """Every slot of ``name`` at its initial value (float64)."""
  o = hparams(name, **given)
  return {slot: np.full(shape, initial(o), np.float64)
          for slot, initial in REFERENCES[name].slots.items()}


def update(name: str, w, slots, g, lr, **given):
  """``name``'s rule on rows ``w`` with summed gradient ``g``."""
  return REFERENCES[name].rule(w, slots, g, lr, hparams(name, **given))


def apply(name: str, w, slots, g, lr, o, *, clipvalue=None, clip_weight_min=None,
          clip_weight_max=None, weight_decay_factor=None,
          multiply_weight_decay_factor_by_learning_rate=False):
  """The whole per-row step (section 0): gradient clipping, decoupled weight
  decay, the rule, weight clipping. ``o``: the rule's hyperparameters
  (``hparams``); the keywords are the options every optimizer shares."""
  lo, hi = (None, None) if clipvalue is None else clipvalue
  g = np.clip(g, -np.inf if lo is None else lo, np.inf if hi is None else hi)
  if weight_decay_factor:
    w = w - weight_decay_factor * (
        lr if multiply_weight_decay_factor_by_learning_rate else 1) * w
  w, slots = REFERENCES[name].rule(w, slots, g, lr, o)
  w = np.clip(w, -np.inf if clip_weight_min is None else clip_weight_min,
              np.inf if clip_weight_max is None else clip_weight_max)
  return w, slots


def per_id_sums(ids, grads) -> Dict[int, np.ndarray]:
  """Each id's summed gradient, ids in first-occurrence order (float64)."""
  sums: Dict[int, np.ndarray] = {}
  for i, g in zip(ids, grads):
    i = int(i)
    sums[i] = sums.get(i, 0) + np.asarray(g, np.float64)
  return sums


def train_step(name: str, table, slots, ids, grads, lr, **given):
  """One step in place: per-id sums of ``grads`` (one row per id in ``ids``),
  then one update of each touched row of ``table`` and its ``slots``."""
  o = hparams(name, **given)
  for i, g in per_id_sums(ids, grads).items():
    w, new = REFERENCES[name].rule(table[i], {k: v[i] for k, v in slots.items()},
                                   g, lr, o)
    table[i] = w
    for k, v in new.items():
      slots[k][i] = v
