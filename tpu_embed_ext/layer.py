"""Keras 3 layer that trains embedding tables with their own TPU optimizers.

``EmbeddingLayer`` hides the enqueue / dequeue / apply_gradients protocol of the
TPU embedding mid-level API inside ``model.fit``. Tables are never Keras
weights, so the model's Keras optimizer never touches them: each table is
updated by its own table optimizer (per-table overrides and schedules
included), exactly as on a TPU.

How the table update is wired into ``fit``: the layer owns one trainable
scalar, the *gradient sink*, and routes its activations through a
``tf.custom_gradient`` whose inputs are the sink and the activations. When
Keras's ``train_step`` asks the tape for the gradient of the loss with respect
to its trainable weights, the custom gradient receives ``dL/dactivations``,
hands them to the engine's ``apply_gradients`` (one table step per training
batch, which also advances the engine's ``step`` and so its schedules), and
returns a zero gradient for the sink. The sink's value is never read, so
whatever the Keras optimizer does to it (momentum, weight decay) has no effect.

Engines: on CPU (no ``TPUStrategy`` in scope) the layer runs
``CPUEmbedding``, our emulation of the TPU engine. Under a ``TPUStrategy`` it
runs ``TPUEmbedding`` (TPU v2-v4) or ``TPUEmbeddingV2`` (SparseCore, v5p/v6e),
chosen by ``create_embedding`` as TensorFlow documents for the hardware. The
TPU branches were NOT run on TPU hardware: no TPU is reachable where this
package is developed. They are exercised on CPU up to the point where a TPU is
needed (construction with a stand-in strategy, the engine chosen, the protocol
each engine needs); see tests/test_layer.py.
"""

from __future__ import annotations

from typing import Optional

import keras
import tensorflow as tf

from tpu_embed_ext.emulation import dispatch

__all__ = ["EmbeddingLayer"]


class EmbeddingLayer(keras.layers.Layer):
  """Embedding lookups whose tables train with TPU embedding optimizers.

  Args:
    spec_or_feature_config: an ``EmbeddingSpec`` (schedules bind to this
      layer's ``step``), or a nested ``tf.tpu.experimental.embedding``
      ``FeatureConfig`` structure as ``TPUEmbedding`` takes it.
    optimizer: the global table optimizer for a feature config whose tables
      have none (a ``tf.tpu.experimental.embedding`` optimizer or our spec).
      Ignored for an ``EmbeddingSpec``, which carries its own.
    engine: which TPU engine to run or emulate: ``"v1"`` (``TPUEmbedding``),
      ``"v2"`` (``TPUEmbeddingV2``, SparseCore), or None to follow the
      hardware (``"v1"`` off-TPU).
    validate: check ids and gradients on every step (CPU engine only).

  Call with ``features`` (the structure of the feature config) and optional
  ``weights``; returns activations with the structure of ``features``.
  ``training=True`` looks up and trains on the backward pass;
  ``training=False`` (``evaluate``, ``predict``) only looks up.
  """

  def __init__(self, spec_or_feature_config, optimizer=None,
               engine: Optional[str] = None, *, validate: bool = True,
               **kwargs):
    super().__init__(**kwargs)
    self._serving = False
    # Created eagerly, outside any tf.function, so the tables and slots exist
    # (and can be restored) before the first call.
    self.embedding = dispatch.create_embedding(
        spec_or_feature_config, optimizer, engine=engine, validate=validate)
    self._kind = _engine_kind(self.embedding)
    if self._kind == "cpu":
      self.embedding.build()
    # The engine leaves its step out of its own checkpoint keys (they equal
    # TPUEmbedding's); the layer checkpoints it, so schedules resume.
    self.table_step = self.embedding.step
    self.gradient_sink = self.add_weight(
        shape=(), initializer="zeros", trainable=True, name="gradient_sink")

  @property
  def step(self) -> tf.Variable:
    """Table updates applied so far (drives the table schedules)."""
    return self.embedding.step

  @property
  def variables_by_table(self):
    """``{table_name: {"parameters": var, <slot>: var}}`` of the engine."""
    return self.embedding.variables

  def call(self, features, weights=None, training=None):
    if self._serving:
      return self._serving_lookup(features, weights)
    if not training:
      return self._lookup(features, weights)
    activations, apply = self._train_lookup(features, weights)
    return _route_gradients(activations, self.gradient_sink, apply)

  # --- engine protocols ----------------------------------------------------

  def _lookup(self, features, weights):
    if self._kind == "tpu_v1":
      self.embedding.enqueue(features, weights, training=False)
      return self.embedding.dequeue()
    if self._kind == "tpu_v2":
      activations, _ = self.embedding(features, weights)
      return activations
    return self.embedding(features, weights)

  def _train_lookup(self, features, weights):
    """Returns activations and the function that applies their gradients."""
    if self._kind == "cpu":
      self.embedding.enqueue(features, weights, training=True)
      return self.embedding.dequeue(), self.embedding.apply_gradients
    # TPU engines have no step of their own: advance the one that
    # create_embedding bound the schedules to.
    if self._kind == "tpu_v2":
      activations, preserved = self.embedding(features, weights)
      apply = lambda grads: self.embedding.apply_gradients(grads, preserved)
    else:
      self.embedding.enqueue(features, weights, training=True)
      activations, apply = self.embedding.dequeue(), self.embedding.apply_gradients

    def apply_and_step(grads):
      apply(grads)
      self.embedding.step.assign_add(1)
    return activations, apply_and_step

  def _serving_lookup(self, features, weights):
    # The standard CPU lookup of a TPU-trained model, with no TPU ops.
    return tf.tpu.experimental.embedding.serving_embedding_lookup(
        features, weights, self.embedding.embedding_tables,
        self.embedding.feature_config)

  def serving_mode(self, enabled: bool = True):
    """Switches calls to ``serving_embedding_lookup`` (used by export)."""
    self._serving = enabled

  def get_config(self):
    raise NotImplementedError(
        "EmbeddingLayer holds TensorFlow TPU embedding objects and is saved "
        "with tf.train.Checkpoint or exported with "
        "tpu_embed_ext.serving.export_for_serving, not as a Keras config.")


def _engine_kind(embedding) -> str:
  """"cpu", "tpu_v1" or "tpu_v2": which mid-level API protocol to speak."""
  from tensorflow.python.tpu import tpu_embedding_v2, tpu_embedding_v3
  if isinstance(embedding, tpu_embedding_v3.TPUEmbeddingV2):
    return "tpu_v2"
  if isinstance(embedding, tpu_embedding_v2.TPUEmbedding):
    return "tpu_v1"
  return "cpu"


def _route_gradients(activations, sink, apply_gradients):
  """Identity on ``activations``; its backward pass trains the tables."""
  flat = tf.nest.flatten(activations)

  @tf.custom_gradient
  def route(sink_value, *flat_activations):
    def grad(*upstream):
      apply_gradients(tf.nest.pack_sequence_as(activations, list(upstream)))
      # No gradient flows into the tables' gather: the engine has applied it.
      return [tf.zeros_like(sink_value)] + [None] * len(flat_activations)
    return [tf.identity(a) for a in flat_activations], grad

  return tf.nest.pack_sequence_as(activations, route(sink, *flat))
