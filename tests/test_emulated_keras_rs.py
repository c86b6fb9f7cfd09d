"""keras-rs ``DistributedEmbedding`` (TensorFlow backend) on the emulated SparseCore TPU.

keras-rs decides where a table goes from the strategy in scope
(``keras_rs/src/layers/embedding/tensorflow/distributed_embedding.py``):
``_has_sparsecore`` is true under ``tf.distribute.TPUStrategy`` whose
``extended.tpu_hardware_feature.embedding_feature`` is V1 or V2, and
``_sparsecore_init`` then builds ``tf.tpu.experimental.embedding.TPUEmbeddingV2``
for V2. Under ``emulate_tpu(sparsecore=True)`` all three are the emulation's,
so the layer takes its SparseCore path unchanged: a lookup inside
``strategy.run`` and ``apply_gradients(gradients, preserved_outputs)`` in its
gradient trap. Trained by ``model.fit`` at 2 replicas, its table must equal a
numpy reference of the TPU's math: each id's gradient summed over both
replicas, one SGD update per step.
"""

import importlib.util
import os

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("keras_rs") is None or
    os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow",
    reason="keras-rs (test extra, Python >= 3.11) on the TensorFlow backend")

VOCAB, DIM, GLOBAL_BATCH, STEPS, REPLICAS, LR = 32, 4, 8, 4, 2, 0.5


def _data():
  rng = np.random.RandomState(3)
  ids = rng.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, 1)).astype(np.int32)
  targets = rng.uniform(-1, 1, (GLOBAL_BATCH * STEPS, DIM)).astype(np.float32)
  return ids, targets


def _numpy_reference(initial):
  """SGD on the table: dL/da = 2 (a - y) / (DIM * GLOBAL_BATCH) (Keras's mse over
  the global batch), summed per id over the whole global batch."""
  table = initial.astype(np.float64).copy()
  ids, targets = _data()
  for step in range(STEPS):
    rows = ids[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH, 0]
    y = targets[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
    grad = np.zeros_like(table)
    np.add.at(grad, rows, 2 * (table[rows] - y) / (DIM * GLOBAL_BATCH))
    table -= LR * grad
  return table


def test_distributed_embedding_takes_the_sparsecore_path_and_trains_with_tpu_math():
  import keras
  import keras_rs
  initial = np.random.RandomState(0).uniform(-1, 1, (VOCAB, DIM)).astype(np.float32)
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    strategy = tf.distribute.TPUStrategy(resolver)
    with strategy.scope():
      table = keras_rs.layers.TableConfig(
          name="table", vocabulary_size=VOCAB, embedding_dim=DIM,
          optimizer=keras.optimizers.SGD(LR),
          initializer=keras.initializers.Constant(initial))
      features = {"ids": keras_rs.layers.FeatureConfig(
          name="ids", table=table, input_shape=(GLOBAL_BATCH, 1),
          output_shape=(GLOBAL_BATCH, DIM))}
      layer = keras_rs.layers.DistributedEmbedding(features)
      inputs = keras.Input(shape=(1,), name="ids", dtype="int32",
                           batch_size=GLOBAL_BATCH // REPLICAS)
      model = keras.Model({"ids": inputs}, layer({"ids": inputs})["ids"])
      model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    # The SparseCore path, on the emulated TPUEmbeddingV2.
    assert layer._placement_to_path_to_feature_config.keys() == {"sparsecore"}
    assert type(layer._tpu_embedding).__module__ == "tpu_embed_ext.emulated_tpu.sparsecore"
    ids, targets = _data()
    dataset = tf.data.Dataset.from_tensor_slices(({"ids": ids}, targets)).batch(
        GLOBAL_BATCH, drop_remainder=True)
    model.fit(dataset, epochs=1, verbose=0)
    trained = layer._tpu_embedding.table_variables("table")["parameters"].numpy()
    # keras-rs's own reader of SparseCore tables (unstacking the shards of
    # embedding_tables) gives the same table.
    with strategy.scope():
      read = layer.get_embedding_tables()["table"]
  np.testing.assert_allclose(trained, _numpy_reference(initial), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(read), trained)
