"""Lookups in occurrence form: every input kind reduced to one shape.

Occurrence ``i`` of a feature sends ``gain_i * E[id_i]`` to output row
``rows[i]`` (docs/semantics.md, section 0.1). Lookups gather and combine in
that form; training reads it backwards (the gradient of occurrence ``i`` is
``gain_i * dL/dact[rows[i]]``), so forward and backward can never disagree.

Lookup semantics are ``TPUEmbeddingForServing``'s (``cpu_embedding_lookup``):
a ragged or sparse rank-2 input is combined per row (``sum``, ``mean`` =
``sum(w e) / sum(w)``, ``sqrtn`` = ``sum(w e) / sqrt(sum(w^2))``, 0 for an
empty row); a sequence feature (``max_sequence_length > 0``) returns
``[batch, max_sequence_length, dim]`` with later positions truncated and
missing ones zero. Simulated quantization is applied to the gathered rows
before the combiner, forward only (section 7).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import validation

__all__ = ["Occurrences", "feature_occurrences", "activation",
           "occurrence_gradients"]


class Occurrences(NamedTuple):
  """One feature's lookup in flat form: ids[i] * gains[i] -> row rows[i]."""
  ids: tf.Tensor              # [n] int64
  rows: Optional[tf.Tensor]   # [n] int; None: the identity (dense lookups)
  gains: Optional[tf.Tensor]  # [n] float32; None: all ones
  num_rows: tf.Tensor         # scalar: rows of the [num_rows, dim] output
  shape: Any                  # the activation shape, without dim


def feature_occurrences(where: str, config, x, w, check: bool) -> Occurrences:
  """The occurrence form of one feature's ids ``x`` and weights ``w``.

  ``where`` names the feature and table in errors; ``check`` enables the
  eager layout checks of weights against ids.
  """
  if not isinstance(x, (tf.SparseTensor, tf.RaggedTensor)):
    x = tf.convert_to_tensor(x)
  if not x.dtype.is_integer:
    raise errors.InputError(
        f"{where}: ids must be integers, got dtype {x.dtype.name}. Fix: cast "
        "the ids with tf.cast(ids, tf.int64).")
  if w is not None and isinstance(x, tf.Tensor):
    raise errors.InputError(
        f"{where}: weights were given for a dense id tensor. Fix: pass the "
        "ids as a RaggedTensor or SparseTensor to weight them.")
  if w is not None and config.max_sequence_length > 0:
    raise errors.InputError(
        f"{where}: weights were given for a sequence feature "
        f"(max_sequence_length={config.max_sequence_length}). Fix: drop them.")
  if w is not None and type(w) is not type(x):
    raise errors.InputError(
        f"{where}: weights are a {type(w).__name__} but ids a "
        f"{type(x).__name__}. Fix: give weights the ids' type and layout.")
  if isinstance(x, tf.Tensor):
    if config.max_sequence_length > 0:
      raise errors.InputError(
          f"{where} is a sequence feature (max_sequence_length="
          f"{config.max_sequence_length}) but got a dense tensor. Fix: pass a "
          "RaggedTensor or SparseTensor.")
    ids = tf.reshape(x, [-1])
    shape = x.shape.as_list() if x.shape.is_fully_defined() else tf.shape(x)
    occ = Occurrences(ids, None, None, tf.size(ids), shape)
  elif isinstance(x, tf.RaggedTensor):
    occ = _ragged(where, config, x, w, check)
  else:
    occ = _sparse(where, config, x, w, check)
  return occ._replace(ids=tf.cast(occ.ids, tf.int64))


def _ragged(where, config, x, w, check) -> Occurrences:
  if x.shape.rank != 2:
    raise errors.InputError(
        f"{where}: ragged ids must have rank 2 [batch, (ids)], got rank "
        f"{x.shape.rank}. Fix: merge the extra ragged dimensions.")
  batch = x.nrows(out_type=tf.int64)
  ids, row = x.values, x.value_rowids()
  weight = None if w is None else tf.cast(w.values, tf.float32)
  if w is not None and check:
    validation.check_same_layout(where, x, w)
  out = config.output_shape
  if out:
    size = _prod(out)
    static_batch = x.shape[0]
    if static_batch is not None and size == static_batch:
      return _combined(config, ids, row, weight, batch, list(out))
    length = size // static_batch if static_batch else None
    if static_batch is None or size % static_batch or length < 1:
      raise errors.InputError(
          f"{where}: output_shape {list(out)} must have the batch size "
          f"{static_batch} or a multiple of it as its number of elements. "
          "Fix: change FeatureConfig.output_shape.")
    return _sequence(ids, row, _positions(x), batch, length, list(out))
  if config.max_sequence_length > 0:
    length = config.max_sequence_length
    return _sequence(ids, row, _positions(x), batch, length, [batch, length])
  return _combined(config, ids, row, weight, batch, tf.reshape(batch, [1]))


def _sparse(where, config, x, w, check) -> Occurrences:
  rank = x.shape.rank
  if rank is None or rank < 2:
    raise errors.InputError(
        f"{where}: sparse ids must have rank >= 2, got rank {rank}. Fix: "
        "add a batch dimension.")
  if w is not None and check:
    validation.check_same_indices(where, x, w)
  weight = None if w is None else tf.cast(w.values, tf.float32)
  if config.max_sequence_length > 0 and not config.output_shape and rank == 2:
    length = config.max_sequence_length
    batch = x.dense_shape[0]
    return _sequence(x.values, x.indices[:, 0], x.indices[:, 1], batch,
                     length, [batch, length])
  # Combine over the last dimension, as embedding_lookup_sparse does.
  outer = x.dense_shape[:-1]
  row = tf.zeros_like(x.indices[:, 0])
  for d in range(rank - 1):
    row = row * x.dense_shape[d] + x.indices[:, d]
  # Like embedding_lookup_sparse, output_shape does not reshape sparse input.
  return _combined(config, x.values, row, weight, tf.reduce_prod(outer), outer)


def _combined(config, ids, row, weight, num_rows, shape) -> Occurrences:
  """Per-row combiner gains (section 0.1)."""
  combiner = config.table.combiner
  w = tf.ones_like(ids, tf.float32) if weight is None else weight
  if combiner == "sum":
    gains = w
  else:
    square = combiner == "sqrtn"
    total = tf.math.unsorted_segment_sum(w * w if square else w, row, num_rows)
    total = tf.sqrt(total) if square else total
    gains = tf.math.divide_no_nan(w, tf.gather(total, row))
  return Occurrences(ids, row, gains, num_rows, shape)


def _positions(x: tf.RaggedTensor) -> tf.Tensor:
  """Position of every value inside its row."""
  starts = tf.gather(x.row_starts(), x.value_rowids())
  return tf.range(tf.size(x.values, out_type=tf.int64), dtype=tf.int64) - starts


def _sequence(ids, row, col, batch, length, shape) -> Occurrences:
  """Sequence lookups: position col of row lands in output row*length+col."""
  keep = col < length
  ids, row, col = (tf.boolean_mask(t, keep) for t in (ids, row, col))
  return Occurrences(ids, row * length + col, None,
                     tf.cast(batch, tf.int64) * length, shape)


def _prod(shape) -> int:
  out = 1
  for s in shape:
    out *= int(s)
  return out


def activation(params, occ: Occurrences, table_config, check=None):
  """The ``[*occ.shape, dim]`` activation of one feature from ``params``.

  ``check`` (an op or None) gates the gather: a bad batch fails before any
  row is read.
  """
  with tf.control_dependencies([check] if check is not None else []):
    rows = tf.gather(params, occ.ids)
  rows = _quantize(rows, table_config.quantization_config)
  dim = table_config.dim
  if occ.rows is None:
    out = rows
  else:
    if occ.gains is not None:
      rows = rows * occ.gains[:, None]
    out = tf.math.unsorted_segment_sum(rows, occ.rows, occ.num_rows)
  if isinstance(occ.shape, list):
    out = tf.reshape(out, occ.shape + [dim])
  else:
    out = tf.reshape(out, tf.concat([tf.cast(occ.shape, tf.int32), [dim]], 0))
  _set_static_shape(out, occ.shape, dim)
  return out


def occurrence_gradients(occ: Occurrences, grad, dim: int):
  """``(ids, [n, dim] gradients)`` of every occurrence, from ``dL/dact``.

  ``grad`` None is a zero gradient for every occurrence (the TPU applies a
  zero-gradient update then, docs/semantics.md section 7).
  """
  if grad is None:
    return occ.ids, tf.zeros([tf.size(occ.ids), dim], tf.float32)
  grad = tf.reshape(tf.cast(grad, tf.float32), [-1, dim])
  if occ.rows is not None:
    grad = tf.gather(grad, occ.rows)
  if occ.gains is not None:
    grad = grad * occ.gains[:, None]
  return occ.ids, grad


def _quantize(rows, config):
  """Simulated quantization of gathered rows (forward only)."""
  if config is None:
    return rows
  lower, upper = float(config.lower), float(config.upper)
  quantum = (upper - lower) / (config.num_buckets - 1)
  x = tf.clip_by_value(rows, lower, upper)
  q = tf.floor((x - lower) / quantum + 0.5) * quantum + lower
  # Straight-through: the backward pass sees the identity (section 7).
  return rows + tf.stop_gradient(q - rows)


def _set_static_shape(tensor, shape, dim):
  if isinstance(shape, (list, tuple)):
    static = [s if isinstance(s, int) else None for s in shape]
    tensor.set_shape(static + [dim])
