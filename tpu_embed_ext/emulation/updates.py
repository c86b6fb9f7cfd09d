"""One table's step: per-id sums, the update rule on touched rows, writes.

Per table, the gradients of every occurrence (all features on the table, all
replicas) are summed per id (``tf.unique`` + ``unsorted_segment_sum``) and
each touched id is updated once by ``update_rules.apply_update``
(docs/semantics.md, section 0). Only touched rows of the table and its slots
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

from tpu_embed_ext import optimizers
from tpu_embed_ext.emulation import update_rules

__all__ = ["Update", "prepare", "learning_rate"]


class Update(NamedTuple):
  """One table's step, prepared: ``grads`` is checked, then ``write`` runs."""
  grads: tf.Tensor                        # what is applied; checked first
  write: Callable[[], Optional[Any]]      # () -> op (None when eager)


def learning_rate(spec, cache: dict) -> tf.Tensor:
  """This step's learning rate; one evaluation per distinct callable (tag)."""
  lr = spec.learning_rate
  if not callable(lr):
    return tf.constant(lr, tf.float32)
  if id(lr) not in cache:
    cache[id(lr)] = tf.cast(lr(), tf.float32)
  return cache[id(lr)]


def prepare(spec, params, slot_vars, ids, grads, lr, *, engine: str) -> Update:
  """What one table applies this step: per-id sums, unless the mode differs.

  ``use_gradient_accumulation=False`` (engine v1): the TPU applies the
  optimizer to contributions as they arrive, in an order it does not specify
  (section 7). The emulator makes the order deterministic: round ``k`` applies
  the ``k``-th contribution (in input order) of every id that has one.
  """
  args = (spec, params, tuple(slot_vars))
  if engine == "v1" and isinstance(spec, optimizers.Adam) and not spec.lazy_adam:
    g = tf.tensor_scatter_nd_add(tf.zeros_like(params), ids[:, None], grads)
    return Update(g, functools.partial(_update_all_rows, *args, g, lr, engine))
  if engine == "v1" and not spec.use_gradient_accumulation:
    return Update(grads, functools.partial(_update_in_rounds, *args, ids, grads,
                                           lr, engine))
  unique, index = tf.unique(ids)
  g = tf.math.unsorted_segment_sum(grads, index, tf.size(unique))
  return Update(g, functools.partial(_write_rows, *args, unique, g, lr, engine))


def _write_rows(spec, params, slot_vars, rows, g, lr, engine):
  """Updates ``rows`` (unique ids) of one table with their gradients ``g``."""
  w = tf.gather(params, rows)
  slots = tuple(tf.gather(s, rows) for s in slot_vars)
  w, slots = update_rules.apply_update(spec, w, slots, g, lr, engine=engine)
  ops = [params.scatter_update(tf.IndexedSlices(w, rows))]
  ops += [v.scatter_update(tf.IndexedSlices(s, rows))
          for v, s in zip(slot_vars, slots)]
  return tf.group(ops)


def _update_all_rows(spec, params, slot_vars, g, lr, engine):
  """Non-lazy Adam: every row steps, untouched ones with g = 0."""
  w, slots = update_rules.apply_update(
      spec, params.read_value(), tuple(s.read_value() for s in slot_vars), g,
      lr, engine=engine)
  return tf.group([params.assign(w)] +
                  [v.assign(s) for v, s in zip(slot_vars, slots)])


def _update_in_rounds(spec, params, slot_vars, ids, grads, lr, engine):
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
                       tf.boolean_mask(grads, mask), lr, engine)

  if tf.executing_eagerly():
    for k in range(int(rounds)):
      apply_round(k)
    return None

  def body(k):
    with tf.control_dependencies([apply_round(k)]):
      return k + 1
  return tf.while_loop(lambda k: k < rounds, body, [tf.constant(0)]).op
