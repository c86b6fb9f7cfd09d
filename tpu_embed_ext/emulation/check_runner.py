"""One runner for every row of ``checks``: eager error, assertion, XLA verdict.

A step that fails a check changes no table, slot or step. Where the check
runs depends on how the step runs:

* eagerly: ``run`` raises the row's ``InputError`` at once;
* in a graph: one ``tf.debugging.Assert`` per row, which every gather and
  write waits for; its message is the same text, built with string ops;
* under XLA (``jit_compile=True``): XLA drops ``Assert`` and clamps
  out-of-range gathers, so a check cannot stop the step. It becomes a
  predicate instead: the engine writes nothing when it is false, records
  the failure (``[kind, item, *dynamic values]``, int64), poisons the bad
  feature's activations with NaN (so the loss shows it at once) and raises
  the ``InputError`` at the next eager call (``CPUEmbedding.raise_if_failed``,
  which formats the record with ``failure_message``).

In a graph every check has the same shape, a ``Verdict``, so the engine
handles the three cases in one place. Like absl's flag validators, the rows
are data and this loop is the only code that runs them.
"""

from __future__ import annotations

import string
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import checks

__all__ = ["Item", "Verdict", "after", "in_xla_context", "run", "by_feature", "combine",
           "status", "failure_message", "RECORD"]

# Dynamic values a failure record holds (the most any row shows).
_VALUES = 3
RECORD = 2 + _VALUES  # [kind, item, *values]


class Item(NamedTuple):
  """What one row checks of one feature, table or table variable."""
  values: Any                     # tensor the row's predicate reads
  bounds: Tuple[Any, ...] = ()    # the predicate's other arguments
  names: Dict[str, Any] = {}      # the message's static fields
  at: int = 0                     # the item's index in the engine's list


class Verdict(NamedTuple):
  """The outcome of checks inside a graph (eager checks raise instead)."""
  ok: tf.Tensor                          # scalar bool
  assertion: Optional[tf.Operation]      # None under XLA
  failure: tf.Tensor                     # int64 [RECORD]: kind, item, values
  per_item_ok: tf.Tensor                 # bool [items]


def in_xla_context() -> bool:
  """Whether ops built now are compiled by XLA (``jit_compile=True``)."""
  graph = ops.get_default_graph()
  if control_flow_util.GraphOrParentsInXlaContext(graph):
    return True
  while graph is not None:
    if getattr(graph, "_jit_compile", None) or getattr(graph, "_xla_compile",
                                                        None):
      return True
    graph = getattr(graph, "outer_graph", None)
  return False


def after(x, gates):
  """``x`` (a tensor, or ragged or sparse ids: their values), read only once
  the assertions ``gates`` ran (None or empty: ``x``)."""
  if not gates:
    return x
  with tf.control_dependencies(gates):
    if isinstance(x, tf.Tensor):
      return tf.identity(x)
    return x.with_values(tf.identity(x.values))


def run(check: checks.Check, items: Sequence[Item],
        after=None) -> Optional[Verdict]:
  """Applies ``check`` to ``items``: eagerly raises the first failing item's
  InputError (None returned); in a graph returns a Verdict whose failure is
  the first failing item's (its assertion runs ``after`` the given op, so
  an earlier check's message is the one raised)."""
  if not items:
    return None
  if tf.executing_eagerly():
    for item in items:
      ok = tf.reshape(check.ok(item.values, *item.bounds), [-1])
      if not bool(tf.reduce_all(ok)):
        pos = tf.argmin(tf.cast(ok, tf.int32), output_type=tf.int64)
        shown = [v.numpy().item() for v in
                 check.shows(item.values, pos, *item.bounds)]
        raise errors.InputError(check.message.format(
            **item.names, **dict(zip(check.dynamic, shown))))
    return None
  oks, shown = [], []
  for item in items:
    ok = tf.reshape(check.ok(item.values, *item.bounds), [-1])
    # The first failing element, or one past the end when none fails.
    pos = tf.argmax(tf.cast(tf.concat([tf.logical_not(ok), [True]], 0), tf.int32),
                    output_type=tf.int64)
    oks.append(tf.reduce_all(ok))
    shown.append(check.shows(item.values, pos, *item.bounds))
  per_item = tf.stack(oks)
  first = tf.argmax(tf.cast(tf.logical_not(per_item), tf.int32),
                    output_type=tf.int64)
  values = [tf.gather(tf.stack([s[k] for s in shown]), first)
            for k in range(len(check.dynamic))]
  ok = tf.reduce_all(per_item)
  failure = tf.stack(
      [tf.constant(check.kind, tf.int64),
       tf.gather(tf.constant([item.at for item in items], tf.int64), first)]
      + [_encode(v, check.encoding) for v in values]
      + [tf.constant(0, tf.int64)] * (_VALUES - len(values)))
  assertion = None
  if not in_xla_context():
    with tf.control_dependencies([after] if after is not None else []):
      # As tf.debugging.Assert guards its data: the message's string ops run
      # only when the check fails.
      assertion = tf.cond(ok, tf.no_op, lambda: tf.debugging.Assert(
          ok, [_graph_message(check, items, first, values)]), name="CheckGuard")
    assertion = getattr(assertion, "op", assertion)
  return Verdict(ok, assertion, failure, per_item)


def _encode(value: tf.Tensor, encoding: str) -> tf.Tensor:
  if encoding == "float32":
    return tf.cast(tf.bitcast(tf.cast(value, tf.float32), tf.int32), tf.int64)
  if encoding == "uint64":
    return tf.bitcast(tf.cast(value, tf.uint64), tf.int64)
  return tf.cast(value, tf.int64)


def _decode(value: int, encoding: str):
  if encoding == "float32":
    return float(np.array(value, np.int64).astype(np.int32).view(np.float32))
  if encoding == "uint64":
    return value % 2 ** 64
  return value


def _graph_message(check, items, first, values) -> tf.Tensor:
  """The row's message of item ``first`` as a string tensor: static fields
  formatted per item in Python, dynamic ones with ``tf.strings.as_string``
  (``shortest`` is C's %g, as Python's ``:g``)."""
  pieces: List[Any] = []
  texts = [""] * len(items)
  for literal, field, spec, _ in string.Formatter().parse(check.message):
    texts = [t + literal for t in texts]
    if field is None:
      continue
    if field in check.dynamic:
      pieces.append(tf.gather(tf.constant(texts), first))
      value = values[check.dynamic.index(field)]
      pieces.append(tf.strings.as_string(value, shortest=spec == "g"))
      texts = [""] * len(items)
    else:
      texts = [t + format(item.names[field], spec)
               for t, item in zip(texts, items)]
  pieces.append(tf.gather(tf.constant(texts), first))
  return tf.strings.join(pieces)


def by_feature(verdicts: List[Sequence[Optional[Verdict]]]) -> Optional[Verdict]:
  """One Verdict of every feature's own checks (feature ``i`` lists its
  Verdicts, each of one item; the first failure is reported, as feature
  ``i``)."""
  flat = [(i, v) for i, vs in enumerate(verdicts) for v in vs if v is not None]
  if not flat:
    return None
  oks = tf.stack([v.ok for _, v in flat])
  failures = tf.stack([tf.tensor_scatter_nd_update(
      v.failure, [[1]], tf.constant([i], tf.int64))
                       for i, v in flat])
  failure = tf.gather(failures, tf.argmax(tf.cast(tf.logical_not(oks), tf.int32)))
  per_item = tf.stack([
      tf.reduce_all(tf.stack([v.ok for v in vs if v is not None]))
      if any(v is not None for v in vs) else tf.constant(True)
      for vs in verdicts])
  assertions = [v.assertion for _, v in flat if v.assertion is not None]
  return Verdict(tf.reduce_all(oks),
                 tf.group(*assertions) if assertions else None, failure, per_item)


def combine(verdicts: List[Optional[Verdict]]) -> Optional[Verdict]:
  """One Verdict for several checks of the same items (first failure wins)."""
  verdicts = [v for v in verdicts if v is not None]
  if len(verdicts) < 2:
    return verdicts[0] if verdicts else None
  ok = tf.reduce_all(tf.stack([v.ok for v in verdicts]))
  failure = verdicts[-1].failure
  for v in reversed(verdicts[:-1]):
    failure = tf.where(v.ok, failure, v.failure)
  per_item = verdicts[0].per_item_ok
  for v in verdicts[1:]:
    per_item = tf.logical_and(per_item, v.per_item_ok)
  assertions = [v.assertion for v in verdicts if v.assertion is not None]
  assertion = tf.group(*assertions) if assertions else None
  return Verdict(ok, assertion, failure, per_item)


def status(verdict: Optional[Verdict]) -> tf.Tensor:
  """``[[ok, kind, item, *values]]`` of a replica's input checks, for the
  merge. In a graph without XLA it is computed after the assertion, so
  whatever waits for it waits for the checks."""
  if verdict is None:
    return tf.constant([[1] + [0] * RECORD], tf.int64)
  deps = [verdict.assertion] if verdict.assertion is not None else []
  with tf.control_dependencies(deps):
    return tf.concat([[tf.cast(verdict.ok, tf.int64)], verdict.failure], 0)[None]


def failure_message(record: Sequence[int], features, tables) -> str:
  """The message of a failure recorded under XLA (``raise_if_failed``).

  ``features`` and ``tables`` are the engine's (``.where``, ``.table``;
  ``.name``, ``.config``, ``.optimizer``): they give the static fields the
  step's checks were given when it was traced.
  """
  kind, at, *values = (int(x) for x in record)
  check = checks.CHECKS[kind - 1]
  if check.over == "feature":
    feature = features[at]
    names = {"where": feature.where,
             "vocab": tables[feature.table].config.vocabulary_size}
  elif check.over == "table":
    names = {"table": tables[at].name}
  else:  # "table variable": parameters, then each slot, table by table.
    names = [{"table": t.name, "variable": v} for t in tables
             for v in ("parameters", *(t.optimizer.slot_names
                                       if t.optimizer is not None else ()))][at]
  shown = [_decode(v, check.encoding) for v in values[:len(check.dynamic)]]
  return check.message.format(**names, **dict(zip(check.dynamic, shown)))
