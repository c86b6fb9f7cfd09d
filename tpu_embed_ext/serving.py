"""Export a model with ``EmbeddingLayer``s as a CPU serving SavedModel.

The exported signature takes raw ids as plain tensors (SavedModel signatures
cannot take ragged or sparse tensors): a single-hot feature as an int tensor
``[batch]`` or ``[batch, 1]``, a multi-hot one as a padded ``[batch, max_ids]``
matrix whose padding is ``PAD_ID`` (-1). The embedding lookups inside are
``tf.tpu.experimental.embedding.serving_embedding_lookup`` over the trained
tables: plain gathers and segment reductions, no TPU ops, so the SavedModel
serves on any CPU.

Out-of-vocabulary ids: the policy is to refuse them. ``check_ids`` makes the
call fail with an ``InvalidArgumentError`` naming the feature, the vocabulary
and the offending ids (a gather would fail at an anonymous node, or on some
devices return zeros silently). Map unknown ids into the vocabulary (a
reserved row) before calling.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import keras
import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.emulation.engine import CPUEmbedding
from tpu_embed_ext.layer import PAD_ID, EmbeddingLayer

__all__ = ["PAD_ID", "export_for_serving", "ragged_from_padded", "check_ids"]


def ragged_from_padded(structure):
  """Turns every rank-2 integer tensor in ``structure`` into a RaggedTensor.

  Entries equal to ``PAD_ID`` are dropped, wherever they are in a row.
  """
  def convert(x):
    if isinstance(x, tf.Tensor) and x.dtype.is_integer and x.shape.rank == 2:
      return tf.ragged.boolean_mask(x, tf.not_equal(x, PAD_ID))
    return x
  return tf.nest.map_structure(convert, structure)


def check_ids(feature: str, ids, vocabulary_size: int, *, padded: bool = True):
  """``ids`` once every entry is in ``[0, vocabulary_size)`` (or ``PAD_ID``).

  ``padded=False`` (a single-hot [batch, 1] input) refuses ``PAD_ID`` too.
  Fails inside the serving call, naming the feature and up to 5 bad ids.
  """
  ids = tf.convert_to_tensor(ids)
  valid = tf.logical_and(ids >= 0, ids < vocabulary_size)
  if padded:
    valid = tf.logical_or(valid, tf.equal(ids, PAD_ID))
  padding = f" or {PAD_ID} (padding)" if padded else ""
  check = tf.debugging.Assert(tf.reduce_all(valid), [
      # No quotes: a SavedModel's error message shows them escaped (\').
      f"feature {feature}: ids must be in [0, {vocabulary_size}){padding}; "
      "out-of-vocabulary ids are refused. Fix: map unknown ids to a row of the "
      "vocabulary before serving. First bad ids:",
      tf.boolean_mask(ids, tf.logical_not(valid))[:5]], summarize=5)
  with tf.control_dependencies([check]):
    return tf.identity(ids)


def _embedding_layers(model: keras.Model):
  return [l for l in model._flatten_layers() if isinstance(l, EmbeddingLayer)]


@contextlib.contextmanager
def _serving_lookups(model: keras.Model):
  layers = _embedding_layers(model)
  if not layers:
    raise ValueError(
        f"model {model.name!r} has no EmbeddingLayer; export it with "
        "model.export() instead.")
  for layer in layers:
    layer.serving_mode(True)
  try:
    yield
  finally:
    for layer in layers:
      layer.serving_mode(False)


def export_for_serving(model: keras.Model, export_dir: str, input_signature: Any,
                       preprocess: Optional[Callable[[Any], Any]] = None,
                       ) -> tf.types.experimental.ConcreteFunction:
  """Writes a SavedModel with a ``serving_default`` signature.

  Args:
    model: a built Keras model whose embeddings come from ``EmbeddingLayer``s.
    export_dir: where to write the SavedModel.
    input_signature: nested ``tf.TensorSpec``s, what clients send (a dict, so
      that the signature's inputs are named).
    preprocess: maps the signature's inputs to the model's inputs; by default
      ``ragged_from_padded`` (padded id matrices -> ragged ids).

  Returns:
    The serving concrete function (also usable in-process).
  """
  preprocess = preprocess or ragged_from_padded
  # The module holds the variables the signature reads, not the Keras model:
  # saving a model would also trace Keras's own default signature. Slots are
  # left out: serving needs only the tables.
  module = tf.Module()
  module.dense_variables = [v.value for v in model.variables]
  module.tables = [
      table for layer in _embedding_layers(model)
      for table in layer.embedding.embedding_tables.values()]

  @tf.function(input_signature=[input_signature])
  def serve(inputs):
    outputs = model(preprocess(inputs), training=False)
    return outputs if isinstance(outputs, dict) else {"outputs": outputs}

  with _serving_lookups(model):
    concrete = serve.get_concrete_function()
  _check_training_shapes(model, preprocess, input_signature, concrete)
  tf.saved_model.save(module, export_dir,
                      signatures={"serving_default": concrete})
  return concrete


def _check_training_shapes(model, preprocess, input_signature, concrete):
  """ConfigError unless serving gives the output shapes of the model's lookups.

  The model trained with ``TPUEmbedding``'s activation shapes, which
  ``serving_embedding_lookup`` (``TPUEmbeddingForServing``'s) does not share
  for dense ids of rank >= 2: ``[B, 1]`` gives ``[B, 1, dim]`` there, not
  ``[B, dim]`` (docs/shapes.md). A SavedModel whose outputs change shape
  would serve something the model never computed, so export stops instead.
  """
  if not all(isinstance(layer.embedding, CPUEmbedding)
             for layer in _embedding_layers(model)):
    return  # A TPU engine's lookups cannot be traced off a TPU.

  @tf.function(input_signature=[input_signature])
  def lookup(inputs):
    outputs = model(preprocess(inputs), training=False)
    return outputs if isinstance(outputs, dict) else {"outputs": outputs}

  want = lookup.get_concrete_function().structured_outputs
  for name, tensor in concrete.structured_outputs.items():
    if tensor.shape.as_list() != want[name].shape.as_list():
      raise errors.ConfigError(
          f"serving output '{name}' has shape {tensor.shape.as_list()}, but the "
          f"model computes {want[name].shape.as_list()}: serving lookups shape "
          "dense ids of rank >= 2 as TPUEmbeddingForServing does ([B, 1] -> "
          "[B, 1, dim]), training as TPUEmbedding does ([B, dim]). Fix: give "
          "the signature [batch] ids for single-hot features and padded "
          "[batch, n] ids (made ragged by ragged_from_padded) for multi-hot "
          "ones, or a preprocess that does.")
