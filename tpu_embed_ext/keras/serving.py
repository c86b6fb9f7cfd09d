"""Export a model with ``EmbeddingLayer``s as a CPU serving SavedModel.

The exported signature takes raw ids as plain tensors (SavedModel signatures
cannot take ragged or sparse tensors): a single-hot feature as an int tensor
``[batch]`` or ``[batch, 1]``, a multi-hot one as a padded ``[batch, max_ids]``
matrix whose padding is ``PAD_ID`` (-1). The embedding lookups inside are
``tf.tpu.experimental.embedding.serving_embedding_lookup`` over the trained
tables: plain gathers and segment reductions, no TPU ops, so the SavedModel
serves on any CPU.

``serving_signature`` and ``checked_inputs`` give a signature whose every
input is checked inside the call (what the ``export`` command writes): an
error names the input and the fix for a wrong rank or shape ([batch, 2] for
a single-hot feature is refused, never cut to its first id), batches of
different sizes, NaN or Inf floats, and out-of-vocabulary ids. The dtype is
the signature's (int64 ids, float32 floats); TensorFlow refuses another one
before the call, naming the input.

Out-of-vocabulary ids: the policy is to refuse them. ``check_ids`` makes the
call fail with an ``InvalidArgumentError`` naming the feature, the vocabulary
and the offending ids (a gather would fail at an anonymous node, or on some
devices return zeros silently). Map unknown ids into the vocabulary (a
reserved row) before calling.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Mapping, Optional

import keras
import tensorflow as tf

from tpu_embed_ext.host import atomic
from tpu_embed_ext import errors
from tpu_embed_ext.emulation.engine import CPUEmbedding
from tpu_embed_ext.keras.layer import PAD_ID, EmbeddingLayer

__all__ = ["PAD_ID", "export_for_serving", "ragged_from_padded", "check_ids",
           "serving_signature", "checked_inputs"]


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
      tf.boolean_mask(tf.reshape(ids, [-1]),
                      tf.reshape(tf.logical_not(valid), [-1]))[:5]], summarize=5)
  with tf.control_dependencies([check]):
    return tf.identity(ids)


def serving_signature(single_hot, multi_hot, floats) -> Dict[str, tf.TensorSpec]:
  """The signature of ``checked_inputs``: ``{name: tf.TensorSpec}``.

  ``single_hot``/``multi_hot``: feature names (int64 ids); ``floats``:
  ``{name: width}`` (float32). A single-hot input has no fixed rank, so
  that it takes [batch] and [batch, 1] alike; ``checked_inputs`` checks it.
  """
  spec = {name: tf.TensorSpec([None, width], tf.float32, name=name)
          for name, width in floats.items()}
  spec.update({name: tf.TensorSpec(None, tf.int64, name=name) for name in single_hot})
  spec.update({name: tf.TensorSpec([None, None], tf.int64, name=name)
               for name in multi_hot})
  return spec


def _assert(condition, message: str, *data):
  return tf.debugging.Assert(condition, [message, *data], summarize=5)


def _after(check, x):
  """``x`` once ``check`` (its rank's) passed: a reduction over the axes of
  an input of another rank fails with "Invalid reduction dimension", naming
  no input."""
  with tf.control_dependencies([check]):
    return tf.identity(x)


def checked_inputs(inputs, *, single_hot: Mapping[str, int],
                   multi_hot: Mapping[str, int], floats: Mapping[str, int]
                   ) -> Dict[str, tf.Tensor]:
  """``inputs`` checked and shaped: single-hot ids [batch], multi-hot ids
  [batch, n] (padded), floats [batch, width].

  ``single_hot``/``multi_hot``: ``{feature: vocabulary_size}``;
  ``floats``: ``{name: width}``. Every check fails the call with an
  ``InvalidArgumentError`` naming the input and the fix.
  """
  static = {name: x.shape for name, x in inputs.items()}
  # The checks read each input without the signature's static shape: with it
  # Grappler folds a rank check to true (tf.size(tf.shape(x)) of a [None,
  # None] spec is the constant 2), though a client can send another rank,
  # which then fails the first reduction ("Invalid reduction dimension").
  inputs = {name: tf.compat.v1.placeholder_with_default(x, shape=None)
            for name, x in inputs.items()}
  out, checks = {}, []
  first = next(iter(inputs))
  # -1 for a scalar first input, which then fails its own check below.
  batch = tf.concat([tf.shape(inputs[first], out_type=tf.int64)[:1],
                     tf.constant([-1], tf.int64)], 0)[0]
  for name, x in inputs.items():
    size = tf.shape(x, out_type=tf.int64)
    checks.append(_assert(
        tf.logical_and(tf.size(size) >= 1,
                       tf.reduce_all(tf.equal(size[:1], batch))),
        f"input {name}: batch size (shape", size,
        f") differs from the batch size of input {first}", batch[None],
        "; every input has one row per example. Fix: send the same number of "
        "rows in every input."))
  for name, width in floats.items():
    shape = tf.shape(inputs[name], out_type=tf.int64)
    checks.append(_assert(
        tf.logical_and(tf.equal(tf.size(shape), 2), tf.reduce_all(
            tf.equal(shape[1:], width))),
        f"input {name}: float32 [batch, {width}] expected, got shape", shape,
        f"Fix: send {width} values per example."))
    x = _after(checks[-1], inputs[name])
    bad = tf.logical_not(tf.math.is_finite(x))
    checks.append(_assert(
        tf.logical_not(tf.reduce_any(bad)),
        f"input {name}: float values must be finite; NaN or Inf at [row, column]:",
        tf.where(bad)[:5], "Fix: replace missing or overflowing values (e.g. "
        "by 0) before serving."))
    out[name] = x
  for name, vocabulary in single_hot.items():
    x = inputs[name]
    shape = tf.shape(x, out_type=tf.int64)
    rank_ok = tf.logical_or(tf.equal(tf.size(shape), 1), tf.logical_and(
        tf.equal(tf.size(shape), 2), tf.equal(tf.reduce_prod(shape[1:]), 1)))
    checks.append(_assert(
        rank_ok, f"input {name}: a single-hot feature takes one id per example, "
        "int64 [batch] or [batch, 1]; got shape", shape,
        "(no id is ever dropped). Fix: send one id per example; a feature with "
        "several ids per example is multi-hot in the config."))
    with tf.control_dependencies(checks):
      ids = tf.reshape(x, [-1])
    out[name] = check_ids(name, ids, vocabulary, padded=False)
  for name, vocabulary in multi_hot.items():
    shape = tf.shape(inputs[name], out_type=tf.int64)
    checks.append(_assert(
        tf.equal(tf.size(shape), 2), f"input {name}: a multi-hot feature takes "
        f"int64 [batch, n] ids padded with {PAD_ID}; got shape", shape,
        f"Fix: send one row of ids per example, padded with {PAD_ID}."))
    out[name] = check_ids(name, _after(checks[-1], inputs[name]), vocabulary,
                          padded=True)
  with tf.control_dependencies(checks):
    return {name: tf.ensure_shape(x, static[name] if name not in single_hot
                                  else [None]) for name, x in out.items()}


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
    export_dir: where to write the SavedModel. It replaces the directory
      there only once complete (``atomic.write_dir``), so a previous export
      stays loadable if this one is killed or fails.
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
  save(module, export_dir, signatures={"serving_default": concrete})
  return concrete


def save(module, export_dir: str, *, what: str = "the SavedModel directory", **kwargs) -> None:
  """``tf.saved_model.save`` whole or not at all (``atomic.write_dir``).

  The previous SavedModel in ``export_dir`` serves until the new one is
  complete; a full or read-only disk is an ``atomic.OutputError``.
  """
  atomic.check_writable(what, export_dir, directory=True)
  try:
    with atomic.write_dir(export_dir) as tmp:
      tf.saved_model.save(module, tmp, **kwargs)
  except (OSError, tf.errors.OpError) as e:
    if isinstance(e, errors.Error):
      raise
    raise atomic.io_error(e, what, export_dir) from None


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
