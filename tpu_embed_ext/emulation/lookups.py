"""Lookups in occurrence form: every input kind reduced to one shape.

Occurrence ``i`` of a feature sends ``gain_i * E[id_i]`` to output row
``rows[i]`` (docs/semantics.md, section 0.1). Lookups gather and combine in
that form; training reads it backwards (the gradient of occurrence ``i`` is
``gain_i * dL/dact[rows[i]]``), so forward and backward can never disagree.

Combiners are ``TPUEmbeddingForServing``'s (``cpu_embedding_lookup``): a
ragged or sparse input is combined per row (``sum``, ``mean`` =
``sum(w e) / sum(w)``, ``sqrtn`` = ``sum(w e) / sqrt(sum(w^2))``, 0 for an
empty row); a sequence feature (``max_sequence_length > 0``) returns
``[batch, max_sequence_length, dim]`` with later positions truncated and
missing ones zero. Simulated quantization is applied to the gathered rows
before the combiner, forward only (docs/semantics.md, other options).

Shapes and the inputs accepted are ``TPUEmbedding``'s, the object the engine
stands in for, where ``TPUEmbeddingForServing`` differs (docs/shapes.md):
dense ids of rank >= 2 must end in a dimension of 1, which is dropped (``[B,
1] -> [B, dim]``, ``[B, 4, 1] -> [B, 4, dim]``); ``[B, k > 1]`` is rejected
(``shapes.input_shape``).

Each input kind has one function (``dense``, ``ragged``, ``sparse``) that
reads ids and weights already checked, and runs no check itself: what the
input checks read, and when the reads here wait for them, is
``input_checks.py``'s; what is wrong in the static shapes raises before
(``check_rows``, ``check_combined``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import check_runner, rules as rules_lib
from tpu_embed_ext.emulation.native import lookup as native_lookup

__all__ = ["Occurrences", "as_ids", "check_rows", "check_combined", "runtime_dims",
           "occurrences", "dense", "ragged", "sparse", "activation",
           "occurrence_gradients"]


class Occurrences(NamedTuple):
  """One feature's lookup in flat form: ids[i] * gains[i] -> row rows[i].

  ``kept`` marks occurrences that count (None: all). Only XLA uses it: there
  truncated sequence positions stay in place with gain 0 instead of being
  masked out, because XLA mishandles the data-dependent sizes that masking
  makes (measured: ``tf.unique`` of a masked tensor returned a duplicate).
  """
  ids: tf.Tensor              # [n] int64
  rows: Optional[tf.Tensor]   # [n] int; None: the identity (dense lookups)
  gains: Optional[tf.Tensor]  # [n] float32; None: all ones
  num_rows: tf.Tensor         # scalar: rows of the [num_rows, dim] output
  shape: Any                  # the activation shape, without dim
  kept: Optional[tf.Tensor] = None  # [n] bool


def as_ids(where: str, x):
  """``x`` if it is a ``tf.Tensor``, ``tf.SparseTensor`` or ``tf.RaggedTensor``.

  ``TPUEmbedding`` takes nothing else (``tpu_embedding_v2.py``
  ``_generate_enqueue_op``: ``ValueError`` "is of unknown type").
  """
  if isinstance(x, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor)):
    return x
  raise errors.InputError(
      f"{where}: ids are of type {type(x).__name__}; TPUEmbedding takes only a "
      "tf.Tensor, tf.SparseTensor or tf.RaggedTensor. Fix: convert them, e.g. "
      "tf.constant(ids, tf.int64) or tf.ragged.constant(ids, tf.int64).")


def check_rows(where: str, x, shape, rules: rules_lib.EngineRules):
  """Raises unless the rows the TPU gets can fill the activation ``shape``
  (a list, ``runtime_dims``): one dense id per sample, and one ragged row
  per sample where every row is a sample (``rules.output_shape_required``:
  ``tpu_embedding_v3.py``); checked when the step is traced."""
  if (rules.output_shape_required and isinstance(x, tf.RaggedTensor)
      and x.shape[0] is not None):
    _check_count(where, "rows of ragged ids", x.shape[0], shape)
  if (isinstance(x, tf.Tensor) and x.shape.is_fully_defined()
      and _is_static(shape)):
    _check_count(where, "ids", x.shape.num_elements(), shape)


def check_combined(where: str, config, x, shape):
  """Raises unless ragged or sparse ids combine into the activation
  ``shape``: a sparse tensor's rows fill it, a ragged tensor's batch size
  divides it (``ragged``, ``sparse``); checked when the step is traced."""
  if _is_sequence(config, x):
    return
  if isinstance(x, tf.SparseTensor):
    static = x.shape[:-1]
    if static.is_fully_defined() and _is_static(shape):
      _check_count(where, "rows of sparse ids", static.num_elements(), shape)
  elif isinstance(x, tf.RaggedTensor):
    size, static_batch = _prod(shape) if _is_static(shape) else None, x.shape[0]
    if static_batch is None or size is None or size == static_batch:
      return
    # A larger output_shape: the row's ids fill size // batch positions.
    if size % static_batch or size // static_batch < 1:
      raise errors.InputError(
          f"{where}: activation shape {shape} must have the batch size "
          f"{static_batch} or a multiple of it as its number of elements. "
          "Fix: change FeatureConfig.output_shape.")


def occurrences(config, x, weights, shape, native: bool = False) -> Occurrences:
  """The occurrence form of one feature's ids ``x`` (any kind, already
  checked by ``check_rows`` and ``check_combined``) and float32 ``weights``
  (their values, one per id; None: unweighted). ``shape`` is the activation
  shape without ``dim`` (``runtime_dims``). ``native``: combiner gains (and
  a ragged feature's rows) from one native op (``native.lookup``: the same
  values); never under XLA. Reads only; runs no check.

  uint64 ids become int64: one of 2^63 or more (which the input checks
  reject) saturates at 2^63 - 1 instead of reading as a negative id.
  """
  if x.dtype == tf.uint64:
    x = _signed(x)
  if isinstance(x, tf.RaggedTensor):
    occ = ragged(config, x, weights, shape, native)
  elif isinstance(x, tf.SparseTensor):
    occ = sparse(config, x, weights, shape, native)
  else:
    return dense(config, x, weights, shape)
  return occ._replace(ids=tf.cast(occ.ids, tf.int64))


def dense(config, x, weights, shape) -> Occurrences:
  """Dense ids: one id per sample, its own output row; weighted
  (``rules.weights_on_dense_ids``): a one-id combiner per sample."""
  ids = tf.reshape(x, [-1])
  if weights is None:
    return Occurrences(tf.cast(ids, tf.int64), None, None, tf.size(ids), shape)
  size = tf.size(ids, out_type=tf.int64)
  return _combined(config, tf.cast(ids, tf.int64), tf.range(size), weights,
                   size, shape)


def ragged(config, x, weights, shape, native=False) -> Occurrences:
  """Ragged ids: a row's ids combined, or a sequence (``max_sequence_length``,
  or an output shape that is a multiple of the batch size)."""
  # A static batch size when known: XLA needs static reshapes.
  batch = x.shape[0] if x.shape[0] is not None else x.nrows(out_type=tf.int64)
  ids = x.values
  static_batch = x.shape[0]
  if _is_sequence(config, x):
    return _sequence(ids, x.value_rowids(), _positions(x), batch,
                     config.max_sequence_length, shape)
  size = _prod(shape) if _is_static(shape) else None
  if static_batch is None or size is None or size == static_batch:
    if native and not check_runner.in_xla_context():
      rows, gains = native_lookup.ragged_gains(x.row_splits, weights,
                                               config.table.combiner)
      return Occurrences(ids, rows, gains, batch, shape)
    return _combined(config, ids, x.value_rowids(), weights, batch, shape)
  return _sequence(ids, x.value_rowids(), _positions(x), batch,
                   size // static_batch, shape)


def sparse(config, x, weights, shape, native=False) -> Occurrences:
  """Sparse ids: combined over the last dimension, as
  ``embedding_lookup_sparse`` does, or a sequence (rank 2 only)."""
  rank = x.shape.rank
  if _is_sequence(config, x):
    return _sequence(x.values, x.indices[:, 0], x.indices[:, 1], x.dense_shape[0],
                     config.max_sequence_length, shape)
  # On the static outer shape when known (XLA needs static shapes).
  static = x.shape[:-1]
  outer = static.as_list() if static.is_fully_defined() else x.dense_shape[:-1]
  # The row-major position of the outer index (rank 1: one row).
  row = x.indices[:, 0] if rank > 1 else tf.zeros_like(x.indices[:, 0])
  for d in range(1, rank - 1):
    row = row * outer[d] + x.indices[:, d]
  num_rows = _prod(outer) if isinstance(outer, list) else tf.reduce_prod(outer)
  if native and not check_runner.in_xla_context():
    return Occurrences(x.values, row, native_lookup.segment_gains(
        row, weights, num_rows, config.table.combiner), num_rows, shape)
  return _combined(config, x.values, row, weights, num_rows, shape)


def _is_sequence(config, x) -> bool:
  """Whether ragged or (rank-2) sparse ids of a feature are a sequence:
  ``max_sequence_length`` without ``output_shape`` (an engine whose rules
  require ``output_shape`` never honours it)."""
  if not (config.max_sequence_length > 0 and not config.output_shape):
    return False
  return isinstance(x, tf.RaggedTensor) or x.shape.rank == 2


def _signed(x):
  """uint64 ids as int64, saturating at 2^63 - 1."""
  values = x if isinstance(x, tf.Tensor) else x.values
  values = tf.cast(tf.minimum(values, tf.constant(2 ** 63 - 1, tf.uint64)), tf.int64)
  return values if isinstance(x, tf.Tensor) else x.with_values(values)


def runtime_dims(x, shape: tf.TensorShape) -> list:
  """``shape`` as a list whose unknown dimensions are read from ``x``.

  An unknown dimension of an activation shape comes from the same position
  of the input (the sequence length, inserted at 1, is always known).
  """
  dims = shape.as_list()
  if None not in dims:
    return dims
  if isinstance(x, tf.SparseTensor):
    runtime = tf.cast(x.dense_shape, tf.int32)
  elif isinstance(x, tf.RaggedTensor):
    runtime = tf.reshape(x.nrows(out_type=tf.int32), [1])
  else:
    runtime = tf.shape(x, out_type=tf.int32)
  return [d if d is not None else runtime[i] for i, d in enumerate(dims)]


def _is_static(dims) -> bool:
  return all(isinstance(d, int) for d in dims)


def _check_count(where, what, count, shape):
  """The TPU fills ``shape`` from the rows it gets: their number must match."""
  if count != _prod(shape):
    raise errors.InputError(
        f"{where}: {count} {what} cannot fill the activation shape {shape} "
        f"({_prod(shape)} rows). Fix: make FeatureConfig.output_shape (or the "
        "shapes given to build) match the input.")


def _combined(config, ids, row, weight, num_rows, shape) -> Occurrences:
  """Per-row combiner gains (docs/semantics.md, section 0.1)."""
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
  num_rows = tf.cast(batch, tf.int64) * length
  if check_runner.in_xla_context():
    zero = tf.zeros_like(ids)
    return Occurrences(tf.where(keep, ids, zero),
                       tf.where(keep, row * length + col, tf.zeros_like(row)),
                       tf.cast(keep, tf.float32), num_rows, shape, keep)
  ids, row, col = (tf.boolean_mask(t, keep) for t in (ids, row, col))
  return Occurrences(ids, row * length + col, None, num_rows, shape)


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
  return tf.reshape(out, list(occ.shape) + [dim])


def occurrence_gradients(occ: Occurrences, grad, dim: int):
  """``(ids, [n, dim] gradients)`` of every occurrence, from ``dL/dact``.

  ``grad`` None is a zero gradient for every occurrence (the TPU applies a
  zero-gradient update then, docs/semantics.md section 7).
  """
  # Occurrences that do not count get id -1: no row is touched for them.
  ids = occ.ids if occ.kept is None else tf.where(
      occ.kept, occ.ids, -tf.ones_like(occ.ids))
  if grad is None:
    return ids, tf.zeros([tf.size(ids), dim], tf.float32)
  grad = tf.reshape(tf.cast(grad, tf.float32), [-1, dim])
  if occ.rows is not None:
    grad = tf.gather(grad, occ.rows)
  if occ.gains is not None:
    grad = grad * occ.gains[:, None]
  return ids, grad


def _quantize(rows, config):
  """Simulated quantization of gathered rows (forward only)."""
  if config is None:
    return rows
  lower, upper = float(config.lower), float(config.upper)
  quantum = (upper - lower) / (config.num_buckets - 1)
  x = tf.clip_by_value(rows, lower, upper)
  q = tf.floor((x - lower) / quantum + 0.5) * quantum + lower
  # Straight-through: the backward pass sees the identity (docs/semantics.md).
  return rows + tf.stop_gradient(q - rows)

