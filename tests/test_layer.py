"""EmbeddingLayer inside model.fit: tables train with their own optimizers only."""

import keras
import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.keras import layer as layer_lib
from tpu_embed_ext.keras import serving
from tests import fixed_head_model as fh

emb_api = tf.tpu.experimental.embedding


def test_fit_matches_hand_written_cpu_embedding_loop():
  batches = fh.batches()
  model = fh.FixedHead(fh.feature_config())
  fh.fit(model, batches, keras.optimizers.Adam(0.5))

  reference = tee.CPUEmbedding(fh.feature_config())
  reference.build()
  bce = keras.losses.BinaryCrossentropy(from_logits=True)
  for features, label in batches:
    reference.enqueue(features, training=True)
    with tf.GradientTape() as tape:
      activations = reference.dequeue()
      tape.watch(activations)
      loss = bce(label, fh.logits(activations))
    reference.apply_gradients(tape.gradient(loss, activations))

  got, want = fh.tables(model.embedding.embedding), fh.tables(reference)
  assert set(got) == {"user", "item"}
  for name in want:
    assert set(got[name]) == set(want[name])
    for key in want[name]:
      np.testing.assert_allclose(got[name][key], want[name][key], rtol=1e-6,
                                 atol=1e-7, err_msg=f"{name}/{key}")
  # The tables moved, and moved once per batch.
  assert not np.allclose(got["user"]["parameters"],
                         fh.init(1)((fh.VOCAB, fh.DIM)).numpy())
  assert int(model.embedding.step.numpy()) == fh.STEPS


def test_keras_optimizer_never_touches_tables():
  # Functional model with single-hot features.
  batches = [({"user": f["user"], "item": f["user"][::-1]}, y)
             for f, y in fh.batches(1)]
  inputs = {"user": keras.Input(shape=(), dtype="int64", name="user"),
            "item": keras.Input(shape=(), dtype="int64", name="item")}
  embedding = tee.EmbeddingLayer(fh.feature_config(lr_user=0.0, lr_item=0.0))
  activations = embedding(inputs)
  x = keras.layers.Concatenate()([activations["user"], activations["item"]])
  model = keras.Model(inputs, keras.layers.Dense(1)(x))  # Functional model.
  before = fh.tables(embedding.embedding)
  dense_before = model.layers[-1].kernel.numpy().copy()
  fh.fit(model, batches, keras.optimizers.Adam(learning_rate=1.0))
  after = fh.tables(embedding.embedding)
  for name in before:  # Slots may move at rate 0 (Adagrad accumulates g^2).
    np.testing.assert_array_equal(after[name]["parameters"],
                                  before[name]["parameters"])
  assert not np.allclose(model.layers[-1].kernel.numpy(), dense_before)
  assert int(embedding.step.numpy()) == fh.STEPS


def test_evaluate_and_predict_only_look_up():
  batches = fh.batches(2)
  model = fh.FixedHead(fh.feature_config())
  fh.fit(model, batches[:1], "sgd")
  before = fh.tables(model.embedding.embedding)
  step = int(model.embedding.step.numpy())
  features, label = batches[1]
  model.evaluate(features, label, verbose=0)
  predictions = model.predict(features, verbose=0)
  lookup = model.embedding.embedding(features)
  np.testing.assert_allclose(predictions, fh.logits(lookup).numpy(), rtol=1e-6)
  assert int(model.embedding.step.numpy()) == step
  after = fh.tables(model.embedding.embedding)
  for name in before:
    for key in before[name]:
      np.testing.assert_array_equal(after[name][key], before[name][key])


def test_checkpoint_round_trip_restores_tables_and_slots(tmp_path):
  batches = fh.batches(3)
  model = fh.FixedHead(fh.feature_config())
  fh.fit(model, batches, "adam")
  path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))

  restored = fh.FixedHead(fh.feature_config())
  restored(batches[0][0])  # Builds the Keras side.
  tf.train.Checkpoint(model=restored).restore(path).assert_existing_objects_matched()
  want, got = fh.tables(model.embedding.embedding), fh.tables(restored.embedding.embedding)
  for name in want:
    for key in want[name]:
      np.testing.assert_array_equal(got[name][key], want[name][key])
  # The embedding part is keyed exactly as TPUEmbedding(ForServing) keys it.
  prefix = "model/embedding/embedding/"
  ours = {k[len(prefix):] for k, _ in tf.train.list_variables(path)
          if k.startswith(prefix)}
  serving_embedding = emb_api.TPUEmbeddingForServing(fh.feature_config(), None)
  serving_embedding.build()
  theirs_path = tf.train.Checkpoint(embedding=serving_embedding).save(
      str(tmp_path / "serving"))
  theirs = {k[len("embedding/"):] for k, _ in tf.train.list_variables(theirs_path)
            if k.startswith("embedding/")}
  assert ours == theirs == {
      "user/.ATTRIBUTES/VARIABLE_VALUE", "item/.ATTRIBUTES/VARIABLE_VALUE",
      "item.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"}


def test_serving_export_predicts_like_the_model(tmp_path):
  batches = fh.batches(4)
  model = fh.FixedHead(fh.feature_config())
  fh.fit(model, batches, "sgd")
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


def test_adapter_follows_the_mid_level_api_class():
  from tensorflow.python.tpu import tpu_embedding_v2, tpu_embedding_v3
  from tpu_embed_ext.keras import adapters
  cpu = adapters.for_engine(tee.CPUEmbedding(fh.feature_config()), "e")
  assert type(cpu) is adapters.CPUAdapter
  # Instances made without __init__: constructing them needs a TPU.
  v1 = object.__new__(tpu_embedding_v2.TPUEmbedding)
  v2 = object.__new__(tpu_embedding_v3.TPUEmbeddingV2)
  assert type(adapters.for_engine(v1, "e")) is adapters.TPUEmbeddingAdapter
  assert type(adapters.for_engine(v2, "e")) is adapters.SparseCoreAdapter


def test_sparsecore_protocol_passes_preserved_outputs(monkeypatch):
  fake = fh.RecordingV2()
  monkeypatch.setattr(layer_lib.dispatch, "create_embedding",
                      lambda *a, **k: fake)
  monkeypatch.setattr(layer_lib.adapters, "for_engine",
                      layer_lib.adapters.SparseCoreAdapter)
  layer = tee.EmbeddingLayer(fh.feature_config())
  features = {"user": tf.constant([1, 2]), "item": tf.constant([3, 4])}
  with tf.GradientTape() as tape:
    out = layer(features, training=True)
    loss = tf.add_n([tf.reduce_sum(v) for v in out.values()])
  tape.gradient(loss, layer.trainable_variables)
  assert fake.calls == ["lookup", ("apply", "preserved")]
  assert int(layer.step.numpy()) == 1


def test_cpu_step_prepares_each_batch_once(monkeypatch):
  """The CPU adapter applies the gradients to the batch its forward pass
  prepared (keras/adapters.py): one preparation (structure, shapes, input
  checks, occurrences) per training step, not a second one to enqueue it."""
  prepared = []
  original = tee.CPUEmbedding._prepare  # pylint: disable=protected-access

  def counting(self, batches, training, strict=True):
    prepared.append((training, strict))
    return original(self, batches, training, strict)

  monkeypatch.setattr(tee.CPUEmbedding, "_prepare", counting)
  model = fh.FixedHead(fh.feature_config())
  model.compile(optimizer=keras.optimizers.SGD(0.1), run_eagerly=True,
                loss=keras.losses.BinaryCrossentropy(from_logits=True))
  features, label = fh.batches()[0]
  model(features)  # Builds the model: one lookup, nothing to train.
  del prepared[:]
  for _ in range(2):
    model.train_on_batch(features, label)
  assert prepared == [(True, False), (True, False)]
  assert int(model.embedding.step.numpy()) == 2
