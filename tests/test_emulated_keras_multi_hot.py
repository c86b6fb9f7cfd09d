"""A user's ``model.fit`` on a TPU with single-hot, ragged, sparse and weighted features.

The program a TPU user writes: a model made in ``TPUStrategy.scope()`` with
``tee.EmbeddingLayer``, a dataset distributed with
``InputOptions(experimental_fetch_to_device=False)`` (a TPU's strategy does
not prefetch ragged or sparse values to its devices), ids passed to the layer
as they come (a TPU refuses ids computed inside ``strategy.run``). Keras
builds such a model from the first batch by reducing it with MEAN over the
replicas, which ragged and sparse values do not have: the layer supplies
that build (``keras/distributed_fit.py``).

Under the emulated TPU, at 2 and 8 replicas, ``TPUEmbedding`` (v1) and
``TPUEmbeddingV2`` (SparseCore), functional and subclassed models with dict
inputs: after ``fit`` the tables, slots and dense weights equal the same
model trained on one CPU device on the same global batches, to float32
reordering. The same build serves ``MirroredStrategy`` (the CPU engine on 2
replicas).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.keras import adapters
from tests.builders import checkpoint_values

api = tf.tpu.experimental.embedding
VOCAB, DIM, GLOBAL_BATCH, BATCHES = 40, 4, 32, 3


def _feature_config(per_replica_batch=None):
  """Three tables; ``per_replica_batch`` sets output_shape (TPUEmbeddingV2)."""
  def table(name, seed, combiner):
    init = np.random.RandomState(seed).uniform(-1, 1, (VOCAB, DIM))
    return api.TableConfig(VOCAB, DIM, initializer=tf.constant_initializer(init),
                           name=name, combiner=combiner, optimizer=api.Adagrad(0.1))
  shape = None if per_replica_batch is None else [per_replica_batch]
  return {name: api.FeatureConfig(table(name, seed, combiner), name=name,
                                  output_shape=shape)
          for name, seed, combiner in (("user", 1, "sum"), ("history", 2, "mean"),
                                       ("tags", 3, "sqrtn"))}


def _dataset():
  """(features, label) global batches: user [B], history ragged and weighted,
  tags sparse and weighted (empty rows included)."""
  rng = np.random.RandomState(0)
  n = GLOBAL_BATCH * BATCHES
  lengths = rng.randint(0, 4, n)
  history = tf.RaggedTensor.from_row_lengths(rng.randint(0, VOCAB, lengths.sum()), lengths)
  history_w = tf.RaggedTensor.from_row_lengths(
      rng.uniform(0.5, 2, lengths.sum()).astype(np.float32), lengths)
  tag_rows, tag_cols = np.nonzero(rng.rand(n, 3) < 0.5)
  tags = tf.SparseTensor(np.stack([tag_rows, tag_cols], 1),
                         rng.randint(0, VOCAB, len(tag_rows)), [n, 3])
  tags_w = tf.SparseTensor(tags.indices,
                           rng.uniform(0.5, 2, len(tag_rows)).astype(np.float32), [n, 3])
  features = {"user": rng.randint(0, VOCAB, n), "history": history,
              "history_w": history_w, "tags": tags, "tags_w": tags_w}
  labels = rng.randint(0, 2, n).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((features, labels)).batch(
      GLOBAL_BATCH, drop_remainder=True)


def _split(inputs):
  features = {k: inputs[k] for k in ("user", "history", "tags")}
  weights = {"user": None, "history": inputs["history_w"], "tags": inputs["tags_w"]}
  return features, weights


def _head(activations):
  return keras.layers.Concatenate()([activations[k] for k in ("user", "history", "tags")])


def _functional(feature_config, per_replica_batch, engine):
  kind = {"user": {}, "history": {"ragged": True}, "history_w": {"ragged": True},
          "tags": {"sparse": True}, "tags_w": {"sparse": True}}
  inputs = {k: keras.Input(shape=() if k == "user" else (None,), name=k,
                           batch_size=per_replica_batch,
                           dtype="float32" if k.endswith("_w") else "int64", **how)
            for k, how in kind.items()}
  layer = tee.EmbeddingLayer(feature_config, engine=engine, name="embedding")
  dense = keras.layers.Dense(1, kernel_initializer="ones", name="dense")
  outputs = dense(_head(layer(*_split(inputs))))
  return keras.Model(inputs, outputs)


class SubclassedModel(keras.Model):

  def __init__(self, feature_config, engine):
    super().__init__()
    self.embedding = tee.EmbeddingLayer(feature_config, engine=engine, name="embedding")
    self.dense = keras.layers.Dense(1, kernel_initializer="ones", name="dense")

  def call(self, inputs, training=False):
    features, weights = _split(inputs)
    return self.dense(_head(self.embedding(features, weights, training=training)))


def _fit(model_kind, feature_config, per_replica_batch, dataset, engine=None):
  model = (_functional(feature_config, per_replica_batch, engine)
           if model_kind == "functional" else SubclassedModel(feature_config, engine))
  model.compile(optimizer=keras.optimizers.SGD(0.5),
                loss=keras.losses.BinaryCrossentropy(from_logits=True))
  model.fit(dataset, epochs=1, verbose=0)
  layer = model.get_layer("embedding") if model_kind == "functional" else model.embedding
  return layer, model.get_layer("dense") if model_kind == "functional" else model.dense


def _tables(layer, tmp_path, name):
  """Tables and slots: by TPUEmbedding's checkpoint keys (CPUEmbedding writes the
  same), or, for TPUEmbeddingV2, per table from its stacked variables."""
  if type(layer._adapter) is adapters.SparseCoreAdapter:
    return {f"{t}/{s}": v.numpy()
            for t in ("user", "history", "tags")
            for s, v in layer.embedding.table_variables(t).items()}
  if type(layer._adapter) is adapters.CPUAdapter and layer.embedding.engine == "v2":
    return {f"{t}/{s}": v.numpy() for t, slots in layer.embedding.variables.items()
            for s, v in slots.items()}
  return checkpoint_values(tf.train.Checkpoint(embedding=layer.embedding).write(
      str(tmp_path / name)))


def _tpu_strategy():
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  return tf.distribute.TPUStrategy(resolver)


@pytest.mark.parametrize("model_kind,replicas,sparsecore", [
    ("functional", 2, False),
    ("subclassed", 8, False),
    ("subclassed", 2, True),
    ("functional", 8, True),
])
def test_fit_with_multi_hot_features_equals_one_device(model_kind, replicas, sparsecore,
                                                       tmp_path):
  per_replica = GLOBAL_BATCH // replicas
  reference, reference_dense = _fit(
      model_kind, _feature_config(GLOBAL_BATCH if sparsecore else None), GLOBAL_BATCH,
      _dataset(), engine="v2" if sparsecore else None)
  want = _tables(reference, tmp_path, "cpu")
  with tee.emulate_tpu(replicas=replicas, sparsecore=sparsecore):
    strategy = _tpu_strategy()
    with strategy.scope():
      dataset = strategy.experimental_distribute_dataset(
          _dataset(), tf.distribute.InputOptions(experimental_fetch_to_device=False))
      layer, dense = _fit(model_kind, _feature_config(per_replica if sparsecore else None),
                          per_replica, dataset)
    assert type(layer._adapter) is (adapters.SparseCoreAdapter if sparsecore
                                   else adapters.TPUEmbeddingAdapter)
    assert int(layer.step.numpy()) == BATCHES
    got = _tables(layer, tmp_path, "tpu")
    got_dense = [w.numpy() for w in dense.weights]
  assert int(reference.step.numpy()) == BATCHES
  assert sorted(got) == sorted(want) and len(want) == 6  # 3 tables, 3 accumulators
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  # Trained: every table moved from its initial values.
  for seed, table in enumerate(("user", "history", "tags"), 1):
    initial = np.random.RandomState(seed).uniform(-1, 1, (VOCAB, DIM))
    assert not np.allclose(reference.embedding.variables[table]["parameters"].numpy(),
                           initial), table
  for got_w, want_w in zip(got_dense, reference_dense.weights):
    np.testing.assert_allclose(got_w, want_w.numpy(), rtol=1e-5, atol=1e-6)


def test_fit_under_mirrored_strategy_takes_ragged_and_sparse_batches(tmp_path):
  """The same build under MirroredStrategy (CPUEmbedding on 2 CPU replicas)."""
  reference, reference_dense = _fit("functional", _feature_config(), GLOBAL_BATCH,
                                    _dataset())
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    layer, dense = _fit("functional", _feature_config(), GLOBAL_BATCH // 2,
                        strategy.experimental_distribute_dataset(_dataset()))
  assert type(layer._adapter) is adapters.CPUAdapter and int(layer.step.numpy()) == BATCHES
  got, want = _tables(layer, tmp_path, "mirrored"), _tables(reference, tmp_path, "one")
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  for got_w, want_w in zip(dense.weights, reference_dense.weights):
    np.testing.assert_allclose(got_w.numpy(), want_w.numpy(), rtol=1e-5, atol=1e-6)
