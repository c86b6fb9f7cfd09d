"""TPUEmbedding's activation shapes: fixed per feature, checked every batch.

A TPU compiles every activation shape, so ``TPUEmbedding`` fixes each
feature's shape once (``FeatureConfig.output_shape``, ``build``'s shapes, or
the first batch) and checks every later batch against it
(``tpu_embedding_v2.py``: ``_get_and_update_output_shapes_from_input``,
``_check_output_shapes``, ``_update_output_shapes``,
``_check_output_shapes_fully_defined``). Where ``TPUEmbedding`` and
``TPUEmbeddingForServing`` differ, these are ``TPUEmbedding``'s
(docs/shapes.md).
"""

from __future__ import annotations

from typing import List

import tensorflow as tf
from tensorflow.python.util import nest

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import rules as rules_lib, structure_checks

__all__ = ["OutputShapes", "input_shape", "output_shape"]


class OutputShapes:
  """The activation shape (without ``dim``) of every feature, as fixed so far.

  ``features`` are the engine's features (``.where`` for errors, ``.config``
  the ``FeatureConfig``), in flattened order.
  """

  def __init__(self, features):
    self._features = features
    self.stored: List[tf.TensorShape] = [
        tf.TensorShape(f.config.output_shape) for f in features]

  def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
    """``build``'s shapes: one input shape per feature, or a batch size."""
    incoming = None
    if per_replica_input_shapes is not None and not isinstance(
        per_replica_input_shapes, int):
      structure_checks.check_structure(
          [None] * len(self._features), "per_replica_input_shapes",
          nest.flatten(per_replica_input_shapes),
          "give one shape per FeatureConfig, in its flattened order.")
      incoming = [output_shape(f.where, f.config, tf.TensorShape(s))
                  for f, s in zip(self._features,
                                  nest.flatten(per_replica_input_shapes))]
    elif per_replica_input_shapes is not None or per_replica_batch_size:
      incoming = self._from_batch_size(
          per_replica_input_shapes if per_replica_input_shapes is not None
          else per_replica_batch_size)
    if incoming is not None:
      self.record(self._checked(incoming, self.stored, strict=True))
    for feature, shape in zip(self._features, self.stored):
      if shape:
        structure_checks.check_fully_defined(feature.where, shape)

  def for_batch(self, flat_ids, strict: bool,
                rules: rules_lib.EngineRules) -> List[tf.TensorShape]:
    """The activation shapes of a batch of ids (one entry per feature).

    ``strict`` (``enqueue``): shapes are checked against those fixed so far
    and must be fully defined; ``record`` them once the batch passed every
    check, so the first good batch fixes unset shapes. Otherwise (a lookup
    with no ``TPUEmbedding`` counterpart) the input rules and
    ``output_shape`` bind, but every call keeps its own batch size and
    nothing is recorded. ``rules``: the engine's (``rules.py``).
    """
    if rules.output_shape_required:  # Shapes are output_shape (tpu_embedding_v3.py).
      incoming = list(self.stored)
    else:
      incoming = [output_shape(f.where, f.config, input_shape(f.where, f.config, x))
                  for f, x in zip(self._features, flat_ids)]
    if strict:
      return self._checked(incoming, self.stored, True)
    configured = [tf.TensorShape(f.config.output_shape) for f in self._features]
    return [new if new.rank == shape.rank and not new.is_fully_defined()
            else shape for shape, new in zip(
                self._checked(incoming, configured, False), incoming)]

  def _from_batch_size(self, batch_size) -> List[tf.TensorShape]:
    """``tpu_embedding_v2.py`` ``_get_output_shapes_from_batch_size``."""
    return [tf.TensorShape([batch_size, f.config.max_sequence_length])
            if not f.config.output_shape and f.config.max_sequence_length > 0
            else tf.TensorShape([batch_size]) for f in self._features]

  def _checked(self, incoming: List[tf.TensorShape],
               stored: List[tf.TensorShape], strict: bool) -> List[tf.TensorShape]:
    """``incoming`` checked against ``stored``; a shape already set wins."""
    for feature, old, new in zip(self._features, stored, incoming):
      structure_checks.check_output_shape(feature.where, old, new)
      if strict:
        structure_checks.check_fully_defined(feature.where, old or new)
    return [old if old else new for old, new in zip(stored, incoming)]

  def record(self, shapes: List[tf.TensorShape]):
    """Keeps the fully defined shapes (recorded once a batch passed)."""
    self.stored = [stored if stored or not new.is_fully_defined() else new
                   for stored, new in zip(self.stored, shapes)]


def input_shape(where: str, config, x) -> tf.TensorShape:
  """``TPUEmbedding``'s per-replica input shape of one feature's ids ``x``.

  The rules of ``tpu_embedding_v2.py`` ``_get_input_shape_for_tensor``,
  ``_get_input_shape_for_sparse_tensor`` and
  ``_get_input_shape_for_ragged_tensor``; the same ``ValueError`` class
  (``InputError``), with a message naming the feature and the fix.
  """
  if isinstance(x, tf.SparseTensor):
    shape = x.shape
    if shape.rank is None or shape.rank < 2:
      raise errors.InputError(
          f"{where}: sparse ids must have rank >= 2 [batch, ..., ids], got "
          f"shape {structure_checks.listed(shape)}. Fix: add a batch dimension.")
    dims = shape.as_list()
    # A sequence feature without output_shape gets its length inserted
    # before the ids dimension (rank 2 only; higher ranks ignore it).
    if (not config.output_shape and config.max_sequence_length > 0
        and len(dims) == 2):
      dims.insert(1, config.max_sequence_length)
    return tf.TensorShape(dims)
  if isinstance(x, tf.RaggedTensor):
    if x.shape.rank != 2:
      raise errors.InputError(
          f"{where}: ragged ids must have rank 2 [batch, (ids)], got shape "
          f"{structure_checks.listed(x.shape)}. Fix: merge the extra ragged dimensions, or pass a "
          "SparseTensor for more dimensions.")
    dims = x.shape.as_list()
    if not config.output_shape and config.max_sequence_length > 0:
      dims.insert(1, config.max_sequence_length)
    return tf.TensorShape(dims)
  dims = x.shape.as_list() if x.shape.rank is not None else None
  if not dims:
    raise errors.InputError(
        f"{where}: dense ids must have rank >= 1 [batch], got shape "
        f"{structure_checks.listed(x.shape)}. Fix: add a batch dimension.")
  if len(dims) > 1 and dims[-1] != 1:
    raise errors.InputError(
        f"{where}: dense ids of shape {structure_checks.listed(x.shape)} have a last dimension of "
        f"{dims[-1]}, but TPUEmbedding needs dense ids of rank >= 2 to end in "
        "a dimension of 1, which it drops ([batch, 1] -> [batch, dim]); it "
        "does not combine several dense ids per row, and padding ids would "
        "be looked up as ids. Fix: for zero-padded multi-hot ids pass a "
        "RaggedTensor or SparseTensor (tf.RaggedTensor.from_tensor(ids, "
        "padding=0) or tf.sparse.from_dense(ids)); for one id per row pass "
        "[batch] or [batch, 1] ids.")
  return tf.TensorShape(dims)


def output_shape(where: str, config, shape: tf.TensorShape) -> tf.TensorShape:
  """The activation shape (without ``dim``) for a per-replica input shape.

  ``tpu_embedding_v2.py`` ``_get_output_shapes_from_input_shapes``: the last
  dimension (the ids) is dropped, except for rank 1; a rank-2 shape not
  ending in 1 of a sequence feature without ``output_shape`` gets
  ``max_sequence_length`` inserted first (shapes given to ``build``).
  """
  if shape.rank is None or shape.rank < 1:
    raise errors.InputError(
        f"{where}: input shape {structure_checks.listed(shape)} must have rank >= 1. Fix: give "
        "[batch, ...] shapes to build(per_replica_input_shapes=...).")
  dims = shape.as_list()
  if (len(dims) == 2 and dims[-1] != 1 and not config.output_shape
      and config.max_sequence_length > 0):
    dims.insert(1, config.max_sequence_length)
  return tf.TensorShape(dims if len(dims) == 1 else dims[:-1])
