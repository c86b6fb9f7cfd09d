"""Input checks: ids in range, weights laid out as their ids, finite
gradients, matching structures.

A step that fails a check changes no table, slot or step. Where the check
runs depends on how the step runs:

* eagerly: it raises ``InputError`` at once;
* in a graph: one ``tf.debugging.Assert`` per kind of check, which every
  gather and write waits for;
* under XLA (``jit_compile=True``): XLA drops ``Assert`` and clamps
  out-of-range gathers, so a check cannot stop the step. It becomes a
  predicate instead: the engine writes nothing when it is false, records the
  failure, poisons the bad feature's activations with NaN (so the loss shows
  it at once) and raises the ``InputError`` at the next eager call
  (``CPUEmbedding.raise_if_failed``).

Every check has the same shape, a ``Verdict``, so the engine handles the
three cases in one place.
"""

from __future__ import annotations

import re
from typing import List, NamedTuple, Optional, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.util import nest

from tpu_embed_ext import errors
from tpu_embed_ext.spec.numeric_traps import MAX_LEARNING_RATE

__all__ = ["Verdict", "in_xla_context", "check_structure", "check_ids",
           "check_finite", "check_gradient", "check_output_shape",
           "check_fully_defined", "feature_path", "listed", "check_same_layout",
           "check_same_indices", "IDS_OUT_OF_RANGE", "NOT_FINITE",
           "NOT_FINITE_UPDATE", "WEIGHTS_MISMATCH", "finite_message",
           "weights_layout_ok", "aligned_weights", "check_weights", "combine",
           "failure_message", "check_gradient_type", "status",
           "SPARSE_INDEX_OUT_OF_RANGE", "WEIGHTS_NOT_FINITE",
           "UNSIGNED_IDS_OUT_OF_RANGE", "FeatureCheck", "check_sparse_indices",
           "check_weights_finite", "check_unsigned_ids", "check_features",
           "sparse_index_message", "weights_finite_message",
           "LEARNING_RATE_OUT_OF_RANGE", "check_rates", "rate_message"]

# Failure kinds recorded under XLA: (kind, index, value).
IDS_OUT_OF_RANGE = 1   # index: feature, value: the offending id
NOT_FINITE = 2         # index: table
NOT_FINITE_UPDATE = 3  # index: table, value: variable (0: parameters, k: slot k)
WEIGHTS_MISMATCH = 4   # index: feature
SPARSE_INDEX_OUT_OF_RANGE = 5   # index: feature, value: the offending index
LEARNING_RATE_OUT_OF_RANGE = 6  # index: table, value: the rate's float32 bits
WEIGHTS_NOT_FINITE = 7          # index: feature
UNSIGNED_IDS_OUT_OF_RANGE = 8   # index: feature, value: the uint64 id's bits


class Verdict(NamedTuple):
  """The outcome of one check inside a graph (eager checks raise instead)."""
  ok: tf.Tensor                          # scalar bool
  assertion: Optional[tf.Operation]      # None under XLA
  failure: tf.Tensor                     # int64 [3]: kind, index, value
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


def check_structure(expected, what: str, value, fix: str):
  """``nest.assert_same_structure(expected, value)`` with a clearer message.

  ``TPUEmbedding.enqueue`` and ``apply_gradients`` run
  ``nest.assert_same_structure(self._feature_config, ...)``
  (``tpu_embedding_v2.py``): a different kind of sequence (a list for a
  tuple) is a ``TypeError``, any other difference a ``ValueError``. Ours
  raise ``InputTypeError`` and ``InputError``, subclasses of those.
  """
  try:
    nest.assert_same_structure(expected, value)
  except (TypeError, ValueError) as e:
    cls = errors.InputTypeError if isinstance(e, TypeError) else errors.InputError
    # nest's own first line ("The two structures don't have the same nested
    # structure."), which users' tests written against a TPU match.
    tf_phrase = (str(e).strip().splitlines() or [""])[0]
    tf_phrase = f"{tf_phrase} " if tf_phrase else ""
    want = [p for p, _ in nest.flatten_with_joined_string_paths(expected)]
    paths = [p for p, _ in nest.flatten_with_joined_string_paths(value)]
    missing = sorted(set(want) - set(paths))
    unexpected = sorted(set(paths) - set(want))
    nested = [p for p in missing if any(u.startswith(f"{p}/") for u in unexpected)]
    if nested:  # A Python list (or dict) where one feature's tensor goes.
      raise cls(
          f"{tf_phrase}{what} entry '{nested[0]}' is a Python "
          f"{type(_at(value, nested[0])).__name__}, but each feature takes one "
          "tf.Tensor, tf.SparseTensor or tf.RaggedTensor. Fix: convert it, e.g. "
          "tf.constant(ids, tf.int64) for one id per row, or "
          "tf.ragged.constant(ids, tf.int64) for several.") from e
    if missing or unexpected:
      detail = f"missing {missing}, unexpected {unexpected}"
      if type(expected) is not type(value):
        detail += (f" (the feature config is a {_kinds(expected)}, {what} a "
                   f"{_kinds(value)})")
    else:
      detail = (f"the feature config is a {_kinds(expected)}, {what} a "
                f"{_kinds(value)}")
    raise cls(f"{tf_phrase}{what} do not match the feature config's structure: "
              f"{detail}. Fix: {fix}") from e


def _at(structure, path: str):
  """The entry of ``structure`` at a joined string path (``a/0/b``)."""
  for key in path.split("/"):
    if isinstance(structure, (list, tuple)):
      structure = structure[int(key)]
    elif isinstance(structure, dict):
      structure = structure[key] if key in structure else next(
          v for k, v in structure.items() if str(k) == key)
    else:
      structure = getattr(structure, key)
  return structure


def _kinds(structure) -> str:
  """The container types of a nested structure, outermost first."""
  kinds = []
  while isinstance(structure, (list, tuple, dict)) and structure:
    kinds.append(type(structure).__name__)
    structure = (next(iter(structure.values())) if isinstance(structure, dict)
                 else structure[0])
  return " of ".join(kinds) or type(structure).__name__


def check_output_shape(where: str, stored: tf.TensorShape,
                       incoming: tf.TensorShape):
  """InputError if ``incoming`` contradicts the feature's ``stored`` shape.

  ``tpu_embedding_v2.py`` ``_check_output_shapes``: unknown dimensions match
  anything; an incoming rank-1 or rank-2 shape is not compared with a stored
  shape of higher rank (a ragged or sequence input filling a larger
  ``output_shape``).
  """
  if not stored or not incoming:
    return
  if len(incoming) in (1, 2) and len(stored) > len(incoming):
    return
  if len(stored) != len(incoming) or any(
      a is not None and b is not None and a != b
      for a, b in zip(stored.as_list(), incoming.as_list())):
    raise errors.InputError(
        f"Inconsistent shape founded for input feature {feature_path(where)}, "
        f"Output shape is set to be {stored}, But got incoming output shape "
        f"{incoming}. {where}: the input gives activations of shape {listed(incoming)}, "
        f"but the feature's output shape is {listed(stored)} (from FeatureConfig.output_shape, "
        "build(), or the first batch). Fix: feed batches of the shape the "
        "feature was built with, or change FeatureConfig.output_shape.")


def feature_path(where: str) -> str:
  """The feature's joined path (TensorFlow's name for it in its messages).

  ``where`` is the engine's ``feature '<path>' (table '<name>')``
  (``tables.resolve_all``); TensorFlow's own phrases, which our messages
  start with (users' tests match them), name the feature by its path alone.
  """
  match = re.match(r"feature '(.*)' \(table '.*'\)$", where, re.S)
  return match.group(1) if match else where


def check_fully_defined(where: str, shape: tf.TensorShape):
  """``tpu_embedding_v2.py`` ``_check_output_shapes_fully_defined``."""
  if not shape.is_fully_defined():
    # Under MultiWorkerMirroredStrategy, drop_remainder=True is not enough:
    # for a dataset that is not infinite, tf.distribute turns on its
    # partial-batch handling in multi-worker mode even for static shapes
    # (input_lib._enable_get_next_as_optional), handing a worker whose data
    # ran out empty batches, so every batch's size becomes unknown.
    raise errors.InputError(
        f"Input Feature {feature_path(where)} has output shape set as {shape} "
        f"which is not fully defined. {where}: output shape {listed(shape)} is "
        "not fully defined; the TPU "
        "compiles every activation shape. Fix: give static shapes: batch with "
        "drop_remainder=True, and under MultiWorkerMirroredStrategy also repeat "
        "the dataset (dataset.repeat(), bounding the loop by steps): on a finite "
        "dataset it gives batches of unknown size even with drop_remainder=True "
        "(a worker whose data runs out gets empty batches); or set "
        "FeatureConfig.output_shape, or fully defined "
        "build(per_replica_input_shapes=...).")


def ids_message(where: str, vocab: int, bad) -> str:
  return (f"{where}: id {bad} is out of range [0, {vocab}). Fix: map ids into "
          f"the vocabulary (e.g. hash them modulo {vocab}) or enlarge "
          "vocabulary_size.")


def not_finite_message(table: str) -> str:
  return (f"table '{table}': gradient has NaN or Inf values; no table, slot or "
          "step was changed. Fix: check the loss for overflow, or clip the "
          "activations' gradients.")


def check_ids(wheres: List[str], ids: List[tf.Tensor],
              vocabs: List[int]) -> Optional[Verdict]:
  """Every id of feature ``i`` in ``[0, vocabs[i])``.

  Eagerly raises (None returned); in a graph returns a Verdict: two
  reductions per feature, one assertion for all (an empty feature gives
  min=MAX, max=MIN, which passes).
  """
  if tf.executing_eagerly():
    for where, x, vocab in zip(wheres, ids, vocabs):
      if tf.size(x) == 0:
        continue
      low, high = int(tf.reduce_min(x)), int(tf.reduce_max(x))
      if low < 0 or high >= vocab:
        raise errors.InputError(ids_message(where, vocab, low if low < 0 else high))
    return None
  low = tf.stack([tf.reduce_min(x) for x in ids])
  high = tf.stack([tf.reduce_max(x) for x in ids])
  bad = tf.logical_or(low < 0, high >= tf.constant(vocabs, tf.int64))
  first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
  value = tf.where(tf.gather(low, first) < 0, tf.gather(low, first),
                   tf.gather(high, first))
  ok = tf.logical_not(tf.reduce_any(bad))
  failure = tf.stack([tf.constant(IDS_OUT_OF_RANGE, tf.int64), first, value])
  assertion = None
  if not in_xla_context():
    messages = tf.constant([
        f"{w}: ids must be in [0, {v}). Fix: map ids into the vocabulary or "
        "enlarge vocabulary_size." for w, v in zip(wheres, vocabs)])
    assertion = tf.debugging.Assert(
        ok, [tf.boolean_mask(messages, bad), "Smallest and largest ids:",
             tf.boolean_mask(low, bad), tf.boolean_mask(high, bad)],
        summarize=8)
  return Verdict(ok, assertion, failure, tf.logical_not(bad))


def check_finite(tables: List[str], tensors: List[List[tf.Tensor]],
                 kind: int = NOT_FINITE,
                 variables: Optional[List[List[str]]] = None,
                 after=None) -> Optional[Verdict]:
  """Every tensor of every table is finite.

  ``kind`` NOT_FINITE: ``tensors[i]`` is what table ``i`` applies (per-id
  sums, so an overflowing sum is caught too); NOT_FINITE_UPDATE: the rows
  it would write, named by ``variables[i]`` (parameters, then slots). Eagerly
  raises; in a graph returns a Verdict whose failure is ``(kind, table,
  variable)``; its assertion runs ``after`` the given op, so the gradient
  check reports before the check of what the gradients produce.
  """
  variables = variables or [["gradient"] * len(ts) for ts in tensors]
  finite = [[tf.reduce_all(tf.math.is_finite(x)) for x in ts] for ts in tensors]
  if tf.executing_eagerly():
    for table, names, oks in zip(tables, variables, finite):
      for name, ok in zip(names, oks):
        if not bool(ok):
          raise errors.InputError(finite_message(kind, table, name))
    return None
  flat = [ok for oks in finite for ok in oks] or [tf.constant(True)]
  table_of = [i for i, oks in enumerate(finite) for _ in oks] or [0]
  variable_of = [j for oks in finite for j in range(len(oks))] or [0]
  flat = tf.stack(flat)
  ok = tf.reduce_all(flat)
  first = tf.argmax(tf.cast(tf.logical_not(flat), tf.int32))
  failure = tf.stack([tf.constant(kind, tf.int64),
                      tf.gather(tf.constant(table_of, tf.int64), first),
                      tf.gather(tf.constant(variable_of, tf.int64), first)])
  per_table = tf.stack([tf.reduce_all(tf.stack(oks)) if oks else tf.constant(True)
                        for oks in finite]) if finite else tf.ones([0], tf.bool)
  assertion = None
  if not in_xla_context():
    if kind == NOT_FINITE:
      head = ("gradient has NaN or Inf values; no table, slot or step was "
              "changed. Fix: check the loss for overflow, or clip the "
              "activations' gradients. Tables:")
      labels = [f"table '{t}'" for t, ns in zip(tables, variables) for _ in ns]
    else:
      head = ("the update would write NaN or Inf; no table, slot or step was "
              "changed. Fix: lower the learning rate, or clip gradients "
              "(clipvalue) or weights (clip_weight_min / clip_weight_max). "
              "Where:")
      labels = [f"table '{t}' {n}" for t, ns in zip(tables, variables) for n in ns]
    names = tf.constant(labels or [""])
    with tf.control_dependencies([after] if after is not None else []):
      assertion = tf.debugging.Assert(
          ok, [head, tf.boolean_mask(names, tf.logical_not(flat))])
  return Verdict(ok, assertion, failure, per_table)


def finite_message(kind: int, table: str, variable: str) -> str:
  if kind == NOT_FINITE:
    return not_finite_message(table)
  return (f"table '{table}': the update would write NaN or Inf into its "
          f"{variable}; no table, slot or step was changed. Fix: lower the "
          "learning rate, or clip gradients (clipvalue) or weights "
          "(clip_weight_min / clip_weight_max).")


def check_gradient_type(where: str, grad):
  """A gradient must be a ``tf.Tensor`` (or None), as ``apply_gradients`` says."""
  if grad is not None and not isinstance(grad, tf.Tensor):
    raise errors.InputError(
        f"found non-tensor type: {type(grad)} at path {feature_path(where)}. "
        f"{where}: gradient is a {type(grad).__name__}, not a tf.Tensor. Fix: "
        "pass dL/d(activation) as a tensor (tf.convert_to_tensor), or None "
        "for a zero gradient.")


def check_gradient(where: str, grad, expected: List[int]):
  """A gradient must be a ``tf.Tensor`` of its activation's static shape.

  ``TPUEmbedding.apply_gradients`` (``tpu_embedding_v2.py``) raises
  ``ValueError`` for a non-tensor gradient and for a static shape other than
  the activation's (an unknown dimension included), eagerly and in graphs.
  """
  check_gradient_type(where, grad)
  # A dimension known only when the batch runs (our lookups without a TPU
  # program, see CPUEmbedding.__call__) is checked for compatibility.
  expected = [d if isinstance(d, int) else None for d in expected]
  want = tf.TensorShape(expected)
  if (grad.shape != want if want.is_fully_defined()
      else not grad.shape.is_compatible_with(want)):
    raise errors.InputError(
        f"{where}: gradient shape {listed(grad.shape)} does not match its activation "
        f"shape {expected}. Fix: pass dL/d(activation) for exactly the "
        "activations dequeue() returned.")


WEIGHTS_MESSAGE = ("weights do not match the ids (other row lengths, other "
                   "indices, or another number of weights). Fix: give one "
                   "weight per id, in the same rows (ragged) or at the same "
                   "indices (sparse).")


def weights_layout_ok(where, ids, weights) -> Optional[tf.Tensor]:
  """Whether ragged or sparse ``weights`` are laid out as ``ids``.

  Eagerly raises ``InputError`` (None returned). In a graph returns a scalar
  bool for ``check_weights``; a difference already visible in the static
  shapes raises when the function is traced.
  """
  ragged = isinstance(ids, tf.RaggedTensor)
  if tf.executing_eagerly():
    (check_same_layout if ragged else check_same_indices)(where, ids, weights)
    return None
  a, b = ((ids.row_splits, weights.row_splits) if ragged
          else (ids.indices, weights.indices))
  if (not a.shape[1:].is_compatible_with(b.shape[1:]) or (
      a.shape.is_fully_defined() and b.shape.is_fully_defined() and a.shape != b.shape)):
    raise errors.InputError(
        f"{where}: {WEIGHTS_MESSAGE} (found when the function was traced: "
        f"{'row splits' if ragged else 'indices'} of shape "
        f"{listed(b.shape)} for ids of shape {listed(a.shape)})")
  # No tf.cond: XLA compiles both branches, with the shapes that differ.
  # b's rows, as many as a has (a row of -1 beyond b's end), are compared.
  b = tf.cast(b, a.dtype)
  padded = tf.concat([b, -tf.ones_like(b[:1]) if b.shape.rank == 1 else
                      -tf.ones([1, tf.shape(b)[1]], b.dtype)], 0)
  rows_a, rows_b = tf.shape(a, out_type=tf.int64)[0], tf.shape(b, out_type=tf.int64)[0]
  aligned = tf.gather(padded, tf.minimum(tf.range(rows_a), rows_b))
  return tf.logical_and(tf.equal(rows_a, rows_b),
                        tf.reduce_all(tf.equal(a, aligned)))


def aligned_weights(values: tf.Tensor, count) -> tf.Tensor:
  """Exactly ``count`` weights from ``values``, whatever their number.

  In a graph a mismatch is reported by ``check_weights``; until then the
  ops that combine weights with ids must not fail with TensorFlow's own
  "Incompatible shapes" first. Equal to ``values`` when the counts match.
  """
  padded = tf.concat([tf.cast(values, tf.float32), [1.0]], 0)
  size = tf.size(values, out_type=tf.int64)
  return tf.gather(padded, tf.minimum(tf.range(count, dtype=tf.int64), size))


def check_weights(wheres: List[str], oks: List[Optional[tf.Tensor]]) -> Optional[Verdict]:
  """In a graph: a Verdict that every feature's weights match its ids."""
  if tf.executing_eagerly() or all(ok is None for ok in oks):
    return None
  per_item = tf.stack([tf.constant(True) if ok is None else ok for ok in oks])
  ok = tf.reduce_all(per_item)
  first = tf.argmax(tf.cast(tf.logical_not(per_item), tf.int32), output_type=tf.int64)
  failure = tf.stack([tf.constant(WEIGHTS_MISMATCH, tf.int64), first,
                      tf.constant(0, tf.int64)])
  assertion = None
  if not in_xla_context():
    names = tf.constant([f"{w}: {WEIGHTS_MESSAGE}" for w in wheres])
    assertion = tf.debugging.Assert(
        ok, [tf.boolean_mask(names, tf.logical_not(per_item))])
  return Verdict(ok, assertion, failure, per_item)


class FeatureCheck(NamedTuple):
  """In a graph, one check of one feature's inputs (``check_features``)."""
  kind: int                          # SPARSE_INDEX_OUT_OF_RANGE, ...
  ok: tf.Tensor                      # scalar bool
  value: tf.Tensor                   # int64: what failed, for the message
  assertion: Optional[tf.Operation]  # None under XLA


def _feature_check(kind: int, ok, value, message: str, shown) -> FeatureCheck:
  assertion = None
  if not in_xla_context():
    assertion = tf.debugging.Assert(ok, [message, *shown], summarize=8)
  return FeatureCheck(kind, ok, tf.cast(value, tf.int64), assertion)


def _first(flags, values):
  """``values[i]`` of the first true ``flags[i]`` (0 when none)."""
  flags = tf.concat([tf.reshape(flags, [-1]), [False]], 0)
  values = tf.concat([tf.reshape(values, [-1]), tf.zeros([1], values.dtype)], 0)
  return tf.gather(values, tf.argmax(tf.cast(flags, tf.int32), output_type=tf.int64))


def sparse_index_message(where: str, value, detail: str = "") -> str:
  return (f"{where}: SparseTensor index {value} is outside the dense_shape of "
          f"the ids{detail}; its id would be looked up into, and trained by, "
          "another output row. Fix: build the SparseTensor with every index in "
          "[0, dense_shape) in its dimension (dense_shape[0] is the batch "
          "size), e.g. with tf.sparse.from_dense or RaggedTensor.to_sparse().")


def check_sparse_indices(where: str, x: tf.SparseTensor) -> Optional[FeatureCheck]:
  """Every index of ``x`` in ``[0, dense_shape)``, dimension by dimension.

  Rows and sequence positions are computed from the indices; one outside
  ``dense_shape`` would name another output row (TensorFlow's segment ops
  raise a message naming no feature; XLA clamps or drops it, so the id
  silently gets another row's gradient). Eagerly raises ``InputError``
  (None returned); in a graph returns a ``FeatureCheck`` whose assertion
  (None under XLA) the feature's rows wait for.
  """
  indices = tf.convert_to_tensor(x.indices, tf.int64)
  shape = tf.convert_to_tensor(x.dense_shape, tf.int64)
  bad = tf.logical_or(indices < 0, indices >= shape[None, :])
  if tf.executing_eagerly():
    where_bad = tf.where(bad).numpy()
    if where_bad.size:
      i, d = (int(v) for v in where_bad[0])
      value = int(indices[i, d])
      raise errors.InputError(sparse_index_message(
          where, value, f" {shape.numpy().tolist()} (index "
          f"{indices[i].numpy().tolist()}: {value} is not in [0, "
          f"{int(shape[d])}) in dimension {d})"))
    return None
  value = _first(bad, indices)
  return _feature_check(SPARSE_INDEX_OUT_OF_RANGE, tf.logical_not(tf.reduce_any(bad)),
                        value, sparse_index_message(where, "(below)"),
                        ["Index outside:", value, "dense_shape:", shape])


def weights_finite_message(where: str) -> str:
  return (f"{where}: weights have NaN or Inf values; no table, slot or step was "
          "changed. Fix: give finite weights (check how they are computed, or "
          "replace them with tf.where(tf.math.is_finite(w), w, 0.0)).")


def check_weights_finite(where: str, weights: tf.Tensor) -> Optional[FeatureCheck]:
  """A feature's weights are inputs: NaN or Inf is named as theirs (it
  otherwise reached the gradient check, which blamed the gradient)."""
  finite = tf.math.is_finite(weights)
  if tf.executing_eagerly():
    if not bool(tf.reduce_all(finite)):
      raise errors.InputError(weights_finite_message(where))
    return None
  return _feature_check(WEIGHTS_NOT_FINITE, tf.reduce_all(finite),
                        tf.constant(0, tf.int64), weights_finite_message(where), [])


def check_unsigned_ids(where: str, ids: tf.Tensor, vocab: int) -> Optional[FeatureCheck]:
  """uint64 ids in ``[0, vocab)`` before they become int64 (where one of
  2^63 or more would read as a negative id, and be reported so)."""
  if tf.executing_eagerly():
    if tf.size(ids) and int(tf.reduce_max(ids)) >= vocab:
      raise errors.InputError(ids_message(where, vocab, int(tf.reduce_max(ids))))
    return None
  high = tf.reduce_max(tf.concat([tf.reshape(ids, [-1]), tf.zeros([1], ids.dtype)], 0))
  return _feature_check(
      UNSIGNED_IDS_OUT_OF_RANGE, high < tf.constant(vocab, ids.dtype),
      tf.bitcast(high, tf.int64),
      f"{where}: ids must be in [0, {vocab}). Fix: map ids into the vocabulary "
      "or enlarge vocabulary_size.", ["Largest id:", high])


def check_features(checks: List[Tuple[FeatureCheck, ...]]) -> Optional[Verdict]:
  """In a graph: a Verdict of every feature's own input checks (each feature
  lists its ``FeatureCheck``s; the first failure is reported)."""
  if tf.executing_eagerly() or not any(checks):
    return None
  flat = [(i, c) for i, cs in enumerate(checks) for c in cs]
  oks = tf.stack([c.ok for _, c in flat])
  failures = tf.stack([tf.stack([tf.constant(c.kind, tf.int64),
                                 tf.constant(i, tf.int64), c.value])
                       for i, c in flat])
  failure = tf.gather(failures, tf.argmax(tf.cast(tf.logical_not(oks), tf.int32)))
  per_item = tf.stack([tf.reduce_all(tf.stack([c.ok for c in cs])) if cs
                       else tf.constant(True) for cs in checks])
  assertions = [c.assertion for _, c in flat if c.assertion is not None]
  return Verdict(tf.reduce_all(oks),
                 tf.group(*assertions) if assertions else None, failure, per_item)


# A callable's rate is held at every step to the bounds a config's rate is
# held to when the spec is made (optimizers.py: >= 0; numeric_traps.py).
_RATE_RULE = (f"a rate must be a finite number in [0, {MAX_LEARNING_RATE:g}] "
              "(below 0 the step climbs the loss; above, one step moves a weight "
              "by lr * g and float32 overflows). No table, slot or step was "
              "changed. Fix: make the callable return a rate in "
              f"[0, {MAX_LEARNING_RATE:g}], such as 0.01.")


def rate_message(table: str, value: float) -> str:
  return f"table '{table}': its learning-rate callable gave {value:g} this step; {_RATE_RULE}"


def check_rates(tables: List[str], rates: List[Optional[tf.Tensor]]) -> Optional[Verdict]:
  """This step's rate of every table with a callable rate (None: a constant,
  checked when the spec was made) in ``[0, MAX_LEARNING_RATE]``.

  Eagerly raises ``InputError``; in a graph returns a Verdict whose failure is
  ``(LEARNING_RATE_OUT_OF_RANGE, table, float32 bits of the rate)``.
  """
  checked = [(i, r) for i, r in enumerate(rates) if r is not None]
  if not checked:
    return None
  if tf.executing_eagerly():
    for i, rate in checked:
      value = float(rate)
      if not 0.0 <= value <= MAX_LEARNING_RATE:  # NaN fails both
        raise errors.InputError(rate_message(tables[i], value))
    return None
  values = tf.stack([tf.cast(r, tf.float32) for _, r in checked])
  per_item = tf.logical_and(values >= 0.0, values <= MAX_LEARNING_RATE)
  ok = tf.reduce_all(per_item)
  first = tf.argmax(tf.cast(tf.logical_not(per_item), tf.int32), output_type=tf.int64)
  index = tf.gather(tf.constant([i for i, _ in checked], tf.int64), first)
  bits = tf.cast(tf.bitcast(tf.gather(values, first), tf.int32), tf.int64)
  failure = tf.stack([tf.constant(LEARNING_RATE_OUT_OF_RANGE, tf.int64), index, bits])
  assertion = None
  if not in_xla_context():
    names = tf.constant([f"table '{tables[i]}'" for i, _ in checked])
    assertion = tf.debugging.Assert(ok, [
        f"a learning-rate callable gave a rate out of range this step; {_RATE_RULE} "
        "Tables and rates:", tf.boolean_mask(names, tf.logical_not(per_item)),
        tf.boolean_mask(values, tf.logical_not(per_item))])
  per_table = tf.tensor_scatter_nd_update(
      tf.ones([len(rates)], tf.bool), [[i] for i, _ in checked], per_item)
  return Verdict(ok, assertion, failure, per_table)


def combine(verdicts: List[Optional[Verdict]]) -> Optional[Verdict]:
  """One Verdict for several checks of the same features (first failure wins)."""
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
  """``[[ok, kind, index, value]]`` of a replica's input checks, for the merge.

  In a graph without XLA it is computed after the assertion, so whatever
  waits for it waits for the checks.
  """
  if verdict is None:
    return tf.constant([[1, 0, 0, 0]], tf.int64)
  deps = [verdict.assertion] if verdict.assertion is not None else []
  with tf.control_dependencies(deps):
    return tf.concat([[tf.cast(verdict.ok, tf.int64)], verdict.failure], 0)[None]


def failure_message(kind: int, index: int, value: int, features, tables) -> str:
  """The message of a failure recorded under XLA (``raise_if_failed``).

  ``features`` and ``tables`` are the engine's (``.where``, ``.table``;
  ``.name``, ``.config``, slot names by ``slots(table)``).
  """
  if kind == IDS_OUT_OF_RANGE:
    feature = features[index]
    return ids_message(feature.where,
                       tables[feature.table].config.vocabulary_size, value)
  if kind == WEIGHTS_MISMATCH:
    return f"{features[index].where}: {WEIGHTS_MESSAGE}"
  if kind == SPARSE_INDEX_OUT_OF_RANGE:
    return sparse_index_message(features[index].where, value)
  if kind == WEIGHTS_NOT_FINITE:
    return weights_finite_message(features[index].where)
  if kind == UNSIGNED_IDS_OUT_OF_RANGE:
    feature = features[index]
    return ids_message(feature.where, tables[feature.table].config.vocabulary_size,
                       value % 2 ** 64)
  if kind == LEARNING_RATE_OUT_OF_RANGE:
    rate = np.array(value, np.int64).astype(np.int32).view(np.float32)
    return rate_message(tables[index].name, float(rate))
  table = tables[index]
  slots = table.optimizer.slot_names if table.optimizer is not None else ()
  return finite_message(kind, table.name, ("parameters", *slots)[value])


def check_same_layout(where, ids: tf.RaggedTensor, weights: tf.RaggedTensor):
  if tf.executing_eagerly() and (
      ids.row_splits.shape != weights.row_splits.shape or not bool(tf.reduce_all(
          tf.equal(ids.row_splits,
                   tf.cast(weights.row_splits, ids.row_splits.dtype))))):
    raise errors.InputError(
        f"{where}: weights have row lengths {weights.row_lengths().numpy().tolist()} "
        f"but ids {ids.row_lengths().numpy().tolist()}. Fix: give one weight "
        "per id, in the same rows.")


def check_same_indices(where, ids: tf.SparseTensor, weights: tf.SparseTensor):
  if tf.executing_eagerly():
    same = (ids.indices.shape == weights.indices.shape and bool(
        tf.reduce_all(tf.equal(ids.indices, weights.indices))))
    if not same:
      raise errors.InputError(
          f"{where}: weights' indices do not match the ids' indices. Fix: give "
          "one weight per id, at the same indices.")


def listed(shape: tf.TensorShape):
  """``[2, None]`` for a known rank, the shape itself otherwise."""
  return shape.as_list() if shape.rank is not None else shape
