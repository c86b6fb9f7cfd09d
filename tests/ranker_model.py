"""A Keras ranking model over two tables that Keras's own distribution feeds:
Ranker ("user": sum, Adagrad; "item": mean, Adam, multi-hot as -1-padded rows)
and its dataset of STEPS global batches. The replica tests train it.
"""

import keras
import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee

api = tf.tpu.experimental.embedding
VOCAB, DIM, GLOBAL_BATCH, STEPS = 30, 4, 8, 10


def default_feature_config():
  def init(seed):
    return tf.constant_initializer(
        np.random.RandomState(seed).uniform(-1, 1, (VOCAB, DIM)))
  user = api.TableConfig(VOCAB, DIM, initializer=init(1), name="user",
                         combiner="sum", optimizer=api.Adagrad(0.1))
  item = api.TableConfig(VOCAB, DIM, initializer=init(2), name="item",
                         combiner="mean", optimizer=api.Adam(0.05))
  return {"user": api.FeatureConfig(user, name="user"),
          "item": api.FeatureConfig(item, name="item")}


def dataset():
  """Multi-hot items as -1-padded rows (Keras cannot split ragged batches)."""
  rng = np.random.RandomState(0)
  n = GLOBAL_BATCH * STEPS
  lengths = rng.randint(1, 4, n)
  items = tf.RaggedTensor.from_row_lengths(
      rng.randint(0, VOCAB, lengths.sum()), lengths).to_tensor(-1, shape=[n, 3])
  features = {"user": rng.randint(0, VOCAB, n), "item": items}
  labels = rng.randint(0, 2, (n, 1)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((features, labels)).batch(
      GLOBAL_BATCH, drop_remainder=True)


class Ranker(keras.Model):
  """Embeddings of the feature config (default ``default_feature_config()``) into one logit."""

  def __init__(self, feature_config=None, engine=None):
    super().__init__()
    self.embedding = tee.EmbeddingLayer(feature_config or default_feature_config(),
                                        engine=engine)
    self.head = keras.layers.Dense(
        1, kernel_initializer=keras.initializers.GlorotUniform(seed=3))

  def call(self, features, training=False):
    features = dict(features, item=tf.RaggedTensor.from_tensor(
        features["item"], padding=-1))
    acts = self.embedding(features, training=training)
    return self.head(tf.concat([acts["user"], acts["item"]], 1))
