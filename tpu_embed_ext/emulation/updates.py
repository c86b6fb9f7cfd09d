"""One table's step: per-id sums, the update rule on touched rows, writes.

Per table, the gradients of every occurrence (all features on the table, all
replicas) are summed per id (``tf.unique`` + ``unsorted_segment_sum``) and
each touched id is updated once by ``update_rules.apply_update``
(docs/semantics.md, the step). Only touched rows of the table and its slots
are gathered and scattered, so a step costs O(ids in the batch) whatever the
vocabulary; non-lazy Adam is the exception, it updates every row by
definition.

Tables are written independently, not batched by optimizer: measured on W2
(benchmarks/), concatenating same-optimizer tables into one update cost more
than it saved, as it serialises the per-table gathers and scatters that
TensorFlow otherwise runs in parallel.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import tensorflow as tf

from tpu_embed_ext import errors, optimizers
from tpu_embed_ext.emulation import update_rules, validation

__all__ = ["Update", "prepare", "learning_rate"]


class Update(NamedTuple):
  """One table's step, prepared: ``grads`` is checked, then ``write`` runs.

  ``write(accept)`` returns the op (None when eager). ``accept``, a scalar
  bool tensor or None, gates the step without control flow (XLA cannot
  branch around the dynamic shapes of a step): where it is false every
  written row keeps its value.
  """
  grads: tf.Tensor
  write: Callable[..., Optional[Any]]


def learning_rate(spec, cache: dict) -> tf.Tensor:
  """This step's learning rate; one evaluation per distinct callable (tag)."""
  lr = spec.learning_rate
  if not callable(lr):
    return tf.constant(lr, tf.float32)
  if id(lr) not in cache:
    cache[id(lr)] = tf.cast(lr(), tf.float32)
  return cache[id(lr)]


def prepare(spec, params, slot_vars, ids, grads, lr, *, engine: str,
            where: str = "") -> Update:
  """What one table applies this step: per-id sums, unless the mode differs.

  ``use_gradient_accumulation=False`` (engine v1): the TPU applies the
  optimizer to contributions as they arrive, in an order it does not specify
  (docs/semantics.md, other options). The emulator makes the order
  deterministic: round ``k`` applies the ``k``-th contribution (in input
  order) of every id that has one.
  """
  args = (spec, params, tuple(slot_vars))
  xla = validation.in_xla_context()
  if engine == "v1" and isinstance(spec, optimizers.Adam) and not spec.lazy_adam:
    # Negative ids (occurrences that do not count) touch nothing.
    g = tf.math.unsorted_segment_sum(grads, ids, tf.shape(params)[0])
    return Update(g, functools.partial(_update_all_rows, *args, g, lr, engine))
  if engine == "v1" and not spec.use_gradient_accumulation:
    if xla:
      raise errors.ConfigError(
          f"{where}: use_gradient_accumulation=False cannot be compiled with "
          "XLA by the emulator (its rounds of updates have data-dependent "
          "sizes). Fix: use jit_compile=False, or enable gradient "
          "accumulation (the default).")
    return Update(grads, functools.partial(_update_in_rounds, *args, ids, grads,
                                           lr, engine))
  if xla:
    return _prepare_static(args, ids, grads, lr, engine)
  unique, index = tf.unique(ids)
  g = tf.math.unsorted_segment_sum(grads, index, tf.size(unique))
  return Update(g, functools.partial(_write_rows, *args, unique, g, lr, engine))


def _prepare_static(args, ids, grads, lr, engine) -> Update:
  """Per-id sums with static shapes, for XLA.

  XLA's ``Unique`` is not reliable on data-dependent sizes, so ids are sorted
  instead (negative ids, which do not count, last): segment ``k`` holds the
  ``k``-th distinct id, and the ``n - count`` trailing segments are padding.
  Padding writes repeat segment 0's write (same row, same value), so a
  scatter of all ``n`` entries changes exactly the touched rows.
  """
  if ids.shape[0] == 0:  # Static under XLA: no occurrence, nothing to write.
    return Update(grads, lambda accept=None: tf.no_op())
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
  return Update(tf.where(valid[:, None], g, 0.0), functools.partial(
      _write_rows, *args, rows, g, lr, engine, padding=valid))


def _gated(accept, new, old):
  return new if accept is None else tf.where(accept, new, old)


def _write_rows(spec, params, slot_vars, rows, g, lr, engine, accept=None,
                padding=None):
  """Updates ``rows`` (unique ids) of one table with their gradients ``g``.

  ``padding`` (XLA): a bool [n] mask of real entries; the others repeat
  entry 0's row and value (or, with no real entry, row 0's old value).
  """
  w_old = tf.gather(params, rows)
  slots_old = tuple(tf.gather(s, rows) for s in slot_vars)
  w, slots = update_rules.apply_update(spec, w_old, slots_old, g, lr,
                                       engine=engine)
  w, slots = _gated(accept, w, w_old), tuple(
      _gated(accept, s, s_old) for s, s_old in zip(slots, slots_old))
  if padding is not None:
    repeat = lambda new, old: tf.where(
        padding[:, None], new, tf.where(padding[0], new[0], old[0]))
    w, slots = repeat(w, w_old), tuple(
        repeat(s, s_old) for s, s_old in zip(slots, slots_old))
  ops = [params.scatter_update(tf.IndexedSlices(w, rows))]
  ops += [v.scatter_update(tf.IndexedSlices(s, rows)) for v, s in zip(slot_vars, slots)]
  return tf.group(ops)


def _update_all_rows(spec, params, slot_vars, g, lr, engine, accept=None):
  """Non-lazy Adam: every row steps, untouched ones with g = 0."""
  w_old = params.read_value()
  slots_old = tuple(s.read_value() for s in slot_vars)
  w, slots = update_rules.apply_update(spec, w_old, slots_old, g, lr,
                                       engine=engine)
  return tf.group([params.assign(_gated(accept, w, w_old))] +
                  [v.assign(_gated(accept, s, s_old))
                   for v, s, s_old in zip(slot_vars, slots, slots_old)])


def _update_in_rounds(spec, params, slot_vars, ids, grads, lr, engine,
                      accept=None):
  """No accumulation: round k applies each id's k-th contribution."""
  n = tf.size(ids)
  unique, index = tf.unique(ids)
  order = tf.argsort(index, stable=True)
  sorted_index = tf.gather(index, order)
  starts = tf.math.unsorted_segment_min(tf.range(n), sorted_index,
                                        tf.size(unique))
  rank_sorted = tf.range(n) - tf.gather(starts, sorted_index)
  rank = tf.scatter_nd(order[:, None], rank_sorted, [n])
  rounds = tf.reduce_max(tf.concat([rank + 1, [0]], 0))

  def apply_round(k):
    mask = tf.equal(rank, k)
    return _write_rows(spec, params, slot_vars, tf.boolean_mask(ids, mask),
                       tf.boolean_mask(grads, mask), lr, engine, accept)

  if tf.executing_eagerly():
    for k in range(int(rounds)):
      apply_round(k)
    return None

  def body(k):
    with tf.control_dependencies([apply_round(k)]):
      return k + 1
  return tf.while_loop(lambda k: k < rounds, body, [tf.constant(0)]).op
