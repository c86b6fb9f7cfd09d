"""The three engine protocols ``EmbeddingLayer`` speaks, one adapter each.

Each adapter is read top to bottom, as keras-rs's TensorFlow
``DistributedEmbedding`` (``keras_rs/src/layers/embedding/tensorflow/
distributed_embedding.py``) writes ``_tpu_embedding_lookup_v1`` and ``_v2``:

* ``CPUAdapter``: our ``CPUEmbedding`` off-TPU. The forward pass prepares
  the batch (``lookup_for_training``) and the backward pass applies the
  gradients to that same batch (``apply_gradients_to``); several calls in one
  step are concatenated into one batch and enqueued once.
* ``TPUEmbeddingAdapter``: ``TPUEmbedding`` (TPU v2-v4) under a
  ``TPUStrategy``: ``enqueue``, ``dequeue``, ``apply_gradients``.
* ``SparseCoreAdapter``: ``TPUEmbeddingV2`` (SparseCore): ``__call__``
  returns the activations and preserved outputs that ``apply_gradients``
  takes back.

``for_engine`` picks one, once, when the layer is made. The gradient
plumbing they share (the sink, the scale probe, several calls in a step) is
``keras/gradients.py``'s.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import tensorflow as tf
from tensorflow.python.tpu import tpu_embedding_v2, tpu_embedding_v3

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import engine as engine_lib
from tpu_embed_ext.keras import gradients as layer_gradients

__all__ = ["CPUAdapter", "TPUEmbeddingAdapter", "SparseCoreAdapter",
           "for_engine"]


class CPUAdapter:
  """``CPUEmbedding``: tables are Keras weights; any number of calls a step."""

  keras_weights = True  # its tables are the layer's (non-trainable) weights

  def __init__(self, embedding, name: str):
    self.embedding = embedding
    self.name = name
    embedding.build()

  def tables(self) -> List[tf.Variable]:
    return list(self.embedding.embedding_tables.values())

  def check_call(self, step: layer_gradients.StepCalls):
    del step  # Calls of one step are concatenated into one batch.

  def lookup(self, features, weights):
    return self.embedding(features, weights)

  def train_lookup(self, features, weights) -> Tuple[Any, Any]:
    """Activations, and the batch they were looked up from."""
    return self.embedding.lookup_for_training(features, weights)

  def apply_gradients(self, step: layer_gradients.StepCalls, gradients):
    """Applies every call's (unscaled) ``gradients`` as one table step."""
    if len(step.calls) == 1:
      self.embedding.apply_gradients_to(step.kept[0], gradients[0])
      return
    # Several calls: one batch of them all, enqueued now that every call of
    # the step is known (the engine's batch shape is then that of the whole
    # step, the same on every step).
    features, weights = layer_gradients.concat_calls(
        self.embedding.feature_config, step.calls, self.name)
    self.embedding.enqueue(features, weights, training=True)
    self.embedding.apply_gradients(tf.nest.map_structure(
        lambda *gs: tf.concat(gs, 0), *gradients))


class _TPUAdapter:
  """What both TPU engines' adapters share: one batch per step, and tables
  that are the engine's (``TPUEmbedding`` refuses ``embedding_tables`` under
  a ``TPUStrategy``; SparseCore's are sharded, stacked views), checkpointed
  with it rather than as Keras weights."""

  keras_weights = False

  def __init__(self, embedding, name: str):
    self.embedding = embedding
    self.name = name

  def tables(self) -> List[tf.Variable]:
    return []

  def check_call(self, step: layer_gradients.StepCalls):
    _one_call_per_step(self.name, step)


class TPUEmbeddingAdapter(_TPUAdapter):
  """``TPUEmbedding`` under a ``TPUStrategy``: enqueue, dequeue, apply."""

  def lookup(self, features, weights):
    self.embedding.enqueue(features, weights, training=False)
    return self.embedding.dequeue()

  def train_lookup(self, features, weights) -> Tuple[Any, Any]:
    self.embedding.enqueue(features, weights, training=True)
    return self.embedding.dequeue(), None

  def apply_gradients(self, step: layer_gradients.StepCalls, gradients):
    """Applies the step's one call's (unscaled) ``gradients``."""
    del step
    self.embedding.apply_gradients(gradients[0])
    _advance_step(self.embedding)


class SparseCoreAdapter(_TPUAdapter):
  """``TPUEmbeddingV2`` (SparseCore): preserved outputs carry the batch."""

  def lookup(self, features, weights):
    activations, _ = self.embedding(features, weights)
    return activations

  def train_lookup(self, features, weights) -> Tuple[Any, Any]:
    """Activations, and the preserved outputs ``apply_gradients`` takes."""
    return self.embedding(features, weights)

  def apply_gradients(self, step: layer_gradients.StepCalls, gradients):
    """Applies the step's one call's (unscaled) ``gradients``."""
    self.embedding.apply_gradients(gradients[0], step.kept[0])
    _advance_step(self.embedding)


def for_engine(embedding, name: str):
  """The adapter of ``embedding``'s protocol (``create_embedding``'s engine)."""
  if isinstance(embedding, tpu_embedding_v3.TPUEmbeddingV2):
    return SparseCoreAdapter(embedding, name)
  if isinstance(embedding, tpu_embedding_v2.TPUEmbedding):
    return TPUEmbeddingAdapter(embedding, name)
  return CPUAdapter(embedding, name)


def _one_call_per_step(name: str, step: layer_gradients.StepCalls):
  if step.calls:
    raise errors.InputError(
        f"EmbeddingLayer '{name}' was called {len(step.calls) + 1} "
        "times in one training step; a TPU engine takes one batch per step. "
        "Fix: call the layer once, with every feature in one structure.")


def _advance_step(embedding):
  """TensorFlow's TPU engines have no step of their own: advance the one
  that ``create_embedding`` bound the schedules to. Ours (``CPUEmbedding``,
  also behind the emulated TPU's engines) advances it in
  ``apply_gradients``."""
  if not isinstance(embedding, engine_lib.CPUEmbedding):
    embedding.step.assign_add(1)
