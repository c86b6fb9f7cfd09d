"""CPUEmbedding's lookups: TPUEmbeddingForServing's values for every input
layout and combiner, and simulated quantization (straight-through backward)."""

import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee
from tests.builders import three_combiner_feature_config, three_combiner_inputs

api = tf.tpu.experimental.embedding


def test_lookups_equal_tpu_embedding_for_serving():
  config = three_combiner_feature_config()
  ours = tee.CPUEmbedding(config, api.SGD(0.1))
  theirs = api.TPUEmbeddingForServing(config, api.SGD(0.1))
  theirs.build()
  for table, var in ours.embedding_tables.items():
    var.assign(theirs.embedding_tables[table])
  features, weights = three_combiner_inputs()
  got, want = ours(features, weights), theirs(features, weights)
  for name in features:
    assert got[name].shape == want[name].shape, name
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7,
                               err_msg=name)
  # Same inside tf.function, and through enqueue/dequeue.
  traced = tf.function(lambda f, w: ours(f, w))(features, weights)
  ours.enqueue(features, weights, training=False)
  dequeued = ours.dequeue()
  for name in features:
    np.testing.assert_allclose(traced[name], want[name], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dequeued[name], want[name], rtol=1e-6, atol=1e-7)


def test_simulated_quantization_forward_and_straight_through_backward():
  config = three_combiner_feature_config(quantize=True)
  emb = tee.CPUEmbedding(config, api.SGD(1.0))
  table = emb.variables["t_sum"]["parameters"]
  before = table.numpy()
  features, weights = three_combiner_inputs()
  features["dense"] = tf.constant([[3], [4], [3], [4]], tf.int64)
  emb.enqueue(features, weights, training=True)
  acts = emb.dequeue()
  quantum = 1.0 / 4
  rows = np.clip(before[[3, 4, 3, 4]], -0.5, 0.5)
  expected = np.floor((rows + 0.5) / quantum + 0.5) * quantum - 0.5
  np.testing.assert_allclose(acts["dense"], expected, atol=1e-6)  # [B, 1] -> [B, dim]
  grads = tf.nest.map_structure(tf.zeros_like, acts)
  grads["dense"] = tf.ones_like(acts["dense"])
  emb.apply_gradients(grads)
  # Straight-through: each of ids 3 and 4 gets gradient 2 (two occurrences).
  after = table.numpy()
  np.testing.assert_allclose(after[3], before[3] - 2.0, atol=1e-6)
  np.testing.assert_allclose(after[4], before[4] - 2.0, atol=1e-6)

