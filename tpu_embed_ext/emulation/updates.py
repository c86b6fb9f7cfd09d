"""The step's TF-op back end: per-id sums, the update rule on touched rows,
writes (step_pipeline.py runs it; native/update.py is the other back end).

Per table, the gradients of every occurrence (all features on the table, all
replicas) are summed per id (``tf.unique`` + ``unsorted_segment_sum``) and
each touched id is updated once by ``update_rules.apply_update`` with the
rule of its optimizer's row (optimizer_rows.py; docs/semantics.md, the
step). Only touched rows of the table and its slots are gathered and
scattered, so a step costs O(ids in the batch) whatever the vocabulary;
non-lazy Adam is the exception, it updates every row by definition.

Tables are written independently, not batched by optimizer: measured on W2
(benchmarks/), concatenating same-optimizer tables into one update cost more
than it saved, as it serialises the per-table gathers and scatters that
TensorFlow otherwise runs in parallel.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Tuple

import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import (check_runner, optimizer_rows, step_pipeline,
                                     update_rules)
from tpu_embed_ext.emulation.rules import EngineRules

__all__ = ["Update", "compute", "prepare"]


class Update(NamedTuple):
  """One table's step, computed but not written.

  ``grads`` (what the rule is applied to) and ``values`` (the new rows of the
  parameters, then of each slot) are checked before anything is written;
  ``write(accept)`` then scatters ``values`` into the variables and returns
  the op (None when eager). ``accept``, a scalar bool tensor or None, gates
  the step without control flow (XLA cannot branch around the dynamic shapes
  of a step): where it is false every row keeps its value.
  """
  grads: tf.Tensor
  values: Tuple[tf.Tensor, ...]
  write: Callable[..., Optional[Any]]


def compute(payloads, tables, status, rates, rate_verdict, *, rules: EngineRules,
            validate: bool) -> step_pipeline.Computed:
  """The back end of ``step_pipeline.apply_step`` with TensorFlow ops.

  Each payload (``payloads.OpsPayload``) holds, per table, the
  occurrences' ``ids`` and ``grads``.
  Every table is prepared before the first write, and each row read after
  the id check (``status``), so a bad id fails with its message.
  """
  del rate_verdict, validate  # the pipeline checks what this computes
  planned = []
  with tf.control_dependencies([] if tf.executing_eagerly() else [status]):
    for i, table in enumerate(tables):
      ids = tf.concat([p.ids[i] for p in payloads], 0)
      grads = tf.concat([p.grads[i] for p in payloads], 0)
      planned.append(prepare(table.optimizer, table.variables[0],
                             table.variables[1:], ids, grads, rates[i],
                             rules=rules, where=f"table '{table.name}'"))

  def write(accept=None):
    return [w for w in (u.write(accept) for u in planned) if w is not None]

  checked = ([[u.grads] for u in planned], [list(u.values) for u in planned])
  return step_pipeline.Computed(lambda: checked, write)


def prepare(spec, params, slot_vars, ids, grads, lr, *, rules: EngineRules,
            where: str = "") -> Update:
  """What one table applies this step: per-id sums, unless the mode differs.

  ``use_gradient_accumulation=False`` (``rules.accumulation_optional``): the TPU applies the
  optimizer to contributions as they arrive, in an order it does not specify
  (docs/semantics.md, other options). The emulator makes the order
  deterministic: round ``k`` applies the ``k``-th contribution (in input
  order) of every id that has one.
  """
  variables = (params,) + tuple(slot_vars)
  rule = functools.partial(update_rules.apply_update,
                           optimizer_rows.row(spec).rule, spec, lr=lr,
                           rules=rules)
  mode = optimizer_rows.mode(spec, rules)
  if mode == optimizer_rows.EVERY_ROW:
    # Every row steps, untouched ones with g = 0; negative ids (occurrences
    # that do not count) touch nothing.
    g = tf.math.unsorted_segment_sum(grads, ids, tf.shape(params)[0])
    old = tuple(v.read_value() for v in variables)
    values = _apply(rule, old, g)
    return Update(g, values, functools.partial(_assign_all, variables, values, old))
  if mode == optimizer_rows.ROUNDS:
    if check_runner.in_xla_context():
      raise errors.ConfigError(
          f"{where}: use_gradient_accumulation=False cannot be compiled with "
          "XLA by the emulator (its rounds of updates have data-dependent "
          "sizes). Fix: use jit_compile=False, or enable gradient "
          "accumulation (the default).")
    return _in_rounds(rule, variables, ids, grads)
  if check_runner.in_xla_context():
    return _static(rule, variables, ids, grads)
  unique, index = tf.unique(ids)
  g = tf.math.unsorted_segment_sum(grads, index, tf.size(unique))
  old = tuple(tf.gather(v, unique) for v in variables)
  values = _apply(rule, old, g)
  return Update(g, values, functools.partial(_scatter, variables, unique, values, old))


def _apply(rule, old, g):
  w, slots = rule(old[0], old[1:], g)
  return (w,) + tuple(slots)


def _gated(accept, new, old):
  return new if accept is None else tf.where(accept, new, old)


def _scatter(variables, rows, values, old, accept=None):
  return tf.group([v.scatter_update(tf.IndexedSlices(_gated(accept, new, o), rows))
                   for v, new, o in zip(variables, values, old)])


def _assign_all(variables, values, old, accept=None):
  return tf.group([v.assign(_gated(accept, new, o))
                   for v, new, o in zip(variables, values, old)])


def _static(rule, variables, ids, grads) -> Update:
  """Per-id sums with static shapes, for XLA.

  XLA's ``Unique`` is not reliable on data-dependent sizes, so ids are sorted
  instead (negative ids, which do not count, last): segment ``k`` holds the
  ``k``-th distinct id, and the ``n - count`` trailing segments are padding.
  Padding entries repeat entry 0's row and value (or, with no real entry,
  row 0's old value), so a scatter of all ``n`` entries changes exactly the
  touched rows.
  """
  if ids.shape[0] == 0:  # Static under XLA: no occurrence, nothing to write.
    return Update(grads, (), lambda accept=None: tf.no_op())
  n = tf.size(ids)
  key = tf.where(ids < 0, tf.int64.max, ids)
  order = tf.argsort(key, stable=True)
  ordered = tf.gather(key, order)
  new = tf.concat([[True], ordered[1:] != ordered[:-1]], 0)
  new = tf.logical_and(new, ordered != tf.int64.max)
  segment = tf.cumsum(tf.cast(new, tf.int32)) - 1
  segment = tf.where(ordered != tf.int64.max, segment, n)  # dropped
  g = tf.math.unsorted_segment_sum(tf.gather(grads, order), segment, n)
  rows = tf.math.unsorted_segment_max(ordered, segment, n)
  valid = tf.range(n) < tf.reduce_sum(tf.cast(new, tf.int32))
  rows = tf.where(valid, rows, tf.where(valid[0], rows[0], 0))
  old = tuple(tf.gather(v, rows) for v in variables)
  values = tuple(
      tf.where(valid[:, None], x, tf.where(valid[0], x[0], o[0]))
      for x, o in zip(_apply(rule, old, g), old))
  return Update(tf.where(valid[:, None], g, 0.0), values,
                functools.partial(_scatter, variables, rows, values, old))


def _in_rounds(rule, variables, ids, grads) -> Update:
  """No accumulation: round k applies each id's k-th contribution.

  The rounds run on the gathered rows of the touched ids; the result is
  written once, like any other step.
  """
  n = tf.size(ids)
  unique, index = tf.unique(ids)
  order = tf.argsort(index, stable=True)
  sorted_index = tf.gather(index, order)
  starts = tf.math.unsorted_segment_min(tf.range(n), sorted_index,
                                        tf.size(unique))
  rank_sorted = tf.range(n) - tf.gather(starts, sorted_index)
  rank = tf.scatter_nd(order[:, None], rank_sorted, [n])
  rounds = tf.reduce_max(tf.concat([rank + 1, [0]], 0))
  old = tuple(tf.gather(v, unique) for v in variables)

  def apply_round(k, rows):
    mask = tf.equal(rank, k)
    at = tf.boolean_mask(index, mask)[:, None]
    new = _apply(rule, tuple(tf.gather_nd(r, at) for r in rows),
                 tf.boolean_mask(grads, mask))
    return tuple(tf.tensor_scatter_nd_update(r, at, x) for r, x in zip(rows, new))

  if tf.executing_eagerly():
    values = old
    for k in range(int(rounds)):
      values = apply_round(k, values)
  else:
    values = tf.while_loop(lambda k, *_: k < rounds,
                           lambda k, *rows: (k + 1,) + apply_round(k, rows),
                           (tf.constant(0),) + old)[1:]
  return Update(grads, tuple(values),
                functools.partial(_scatter, variables, unique, tuple(values), old))
