"""A Keras model over two tables whose gradients are reproducible: FixedHead
(logits a fixed projection of the activations) on "user" (sum, SGD) and
"item" (mean, Adagrad), its batches, a fit loop, and a recording stand-in for
TPUEmbeddingV2. The layer's tests and the XLA and native-kernel tests train it.
"""

import keras
import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee

emb_api = tf.tpu.experimental.embedding
VOCAB, DIM, BATCH, STEPS = 12, 4, 6, 5


def init(seed):
  values = np.random.RandomState(seed).uniform(-1, 1, (VOCAB, DIM))
  return tf.constant_initializer(values.astype(np.float32))


def feature_config(lr_user=0.1, lr_item=0.05):
  user = emb_api.TableConfig(VOCAB, DIM, initializer=init(1), name="user",
                             combiner="sum", optimizer=emb_api.SGD(lr_user))
  item = emb_api.TableConfig(VOCAB, DIM, initializer=init(2), name="item",
                             combiner="mean",
                             optimizer=emb_api.Adagrad(lr_item))
  return {"user": emb_api.FeatureConfig(user, name="user"),
          "item": emb_api.FeatureConfig(item, name="item")}


def batches(seed=0):
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(STEPS):
    user = tf.constant(rng.randint(0, VOCAB, BATCH), tf.int64)
    lengths = rng.randint(1, 4, BATCH)
    item = tf.RaggedTensor.from_row_lengths(
        tf.constant(rng.randint(0, VOCAB, lengths.sum()), tf.int64), lengths)
    label = tf.constant(rng.randint(0, 2, (BATCH, 1)), tf.float32)
    out.append(({"user": user, "item": item}, label))
  return out


PROJECTION = tf.constant(
    np.random.RandomState(7).normal(size=(2 * DIM, 1)).astype(np.float32))


def logits(activations):
  return tf.matmul(tf.concat([activations["user"], activations["item"]], 1),
                   PROJECTION)


class FixedHead(keras.Model):
  """Logits = fixed projection of the activations: dL/dact is reproducible."""

  def __init__(self, feature_config, **kwargs):
    super().__init__(**kwargs)
    self.embedding = tee.EmbeddingLayer(feature_config)

  def call(self, features, training=False):
    return logits(self.embedding(features, training=training))


def tables(embedding):
  return {name: {k: v.numpy() for k, v in slots.items()}
          for name, slots in embedding.variables.items()}


def fit(model, batches, optimizer):
  model.compile(optimizer=optimizer,
                loss=keras.losses.BinaryCrossentropy(from_logits=True))
  for features, label in batches:
    model.train_on_batch(features, label)


class RecordingV2:
  """Stands in for TPUEmbeddingV2: records the protocol the layer speaks."""

  def __init__(self):
    self.calls = []
    self.step = tf.Variable(0, dtype=tf.int64)
    self.embedding_tables = {}

  def __call__(self, features, weights=None):
    self.calls.append("lookup")
    return tf.nest.map_structure(
        lambda x: tf.ones([tf.shape(x)[0], DIM]), features), "preserved"

  def apply_gradients(self, gradients, preserved):
    self.calls.append(("apply", preserved))
