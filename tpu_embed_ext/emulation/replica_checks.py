"""Input checks of one enqueue that carries every replica's batch.

``enqueue`` outside ``strategy.run`` with distributed values (as
TensorFlow's TPU tests feed the TPU) holds all local replicas' batches. Each
check row (``checks.py``) then runs once over all replicas' values of a
feature concatenated in replica order, instead of once per replica: building
the checks per replica dominated tracing at 8 replicas (issue 34). The
messages are the rows' own (they name the feature, not the replica); the
first bad value in replica order is the one reported. The engine uses this
in a graph outside XLA only: under XLA each replica keeps its own verdict
(its activations alone turn NaN), and eagerly each replica's batch raises
in turn.
"""

from __future__ import annotations

from typing import List

import tensorflow as tf

from tpu_embed_ext.emulation import check_runner, checks
from tpu_embed_ext.emulation.lookups import Occurrences

__all__ = ["prepare_together", "own_checks", "gates", "batch_verdict", "checked_together",
           "concatenated"]


def prepare_together(engine, batches, training: bool) -> dict:
  """``{replica: protocol.Pending}`` of every replica's batch, for
  ``engine._put``: each check row run once over all replicas' values."""
  inputs = {replica: engine._inputs(features, weights)  # pylint: disable=protected-access
            for replica, (features, weights) in batches.items()}
  own = own_checks(engine._features, list(inputs.values()))  # pylint: disable=protected-access
  prepared = {replica: engine._prepare(  # pylint: disable=protected-access
      batches[replica][0], None, training, check=False, inputs=flat,
      own_checked=gates(own)) for replica, flat in inputs.items()}
  verdict = batch_verdict([p.occurrences for p in prepared.values()], own,
                          engine._features, engine._tables)  # pylint: disable=protected-access
  return {replica: engine._limited(pending._replace(verdict=verdict), replica)  # pylint: disable=protected-access
          for replica, pending in prepared.items()}


def own_checks(features, inputs) -> list:
  """Each feature's ``checked_together`` over the replicas' ``inputs``
  (``(ids, weights)`` of each replica, one entry per feature)."""
  return [checked_together(f.where, f.config, [ids[i] for ids, _ in inputs],
                           [ws[i] for _, ws in inputs])
          for i, f in enumerate(features)]


def gates(own) -> list:
  """What each feature's reads wait for (``feature_occurrences``'s
  ``own_checked``): the assertions of its ``checked_together`` verdicts, or
  None where its replicas were checked one by one."""
  return [None if verdicts is None else
          [v.assertion for v in verdicts if v.assertion is not None]
          for verdicts in own]


def batch_verdict(per_replica, own, features, tables):
  """The Verdict of all replicas' batches (each replica's occurrences,
  ``per_replica``; ``own``: ``own_checks``), as ``check_runner.batch_verdict``
  of one batch: each feature's own checks, then weights against ids, then
  ids in range."""
  merged = [o._replace(checks=tuple(verdicts) + o.checks)
            if verdicts is not None else o
            for o, verdicts in zip(concatenated(per_replica), own)]
  return check_runner.batch_verdict(merged, features, tables)


def checked_together(where: str, config, xs: list, ws: list):
  """One feature's own input checks (uint64 ids, sparse indices, finite
  weights: ``feature_occurrences``'s) run once over every replica's values
  concatenated, in replica order: their verdicts (each replica's
  feature_occurrences then gets ``own_checked``, their assertions, and waits
  for them where it would wait for its own). None when the replicas'
  inputs are not alike (kinds, dtypes, ranks) or not valid ids and weights:
  each replica is then checked on its own, so that ``feature_occurrences``
  raises its own errors as before.
  """
  kind = (tf.SparseTensor if isinstance(xs[0], tf.SparseTensor) else
          tf.RaggedTensor if isinstance(xs[0], tf.RaggedTensor) else tf.Tensor)
  if not all(isinstance(v, kind) for v in xs + [w for w in ws if w is not None]):
    return None
  if len({x.dtype for x in xs}) != 1 or not xs[0].dtype.is_integer:
    return None
  if kind is tf.RaggedTensor and any(v.ragged_rank != 1 for v in xs + ws if v is not None):
    return None
  if kind is tf.SparseTensor and len({x.indices.shape[-1] for x in xs}) != 1:
    return None
  weighted = [w is not None for w in ws]
  if any(weighted) and not (all(weighted) and all(
      w.dtype.is_floating or w.dtype.is_integer for w in ws)):
    return None
  flat = (lambda v: tf.reshape(v, [-1])) if kind is tf.Tensor else (lambda v: v.values)
  names = {"where": where}
  rows = []  # (check, item), in feature_occurrences' order
  if xs[0].dtype == tf.uint64:
    vocab = config.table.vocabulary_size
    rows.append((checks.UNSIGNED_IDS, check_runner.Item(
        tf.concat([flat(x) for x in xs], 0), (vocab,), dict(names, vocab=vocab))))
  if kind is tf.SparseTensor:
    bounds = _dense_shapes(xs)
    rows.append((checks.SPARSE_INDICES, check_runner.Item(
        tf.concat([x.indices for x in xs], 0), (bounds,), names)))
  if all(weighted):
    rows.append((checks.WEIGHTS_FINITE, check_runner.Item(
        tf.concat([tf.cast(flat(w), tf.float32) for w in ws], 0), names=names)))
  return [check_runner.run(check, [item]) for check, item in rows]


def concatenated(per_replica: List[List[Occurrences]]) -> List[Occurrences]:
  """Each feature's occurrences of several replicas as one, for the input
  checks only (``check_runner.batch_verdict`` reads ``ids``, ``weights_ok``
  and ``checks``): ids concatenated in replica order, so the first bad id
  found is that of the first replica that has one; every replica's own
  verdicts. Nothing else is meaningful (rows and gains stay replica 0's)."""
  merged = []
  for feature in zip(*per_replica):
    layouts = [o.weights_ok for o in feature if o.weights_ok is not None]
    merged.append(feature[0]._replace(
        ids=tf.concat([o.ids for o in feature], 0),
        weights_ok=tf.stack(layouts) if layouts else None,
        checks=tuple(v for o in feature for v in o.checks)))
  return merged


def _dense_shapes(xs) -> tf.Tensor:
  """The dense_shape each index row of the replicas' SparseTensors ``xs``
  is bounded by: one for all of them when their shapes are static and equal
  (a fully defined static shape is the dense_shape's value: TensorFlow
  derives it from that tensor, or makes the tensor from it), else each
  replica's own, one row per index row."""
  static = {tuple(x.shape.as_list()) if x.shape.is_fully_defined() else None
            for x in xs}
  if len(static) == 1 and None not in static:
    return tf.constant(static.pop(), tf.int64)
  rows = tf.stack([tf.shape(x.indices, tf.int64) for x in xs])[:, 0]
  return tf.repeat(tf.stack([x.dense_shape for x in xs]), rows, axis=0)
