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
from typing import Any, Callable, NamedTuple, Optional, Tuple

import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.spec import optimizers
from tpu_embed_ext.spec.schedules import Schedule
from tpu_embed_ext.emulation import update_rules, validation

__all__ = ["Update", "apply_step", "prepare", "learning_rate", "learning_rates"]


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


def apply_step(payloads, tables, *, engine: str, validate: bool,
               step: tf.Variable, failure: tf.Variable):
  """The step with TensorFlow ops, once, from every replica's payload.

  The TF-op twin of ``native.update.apply_step``. Each payload holds
  ``status`` (the lookup's id check) and, per table, the occurrences' ``ids``
  and ``grads``; ``tables`` lists ``(name, optimizer spec, [parameters,
  *slots])``. Every table is prepared and checked before the first write, so
  the tables, slots and ``step`` change together or not at all.
  """
  status = tf.concat([p["status"] for p in payloads], 0)
  names = [name for name, _, _ in tables]
  rates, rate_verdict = learning_rates(names, [spec for _, spec, _ in tables])
  planned = []
  # Rows are read after the id check: a bad id fails with its message.
  with tf.control_dependencies([] if tf.executing_eagerly() else [status]):
    for i, (name, spec, variables) in enumerate(tables):
      ids = tf.concat([p["ids"][i] for p in payloads], 0)
      grads = tf.concat([p["grads"][i] for p in payloads], 0)
      planned.append(prepare(spec, variables[0], variables[1:], ids, grads,
                             rates[i], engine=engine, where=f"table '{name}'"))
  verdicts = [rate_verdict] if rate_verdict is not None else []
  if validate:
    # Each check's assertion runs after the one before: the first failure's
    # message is the one raised (a rate of 1e30 also overflows the update).
    after = rate_verdict.assertion if rate_verdict is not None else None
    verdicts.append(validation.check_finite(names, [[u.grads] for u in planned],
                                            after=after))
    verdicts.append(validation.check_finite(
        names, [list(u.values) for u in planned], validation.NOT_FINITE_UPDATE,
        [["parameters", *spec.slot_names] for _, spec, _ in tables],
        after=verdicts[-1].assertion if verdicts[-1] is not None else None))

  def write(accept=None):
    with tf.control_dependencies([w for w in (u.write(accept) for u in planned)
                                  if w is not None]):
      if accept is None:
        return step.assign_add(1)
      return step.assign_add(tf.cast(accept, tf.int64))

  if tf.executing_eagerly():
    write()
    return
  if verdicts and verdicts[0].assertion is None:
    # XLA: no assertion can stop the step, so it is gated instead, and the
    # first failure (ids, gradients, new values) recorded for
    # raise_if_failed.
    accept = tf.reduce_all(status[:, 0] > 0)
    first = tf.gather(status, tf.argmin(status[:, 0]))[1:]
    for verdict in verdicts:
      first = tf.where(accept, verdict.failure, first)
      accept = tf.logical_and(accept, verdict.ok)
    with tf.control_dependencies([write(accept)]):
      failure.assign(tf.where(accept, failure, first))
    return
  with tf.control_dependencies([status] + [v.assertion for v in verdicts]):
    write()


def learning_rates(names, specs):
  """``(rates, verdict)``: this step's rate of every table, and the check
  that every callable's rate is in range (``validation.check_rates``: eagerly
  it raises, naming the table, before anything is computed or written)."""
  cache = {}
  rates = [learning_rate(spec, cache) for spec in specs]
  verdict = validation.check_rates(
      names, [r if _unchecked_callable(s.learning_rate) else None
              for s, r in zip(specs, rates)])
  return rates, verdict


def _unchecked_callable(lr) -> bool:
  """A user's callable rate: constants and schedules (tf/rates.py's
  bound callables carry theirs as ``.schedule``) were checked over their
  whole range when the spec was made. Under Adam's bias correction a user's
  callable is checked times the correction factor, the rate applied."""
  return callable(lr) and not isinstance(getattr(lr, "schedule", None),
                                         Schedule)


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
  variables = (params,) + tuple(slot_vars)
  rule = functools.partial(update_rules.apply_update, spec, lr=lr, engine=engine)
  if engine == "v1" and isinstance(spec, optimizers.Adam) and not spec.lazy_adam:
    # Every row steps, untouched ones with g = 0; negative ids (occurrences
    # that do not count) touch nothing.
    g = tf.math.unsorted_segment_sum(grads, ids, tf.shape(params)[0])
    old = tuple(v.read_value() for v in variables)
    values = _apply(rule, old, g)
    return Update(g, values, functools.partial(_assign_all, variables, values, old))
  if engine == "v1" and not spec.use_gradient_accumulation:
    if validation.in_xla_context():
      raise errors.ConfigError(
          f"{where}: use_gradient_accumulation=False cannot be compiled with "
          "XLA by the emulator (its rounds of updates have data-dependent "
          "sizes). Fix: use jit_compile=False, or enable gradient "
          "accumulation (the default).")
    return _in_rounds(rule, variables, ids, grads)
  if validation.in_xla_context():
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
