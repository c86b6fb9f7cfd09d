"""SparseCore's own input errors, where the emulated engine would word them otherwise.

``TPUEmbeddingV2`` flattens a dense id tensor and hands it to SparseCore's
preprocessing as one id per sample (``tpu_embedding_v3.py``,
``_convert_input_feature_to_coo``: ``reshape(input_feature, [-1])`` with no
row splits), whose kernel refuses a count other than the feature's sample
count, ``prod(output_shape)`` (``ValidateInputs`` in
``tensorflow/core/tpu/kernels/sparse_core_preprocess_ops.cc``): an
``InvalidArgumentError`` "Dense tensor input should have values elements
number the same as the sample count. But got N elements for values and
sample count as S." This is what a TPU says, for instance, when Keras's
``model.fit`` builds a model on SparseTensor inputs by handing the layer a
dense placeholder. Raised here with that class and phrase first, then the
feature and the fix.
"""

from __future__ import annotations

import functools
import operator

import tensorflow as tf
from tensorflow.python.util import nest

from tpu_embed_ext import errors

__all__ = ["SparseCoreInputError", "check_dense_sample_counts"]


class SparseCoreInputError(errors.InputError, tf.errors.InvalidArgumentError):
  """SparseCore preprocessing's ``InvalidArgumentError`` (an ``InputError`` too)."""

  def __init__(self, message: str):
    tf.errors.InvalidArgumentError.__init__(self, None, None, message)

  def __str__(self):
    return self.message


def check_dense_sample_counts(feature_config, features) -> None:
  """Each dense id tensor holds ``prod(output_shape)`` ids, as SparseCore requires."""
  paths = nest.flatten_with_joined_string_paths(feature_config)
  flat = tf.nest.flatten(features, expand_composites=False)
  if len(flat) != len(paths):
    return  # The engine names the structure mismatch.
  for (path, config), value in zip(paths, flat):
    shape = getattr(config, "output_shape", None)
    if (not isinstance(value, tf.Tensor) or not shape
        or not value.shape.is_fully_defined()):
      continue
    samples = functools.reduce(operator.mul, list(shape), 1)
    count = value.shape.num_elements()
    if count not in (0, samples):
      raise SparseCoreInputError(
          "Dense tensor input should have values elements number the same as "
          f"the sample count. But got {count} elements for values and sample "
          f"count as {samples}. (emulated TPUEmbeddingV2: feature '{path}' "
          f"(table '{config.table.name}'): a dense id tensor of shape "
          f"{value.shape.as_list()} for output_shape {list(shape)}; SparseCore "
          "takes one id per sample from a dense tensor. Fix: pass a "
          "RaggedTensor or SparseTensor for several ids per sample, or make "
          "output_shape match the ids.)")
