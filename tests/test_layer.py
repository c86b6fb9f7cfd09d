"""EmbeddingLayer inside model.fit: tables train with their own optimizers only."""


import keras
import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.keras import layer as layer_lib
from tpu_embed_ext.keras import serving

emb_api = tf.tpu.experimental.embedding
VOCAB, DIM, BATCH, STEPS = 12, 4, 6, 5


def _init(seed):
  values = np.random.RandomState(seed).uniform(-1, 1, (VOCAB, DIM))
  return tf.constant_initializer(values.astype(np.float32))


def _feature_config(lr_user=0.1, lr_item=0.05):
  user = emb_api.TableConfig(VOCAB, DIM, initializer=_init(1), name="user",
                             combiner="sum", optimizer=emb_api.SGD(lr_user))
  item = emb_api.TableConfig(VOCAB, DIM, initializer=_init(2), name="item",
                             combiner="mean",
                             optimizer=emb_api.Adagrad(lr_item))
  return {"user": emb_api.FeatureConfig(user, name="user"),
          "item": emb_api.FeatureConfig(item, name="item")}


def _batches(seed=0):
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


def _logits(activations):
  return tf.matmul(tf.concat([activations["user"], activations["item"]], 1),
                   PROJECTION)


class FixedHead(keras.Model):
  """Logits = fixed projection of the activations: dL/dact is reproducible."""

  def __init__(self, feature_config, **kwargs):
    super().__init__(**kwargs)
    self.embedding = tee.EmbeddingLayer(feature_config)

  def call(self, features, training=False):
    return _logits(self.embedding(features, training=training))


def _tables(embedding):
  return {name: {k: v.numpy() for k, v in slots.items()}
          for name, slots in embedding.variables.items()}


def _fit(model, batches, optimizer):
  model.compile(optimizer=optimizer,
                loss=keras.losses.BinaryCrossentropy(from_logits=True))
  for features, label in batches:
    model.train_on_batch(features, label)


def test_fit_matches_hand_written_cpu_embedding_loop():
  batches = _batches()
  model = FixedHead(_feature_config())
  _fit(model, batches, keras.optimizers.Adam(0.5))

  reference = tee.CPUEmbedding(_feature_config())
  reference.build()
  bce = keras.losses.BinaryCrossentropy(from_logits=True)
  for features, label in batches:
    reference.enqueue(features, training=True)
    with tf.GradientTape() as tape:
      activations = reference.dequeue()
      tape.watch(activations)
      loss = bce(label, _logits(activations))
    reference.apply_gradients(tape.gradient(loss, activations))

  got, want = _tables(model.embedding.embedding), _tables(reference)
  assert set(got) == {"user", "item"}
  for name in want:
    assert set(got[name]) == set(want[name])
    for key in want[name]:
      np.testing.assert_allclose(got[name][key], want[name][key], rtol=1e-6,
                                 atol=1e-7, err_msg=f"{name}/{key}")
  # The tables moved, and moved once per batch.
  assert not np.allclose(got["user"]["parameters"],
                         _init(1)((VOCAB, DIM)).numpy())
  assert int(model.embedding.step.numpy()) == STEPS


def test_keras_optimizer_never_touches_tables():
  # Functional model with single-hot features.
  batches = [({"user": f["user"], "item": f["user"][::-1]}, y)
             for f, y in _batches(1)]
  inputs = {"user": keras.Input(shape=(), dtype="int64", name="user"),
            "item": keras.Input(shape=(), dtype="int64", name="item")}
  embedding = tee.EmbeddingLayer(_feature_config(lr_user=0.0, lr_item=0.0))
  activations = embedding(inputs)
  x = keras.layers.Concatenate()([activations["user"], activations["item"]])
  model = keras.Model(inputs, keras.layers.Dense(1)(x))  # Functional model.
  before = _tables(embedding.embedding)
  dense_before = model.layers[-1].kernel.numpy().copy()
  _fit(model, batches, keras.optimizers.Adam(learning_rate=1.0))
  after = _tables(embedding.embedding)
  for name in before:  # Slots may move at rate 0 (Adagrad accumulates g^2).
    np.testing.assert_array_equal(after[name]["parameters"],
                                  before[name]["parameters"])
  assert not np.allclose(model.layers[-1].kernel.numpy(), dense_before)
  assert int(embedding.step.numpy()) == STEPS


def test_evaluate_and_predict_only_look_up():
  batches = _batches(2)
  model = FixedHead(_feature_config())
  _fit(model, batches[:1], "sgd")
  before = _tables(model.embedding.embedding)
  step = int(model.embedding.step.numpy())
  features, label = batches[1]
  model.evaluate(features, label, verbose=0)
  predictions = model.predict(features, verbose=0)
  lookup = model.embedding.embedding(features)
  np.testing.assert_allclose(predictions, _logits(lookup).numpy(), rtol=1e-6)
  assert int(model.embedding.step.numpy()) == step
  after = _tables(model.embedding.embedding)
  for name in before:
    for key in before[name]:
      np.testing.assert_array_equal(after[name][key], before[name][key])


def test_checkpoint_round_trip_restores_tables_and_slots(tmp_path):
  batches = _batches(3)
  model = FixedHead(_feature_config())
  _fit(model, batches, "adam")
  path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))

  restored = FixedHead(_feature_config())
  restored(batches[0][0])  # Builds the Keras side.
  tf.train.Checkpoint(model=restored).restore(path).assert_existing_objects_matched()
  want, got = _tables(model.embedding.embedding), _tables(restored.embedding.embedding)
  for name in want:
    for key in want[name]:
      np.testing.assert_array_equal(got[name][key], want[name][key])
  # The embedding part is keyed exactly as TPUEmbedding(ForServing) keys it.
  prefix = "model/embedding/embedding/"
  ours = {k[len(prefix):] for k, _ in tf.train.list_variables(path)
          if k.startswith(prefix)}
  serving_embedding = emb_api.TPUEmbeddingForServing(_feature_config(), None)
  serving_embedding.build()
  theirs_path = tf.train.Checkpoint(embedding=serving_embedding).save(
      str(tmp_path / "serving"))
  theirs = {k[len("embedding/"):] for k, _ in tf.train.list_variables(theirs_path)
            if k.startswith("embedding/")}
  assert ours == theirs == {
      "user/.ATTRIBUTES/VARIABLE_VALUE", "item/.ATTRIBUTES/VARIABLE_VALUE",
      "item.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"}


def test_serving_export_predicts_like_the_model(tmp_path):
  batches = _batches(4)
  model = FixedHead(_feature_config())
  _fit(model, batches, "sgd")
  features, _ = batches[0]
  signature = {"user": tf.TensorSpec([None], tf.int64, name="user"),
               "item": tf.TensorSpec([None, None], tf.int64, name="item")}
  export_dir = str(tmp_path / "serving")
  serving.export_for_serving(model, export_dir, signature)

  loaded = tf.saved_model.load(export_dir)
  padded = features["item"].to_tensor(default_value=serving.PAD_ID)
  out = loaded.signatures["serving_default"](user=features["user"], item=padded)
  np.testing.assert_allclose(out["outputs"].numpy(),
                             model.predict(features, verbose=0), rtol=1e-6,
                             atol=1e-6)
  graph = loaded.signatures["serving_default"].graph.as_graph_def()
  graph_ops = {n.op for n in graph.node} | {
      n.op for f in graph.library.function for n in f.node_def}
  assert "ResourceGather" in graph_ops or "GatherV2" in graph_ops, graph_ops
  assert not any("TPU" in op for op in graph_ops), sorted(graph_ops)


def test_engine_kind_follows_the_mid_level_api_class():
  from tensorflow.python.tpu import tpu_embedding_v2, tpu_embedding_v3
  assert layer_lib._engine_kind(tee.CPUEmbedding(_feature_config())) == "cpu"
  # Instances made without __init__: constructing them needs a TPU.
  v1 = object.__new__(tpu_embedding_v2.TPUEmbedding)
  v2 = object.__new__(tpu_embedding_v3.TPUEmbeddingV2)
  assert layer_lib._engine_kind(v1) == "tpu_v1"
  assert layer_lib._engine_kind(v2) == "tpu_v2"


class _RecordingV2:
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


def test_sparsecore_protocol_passes_preserved_outputs(monkeypatch):
  fake = _RecordingV2()
  monkeypatch.setattr(layer_lib.dispatch, "create_embedding",
                      lambda *a, **k: fake)
  monkeypatch.setattr(layer_lib, "_engine_kind", lambda e: "tpu_v2")
  layer = tee.EmbeddingLayer(_feature_config())
  features = {"user": tf.constant([1, 2]), "item": tf.constant([3, 4])}
  with tf.GradientTape() as tape:
    out = layer(features, training=True)
    loss = tf.add_n([tf.reduce_sum(v) for v in out.values()])
  tape.gradient(loss, layer.trainable_variables)
  assert fake.calls == ["lookup", ("apply", "preserved")]
  assert int(layer.step.numpy()) == 1
