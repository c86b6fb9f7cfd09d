"""A step's input checks as data, and the batches they prepare.

``INPUT_CHECKS`` lists which rows of ``checks`` run over a batch's inputs,
what each reads of a feature (its ``CheckItems``) and when; one loop runs
them (``feature_checks``, then ``batch_verdict``), as absl's flag validators
are a list run by one loop. The same calls run over one replica's items or
over every replica's items joined in replica order (``joined``): a row's
predicate is element-wise, so the first bad value in replica order is the
one reported, with the row's own message (it names the feature, not the
replica).

A batch is prepared in three steps (``prepare``): each feature's ids and
weights are read (``read``: what is wrong in their structure or static
shapes raises at once, in feature order), the rows that read the inputs
run, and only then are the occurrences built (``lookups``), from inputs
that wait for those rows' assertions in a graph: eagerly a row raises
before any occurrence is built, so TensorFlow's own errors (a segment sum
over sparse indices outside the dense_shape) never come first. The rows
that read the occurrences (ids in range) run last.

One ``enqueue`` of every replica's batch, traced in a graph outside XLA,
runs each row once over all replicas' values (building them per replica
dominated tracing at 8 replicas, issue 34). Under XLA each replica keeps
its own verdict (its activations alone turn NaN); eagerly each replica's
batch raises in turn.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tpu_embed_ext.emulation import (check_runner, checks, lookups, protocol,
                                      rules as rules_lib, structure_checks)

__all__ = ["CheckItems", "FeatureInput", "InputCheck", "INPUT_CHECKS", "read",
           "feature_checks", "batch_verdict", "joined", "gated", "flat_inputs",
           "prepare"]


class CheckItems(NamedTuple):
  """What the input checks read of one feature (None: nothing to read), of
  one replica or of every replica joined."""
  unsigned: Optional[tf.Tensor] = None  # uint64 ids, before they become int64
  indices: Optional[tf.Tensor] = None   # [n, rank] int64 indices of sparse ids
  bounds: Optional[tf.Tensor] = None    # their dense_shape [rank] (or [n, rank])
  weights: Optional[tf.Tensor] = None   # [n] float32 weights
  layout: Optional[tf.Tensor] = None    # bool, [] or [replicas]: weights laid
                                        # out as the ids (WEIGHTS_LAYOUT)
  ids: Optional[tf.Tensor] = None       # [n] int64 ids of the occurrences


class FeatureInput(NamedTuple):
  """One feature's ids and weights as read, before its occurrences."""
  ids: Any                       # tf.Tensor, tf.SparseTensor or tf.RaggedTensor
  weights: Optional[tf.Tensor]   # float32 values, one per id (None: unweighted)
  shape: list                    # the activation shape (lookups.runtime_dims)
  items: CheckItems              # what the checks read (empty: not validating)


class InputCheck(NamedTuple):
  """One row of the schedule."""
  check: checks.Check
  # (values, *bounds) of the check's Item for one feature's items and its
  # table's vocabulary_size; None: nothing to check.
  reads: Callable[[CheckItems, int], Optional[tuple]]
  # Reads the inputs: eagerly it raises as its feature is read, before the
  # feature's occurrences are built; otherwise once all features' are.
  of_inputs: bool
  # Its feature's occurrences are built from inputs that wait for it (in a
  # graph: its assertion); its verdicts are the feature's own
  # (check_runner.by_feature). In a graph every other row runs once over
  # all features, after the features' own, in this order.
  gates: bool


def _present(value, *bounds):
  return None if value is None else (value, *bounds)


INPUT_CHECKS: Tuple[InputCheck, ...] = (
    InputCheck(checks.UNSIGNED_IDS, lambda i, vocab: _present(i.unsigned, vocab),
               of_inputs=True, gates=True),
    InputCheck(checks.SPARSE_INDICES, lambda i, vocab: _present(i.indices, i.bounds),
               of_inputs=True, gates=True),
    InputCheck(checks.WEIGHTS_FINITE, lambda i, vocab: _present(i.weights),
               of_inputs=True, gates=True),
    InputCheck(checks.WEIGHTS_LAYOUT, lambda i, vocab: _present(i.layout),
               of_inputs=True, gates=False),
    InputCheck(checks.IDS_IN_RANGE, lambda i, vocab: _present(i.ids, vocab),
               of_inputs=False, gates=False),
)


def read(where: str, config, x, w, shape, rules: rules_lib.EngineRules,
         validate: bool) -> FeatureInput:
  """One feature's ids ``x`` and weights ``w`` as read for its activation
  ``shape`` (a ``TensorShape``): their kinds, dtypes and static shapes
  checked (raising at once, in ``TPUEmbedding``'s order); what the input
  checks read of them when ``validate``."""
  x = structure_checks.check_ids_and_weights(where, config, x, w, rules)
  shape = lookups.runtime_dims(x, tf.TensorShape(shape))
  lookups.check_rows(where, x, shape, rules)
  weights = structure_checks.float_weights(where, w)
  layout = None
  if validate and w is not None and not isinstance(x, tf.Tensor):
    layout = structure_checks.weights_layout_ok(where, x, w)
  if not isinstance(x, tf.Tensor):
    lookups.check_combined(where, config, x, shape)
  if not validate:
    return FeatureInput(x, weights, shape, CheckItems())
  sparse = isinstance(x, tf.SparseTensor)
  return FeatureInput(x, weights, shape, CheckItems(
      unsigned=(x if isinstance(x, tf.Tensor) else x.values)
      if x.dtype == tf.uint64 else None,
      indices=tf.convert_to_tensor(x.indices, tf.int64) if sparse else None,
      bounds=_dense_shape(x) if sparse else None,
      weights=weights, layout=layout))


def _dense_shape(x: tf.SparseTensor) -> tf.Tensor:
  """``x.dense_shape``; a constant when the static shape is fully defined
  (it is the dense_shape's value: TensorFlow derives it from that tensor,
  or makes the tensor from it), so that ``joined`` can tell equal shapes."""
  if x.shape.is_fully_defined():
    return tf.constant(x.shape.as_list(), tf.int64)
  return tf.convert_to_tensor(x.dense_shape, tf.int64)


def feature_checks(items: CheckItems, names) -> Tuple[check_runner.Verdict, ...]:
  """The rows run with one feature (``names``: its message fields and
  ``vocab``): eagerly every row that reads the inputs (the first failure
  raises); in a graph the rows that gate, as the feature's own verdicts."""
  eager = tf.executing_eagerly()
  verdicts = []
  for row in INPUT_CHECKS:
    if row.of_inputs if eager else row.gates:
      reads = row.reads(items, names["vocab"])
      if reads is not None:
        verdicts.append(check_runner.run(row.check, [
            check_runner.Item(reads[0], tuple(reads[1:]), names)]))
  return tuple(v for v in verdicts if v is not None)


def batch_verdict(items: Sequence[CheckItems], names,
                  own) -> Optional[check_runner.Verdict]:
  """The Verdict of a batch (each feature's ``items`` and ``names``; ``own``:
  each feature's ``feature_checks``): the features' own, then each other
  row over every feature. Eagerly the rows left raise (None returned)."""
  eager = tf.executing_eagerly()
  verdicts = [check_runner.by_feature(list(own))]
  for row in INPUT_CHECKS:
    if not row.of_inputs if eager else not row.gates:
      verdicts.append(_over_features(row, items, names))
  return check_runner.combine(verdicts)


def _over_features(row: InputCheck, items, names) -> Optional[check_runner.Verdict]:
  """``row`` run once over every feature that has something it reads (the
  first failing feature is reported); a feature without passes."""
  reads = [row.reads(i, n["vocab"]) for i, n in zip(items, names)]
  present = [k for k, r in enumerate(reads) if r is not None]
  verdict = check_runner.run(row.check, [
      check_runner.Item(reads[k][0], tuple(reads[k][1:]), names[k], k)
      for k in present])
  if verdict is None or len(present) == len(reads):
    return verdict
  oks = dict(zip(present, tf.unstack(verdict.per_item_ok, len(present))))
  return verdict._replace(per_item_ok=tf.stack(
      [oks.get(k, tf.constant(True)) for k in range(len(reads))]))


def joined(parts: Sequence[CheckItems]) -> CheckItems:
  """One feature's items of several replicas as one, in replica order:
  values concatenated, layouts stacked."""
  def cat(values):
    values = [v for v in values if v is not None]
    return tf.concat(values, 0) if values else None
  indices, bounds = _joined_indices([p for p in parts if p.indices is not None])
  layouts = [p.layout for p in parts if p.layout is not None]
  return CheckItems(
      unsigned=cat([None if p.unsigned is None else tf.reshape(p.unsigned, [-1])
                    for p in parts]),
      indices=indices, bounds=bounds, weights=cat([p.weights for p in parts]),
      layout=tf.stack(layouts) if layouts else None,
      ids=cat([p.ids for p in parts]))


def _joined_indices(parts: List[CheckItems]):
  """Several replicas' sparse indices as one ``[n, rank]`` and the
  dense_shape each index row is bounded by: one for all of them when their
  shapes are static and equal, else each replica's own, one row per index
  row. Indices of a lower rank get trailing zeros, bounded by 1."""
  if not parts:
    return None, None
  ranks = [p.indices.shape[-1] for p in parts]
  indices, bounds = [p.indices for p in parts], [p.bounds for p in parts]
  if None not in ranks and len(set(ranks)) > 1:
    top = max(ranks)
    indices = [tf.pad(i, [[0, 0], [0, top - r]]) for i, r in zip(indices, ranks)]
    bounds = [tf.concat([b, tf.ones([top - r], tf.int64)], 0)
              for b, r in zip(bounds, ranks)]
  static = {None if v is None else tuple(v) for v in
            (tf.get_static_value(b) for b in bounds)}
  if len(static) == 1 and None not in static:
    bound = tf.constant(np.array(static.pop(), np.int64))
  else:
    rows = tf.stack([tf.shape(i, out_type=tf.int64)[0] for i in indices])
    bound = tf.repeat(tf.stack(bounds), rows, axis=0)
  return tf.concat(indices, 0), bound


def gated(feature: FeatureInput, own) -> Tuple[Any, Optional[tf.Tensor]]:
  """``(ids, weights)`` of ``feature`` for its occurrences: in a graph, what
  a check reads is read only once the feature's own verdicts' assertions
  ran (uint64 ids, sparse indices, weights), and until the weights layout
  is checked, one weight per id."""
  gates = [v.assertion for v in own if v.assertion is not None]
  x, weights = feature.ids, feature.weights
  if gates:
    if x.dtype == tf.uint64:
      x = check_runner.after(x, gates)
    if isinstance(x, tf.SparseTensor):
      x = tf.SparseTensor(check_runner.after(x.indices, gates), x.values,
                          x.dense_shape)
    if weights is not None:
      weights = check_runner.after(weights, gates)
  if feature.items.layout is not None and not tf.executing_eagerly():
    weights = structure_checks.aligned_weights(weights, tf.size(x.values, tf.int64))
  return x, weights


# --- preparing one enqueue's batches -----------------------------------------

class _Settings(NamedTuple):
  features: Sequence[Any]   # the engine's tables.Feature list
  names: List[Dict[str, Any]]
  shapes: Any               # shapes.OutputShapes
  rules: rules_lib.EngineRules
  native: bool
  validate: bool
  strict: bool


def flat_inputs(feature_config, features, x, weights) -> Tuple[list, list]:
  """``(ids, weights)`` of a batch ``x`` (and its ``weights``), one entry per
  feature of ``features`` (the engine's), once their structures are checked
  against ``feature_config``, as ``TPUEmbedding.enqueue`` checks them first."""
  structure_checks.check_structure(
      feature_config, "features", x,
      "pass one entry per FeatureConfig "
      f"({', '.join(f.path for f in features)}), in the same containers.")
  flat = tf.nest.flatten(x, expand_composites=False)
  flat_weights = [None] * len(flat)
  if weights is not None:
    structure_checks.check_structure(
        feature_config, "weights", weights,
        "give weights the structure of features (None entries allowed).")
    flat_weights = list(tf.nest.flatten(weights))
  return [lookups.as_ids(f.where, ids) for f, ids in zip(features, flat)], flat_weights


def prepare(batches: Dict[Any, tuple], training: bool, *, features, tables,
            shapes, rules: rules_lib.EngineRules, native: bool, validate: bool,
            strict: bool = True,
            limit: Optional[Callable] = None) -> Dict[Any, protocol.Pending]:
  """``{replica: Pending}`` of one enqueue's ``{replica: (features, ids,
  weights)}`` (the structure given, then one entry per feature: the
  engine's ``_inputs``), checked; nothing is recorded in ``batches``.

  ``shapes`` (``shapes.OutputShapes``) gives each batch's activation shapes
  (``strict``: ``enqueue``'s rules, recording them); ``native``: combiner
  gains from the native ops; ``validate``: run the input checks. ``limit``
  (``(pending, replica) -> pending``) applies SparseCore's limits to each.
  """
  settings = _Settings(features, [
      {"where": f.where, "vocab": tables[f.table].config.vocabulary_size}
      for f in features], shapes, rules, native, validate, strict)
  limit = limit or (lambda pending, replica: pending)
  if (len(batches) > 1 and validate and not tf.executing_eagerly()
      and not check_runner.in_xla_context()):
    return _together(batches, training, settings, limit)
  prepared = {}
  for replica, (structure, ids, weights) in batches.items():
    inputs, own = _read(settings, ids, weights, checked=True)
    occurrences = _occurrences(settings, inputs, own)
    verdict = None
    if validate:
      verdict = batch_verdict([i.items._replace(ids=o.ids) for i, o in
                               zip(inputs, occurrences)], settings.names, own)
    prepared[replica] = limit(protocol.Pending(structure, occurrences, verdict,
                                               training), replica)
  return prepared


def _together(batches, training, settings: _Settings, limit):
  """``prepare`` of several replicas' batches in a graph outside XLA: each
  row runs once over every replica's items joined."""
  read_in = {replica: _read(settings, ids, weights, checked=False)[0]
             for replica, (_, ids, weights) in batches.items()}
  per_feature = list(zip(*read_in.values()))  # [feature][replica]
  items = [joined([i.items for i in inputs]) for inputs in per_feature]
  own = [feature_checks(i, n) for i, n in zip(items, settings.names)]
  occurrences = {replica: _occurrences(settings, inputs, own)
                 for replica, inputs in read_in.items()}
  items = [i._replace(ids=tf.concat([occ[k].ids for occ in occurrences.values()], 0))
           for k, i in enumerate(items)]
  verdict = batch_verdict(items, settings.names, own)
  return {replica: limit(protocol.Pending(structure, occurrences[replica], verdict,
                                          training), replica)
          for replica, (structure, _, _) in batches.items()}


def _read(settings: _Settings, ids, weights, checked: bool):
  """Every feature of one replica's batch ``read``; with ``checked``, each
  feature's ``feature_checks`` run as it is read (eagerly the first failure
  raises before the next feature is read). Records the batch's shapes."""
  batch_shapes = settings.shapes.for_batch(ids, settings.strict, settings.rules)
  inputs, own = [], []
  for f, x, w, shape, names in zip(settings.features, ids, weights, batch_shapes,
                                   settings.names):
    inputs.append(read(f.where, f.config, x, w, shape, settings.rules,
                       settings.validate))
    own.append(feature_checks(inputs[-1].items, names)
               if checked and settings.validate else ())
  if settings.strict:
    settings.shapes.record(batch_shapes)
  return inputs, own


def _occurrences(settings: _Settings, inputs, own) -> List[lookups.Occurrences]:
  return [lookups.occurrences(f.config, *gated(i, o), i.shape, settings.native)
          for f, i, o in zip(settings.features, inputs, own)]
