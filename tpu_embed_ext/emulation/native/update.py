"""The native update: the backward pass and update of a whole step in one op.

``update_op.cc`` (``TpuEmbedExtApplyStep``) does for every table of the step
what ``updates.prepare`` and the engine's checks do with TensorFlow ops: the
per-occurrence gradients (``gain * dL/dact[row]``, as
``lookups.occurrence_gradients``), per-id sums in input order (or the
rounds of ``use_gradient_accumulation=False``, or every row for non-lazy
Adam), ``update_rules.apply_update`` on the touched rows, and the checks of
what is applied and what is written: a step that fails one leaves every
table and slot as it was (rows updated in place are put back from the op's
undo log; rows computed in scratch are never written). Same float32
operations in the same order, so the same numbers bit for bit
(docs/native_kernels.md).

A step that fails a check writes nothing; the op says which table and
variable failed, and the engine's own checks (``updates.finite_verdicts``)
then raise the usual message: ``InputError`` eagerly, the failed assertion
inside ``tf.function``. The step counter advances only after the op
accepted the step.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Sequence

import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.spec import optimizers
from tpu_embed_ext.emulation import checks, updates
from tpu_embed_ext.emulation.native import loader

__all__ = ["Table", "segment", "apply_step"]

# Keep in sync with update_op.cc (Kind, Mode, Flag, Param).
_KINDS = {optimizers.SGD: 0, optimizers.Adagrad: 1,
          optimizers.AdagradMomentum: 2, optimizers.Adam: 3, optimizers.FTRL: 4}
_SUMS, _ROUNDS, _EVERY_ROW = 0, 1, 2
_CLIP_LOW, _CLIP_HIGH, _DECAY, _DECAY_TIMES_LR = 1, 2, 4, 8
_WEIGHT_MIN, _WEIGHT_MAX, _BETA2_IS_ONE, _NESTEROV = 16, 32, 64, 128
_SUM_INSIDE_SQRT, _LINEAR_TIMES_LR, _L1 = 256, 512, 1024
_GRAPH_POW, _RSQRT_MUL, _RECIPROCAL_LR = 2048, 4096, 8192
_NUM_PARAMS = 11


class Table(NamedTuple):
  """What the op needs to know of one table."""
  name: str
  optimizer: Any       # the resolved optimizer spec
  variables: list      # parameters, then slots in ``optimizer.slot_names`` order
  vocabulary_size: int


def _empty(dtype):
  return tf.zeros([0], dtype)


def segment(occ, grad, dim: int):
  """``(ids, rows, gains, grads)`` of one feature, for the op.

  The op computes ``gains[i] * grads[rows[i]]`` for occurrence ``i``, as
  ``lookups.occurrence_gradients`` does with a gather and a multiply (rows
  empty: row ``i``; gains empty: 1); ``grad`` None is a zero gradient for
  every occurrence.
  """
  if occ.kept is not None:  # Only XLA builds these; XLA runs TensorFlow ops.
    raise errors.ConfigError(
        "the native update cannot run under XLA. Fix: use kernels='tf' with "
        "jit_compile=True.")
  ids = tf.cast(occ.ids, tf.int64)
  if grad is None:
    return (ids, _empty(tf.int64), _empty(tf.float32),
            tf.zeros([tf.size(ids), dim], tf.float32))
  grad = tf.reshape(tf.cast(grad, tf.float32), [-1, dim])
  rows = _empty(tf.int64) if occ.rows is None else tf.cast(occ.rows, tf.int64)
  gains = _empty(tf.float32) if occ.gains is None else occ.gains
  return ids, rows, gains, grad


def _grappler():
  """``(arithmetic, constant_folding)``: whether Grappler rewrites the TF-op
  path's graph before it runs (inside ``tf.function``; never eagerly).

  Its arithmetic optimizer turns ``x / sqrt(y)`` into ``x * rsqrt(y)`` and
  ``pow(x, c)`` for c in (2, 3, 0.5, -0.5, -1) into Square, ..., Reciprocal;
  constant folding turns ``x / c`` into ``x * (1 / c)``. The kernel
  computes what the rewritten graph computes, so both paths stay identical.
  """
  if tf.executing_eagerly():
    return False, False
  options = tf.config.optimizer.get_experimental_options()
  if options.get("disable_meta_optimizer", False):
    return False, False
  return (options.get("arithmetic_optimization", True),
          options.get("constant_folding", True))


def _describe(spec, engine: str, grappler=(False, False), constant_lr=False):
  """``(kind, mode, flags, params)`` of one table; every float is what
  TensorFlow's ops see: the Python expression of update_rules.py, then
  float32. ``grappler``: see ``_grappler``; ``constant_lr``: this step's
  rate is a constant of the graph (constant folding applies to it)."""
  kind = _KINDS[type(spec)]
  if engine == "v1" and isinstance(spec, optimizers.Adam) and not spec.lazy_adam:
    mode = _EVERY_ROW
  elif engine == "v1" and not spec.use_gradient_accumulation:
    mode = _ROUNDS
  else:
    mode = _SUMS
  flags = 0
  params = [0.0] * _NUM_PARAMS
  if engine == "v1":
    low, high = spec.gradient_clip_limits
    if low is not None:
      flags |= _CLIP_LOW
      params[0] = float(low)
    if high is not None:
      flags |= _CLIP_HIGH
      params[1] = float(high)
    if spec.weight_decay_factor:
      flags |= _DECAY
      params[2] = float(spec.weight_decay_factor)
      if spec.multiply_weight_decay_factor_by_learning_rate:
        flags |= _DECAY_TIMES_LR
    if spec.clip_weight_min is not None:
      flags |= _WEIGHT_MIN
      params[3] = float(spec.clip_weight_min)
    if spec.clip_weight_max is not None:
      flags |= _WEIGHT_MAX
      params[4] = float(spec.clip_weight_max)
  arithmetic, folding = grappler
  flags |= (_GRAPH_POW | _RSQRT_MUL) if arithmetic else 0
  flags |= _RECIPROCAL_LR if folding and constant_lr else 0
  extra: List[float] = []
  if isinstance(spec, optimizers.AdagradMomentum):
    extra = [spec.beta2, 1.0 - spec.beta2, spec.epsilon, -1.0 / spec.exponent,
             spec.momentum]
    flags |= (_BETA2_IS_ONE if spec.beta2 == 1.0 else 0)
    flags |= (_NESTEROV if spec.use_nesterov else 0)
  elif isinstance(spec, optimizers.Adam):
    extra = [spec.beta_1, 1.0 - spec.beta_1, spec.beta_2, 1.0 - spec.beta_2,
             spec.epsilon * spec.epsilon, spec.epsilon]
    flags |= (_SUM_INSIDE_SQRT if spec.sum_inside_sqrt else 0)
  elif isinstance(spec, optimizers.FTRL):
    l1, l2 = spec.l1_regularization_strength, spec.l2_regularization_strength
    extra = [-spec.learning_rate_power, l1, l2, spec.beta, 2.0 * l2]
    flags |= (_LINEAR_TIMES_LR if spec.multiply_linear_by_learning_rate else 0)
    flags |= (_L1 if l1 != 0 else 0)
  params[5:5 + len(extra)] = [float(x) for x in extra]
  return kind, mode, flags, params


def _learning_rates(tables: Sequence[Table]):
  """This step's rate of every table as one tensor (one evaluation per
  distinct callable, as the TF-op path: ``updates.learning_rates``), and
  whether each is a constant of the graph. A callable's rate out of range
  raises eagerly; in a graph the op waits for its assertion."""
  specs = [t.optimizer for t in tables]
  if not any(callable(s.learning_rate) for s in specs):
    return (tf.constant([s.learning_rate for s in specs], tf.float32),
            [True] * len(specs))
  rates, verdict = updates.learning_rates([t.name for t in tables], specs)
  constant = [tf.get_static_value(r) is not None for r in rates]
  with tf.control_dependencies([verdict.assertion] if verdict is not None else []):
    return tf.identity(tf.stack(rates)), constant


def apply_step(payloads, tables: Sequence[Table], feature_tables: Sequence[int],
               feature_wheres: Sequence[str], *, engine: str, validate: bool,
               step: tf.Variable):
  """The step, once, from every replica's payload (``CPUEmbedding``'s merge).

  Each payload holds ``status`` (the lookup's id check) and ``segments``,
  one ``segment(...)`` per feature. Replicas come in order, and so do the
  features of each: the order the TF-op path concatenates them in, so the
  per-id sums add in the same order. Returns the step's op in a graph.
  """
  # The kernel reads [ok, kind, item, value] (it refuses a step that failed).
  status = tf.concat([p["status"] for p in payloads], 0)[:, :4]
  segments = [s for p in payloads for s in p["segments"]]
  segment_table = [feature_tables[i % len(feature_tables)]
                   for i in range(len(segments))]
  # The kernel checks ids itself when the engine's checks are off; it fills
  # in {id}.
  messages = [checks.IDS_IN_RANGE.message.format(
      where=feature_wheres[i % len(feature_wheres)],
      vocab=tables[feature_tables[i % len(feature_tables)]].vocabulary_size,
      value="{id}") for i in range(len(segments))]
  rates, constant = _learning_rates(tables)
  grappler = _grappler()
  described = [_describe(t.optimizer, engine, grappler, c)
               for t, c in zip(tables, constant)]
  variables = [v for t in tables for v in t.variables]
  accepted, gradient_ok, update_ok = loader.load().tpu_embed_ext_apply_step(
      variables=[v.handle for v in variables],
      ids=[s[0] for s in segments], rows=[s[1] for s in segments],
      gains=[s[2] for s in segments], grads=[s[3] for s in segments],
      learning_rates=rates, status=status,
      segment_table=segment_table, segment_message=messages,
      table_kind=[d[0] for d in described], table_mode=[d[1] for d in described],
      table_flags=[d[2] for d in described],
      table_params=[x for d in described for x in d[3]],
      check_finite=validate)

  def explain():
    """The engine's checks on the op's verdicts: its messages, eagerly and
    as assertions. Non-finite flags stand in for the tensors that failed."""
    names = [t.name for t in tables]
    flag = lambda ok: tf.where(ok, 0.0, float("nan"))
    grads = [flag(gradient_ok[i]) for i in range(len(tables))]
    first, values = 0, []
    for t in tables:
      values.append([flag(update_ok[first + j]) for j in range(len(t.variables))])
      first += len(t.variables)
    return [v.assertion for v in updates.finite_verdicts(
        names, grads, values, [t.optimizer.slot_names for t in tables])
            if v is not None]

  if tf.executing_eagerly():
    if not bool(accepted):
      explain()  # raises InputError
    step.assign_add(1)
    return None

  def rejected():
    with tf.control_dependencies(explain()):
      return tf.constant(False)

  done = tf.cond(accepted, lambda: tf.constant(True), rejected)
  with tf.control_dependencies([done]):
    return step.assign_add(1)
