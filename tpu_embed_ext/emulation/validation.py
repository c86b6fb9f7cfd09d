"""Input checks: ids in range, finite gradients, matching structures.

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

from typing import List, NamedTuple, Optional

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.util import nest

from tpu_embed_ext import errors

__all__ = ["Verdict", "in_xla_context", "check_structure", "check_ids",
           "check_finite", "check_gradient", "check_output_shape",
           "check_fully_defined", "listed", "check_same_layout",
           "check_same_indices", "IDS_OUT_OF_RANGE", "NOT_FINITE"]

# Failure kinds recorded under XLA: (kind, index, value).
IDS_OUT_OF_RANGE = 1   # index: feature, value: the offending id
NOT_FINITE = 2         # index: table


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
    want = [p for p, _ in nest.flatten_with_joined_string_paths(expected)]
    paths = [p for p, _ in nest.flatten_with_joined_string_paths(value)]
    missing = sorted(set(want) - set(paths))
    unexpected = sorted(set(paths) - set(want))
    if missing or unexpected:
      detail = f"missing {missing}, unexpected {unexpected}"
    else:
      detail = (f"the feature config is a {_kinds(expected)}, {what} a "
                f"{_kinds(value)}")
    raise cls(f"{what} do not match the feature config's structure: "
              f"{detail}. Fix: {fix}") from e


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
        f"{where}: the input gives activations of shape {listed(incoming)}, "
        f"but the feature's output shape is {listed(stored)} (from FeatureConfig.output_shape, "
        "build(), or the first batch). Fix: feed batches of the shape the "
        "feature was built with, or change FeatureConfig.output_shape.")


def check_fully_defined(where: str, shape: tf.TensorShape):
  """``tpu_embedding_v2.py`` ``_check_output_shapes_fully_defined``."""
  if not shape.is_fully_defined():
    raise errors.InputError(
        f"{where}: output shape {listed(shape)} is not fully defined; the TPU "
        "compiles every activation shape. Fix: give static shapes (batch with "
        "drop_remainder=True), FeatureConfig.output_shape, or fully defined "
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


def check_finite(tables: List[str], grads: List[tf.Tensor]) -> Optional[Verdict]:
  """Every gradient a table will apply is finite (per-id sums: an overflowing
  sum is caught too)."""
  finite = [tf.reduce_all(tf.math.is_finite(g)) for g in grads]
  if tf.executing_eagerly():
    for table, ok in zip(tables, finite):
      if not bool(ok):
        raise errors.InputError(not_finite_message(table))
    return None
  finite = tf.stack(finite)
  ok = tf.reduce_all(finite)
  first = tf.argmax(tf.cast(tf.logical_not(finite), tf.int32),
                    output_type=tf.int64)
  failure = tf.stack([tf.constant(NOT_FINITE, tf.int64), first,
                      tf.constant(0, tf.int64)])
  assertion = None
  if not in_xla_context():
    names = tf.constant([f"table '{t}'" for t in tables])
    assertion = tf.debugging.Assert(
        ok, ["gradient has NaN or Inf values; no table, slot or step was "
             "changed. Fix: check the loss for overflow, or clip the "
             "activations' gradients. Tables:",
             tf.boolean_mask(names, tf.logical_not(finite))])
  return Verdict(ok, assertion, failure, finite)


def check_gradient(where: str, grad, expected: List[int]):
  """A gradient must be a ``tf.Tensor`` of its activation's static shape.

  ``TPUEmbedding.apply_gradients`` (``tpu_embedding_v2.py``) raises
  ``ValueError`` for a non-tensor gradient and for a static shape other than
  the activation's (an unknown dimension included), eagerly and in graphs.
  """
  if not isinstance(grad, tf.Tensor):
    raise errors.InputError(
        f"{where}: gradient is a {type(grad).__name__}, not a tf.Tensor. Fix: "
        "pass dL/d(activation) as a tensor (tf.convert_to_tensor), or None "
        "for a zero gradient.")
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
