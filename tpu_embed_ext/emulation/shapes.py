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

from tpu_embed_ext.emulation import lookups, structure_checks

__all__ = ["OutputShapes"]


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
      incoming = [lookups.output_shape(f.where, f.config, tf.TensorShape(s))
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

  def for_batch(self, flat_ids, strict: bool, engine: str) -> List[tf.TensorShape]:
    """The activation shapes of a batch of ids (one entry per feature).

    ``strict`` (``enqueue``): shapes are checked against those fixed so far
    and must be fully defined; ``record`` them once the batch passed every
    check, so the first good batch fixes unset shapes. Otherwise (a lookup
    with no ``TPUEmbedding`` counterpart) the input rules and
    ``output_shape`` bind, but every call keeps its own batch size and
    nothing is recorded.
    """
    if engine == "v2":  # Shapes are output_shape (tpu_embedding_v3.py).
      incoming = list(self.stored)
    else:
      incoming = [lookups.output_shape(f.where, f.config,
                                       lookups.input_shape(f.where, f.config, x))
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
