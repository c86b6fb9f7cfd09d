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
1] -> [B, dim]``, ``[B, 4, 1] -> [B, 4, dim]``); ``[B, k > 1]`` is rejected.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import check_runner, checks, structure_checks
from tpu_embed_ext.emulation.native import lookup as native_lookup

__all__ = ["Occurrences", "as_ids", "input_shape", "output_shape",
           "feature_occurrences", "activation", "occurrence_gradients"]


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
  # In a graph, whether the weights match the ids (checks.WEIGHTS_LAYOUT).
  weights_ok: Optional[tf.Tensor] = None
  # In a graph, the feature's own input checks (check_runner.by_feature):
  # sparse indices, uint64 ids, finite weights.
  checks: Tuple[check_runner.Verdict, ...] = ()


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


def feature_occurrences(where: str, config, x, w, check: bool,
                        shape, engine: str = "v1",
                        native: bool = False,
                        own_checked=None) -> Occurrences:
  """The occurrence form of one feature's ids ``x`` and weights ``w``.

  ``where`` names the feature and table in errors; ``check`` enables the
  checks of weights against ids (eagerly they raise; in a graph their
  outcome is ``weights_ok``, for ``checks.WEIGHTS_LAYOUT``); ``shape`` is the feature's
  activation shape without ``dim`` (a ``TensorShape``, see ``output_shape``);
  its unknown dimensions are read from ``x`` when the batch runs.

  ``engine="v2"`` (``TPUEmbeddingV2``, ``tpu_embedding_v3.py``
  ``_convert_input_feature_to_list_of_coo_tensors``): every dense id, ragged
  row or sparse row is one of the ``prod(output_shape)`` samples, dense ids
  may be weighted, and ``max_sequence_length`` plays no part.

  ``native``: combiner gains (and a ragged feature's rows) from one native
  op (``native.lookup``: the same values); never under XLA.

  ``own_checked``: the assertions of the feature's own checks (uint64 ids,
  sparse indices, finite weights) run over all replicas at once
  (replica_checks.py); None: run here. What would wait for them waits for those.
  """
  own_check = check and own_checked is None
  if not isinstance(x, (tf.SparseTensor, tf.RaggedTensor)):
    x = tf.convert_to_tensor(x)
  if not x.dtype.is_integer:
    raise errors.InputError(
        f"{where}: ids must be integers, got dtype {x.dtype.name}. Fix: cast "
        "the ids with tf.cast(ids, tf.int64).")
  # tpu_embedding_v2.py _add_data_for_tensor / _sparse_tensor / _ragged_tensor.
  v2 = engine == "v2"
  if w is not None and isinstance(x, tf.Tensor) and not v2:
    raise errors.InputError(
        f"Weight specified for dense input {structure_checks.feature_path(where)}, "
        "which is not allowed. Weight will always be 1 in this case. "
        f"{where}: weights were given for a dense id tensor. Fix: pass the "
        "ids as a RaggedTensor or SparseTensor to weight them.")
  if w is not None and config.max_sequence_length > 0 and not v2:
    # TPUEmbedding passes them to the TPU, which does not document what a
    # weight does to a sequence position; TPUEmbeddingForServing rejects them.
    raise errors.InputError(
        f"{where}: weights were given for a sequence feature "
        f"(max_sequence_length={config.max_sequence_length}); what the TPU "
        "does with them is not documented, so they are not emulated. Fix: "
        "drop them.")
  if w is not None and type(w) is not type(x):
    tf_phrase = "" if v2 else (
        f"Weight for {structure_checks.feature_path(where)} is type {type(w)} which "
        f"does not match type input which is {type(x).__name__}. ")
    raise errors.InputError(
        f"{tf_phrase}{where}: weights are a {type(w).__name__} but ids a "
        f"{type(x).__name__}. Fix: give weights the ids' type and layout.")
  own: List[check_runner.Verdict] = []
  if x.dtype == tf.uint64:
    x = _signed(where, config, check_runner.after(x, own_checked), own_check, own)
  shape = _runtime_dims(x, tf.TensorShape(shape))
  if v2 and isinstance(x, tf.RaggedTensor) and x.shape[0] is not None:
    _check_count(where, "rows of ragged ids", x.shape[0], shape)
  if isinstance(x, tf.Tensor):
    ids = tf.reshape(x, [-1])
    if x.shape.is_fully_defined() and _is_static(shape):
      _check_count(where, "ids", x.shape.num_elements(), shape)
    if w is not None:  # v2: one weighted id per sample.
      w = check_runner.after(_weights(where, tf.reshape(w, [-1]), own_check, own), own_checked)
      return _combined(config, tf.cast(ids, tf.int64),
                       tf.range(tf.size(ids, out_type=tf.int64)), w,
                       tf.size(ids, out_type=tf.int64), shape
                       )._replace(checks=tuple(own))
    occ = Occurrences(ids, None, None, tf.size(ids), shape)
  else:
    if own_checked and isinstance(x, tf.SparseTensor):
      x = tf.SparseTensor(check_runner.after(x.indices, own_checked), x.values, x.dense_shape)
    if own_check and isinstance(x, tf.SparseTensor):
      # Every op that reads a row computed from the indices waits for the
      # check (a combiner's segment sums, the gradients' gather).
      indices = _gated(x.indices, check_runner.run(checks.SPARSE_INDICES, [
          check_runner.Item(tf.convert_to_tensor(x.indices, tf.int64),
                            (tf.convert_to_tensor(x.dense_shape, tf.int64),),
                            {"where": where})]), own)
      x = tf.SparseTensor(indices, x.values, x.dense_shape)
    weights_ok, weight = None, None
    if w is not None:
      weight = check_runner.after(_weights(where, w.values, own_check, own), own_checked)
      if check:
        weights_ok = structure_checks.weights_layout_ok(where, x, w)
        if tf.executing_eagerly():
          check_runner.run(checks.WEIGHTS_LAYOUT, [check_runner.Item(
              weights_ok, names={"where": where})])  # raises if not
          weights_ok = None
      if weights_ok is not None:
        # Checked when the step runs; until then, one weight per id.
        weight = structure_checks.aligned_weights(weight,
                                                  tf.size(x.values, tf.int64))
    if isinstance(x, tf.RaggedTensor):
      occ = _ragged(where, config, x, weight, shape, native)
    else:
      occ = _sparse(where, config, x, weight, shape, native)
    occ = occ._replace(weights_ok=weights_ok)
  return occ._replace(ids=tf.cast(occ.ids, tf.int64), checks=tuple(own))


def _gated(tensor, verdict, own: list):
  """``tensor``, read only once the feature's check passed (in a graph;
  ``verdict`` is None eagerly, where the check raised; its assertion is None
  under XLA)."""
  if verdict is None:
    return tensor
  own.append(verdict)
  if verdict.assertion is None:
    return tensor
  with tf.control_dependencies([verdict.assertion]):
    return tf.identity(tensor)


def _weights(where, values, check: bool, own: list) -> tf.Tensor:
  """Weights as float32, checked as inputs of the feature: numbers, finite."""
  if not (values.dtype.is_floating or values.dtype.is_integer):
    raise errors.InputError(
        f"{where}: weights must be numbers, got dtype {values.dtype.name}. Fix: "
        "give float32 weights (tf.strings.to_number(weights) for strings).")
  values = tf.cast(values, tf.float32)
  if not check:
    return values
  return _gated(values, check_runner.run(checks.WEIGHTS_FINITE, [
      check_runner.Item(values, names={"where": where})]), own)


def _signed(where, config, x, check: bool, own: list):
  """uint64 ids as int64, checked first: one of 2^63 or more would read as a
  negative id (and be reported as one). Past the check (or under XLA, where
  the step is rejected) such an id saturates at 2^63 - 1."""
  values = x if isinstance(x, tf.Tensor) else x.values
  if check:
    vocab = config.table.vocabulary_size
    values = _gated(values, check_runner.run(checks.UNSIGNED_IDS, [
        check_runner.Item(values, (vocab,), {"where": where, "vocab": vocab})]),
                    own)
  values = tf.cast(tf.minimum(values, tf.constant(2 ** 63 - 1, tf.uint64)), tf.int64)
  if isinstance(x, tf.Tensor):
    return values
  return x.with_values(values)


def _runtime_dims(x, shape: tf.TensorShape) -> list:
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


def _ragged(where, config, x, weight, shape, native=False) -> Occurrences:
  # A static batch size when known: XLA needs static reshapes.
  batch = x.shape[0] if x.shape[0] is not None else x.nrows(out_type=tf.int64)
  ids = x.values
  static_batch = x.shape[0]
  if config.max_sequence_length > 0 and not config.output_shape:
    return _sequence(ids, x.value_rowids(), _positions(x), batch,
                     config.max_sequence_length, shape)
  size = _prod(shape) if _is_static(shape) else None
  if static_batch is None or size is None or size == static_batch:
    if native and not check_runner.in_xla_context():
      rows, gains = native_lookup.ragged_gains(x.row_splits, weight,
                                               config.table.combiner)
      return Occurrences(ids, rows, gains, batch, shape)
    return _combined(config, ids, x.value_rowids(), weight, batch, shape)
  # A larger output_shape: the row's ids fill size // batch positions.
  length = size // static_batch
  if size % static_batch or length < 1:
    raise errors.InputError(
        f"{where}: activation shape {shape} must have the batch size "
        f"{static_batch} or a multiple of it as its number of elements. "
        "Fix: change FeatureConfig.output_shape.")
  return _sequence(ids, x.value_rowids(), _positions(x), batch, length, shape)


def _sparse(where, config, x, weight, shape, native=False) -> Occurrences:
  rank = x.shape.rank
  if config.max_sequence_length > 0 and not config.output_shape and rank == 2:
    return _sequence(x.values, x.indices[:, 0], x.indices[:, 1], x.dense_shape[0],
                     config.max_sequence_length, shape)
  # Combine over the last dimension, as embedding_lookup_sparse does, on the
  # static outer shape when known (XLA needs static shapes).
  static = x.shape[:-1]
  outer = static.as_list() if static.is_fully_defined() else x.dense_shape[:-1]
  if static.is_fully_defined() and _is_static(shape):
    _check_count(where, "rows of sparse ids", static.num_elements(), shape)
  # The row-major position of the outer index (rank 1: one row).
  row = x.indices[:, 0] if rank > 1 else tf.zeros_like(x.indices[:, 0])
  for d in range(1, rank - 1):
    row = row * outer[d] + x.indices[:, d]
  num_rows = _prod(outer) if isinstance(outer, list) else tf.reduce_prod(outer)
  if native and not check_runner.in_xla_context():
    return Occurrences(x.values, row, native_lookup.segment_gains(
        row, weight, num_rows, config.table.combiner), num_rows, shape)
  return _combined(config, x.values, row, weight, num_rows, shape)


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

