"""Checks of structures, shapes and kinds: TensorFlow's input rules.

All of them are known when a step is traced, so they raise ``InputError``
(or ``InputTypeError``) at once, eagerly and in graphs alike, with
TensorFlow's phrase first where ``TPUEmbedding`` has one. Checks of input
values, which a graph only knows when the step runs, are rows in
``checks`` run by ``check_runner``.
"""

from __future__ import annotations

import re
from typing import List, Optional

import tensorflow as tf
from tensorflow.python.util import nest

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import checks, rules as rules_lib

__all__ = ["check_structure", "check_ids_and_weights", "float_weights", "check_output_shape", "feature_path",
           "check_fully_defined", "check_gradient_type", "check_gradient",
           "weights_layout_ok", "aligned_weights", "listed"]

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


def check_ids_and_weights(where: str, config, x, w,
                          rules: rules_lib.EngineRules):
  """One feature's ids ``x`` (as a tensor unless ragged or sparse) once their
  dtype, and the kind of their weights ``w``, are ones the engine takes.

  ``tpu_embedding_v2.py`` ``_add_data_for_tensor`` / ``_sparse_tensor`` /
  ``_ragged_tensor``: weights on dense ids are refused unless
  ``rules.weights_on_dense_ids``, and must have the ids' type (with
  TensorFlow's phrase first where ``rules.tf_weight_phrases``).
  """
  if not isinstance(x, (tf.SparseTensor, tf.RaggedTensor)):
    x = tf.convert_to_tensor(x)
  if not x.dtype.is_integer:
    raise errors.InputError(
        f"{where}: ids must be integers, got dtype {x.dtype.name}. Fix: cast "
        "the ids with tf.cast(ids, tf.int64).")
  if w is not None and isinstance(x, tf.Tensor) and not rules.weights_on_dense_ids:
    raise errors.InputError(
        f"Weight specified for dense input {feature_path(where)}, "
        "which is not allowed. Weight will always be 1 in this case. "
        f"{where}: weights were given for a dense id tensor. Fix: pass the "
        "ids as a RaggedTensor or SparseTensor to weight them.")
  if (w is not None and config.max_sequence_length > 0
      and rules.sequence_length_honoured):
    # TPUEmbedding passes them to the TPU, which does not document what a
    # weight does to a sequence position; TPUEmbeddingForServing rejects them.
    raise errors.InputError(
        f"{where}: weights were given for a sequence feature "
        f"(max_sequence_length={config.max_sequence_length}); what the TPU "
        "does with them is not documented, so they are not emulated. Fix: "
        "drop them.")
  if w is not None and type(w) is not type(x):
    tf_phrase = "" if not rules.tf_weight_phrases else (
        f"Weight for {feature_path(where)} is type {type(w)} which "
        f"does not match type input which is {type(x).__name__}. ")
    raise errors.InputError(
        f"{tf_phrase}{where}: weights are a {type(w).__name__} but ids a "
        f"{type(x).__name__}. Fix: give weights the ids' type and layout.")
  return x


def float_weights(where: str, w) -> Optional[tf.Tensor]:
  """The values of weights ``w`` (a flat tensor; None: None) as float32,
  once they are numbers."""
  if w is None:
    return None
  values = tf.reshape(w, [-1]) if isinstance(w, tf.Tensor) else w.values
  if not (values.dtype.is_floating or values.dtype.is_integer):
    raise errors.InputError(
        f"{where}: weights must be numbers, got dtype {values.dtype.name}. Fix: "
        "give float32 weights (tf.strings.to_number(weights) for strings).")
  return tf.cast(values, tf.float32)


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


def weights_layout_ok(where, ids, weights) -> tf.Tensor:
  """A scalar bool: whether ragged or sparse ``weights`` are laid out as
  ``ids`` (the same row splits or indices), for ``checks.WEIGHTS_LAYOUT``.

  A difference already visible in the static shapes raises when the
  function is traced.
  """
  ragged = isinstance(ids, tf.RaggedTensor)
  a, b = ((ids.row_splits, weights.row_splits) if ragged
          else (ids.indices, weights.indices))
  if tf.executing_eagerly():
    return tf.constant(a.shape == b.shape and bool(
        tf.reduce_all(tf.equal(a, tf.cast(b, a.dtype)))))
  if (not a.shape[1:].is_compatible_with(b.shape[1:]) or (
      a.shape.is_fully_defined() and b.shape.is_fully_defined() and a.shape != b.shape)):
    raise errors.InputError(
        checks.WEIGHTS_LAYOUT.message.format(where=where) +
        f" (found when the function was traced: "
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

  In a graph a mismatch is reported by ``checks.WEIGHTS_LAYOUT``; until then the
  ops that combine weights with ids must not fail with TensorFlow's own
  "Incompatible shapes" first. Equal to ``values`` when the counts match.
  """
  padded = tf.concat([tf.cast(values, tf.float32), [1.0]], 0)
  size = tf.size(values, out_type=tf.int64)
  return tf.gather(padded, tf.minimum(tf.range(count, dtype=tf.int64), size))


def listed(shape: tf.TensorShape):
  """``[2, None]`` for a known rank, the shape itself otherwise."""
  return shape.as_list() if shape.rank is not None else shape
