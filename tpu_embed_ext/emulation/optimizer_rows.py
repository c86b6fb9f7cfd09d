"""One row per optimizer: what the engine knows of each, in one table.

A row holds
- ``spec``: the spec class (tpu_embed_ext.spec.optimizers). Its
  ``slot_names`` and ``slot_initial_values()`` are the row's slots: the spec
  owns them, as checkpoints, plans and the Keras layer name slots without
  the engine;
- ``rule``: the pure update of update_rules.py, which the TF-op back end
  runs (updates.py);
- ``native_kind``, ``native_params`` and ``native_flags``: the ``Kind`` of
  update_op.cc's ``switch``, and the parameters ``kA``.. and flags its
  ``case`` reads; the native back end (native/update.py) sends them;
- ``every_row``: whether engine v1 updates every row of the table each step
  (non-lazy Adam), untouched rows with a zero gradient.

Adding an optimizer is a spec class holding its facts (its TensorFlow class
by name, its numeric traps, its ``plan`` settings: spec/optimizers.py), its
rule, one row here, one row in tests/references.py, and the C++ ``case``;
tests/test_optimizer_rows.py fails while one is missing. The constants below
mirror update_op.cc's ``Mode``, ``Flag`` and ``Param`` enums; keep them in
sync.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Sequence, Tuple

from tpu_embed_ext.spec import optimizers
from tpu_embed_ext.emulation import update_rules
from tpu_embed_ext.emulation.rules import EngineRules

__all__ = ["OptimizerRow", "ROWS", "row", "mode", "native_encoding",
           "SUMS", "ROUNDS", "EVERY_ROW", "NUM_PARAMS"]

# Mode: how a table's occurrences become updates.
SUMS, ROUNDS, EVERY_ROW = 0, 1, 2
# Flag: the options every optimizer shares, then the rows' own.
CLIP_LOW, CLIP_HIGH, DECAY, DECAY_TIMES_LR = 1, 2, 4, 8
WEIGHT_MIN, WEIGHT_MAX, BETA2_IS_ONE, NESTEROV = 16, 32, 64, 128
SUM_INSIDE_SQRT, LINEAR_TIMES_LR, L1 = 256, 512, 1024
# Grappler's rewrites of the TF-op path's graph (see native/update.py).
GRAPH_POW, RSQRT_MUL, RECIPROCAL_LR = 2048, 4096, 8192
# Param: the shared values (gradient clip low/high, decay, weight min/max),
# then the row's own from kA (at most NUM_PARAMS - FIRST_ROW_PARAM).
FIRST_ROW_PARAM, NUM_PARAMS = 5, 11


def _no_params(spec) -> Tuple[float, ...]:
  del spec
  return ()


def _no_flags(spec) -> int:
  del spec
  return 0


def _never(spec) -> bool:
  del spec
  return False


@dataclasses.dataclass(frozen=True)
class OptimizerRow:
  """One optimizer's rule, slots and native encoding (see the module doc)."""
  spec: type
  rule: Callable
  native_kind: int
  native_params: Callable[[Any], Sequence[float]] = _no_params
  """``kA``, ``kB``, ...: each the Python expression the rule computes, so
  that float32 rounds it as TensorFlow's ops see it."""
  native_flags: Callable[[Any], int] = _no_flags
  every_row: Callable[[Any], bool] = _never

  @property
  def slot_names(self) -> Tuple[str, ...]:
    return self.spec.slot_names

  @staticmethod
  def slot_initial_values(spec) -> Tuple[float, ...]:
    return spec.slot_initial_values()


ROWS: Dict[type, OptimizerRow] = {r.spec: r for r in (
    OptimizerRow(optimizers.SGD, update_rules.sgd, native_kind=0),
    OptimizerRow(optimizers.Adagrad, update_rules.adagrad, native_kind=1),
    OptimizerRow(
        optimizers.AdagradMomentum, update_rules.adagrad_momentum, native_kind=2,
        native_params=lambda o: (o.beta2, 1.0 - o.beta2, o.epsilon,
                                 -1.0 / o.exponent, o.momentum),
        native_flags=lambda o: ((BETA2_IS_ONE if o.beta2 == 1.0 else 0)
                                | (NESTEROV if o.use_nesterov else 0))),
    OptimizerRow(
        optimizers.Adam, update_rules.adam, native_kind=3,
        native_params=lambda o: (o.beta_1, 1.0 - o.beta_1, o.beta_2,
                                 1.0 - o.beta_2, o.epsilon * o.epsilon, o.epsilon),
        native_flags=lambda o: SUM_INSIDE_SQRT if o.sum_inside_sqrt else 0,
        every_row=lambda o: not o.lazy_adam),
    OptimizerRow(
        optimizers.FTRL, update_rules.ftrl, native_kind=4,
        native_params=lambda o: (-o.learning_rate_power,
                                 o.l1_regularization_strength,
                                 o.l2_regularization_strength, o.beta,
                                 2.0 * o.l2_regularization_strength),
        native_flags=lambda o: (
            (LINEAR_TIMES_LR if o.multiply_linear_by_learning_rate else 0)
            | (L1 if o.l1_regularization_strength != 0 else 0))),
)}


def row(spec) -> OptimizerRow:
  """The row of ``spec``'s optimizer."""
  return ROWS[type(spec)]


def mode(spec, rules: EngineRules) -> int:
  """How ``spec``'s table turns this step's occurrences into updates: every
  row (non-lazy Adam), rounds of contributions
  (``use_gradient_accumulation=False``), or one update per id of its summed
  gradient. Engine v2 (SparseCore) always sums."""
  if rules.updates_every_row and row(spec).every_row(spec):
    return EVERY_ROW
  if rules.accumulation_optional and not spec.use_gradient_accumulation:
    return ROUNDS
  return SUMS


def native_encoding(spec, rules: EngineRules, grappler=(False, False),
                    constant_lr=False) -> Tuple[int, int, int, List[float]]:
  """``(kind, mode, flags, params)`` of one table for update_op.cc; every
  float is what TensorFlow's ops see: the Python expression of
  update_rules.py, then float32. ``grappler``: whether Grappler's arithmetic
  optimizer and constant folding rewrite the TF-op path's graph;
  ``constant_lr``: this step's rate is a constant of the graph (constant
  folding applies to it)."""
  r = row(spec)
  flags = 0
  params = [0.0] * NUM_PARAMS
  if rules.clips_and_decays:  # SparseCore has no clipping, refuses weight decay
    low, high = spec.gradient_clip_limits
    if low is not None:
      flags |= CLIP_LOW
      params[0] = float(low)
    if high is not None:
      flags |= CLIP_HIGH
      params[1] = float(high)
    if spec.weight_decay_factor:
      flags |= DECAY
      params[2] = float(spec.weight_decay_factor)
      if spec.multiply_weight_decay_factor_by_learning_rate:
        flags |= DECAY_TIMES_LR
    if spec.clip_weight_min is not None:
      flags |= WEIGHT_MIN
      params[3] = float(spec.clip_weight_min)
    if spec.clip_weight_max is not None:
      flags |= WEIGHT_MAX
      params[4] = float(spec.clip_weight_max)
  arithmetic, folding = grappler
  flags |= (GRAPH_POW | RSQRT_MUL) if arithmetic else 0
  flags |= RECIPROCAL_LR if folding and constant_lr else 0
  flags |= r.native_flags(spec)
  extra = [float(x) for x in r.native_params(spec)]
  params[FIRST_ROW_PARAM:FIRST_ROW_PARAM + len(extra)] = extra
  return r.native_kind, mode(spec, rules), flags, params
