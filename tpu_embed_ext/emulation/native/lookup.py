"""The native lookup: ``lookups.activation`` in one op (``lookup_op.cc``).

Same inputs, same result, bit for bit: the op gathers, quantizes, weights and
sums per output row with the float32 operations of the TF-op path, in input
order. The gains (the combiner's ``w / sum(w)``, ``w / sqrt(sum(w^2))``) are
the ones ``lookups`` computes in TensorFlow, shared with the backward pass.
Simulated quantization runs inside the op. No gradient is registered: the
engine trains through ``apply_gradients``, never through the gather (as the
TF-op path, where ``EmbeddingLayer`` stops gradients into the tables).
"""

from __future__ import annotations

import tensorflow as tf

from tpu_embed_ext.emulation.native import loader

__all__ = ["activation", "ragged_gains", "segment_gains"]

_COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}


def _empty(dtype):
  return tf.zeros([0], dtype)


def _int64(x):
  """``x`` as an int64 tensor (a Python int: one constant, no cast op)."""
  return tf.constant(x, tf.int64) if isinstance(x, int) else tf.cast(x, tf.int64)


def ragged_gains(row_splits, weights, combiner: str):
  """``(rows, gains)`` of a combined ragged feature in one op: its
  ``value_rowids`` and what ``lookups._combined`` computes (gains None:
  all ones, a sum without weights)."""
  rows, gains = loader.load().tpu_embed_ext_ragged_gains(
      tf.cast(row_splits, tf.int64),
      _empty(tf.float32) if weights is None else weights,
      combiner=_COMBINERS[combiner])
  return rows, (None if combiner == "sum" and weights is None else gains)


def segment_gains(rows, weights, num_rows, combiner: str):
  """What ``lookups._combined`` computes for ids whose output rows are
  ``rows`` (of ``num_rows``): a sum's gains are its weights (None: all
  ones), the other combiners' one op."""
  if combiner == "sum":
    return weights
  return loader.load().tpu_embed_ext_segment_gains(
      tf.cast(rows, tf.int64), _empty(tf.float32) if weights is None else weights,
      _int64(num_rows), combiner=_COMBINERS[combiner])


def activation(params, occ, table_config, check=None):
  """``lookups.activation(params, occ, table_config, check)`` in one op."""
  ops = loader.load()
  q = table_config.quantization_config
  attrs = {}
  if q is not None:
    lower, upper = float(q.lower), float(q.upper)
    attrs = dict(quantize=True, q_lower=lower, q_upper=upper,
                 q_quantum=(upper - lower) / (q.num_buckets - 1))
  rows = (_empty(tf.int64) if occ.rows is None
          else tf.cast(occ.rows, tf.int64))
  gains = _empty(tf.float32) if occ.gains is None else occ.gains
  num_rows = _int64(occ.num_rows)
  with tf.control_dependencies([check] if check is not None else []):
    out = ops.tpu_embed_ext_lookup(
        params.handle, tf.cast(occ.ids, tf.int64), rows, gains, num_rows,
        dim=table_config.dim, segmented=occ.rows is not None, **attrs)
  return tf.reshape(out, list(occ.shape) + [table_config.dim])
