"""model.fit with EmbeddingLayer under MirroredStrategy equals one device.

Keras divides each replica's loss by the number of replicas, so the summed
per-replica gradients are the global batch's gradient; the engine sums the
replicas' per-id gradients and applies them once. Tables, slots, the table
step and the dense weights must then equal one device on the same global
batches, over 10 steps.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests.test_replicas import mirrored

api = tf.tpu.experimental.embedding
VOCAB, DIM, GLOBAL_BATCH, STEPS = 30, 4, 8, 10


def _feature_config():
  def init(seed):
    return tf.constant_initializer(
        np.random.RandomState(seed).uniform(-1, 1, (VOCAB, DIM)))
  user = api.TableConfig(VOCAB, DIM, initializer=init(1), name="user",
                         combiner="sum", optimizer=api.Adagrad(0.1))
  item = api.TableConfig(VOCAB, DIM, initializer=init(2), name="item",
                         combiner="mean", optimizer=api.Adam(0.05))
  return {"user": api.FeatureConfig(user, name="user"),
          "item": api.FeatureConfig(item, name="item")}


def _dataset():
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
  """Embeddings of the feature config (default ``_feature_config()``) into one logit."""

  def __init__(self, feature_config=None, engine=None):
    super().__init__()
    self.embedding = tee.EmbeddingLayer(feature_config or _feature_config(),
                                        engine=engine)
    self.head = keras.layers.Dense(
        1, kernel_initializer=keras.initializers.GlorotUniform(seed=3))

  def call(self, features, training=False):
    features = dict(features, item=tf.RaggedTensor.from_tensor(
        features["item"], padding=-1))
    acts = self.embedding(features, training=training)
    return self.head(tf.concat([acts["user"], acts["item"]], 1))


def _train(strategy):
  with strategy.scope():
    model = Ranker()
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
  model.fit(_dataset(), epochs=1, verbose=0)
  tables = {f"{t}/{k}": v.numpy()
            for t, slots in model.embedding.variables_by_table.items()
            for k, v in slots.items()}
  dense = [w.numpy() for w in model.head.weights]
  return tables, int(model.embedding.step.numpy()), dense


@pytest.fixture(scope="module")
def one_device():
  return _train(tf.distribute.get_strategy())


@pytest.mark.parametrize("replicas", [2, 4])
def test_fit_under_mirrored_strategy_equals_one_device(one_device, replicas):
  tables, step, dense = _train(mirrored(replicas))
  want_tables, want_step, want_dense = one_device
  assert step == want_step == STEPS
  for name, value in want_tables.items():
    np.testing.assert_allclose(tables[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  for got, want in zip(dense, want_dense):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_xla_around_several_replicas_is_refused_with_the_fix(no_op_determinism):
  """TensorFlow cannot compile several CPU devices in one XLA cluster."""
  del no_op_determinism
  strategy = mirrored(2)
  with strategy.scope():
    model = Ranker()
    model.compile(optimizer=keras.optimizers.SGD(0.5), jit_compile=True,
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
  assert model.jit_compile
  with pytest.raises(tee.ConfigError, match=(
      r"XLA \(jit_compile=True\) around 2 MirroredStrategy replicas cannot run on "
      r"CPU: .* Fix: emulate the replicas with jit_compile=False, or compile one "
      r"device with jit_compile=True")):
    model.fit(_dataset(), epochs=1, verbose=0)
  assert int(model.embedding.step.numpy()) == 0
