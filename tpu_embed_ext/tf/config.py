"""Spec -> fresh TensorFlow TPU embedding objects, and the TPU config proto.

Every call builds new ``TableConfig``/``FeatureConfig``/optimizer objects:
``TPUEmbedding.__init__`` writes into the ``TableConfig``s it is given (the
global optimizer, generated names), so objects handed out must never be
shared with the spec or with another call.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import tensorflow as tf
from tensorflow.python.ops import init_ops_v2
from tensorflow.python.util import nest

from tpu_embed_ext.tf import optimizers, rates, tags as rate_tags

__all__ = ["feature_config", "table_order", "config_proto", "tags"]

_api = tf.tpu.experimental.embedding


def _initializer(table):
  """The table's initializer, as one TPU host or the CPU would call it, made
  to give the same table when a TPU calls it per shard (``_whole_table``)."""
  init = _tf_initializer(table)
  return _whole_table(init) if init is not None else None


def _whole_table(initializer):
  """``initializer`` for every TPU: called without ``shard_info`` (one host,
  the CPU) it is ``initializer``; called per shard with ``shard_info``
  (``TPUEmbedding`` on a pod: one shard per host, ``make_sharded_variable_creator``;
  ``TPUEmbeddingV2``: one per device), it gives that shard's rows of one
  whole table, drawn once (at the first shard) and dropped when every row
  was given. TensorFlow would otherwise call a random initializer once per
  shard with the shard's shape: other initial tables on a pod than on one
  host (the pod's shards even start alike)."""
  whole = {}

  def init(shape, dtype=tf.float32, shard_info=None):
    if shard_info is None:
      return initializer(shape, dtype=dtype)
    key = (tuple(shape), tf.as_dtype(dtype).name)
    if key not in whole:
      whole[key] = [initializer(shape, dtype=dtype), 0]
    table, given = whole[key]
    start, rows = shard_info.offset[0], shard_info.shape[0]
    whole[key][1] = given + rows
    if whole[key][1] >= shape[0]:
      del whole[key]
    return table[start:start + rows]
  return init


def _tf_initializer(table):
  init = table.initializer
  if init is None:  # TensorFlow's default (TableConfig): truncated normal, 1/sqrt(dim).
    return init_ops_v2.TruncatedNormal(mean=0.0, stddev=1 / math.sqrt(table.dim))
  kind = init["type"]
  stddev = init.get("stddev") or 1.0 / table.dim ** 0.5
  if kind == "truncated_normal":
    return tf.keras.initializers.TruncatedNormal(init.get("mean", 0.0), stddev)
  if kind == "normal":
    return tf.keras.initializers.RandomNormal(init.get("mean", 0.0), stddev)
  if kind == "uniform":
    return tf.keras.initializers.RandomUniform(init.get("minval", -0.05),
                                               init.get("maxval", 0.05))
  if kind == "zeros":
    return tf.zeros_initializer()
  return tf.constant_initializer(init["value"])


def feature_config(spec, step=None, binder=None,
                   table_optimizers=None) -> Dict[str, Any]:
  """Fresh ``{feature: tf.tpu.experimental.embedding.FeatureConfig}`` of an
  ``EmbeddingSpec`` (``tpu_embed_ext.feature_config``, and
  ``EmbeddingSpec.feature_config``): TensorFlow's objects, for
  ``TPUEmbedding`` and ``TPUEmbeddingV2`` on a TPU.

  Schedules (and Adam's bias correction) become zero-arg callables reading
  ``step`` (``rates.RateBinder``; ``binder``: one already made for it), one
  per distinct rate, so TensorFlow gives tables sharing a rate one tag.
  ``table_optimizers``: ``{table name: spec.optimizer_for(name)}``, when the caller
  has resolved them already (their checks and warnings then run once).
  """
  binder = binder or rates.RateBinder(step)
  tables = {}
  for t in spec.tables:
    resolved = (table_optimizers[t.name] if table_optimizers is not None
                else spec.optimizer_for(t.name))
    quantization = None
    if t.quantization:
      quantization = _api.QuantizationConfig(**t.quantization)
    tables[t.name] = _api.TableConfig(
        vocabulary_size=t.vocabulary_size, dim=t.dim,
        initializer=_initializer(t),
        optimizer=optimizers.to_tf(resolved, learning_rate=binder.rate(resolved)),
        combiner=t.combiner, name=t.name, quantization_config=quantization)
  return {f.name: _api.FeatureConfig(
      tables[f.table], max_sequence_length=f.max_sequence_length,
      output_shape=list(f.output_shape) if f.output_shape else None, name=f.name)
          for f in spec.features}


def table_order(config) -> List[Any]:
  """Tables in TPUEmbedding's order: first use in the flattened features."""
  order = []
  for feature in nest.flatten(config):
    if all(feature.table is not t for t in order):
      order.append(feature.table)
  return order


def tags(config) -> Dict[str, Optional[int]]:
  """``{table name: dynamic learning-rate tag or None}``, as TPUEmbedding tags."""
  order = table_order(config)
  names = [t.name for t in order]
  rates = [t.optimizer.learning_rate for t in order]
  assigned = rate_tags.assign_tags(names, rates)
  rate_tags.check_tag_rules(assigned, dict(zip(names, rates)))
  return assigned


def config_proto(config, *, num_hosts: int = 1, num_tensor_cores: int = 8,
                 batch_size: int = 1):
  """The ``TPUEmbeddingConfiguration`` TPUEmbedding would send, built on CPU.

  Table descriptors are written by TensorFlow's own ``_set_table_descriptor``
  (optimizer parameters, dynamic learning-rate tags, quantization); feature
  descriptors as ``TPUEmbedding._create_config_proto`` writes them, with input
  shapes for ``batch_size`` per replica. Host and core counts are arguments,
  since no TPU is there to ask.
  """
  from tensorflow.core.protobuf.tpu import tpu_embedding_configuration_pb2 as pb
  proto = pb.TPUEmbeddingConfiguration()
  order = table_order(config)
  dynamic = []
  for table in order:
    rate = table.optimizer.learning_rate
    if callable(rate) and all(rate is not r for r in dynamic):
      dynamic.append(rate)
  index = {r: i for i, r in enumerate(dynamic)}
  for table in order:
    table._set_table_descriptor(proto.table_descriptor.add(), num_hosts, index)  # pylint: disable=protected-access
  for feature in nest.flatten(config):
    descriptor = proto.feature_descriptor.add()
    if feature.name:
      descriptor.name = feature.name
    descriptor.table_id = next(i for i, t in enumerate(order) if t is feature.table)
    shape = ([batch_size] + list(feature.output_shape[1:])
             if feature.output_shape else [batch_size])
    if feature.max_sequence_length:
      shape = shape + [feature.max_sequence_length]
    descriptor.input_shape.extend(shape)
  proto.mode = pb.TPUEmbeddingConfiguration.TRAINING
  proto.num_hosts = num_hosts
  proto.num_tensor_cores = num_tensor_cores
  proto.sharding_strategy = pb.TPUEmbeddingConfiguration.DIV_DEFAULT
  return proto
