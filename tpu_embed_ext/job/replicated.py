"""Calling the model outside ``fit`` under a TPU strategy: one batch per replica.

On a TPU, ``TPUEmbedding`` is looked up inside ``strategy.run`` only, every
replica with a batch of the shape it was built for. ``fit`` does that; the
job's own calls (building the variables on the first held-out batch, the
held-out evaluation) do it here: the global batch is padded to the training
batch size (the held-out split's last batch may be smaller), split into one
contiguous slice per replica, run with ``strategy.run``, and the padding
dropped from the outputs. Off a strategy (``--tpu none``) the model is
called directly.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tpu_embed_ext import errors

__all__ = ["call_model", "rows", "fit_dataset", "per_replica_batch"]


def call_model(model, features, batch_size: int):
  """``model(features, training=False)`` under the strategy in scope, if any."""
  strategy = tf.distribute.get_strategy()
  if not tf.distribute.has_strategy():
    return model(features, training=False)
  per = per_replica_batch(batch_size, strategy)
  n = rows(features)
  padded = tf.nest.map_structure(lambda x: _pad(x, batch_size), features,
                                 expand_composites=False)
  per_replica = strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.nest.map_structure(
          lambda x: _rows_slice(x, ctx.replica_id_in_sync_group * per, per),
          padded, expand_composites=False))
  outputs = _replicated_call(model)(per_replica)
  return tf.concat(strategy.experimental_local_results(outputs), 0)[:n]


def per_replica_batch(batch_size: int, strategy) -> int:
  """Each replica's share of the global batch; a ConfigError if it does not split."""
  replicas = strategy.num_replicas_in_sync
  if batch_size % replicas:
    raise errors.ConfigError(
        f"batch_size {batch_size} does not split over {replicas} replicas. Fix: "
        f"use a batch size divisible by {replicas}.", path="train.batch_size")
  return batch_size // replicas


# model -> its replicated call (one tf.function per model, traced once per shape).
_CALLS = weakref.WeakKeyDictionary()


def _replicated_call(model):
  """``strategy.run`` of the model in a ``tf.function``: a TPUStrategy runs
  nothing eagerly."""
  if model not in _CALLS:
    strategy = tf.distribute.get_strategy()
    _CALLS[model] = tf.function(
        lambda f: strategy.run(lambda x: model(x, training=False), args=(f,)),
        reduce_retracing=True)
  return _CALLS[model]


def rows(features) -> int:
  x = tf.nest.flatten(features, expand_composites=False)[0]
  if isinstance(x, tf.SparseTensor):
    return int(x.dense_shape[0])
  if isinstance(x, tf.RaggedTensor):
    return int(x.nrows())
  return int(x.shape[0])


def _pad(x, size: int):
  """``x`` with empty (zero, id-less) rows up to ``size`` rows."""
  if isinstance(x, tf.SparseTensor):
    return tf.sparse.reset_shape(x, [size, x.dense_shape[1]])
  if isinstance(x, tf.RaggedTensor):
    missing = size - x.nrows()
    empty = tf.RaggedTensor.from_row_lengths(
        tf.zeros([0], x.dtype), tf.zeros([missing], x.row_splits.dtype))
    return tf.concat([x, empty], 0)
  missing = size - tf.shape(x)[0]
  return tf.pad(x, [[0, missing]] + [[0, 0]] * (x.shape.rank - 1))


def _rows_slice(x, start: int, count: int):
  if isinstance(x, tf.SparseTensor):
    return tf.sparse.slice(x, [start, 0], [count, x.dense_shape[1]])
  return x[start:start + count]


def fit_dataset(make_dataset):
  """The training dataset as ``fit`` under a strategy needs it, distributed.

  Under a strategy Keras's ``fit`` iterates the dataset twice: it takes the
  first batch of one iterator to build the model, then trains from a new
  iterator. Every iterator must see the batches of the first: the shuffle
  reshuffles per iterator (``reshuffle_each_iteration``), and a second
  iterator would train on another order than ``--tpu none`` and a resumed
  run. So the dataset is built anew inside each iterator (``flat_map``),
  whose first pass is the order of a single run.

  Multi-hot ids stay ``tf.RaggedTensor`` / ``tf.SparseTensor``, made on the
  host by the input pipeline, as a TPU's ``TPUEmbedding`` takes them (it
  refuses ids computed inside ``strategy.run``). A TPU's strategy does not
  prefetch those to its devices (``TPUStrategy._check_spec``), hence
  ``experimental_fetch_to_device=False``; Keras's first-batch build of such
  a batch: ``keras/distributed_fit.py``.

  On a pod slice (several hosts: ``--tpu emulate:8,hosts=2``,
  ``emulate:v5p:8``) TensorFlow's ``input_lib`` gives every host a clone of
  the dataset, rebatched to its replicas' shares and auto-sharded by host.
  The policy is DATA: every host reads the same seeded order and keeps its
  replicas' rows of each global batch, so a step's global batch, over all
  hosts, holds the examples of ``--tpu none``'s step (``AUTO`` would shard
  by file: other examples per step than one host reads, and an error for a
  split stored in fewer files than hosts).
  """
  dataset = tf.data.Dataset.range(1).flat_map(lambda _: make_dataset())
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.DATA)
  dataset = dataset.with_options(options)
  return tf.distribute.get_strategy().experimental_distribute_dataset(
      dataset, options=tf.distribute.InputOptions(experimental_fetch_to_device=False))
