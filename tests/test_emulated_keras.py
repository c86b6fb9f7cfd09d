"""model.fit with EmbeddingLayer under the emulated TPUStrategy: the layer's TPU branch.

Under ``emulate_tpu`` the strategy a program builds from its resolver is a
``TPUStrategy``, so ``EmbeddingLayer`` (through ``create_embedding``) takes its
TPU branch: it builds ``tf.tpu.experimental.embedding.TPUEmbedding`` (the
emulated one) and speaks its enqueue / dequeue / apply_gradients protocol, or
``TPUEmbeddingV2`` with SparseCore. Keras runs ``fit`` as on a TPU (it
reduces the logged loss with "first" under a TPUStrategy). At 2 replicas the
tables, the dense weights and the predictions must equal the same model
trained on one CPU device on the same global batches.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.keras import adapters
from tests.builders import checkpoint_values
# The model, data and sizes of the MirroredStrategy test (-1-padded multi-hot items).
from tests import ranker_model as rk

api = tf.tpu.experimental.embedding
REPLICAS = 2


def _feature_config(batch=None):
  """Two tables; ``batch`` sets output_shape (TPUEmbeddingV2 needs it)."""
  def init(seed):
    return tf.constant_initializer(
        np.random.RandomState(seed).uniform(-1, 1, (rk.VOCAB, rk.DIM)))
  optimizer = api.Adagrad(0.1)
  user = api.TableConfig(rk.VOCAB, rk.DIM, initializer=init(1), name="user",
                         combiner="sum", optimizer=optimizer)
  item = api.TableConfig(rk.VOCAB, rk.DIM, initializer=init(2), name="item",
                         combiner="mean", optimizer=optimizer)
  shape = None if batch is None else [batch]
  return {"user": api.FeatureConfig(user, name="user", output_shape=shape),
          "item": api.FeatureConfig(item, name="item", output_shape=shape)}


class DirectRanker(rk.Ranker):
  """``Ranker`` fed ids it passes to the layer unchanged: inside ``strategy.run``
  a TPU takes ``TPUEmbedding.enqueue``'s ids only straight from the step's
  arguments (``_raise_error_for_non_direct_inputs``), so the padded-to-ragged
  conversion of ``Ranker.call`` is refused there
  (``test_ids_computed_inside_the_step_are_refused_as_on_a_tpu``)."""

  def call(self, features, training=False):
    acts = self.embedding(features, training=training)
    return self.head(tf.concat([acts["user"], acts["item"]], 1))


def _direct_dataset():
  """``_dataset`` with one item per row ([batch, 1], each row's first id)."""
  return rk.dataset().map(lambda x, y: (dict(x, item=x["item"][:, :1]), y))


def _fit(strategy, feature_config, engine=None, model_class=DirectRanker,
         dataset=_direct_dataset):
  with strategy.scope():
    model = model_class(feature_config, engine)
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
  model.fit(dataset(), epochs=1, verbose=0)
  predictions = model.predict(dataset().map(lambda x, y: x), verbose=0)
  return model, predictions


def _tpu_strategy():
  """The strategy a TPU program builds (inside emulate_tpu: the emulated one)."""
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  return tf.distribute.TPUStrategy(resolver)


def _check_dense_and_predictions(model, predictions, reference, reference_predictions):
  assert int(model.embedding.step.numpy()) == rk.STEPS
  for got, want in zip(model.head.weights, reference.head.weights):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(predictions, reference_predictions, rtol=1e-5, atol=1e-6)


def test_fit_takes_the_tpu_embedding_branch_and_equals_one_device(tmp_path):
  reference, reference_predictions = _fit(tf.distribute.get_strategy(),
                                          _feature_config())
  with tee.emulate_tpu(replicas=REPLICAS):
    strategy = _tpu_strategy()
    model, predictions = _fit(strategy, _feature_config())
    layer = model.embedding
    assert type(layer._adapter) is adapters.TPUEmbeddingAdapter
    assert isinstance(layer.embedding, tf.tpu.experimental.embedding.TPUEmbedding)
    assert type(layer.embedding).__module__.startswith("tpu_embed_ext.emulated_tpu")
    saved = tf.train.Checkpoint(embedding=layer.embedding).write(str(tmp_path / "tpu"))
  _check_dense_and_predictions(model, predictions, reference, reference_predictions)
  # Tables and slots, by TPUEmbedding's checkpoint keys (on a TPU the tables
  # are read back through a checkpoint too).
  want = checkpoint_values(tf.train.Checkpoint(
      embedding=reference.embedding.embedding).write(str(tmp_path / "cpu")))
  got = checkpoint_values(saved)
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_fit_with_sparsecore_takes_the_tpu_embedding_v2_branch():
  reference, reference_predictions = _fit(
      tf.distribute.get_strategy(), _feature_config(rk.GLOBAL_BATCH), engine="v2")
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy = _tpu_strategy()
    model, predictions = _fit(strategy, _feature_config(rk.GLOBAL_BATCH // REPLICAS))
    layer = model.embedding
    assert type(layer._adapter) is adapters.SparseCoreAdapter
    from tensorflow.python.tpu import tpu_embedding_v3
    assert isinstance(layer.embedding, tpu_embedding_v3.TPUEmbeddingV2)
    assert type(layer.embedding).__module__ == "tpu_embed_ext.emulated_tpu.sparsecore"
    tables = {t: {s: v.numpy() for s, v in layer.embedding.table_variables(t).items()}
              for t in ("user", "item")}
  _check_dense_and_predictions(model, predictions, reference, reference_predictions)
  for table, slots in reference.embedding.variables_by_table.items():
    for slot, var in slots.items():
      np.testing.assert_allclose(tables[table][slot], var.numpy(), rtol=1e-5,
                                 atol=1e-6, err_msg=f"{table}/{slot}")


def test_ids_computed_inside_the_step_are_refused_as_on_a_tpu():
  """``rk.Ranker`` turns its padded items into a RaggedTensor inside the model, so
  inside ``strategy.run``: a TPU refuses such ids (TensorFlow's
  ``_raise_error_for_non_direct_inputs``), and so does the emulated TPU."""
  with tee.emulate_tpu(replicas=REPLICAS):
    strategy = _tpu_strategy()
    with pytest.raises(ValueError, match=(
        "Received input tensor item/RaggedTensor/0 which is the output of op "
        ".* which does not have the `_tpu_input_identity` attr. .*Fix: compute "
        "the ids in the input pipeline")):
      _fit(strategy, _feature_config(), model_class=rk.Ranker, dataset=rk.dataset)
