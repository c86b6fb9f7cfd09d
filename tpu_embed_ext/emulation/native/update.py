"""The native back end of the step: backward pass and update in one op.

``update_op.cc`` (``TpuEmbedExtApplyStep``) does for every table of the step
what ``updates.compute`` (the TF-op back end) and the pipeline's checks do
with TensorFlow ops: the per-occurrence gradients (``gain * dL/dact[row]``,
as ``lookups.occurrence_gradients``), per-id sums in input order (or the
rounds of ``use_gradient_accumulation=False``, or every row for non-lazy
Adam), ``update_rules.apply_update`` on the touched rows (the ``case`` of
the optimizer's row: optimizer_rows.py), and the checks of what is applied
and what is written: a step that fails one leaves every table and slot as
it was (rows updated in place are put back from the op's undo log; rows
computed in scratch are never written). Same float32 operations in the
same order, so the same numbers bit for bit (docs/native_kernels.md).

A step that fails a check writes nothing; the op says which table and
variable failed, and ``step_pipeline`` runs its usual checks on those
verdicts to raise the usual message.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import checks, optimizer_rows, step_pipeline
from tpu_embed_ext.emulation.native import loader
from tpu_embed_ext.emulation.rules import EngineRules

__all__ = ["segment", "kernel"]


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


def kernel(feature_tables: Sequence[int], feature_wheres: Sequence[str]):
  """The back end of ``step_pipeline.apply_step`` on the native op.

  Each payload (``payloads.NativePayload``) holds ``status`` (the lookup's
  id check) and ``segments``,
  one ``segment(...)`` per feature (feature ``i`` of each replica is on
  table ``feature_tables[i]``, named ``feature_wheres[i]`` in messages).
  Replicas come in order, and so do the features of each: the order the
  TF-op path concatenates them in, so the per-id sums add in the same order.
  """
  def compute(payloads, tables: Sequence[step_pipeline.Table], status, rates,
              rate_verdict, *, rules: EngineRules, validate: bool
              ) -> step_pipeline.Computed:
    segments = [s for p in payloads for s in p.segments]
    segment_table = [feature_tables[i % len(feature_tables)]
                     for i in range(len(segments))]
    # The kernel checks ids itself when the engine's checks are off; it
    # fills in {id}.
    messages = [checks.IDS_IN_RANGE.message.format(
        where=feature_wheres[i % len(feature_wheres)],
        vocab=tables[segment_table[i]].vocabulary_size, value="{id}")
        for i in range(len(segments))]
    # A rate is a constant of the graph unless a callable made it; the op
    # runs after the callables' range check.
    constant = [tf.get_static_value(r) is not None for r in rates]
    rates = tf.stack(rates)
    if rate_verdict is not None:
      with tf.control_dependencies([rate_verdict.assertion]):
        rates = tf.identity(rates)
    grappler = _grappler()
    described = [optimizer_rows.native_encoding(t.optimizer, rules, grappler, c)
                 for t, c in zip(tables, constant)]
    variables = [v for t in tables for v in t.variables]
    accepted, gradient_ok, update_ok = loader.load().tpu_embed_ext_apply_step(
        variables=[v.handle for v in variables],
        ids=[s[0] for s in segments], rows=[s[1] for s in segments],
        gains=[s[2] for s in segments], grads=[s[3] for s in segments],
        learning_rates=rates, status=status[:, :4],  # [ok, kind, item, value]
        segment_table=segment_table, segment_message=messages,
        table_kind=[d[0] for d in described], table_mode=[d[1] for d in described],
        table_flags=[d[2] for d in described],
        table_params=[x for d in described for x in d[3]],
        check_finite=validate)

    def checked():
      """Non-finite stand-ins for the tensors that failed the op's checks."""
      flag = lambda ok: tf.where(ok, 0.0, float("nan"))
      grads, values, first = [], [], 0
      for i, t in enumerate(tables):
        grads.append([flag(gradient_ok[i])])
        values.append([flag(update_ok[first + j]) for j in range(len(t.variables))])
        first += len(t.variables)
      return grads, values

    return step_pipeline.Computed(checked, accepted=accepted)

  return compute
