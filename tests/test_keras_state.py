"""EmbeddingLayer through Keras's own saving paths, loss scaling and options.

Every persistence path is checked the same way: train, save, build a fresh
model, load, then compare every table, slot, the table step, the dense weights
and the predictions bit for bit, and train one more step on both.
"""

import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.keras import weights as layer_weights
from tests import fixed_head_model as fh

USER_VOCAB, ITEM_VOCAB, DIM, BATCH, STEPS = 12, 10, 4, 6, 5

SPEC = {
    "optimizer": {"type": "adagrad", "learning_rate": 0.1},
    # The table step drives this schedule: a lost step changes the next update.
    "schedules": {"halving": {"class": "ExponentialDecay",
                              "initial_learning_rate": 0.2, "decay_steps": 2,
                              "decay_rate": 0.5}},
    "tables": {
        "user": {"vocabulary_size": USER_VOCAB, "dim": DIM, "combiner": "sum",
                 "initializer": {"type": "uniform", "minval": -1.0, "maxval": 1.0},
                 "optimizer": {"type": "adam", "learning_rate": "halving"}},
        "item": {"vocabulary_size": ITEM_VOCAB, "dim": DIM, "combiner": "mean",
                 "initializer": {"type": "uniform", "minval": -1.0, "maxval": 1.0}},
    },
    "features": {"user": {"table": "user"}, "item": {"table": "item"}},
}


def _spec(**table_changes):
  config = {**SPEC, "tables": {k: dict(v) for k, v in SPEC["tables"].items()}}
  for table, changes in table_changes.items():
    config["tables"][table].update(changes)
  return tee.EmbeddingSpec.from_dict(config)


def _inputs(user_sparse=False):
  return {"user": (keras.Input(shape=(None,), dtype="int64", sparse=True, name="user")
                   if user_sparse else
                   keras.Input(shape=(), dtype="int64", name="user")),
          "item": keras.Input(shape=(None,), dtype="int64", ragged=True,
                              name="item")}


def _seeded(layer):
  """Fixed table values (spec initializers take no seed): repeatable tests."""
  rng = np.random.RandomState(17)
  for variables in layer.variables_by_table.values():
    table = variables["parameters"]
    table.assign(rng.uniform(-1, 1, table.shape).astype(np.float32))
  return layer


def _model(spec=None, user_sparse=False):
  inputs = _inputs(user_sparse)
  layer = _seeded(tee.EmbeddingLayer(spec or _spec(), name="embedding"))
  activations = layer(inputs)
  x = keras.layers.Concatenate()([activations["user"], activations["item"]])
  head = keras.layers.Dense(1, name="head",
                            kernel_initializer=keras.initializers.GlorotUniform(1))
  return keras.Model(inputs, head(x))


def _compiled(model, optimizer):
  model.compile(optimizer=optimizer,
                loss=keras.losses.BinaryCrossentropy(from_logits=True))
  return model


def _batches(seed=0, n=STEPS):
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(n):
    lengths = rng.randint(1, 4, BATCH)
    item = tf.RaggedTensor.from_row_lengths(
        tf.constant(rng.randint(0, ITEM_VOCAB, lengths.sum()), tf.int64), lengths)
    out.append(({"user": tf.constant(rng.randint(0, USER_VOCAB, BATCH), tf.int64),
                 "item": item},
                tf.constant(rng.randint(0, 2, (BATCH, 1)), tf.float32)))
  return out


def _dataset(batches):
  sets = [tf.data.Dataset.from_tensors(b) for b in batches]
  return functools.reduce(lambda a, b: a.concatenate(b), sets)


def _state(model):
  """Every table and slot, the table step and the dense weights, as numpy."""
  layer = model.get_layer("embedding")
  out = {f"{t}/{k}": v.numpy() for t, slots in layer.variables_by_table.items()
         for k, v in slots.items()}
  out["step"] = layer.step.numpy()
  out.update({f"head/{i}": w.numpy()
              for i, w in enumerate(model.get_layer("head").weights)})
  return out


def _assert_same_state(model, restored):
  want, got = _state(model), _state(restored)
  assert set(got) == set(want)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _assert_round_trip(model, restored, batches):
  """Same state and predictions bit for bit, and after one more step too."""
  _assert_same_state(model, restored)
  features, label = batches[-1]
  np.testing.assert_array_equal(restored.predict(features, verbose=0),
                                model.predict(features, verbose=0))
  for m in (model, restored):
    m.train_on_batch(features, label)
  _assert_same_state(model, restored)
  assert int(restored.get_layer("embedding").step.numpy()) == len(batches)


def _trained(optimizer, batches):
  model = _compiled(_model(), optimizer)
  for features, label in batches[:-1]:
    model.train_on_batch(features, label)
  return model


# --- persistence paths -------------------------------------------------------

def test_save_weights_load_weights_round_trip(tmp_path):
  batches = _batches(0)
  model = _trained("sgd", batches)
  path = str(tmp_path / "model.weights.h5")
  model.save_weights(path)
  restored = _compiled(_model(), "sgd")
  restored.load_weights(path)
  assert int(restored.get_layer("embedding").step.numpy()) == len(batches) - 1
  _assert_round_trip(model, restored, batches)


def test_model_checkpoint_weights_only_round_trip(tmp_path):
  batches = _batches(1)
  model = _compiled(_model(), "sgd")
  path = str(tmp_path / "ckpt.weights.h5")
  checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
  model.fit(_dataset(batches[:-1]), epochs=1, verbose=0, callbacks=[checkpoint])
  restored = _compiled(_model(), "sgd")
  restored.load_weights(path)
  _assert_round_trip(model, restored, batches)


def test_model_checkpoint_full_round_trip(tmp_path):
  batches = _batches(2)
  model = _compiled(_model(), keras.optimizers.Adam(0.05))
  path = str(tmp_path / "ckpt.keras")
  checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=False)
  model.fit(_dataset(batches[:-1]), epochs=1, verbose=0, callbacks=[checkpoint])
  restored = keras.saving.load_model(path)
  _assert_round_trip(model, restored, batches)


def test_model_save_load_model_round_trip_rebuilds_the_layer_from_its_spec(tmp_path):
  batches = _batches(3)
  model = _trained(keras.optimizers.Adam(0.05), batches)
  path = str(tmp_path / "model.keras")
  model.save(path)
  restored = keras.saving.load_model(path)
  layer = restored.get_layer("embedding")
  assert isinstance(layer, tee.EmbeddingLayer)
  assert layer.get_config()["spec"] == _spec().to_dict()
  assert tee.EmbeddingSpec.from_dict(layer.get_config()["spec"]) == _spec()
  _assert_round_trip(model, restored, batches)


def test_tf_train_checkpoint_round_trip_keeps_the_step(tmp_path):
  batches = _batches(4)
  model = _trained("sgd", batches)
  path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
  restored = _compiled(_model(), "sgd")
  tf.train.Checkpoint(model=restored).restore(path).assert_existing_objects_matched()
  _assert_round_trip(model, restored, batches)


def test_model_export_serves_the_tables_without_tpu_ops(tmp_path):
  batches = _batches(5)
  model = _trained("sgd", batches)
  path = str(tmp_path / "export")
  model.export(path, verbose=False)
  loaded = tf.saved_model.load(path)
  features, _ = batches[-1]
  # The serving signature takes a ragged input as a matrix padded with -1.
  padded = {"user": features["user"],
            "item": features["item"].to_tensor(default_value=tee.layer.PAD_ID)}
  out = loaded.signatures["serving_default"](**padded)["output_0"]
  np.testing.assert_array_equal(out.numpy(), model.predict(features, verbose=0))
  graph = loaded.signatures["serving_default"].graph.as_graph_def()
  ops = {n.op for n in graph.node} | {
      n.op for f in graph.library.function for n in f.node_def}
  assert not any("TPU" in op for op in ops), sorted(ops)
  # Tables, dense weights and the sink: serving needs no slots and no step.
  shapes = sorted((tuple(v.shape), v.dtype.name) for v in loaded.variables)
  assert shapes == sorted([
      ((USER_VOCAB, DIM), "float32"), ((ITEM_VOCAB, DIM), "float32"),
      ((2 * DIM, 1), "float32"), ((1,), "float32"), ((), "float32")])


# --- what load_own_variables refuses -----------------------------------------

class Subclassed(keras.Model):
  """``_model`` as a subclassed model: Keras reaches its layer by two paths."""

  def __init__(self, spec=None):
    super().__init__()
    self.embedding = _seeded(tee.EmbeddingLayer(spec or _spec(), name="embedding"))
    self.head = keras.layers.Dense(
        1, name="head", kernel_initializer=keras.initializers.GlorotUniform(1))

  def call(self, inputs):
    activations = self.embedding(inputs)
    return self.head(tf.concat([activations["user"], activations["item"]], 1))


_MODELS = {"functional": _model, "subclassed": Subclassed}


def _saved_weights(tmp_path, kind="functional"):
  model = _compiled(_MODELS[kind](), "sgd")
  for features, label in _batches(6, n=2)[:-1]:
    model.train_on_batch(features, label)
  path = str(tmp_path / "model.weights.h5")
  model.save_weights(path)
  return path


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
@pytest.mark.parametrize("changes, message", [
    ({"item": {"vocabulary_size": ITEM_VOCAB + 1}},
     "EmbeddingLayer 'embedding': table 'item' is saved with shape [10, 4], this "
     "layer has [11, 4]. Fix: load into a spec with the same vocabulary_size "
     "and dim."),
    ({"user": {"vocabulary_size": USER_VOCAB + 1}},
     "EmbeddingLayer 'embedding': table 'user' is saved with shape [12, 4], this "
     "layer has [13, 4]."),
    ({"item": {"optimizer": {"type": "sgd", "learning_rate": 0.1}}},
     "EmbeddingLayer 'embedding': table 'item' is saved with optimizer slots "
     "['accumulators'], its optimizer needs []. Fix: load with the table "
     "optimizer the weights were trained with."),
], ids=["shape", "user_shape", "slots"])
def test_load_mismatch_names_the_table_and_changes_nothing(tmp_path, changes, message,
                                                           kind):
  # A subclassed model once named the wrong cause: Keras tried its layer again
  # under a second, empty path and reported that error ("not in the saved
  # weights (they hold [])").
  path = _saved_weights(tmp_path, kind)
  other = _compiled(_MODELS[kind](_spec(**changes)), "sgd")
  features, _ = _batches(6, n=1)[0]
  other(features)
  layer = other.get_layer("embedding")
  before = {k: v.numpy() for k, v in layer_weights.keyed_variables(layer).items()}
  with pytest.raises(ValueError, match=re.escape(message)):
    other.load_weights(path)
  for key, variable in layer_weights.keyed_variables(layer).items():
    np.testing.assert_array_equal(variable.numpy(), before[key], err_msg=key)


def test_feature_config_layer_cannot_be_saved_as_keras_config(tmp_path):
  step = tf.Variable(0, dtype=tf.int64)
  layer = tee.EmbeddingLayer(_spec().feature_config(step=step), name="raw")
  with pytest.raises(errors.ConfigTypeError, match=re.escape(
      "EmbeddingLayer 'raw' was built from a tf.tpu.experimental.embedding "
      "FeatureConfig structure, which has no Keras config (model.save / "
      "get_config). Fix: build the layer from a tpu_embed_ext.EmbeddingSpec")):
    layer.get_config()


# --- table gradients whatever the dense optimizer does -----------------------

def _reference_embedding(model):
  """A CPUEmbedding of the same spec, with the model's tables and slots."""
  layer = model.get_layer("embedding")
  reference = tee.CPUEmbedding(_spec())
  for table, slots in reference.variables.items():
    for key, variable in slots.items():
      variable.assign(layer.variables_by_table[table][key])
  return reference


def _reference_run(model, batches, dense_dtype=tf.float32):
  """Trains the model; trains a CPUEmbedding with dL/dact of the unscaled loss.

  The reference reads the model's dense weights before each step, so it
  follows whatever the dense optimizer does to them.
  """
  reference = _reference_embedding(model)
  for features, label in batches:
    _reference_step(reference, model, features, label)
    model.train_on_batch(features, label)
  return reference


def _reference_step(reference, model, features, label):
  """One step of dL/dact of the unscaled loss with the model's dense weights."""
  kernel, bias = (w.numpy() for w in model.get_layer("head").weights)
  reference.enqueue(features, training=True)
  with tf.GradientTape() as tape:
    activations = reference.dequeue()
    tape.watch(activations)
    x = tf.concat([activations["user"], activations["item"]], 1)
    loss = keras.losses.BinaryCrossentropy(from_logits=True)(
        label, tf.matmul(x, kernel) + bias)
  reference.apply_gradients(tape.gradient(loss, activations))


def _assert_tables_match(model, reference, steps=STEPS, **tolerance):
  layer = model.get_layer("embedding")
  for table, slots in reference.variables.items():
    for key, variable in slots.items():
      np.testing.assert_allclose(layer.variables_by_table[table][key].numpy(),
                                 variable.numpy(), err_msg=f"{table}/{key}",
                                 **tolerance)
  assert int(layer.step.numpy()) == int(reference.step.numpy()) == steps


DENSE_OPTIONS = {
    "plain": {}, "loss_scale_factor": {"loss_scale_factor": 1024.0},
    "clipnorm": {"clipnorm": 1e-3}, "global_clipnorm": {"global_clipnorm": 1e-3},
    "clipvalue": {"clipvalue": 1e-4},
    "accumulation": {"gradient_accumulation_steps": 2},
}


@pytest.mark.parametrize("name", sorted(DENSE_OPTIONS))
def test_table_gradients_are_those_of_the_unscaled_loss(name):
  model = _compiled(_model(), keras.optimizers.SGD(0.5, **DENSE_OPTIONS[name]))
  layer = model.get_layer("embedding")
  start = layer.variables_by_table["item"]["parameters"].numpy()
  reference = _reference_run(model, _batches(7))
  _assert_tables_match(model, reference, rtol=1e-6, atol=1e-7)
  moved = layer.variables_by_table["item"]["parameters"].numpy()
  assert np.abs(moved - start).max() > 1e-3


def test_power_of_two_loss_scale_gives_bit_identical_tables():
  plain = _compiled(_model(), keras.optimizers.SGD(0.5))
  scaled = _compiled(_model(), keras.optimizers.SGD(0.5, loss_scale_factor=1024.0))
  scaled.set_weights(plain.get_weights())  # Tables included: they are weights.
  for model in (plain, scaled):
    for features, label in _batches(15):
      model.train_on_batch(features, label)
  _assert_same_state(plain, scaled)


def test_mixed_float16_tables_follow_the_unscaled_float32_gradients():
  keras.mixed_precision.set_dtype_policy("mixed_float16")
  try:
    model = _compiled(_model(), keras.optimizers.SGD(0.5))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    features, _ = _batches(8)[0]
    layer = model.get_layer("embedding")
    assert layer(features)["user"].dtype == tf.float16
    start = {t: {k: v.numpy() for k, v in slots.items()}
             for t, slots in layer.variables_by_table.items()}
    reference = _reference_run(model, _batches(8))
  finally:
    keras.mixed_precision.set_dtype_policy("float32")
  assert int(layer.step.numpy()) == int(reference.step.numpy()) == STEPS
  for table, slots in reference.variables.items():
    for key, variable in slots.items():
      got = layer.variables_by_table[table][key]
      assert got.dtype == tf.float32
      want = variable.numpy()
      # float16 activations and dense math: within 0.5% of how far the run
      # moved each variable (Adam amplifies the rounding of tiny gradients).
      # A gradient left scaled by 2**15 is off by about the whole movement.
      movement = np.abs(want - start[table][key]).max()
      assert movement > 0, f"{table}/{key}"
      np.testing.assert_allclose(got.numpy(), want, rtol=0,
                                 atol=5e-3 * movement, err_msg=f"{table}/{key}")


def test_overflowing_loss_scale_skips_the_table_step_like_the_dense_step():
  keras.mixed_precision.set_dtype_policy("mixed_float16")
  try:
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=2.0 ** 40)
    model = _compiled(_model(), optimizer)
    before = _state(model)
    features, label = _batches(9)[0]
    model.train_on_batch(features, label)
  finally:
    keras.mixed_precision.set_dtype_policy("float32")
  after = _state(model)
  for key in before:  # Nothing moved: not the tables, not the dense weights.
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)
  assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 39


# --- trainable, summary, several calls, composite inputs -----------------------

def _summary(model):
  lines = []
  model.summary(print_fn=lambda line, **_: lines.append(line))
  text = "\n".join(lines)
  count = lambda kind: int(re.search(
      rf"{kind} params: ([\d,]+)", text).group(1).replace(",", ""))
  return count("Total"), count("Trainable"), count("Non-trainable")


def test_summary_counts_tables_as_non_trainable_weights():
  model = _model()
  tables = (USER_VOCAB + ITEM_VOCAB) * DIM
  dense = 2 * DIM + 1
  # The one trainable scalar is the gradient sink.
  assert _summary(model) == (tables + dense + 1, dense + 1, tables)
  layer = model.get_layer("embedding")
  assert layer.count_params() == tables + 1
  assert all(not v.trainable for v in layer.non_trainable_weights)
  assert [v.name for v in layer.trainable_weights] == ["gradient_sink"]


def test_trainable_false_freezes_tables_slots_and_step():
  model = _model()
  layer = model.get_layer("embedding")
  layer.trainable = False
  _compiled(model, keras.optimizers.SGD(0.5))
  before = _state(model)
  for features, label in _batches(10, n=2):
    model.train_on_batch(features, label)
  after = _state(model)
  for key in before:
    if key.startswith("head/"):
      assert not np.array_equal(after[key], before[key]), key
    else:
      np.testing.assert_array_equal(after[key], before[key], err_msg=key)
  tables = (USER_VOCAB + ITEM_VOCAB) * DIM
  assert _summary(model)[1:] == (2 * DIM + 1, tables + 1)


class TwoTowers(keras.Model):
  """Two towers sharing one EmbeddingLayer: one call per tower."""

  def __init__(self, spec, **kwargs):
    super().__init__(**kwargs)
    self.embedding = tee.EmbeddingLayer(spec)

  def call(self, inputs, training=False):
    return (fh.logits(self.embedding(inputs["a"], training=training))
            + fh.logits(self.embedding(inputs["b"], training=training)))


class OneCall(TwoTowers):
  """The same model with both towers' features in one call."""

  def call(self, inputs, training=False):
    a, b = inputs["a"], inputs["b"]
    both = {k: tf.concat([a[k], b[k]], 0) for k in a}
    activations = self.embedding(both, training=training)
    n = tf.shape(a["user"])[0]
    first = {k: v[:n] for k, v in activations.items()}
    second = {k: v[n:] for k, v in activations.items()}
    return fh.logits(first) + fh.logits(second)


def test_two_calls_in_one_step_make_one_table_step_like_one_call():
  a, b = _batches(12, n=3), _batches(13, n=3)
  batches = [({"a": fa, "b": fb}, ya) for (fa, ya), (fb, _) in zip(a, b)]
  spec = _spec()
  two, one = TwoTowers(spec), OneCall(spec)
  _seeded(two.embedding)
  _seeded(one.embedding)
  for model in (two, one):
    _compiled(model, "sgd")
    for features, label in batches:
      model.train_on_batch(features, label)
  for name, slots in one.embedding.variables_by_table.items():
    for key, variable in slots.items():
      np.testing.assert_allclose(two.embedding.variables_by_table[name][key].numpy(),
                                 variable.numpy(), rtol=1e-6, atol=1e-7,
                                 err_msg=f"{name}/{key}")
  assert int(two.embedding.step.numpy()) == int(one.embedding.step.numpy()) == 3


def test_ragged_and_sparse_inputs_reach_the_engine_as_such():
  inputs = _inputs(user_sparse=True)
  layer = _seeded(tee.EmbeddingLayer(_spec()))
  activations = layer(inputs)
  for output in activations.values():
    assert tuple(output.shape) == (None, DIM)
  model = keras.Model(inputs, activations)
  item = _batches(14, n=1)[0][0]["item"]
  user = tf.RaggedTensor.from_row_lengths(
      tf.constant([1, 2, 3, 4, 5, 6, 7], tf.int64), [2, 1, 1, 1, 1, 1]).to_sparse()
  got = model.predict({"user": user, "item": item}, verbose=0)
  user_table = layer.variables_by_table["user"]["parameters"].numpy()
  item_table = layer.variables_by_table["item"]["parameters"].numpy()
  rows = [[1, 2], [3], [4], [5], [6], [7]]
  np.testing.assert_allclose(got["user"], [user_table[r].sum(0) for r in rows],
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got["item"], [item_table[r].mean(0) for r in item.to_list()],
                             rtol=1e-6, atol=1e-6)


# --- pinned errors -------------------------------------------------------------

def _store(layer):
  store = {}
  layer.save_own_variables(store)
  return store


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("user"),
     "EmbeddingLayer 'embedding': table 'user' is not in the saved weights (they "
     "hold ['.gradient_sink', '.step', 'item', 'item.accumulators', "
     "'user.momenta', 'user.velocities']). Fix: load weights saved from a layer "
     "with the same spec, or rename the table back."),
    (lambda s: s.update(other=np.zeros([2, DIM], np.float32)),
     "EmbeddingLayer 'embedding': the saved weights hold ['other'], which this "
     "spec does not have. Fix: load into a layer with the same spec."),
    (lambda s: s.pop(".step"),
     "EmbeddingLayer 'embedding': the saved weights lack ['.step']. Fix: load "
     "weights saved by EmbeddingLayer.save_own_variables."),
    (lambda s: s.update({"user.momenta": np.zeros([USER_VOCAB, 1], np.float32)}),
     "EmbeddingLayer 'embedding': table 'user' is saved with shape [12, 1] "
     "(slot 'momenta'), this layer has [12, 4]."),
], ids=["missing_table", "unknown_key", "missing_step", "slot_shape"])
def test_load_own_variables_rejects_bad_stores_and_changes_nothing(edit, message):
  layer = tee.EmbeddingLayer(_spec(), name="embedding")
  store = _store(layer)
  store = {k: v + 1 for k, v in store.items()}  # Differs from the layer.
  edit(store)
  before = _store(layer)
  with pytest.raises(errors.ConfigError, match=re.escape(message)):
    layer.load_own_variables(store)
  after = _store(layer)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_declared_ragged_input_with_float_ids_is_rejected():
  layer = tee.EmbeddingLayer(_spec(), name="embedding")
  layer(_inputs())  # Declares "item" ragged.
  features = {"user": tf.constant([1, 2], tf.int64),
              "item": tf.constant([[1.0, -1.0], [2.0, 3.0]])}
  with pytest.raises(errors.InputError, match=re.escape(
      "EmbeddingLayer 'embedding': feature 'item': ids must be integers, got "
      "dtype float32 for a ragged input. Fix: cast the ids to int64; for "
      "model.export of a subclassed model pass input_signature= with integer "
      "tf.TensorSpecs.")):
    layer(features)


def test_declared_ragged_input_as_padded_matrix_is_refused_for_training():
  layer = tee.EmbeddingLayer(_spec(), name="embedding")
  layer(_inputs())
  features = {"user": tf.constant([1, 2], tf.int64),
              "item": tf.constant([[1, 0], [2, 3]], tf.int64)}
  with pytest.raises(errors.InputError, match=re.escape(
      "EmbeddingLayer 'embedding': feature 'item' was declared "
      "keras.Input(ragged=True) but got a dense [2, 2] tensor for training. "
      "Fix: pass a tf.RaggedTensor (a matrix padded with -1 is read only for "
      "serving).")):
    with tf.GradientTape():
      layer(features, training=True)


def test_declared_ragged_input_as_padded_matrix_drops_the_padding():
  layer = tee.EmbeddingLayer(_spec(), name="embedding")
  layer(_inputs())
  padded = tf.constant([[1, -1, 2], [3, -1, -1]], tf.int64)
  ragged = tf.ragged.constant([[1, 2], [3]], tf.int64)
  user = tf.constant([0, 1], tf.int64)
  np.testing.assert_array_equal(layer({"user": user, "item": padded})["item"],
                                layer({"user": user, "item": ragged})["item"])


def _two_eager_calls(layer, first, second):
  with tf.GradientTape() as tape:
    outputs = [layer(first, training=True), layer(second, training=True)]
    loss = tf.add_n([tf.reduce_sum(a) for o in outputs for a in o.values()]
                    + list(layer.losses))
  tape.gradient(loss, layer.trainable_variables)


_ITEM = tf.ragged.constant([[1, 2], [3]], tf.int64)
_DENSE_USER = {"user": tf.constant([1, 2], tf.int64), "item": _ITEM}
_OUTPUT_SHAPE_SPEC = {**SPEC, "features": {
    "user": {"table": "user", "output_shape": [2]}, "item": {"table": "item"}}}


@pytest.mark.parametrize("config, second, message", [
    (SPEC, {"user": tf.ragged.constant([[1], [2]], tf.int64), "item": _ITEM},
     "EmbeddingLayer 'embedding': feature 'user' comes as EagerTensor and "
     "RaggedTensor in calls of one training step, which cannot be concatenated "
     "into one table step. Fix: pass it as the same kind of tensor in every "
     "call."),
    (_OUTPUT_SHAPE_SPEC, _DENSE_USER,
     "EmbeddingLayer 'embedding' was called 2 times in one training step with "
     "a feature that sets output_shape, whose batch cannot be concatenated. "
     "Fix: call the layer once per step, with every feature in one "
     "structure."),
], ids=["tensor_kinds", "output_shape"])
def test_two_calls_that_cannot_be_concatenated_are_rejected(config, second, message):
  layer = tee.EmbeddingLayer(tee.EmbeddingSpec.from_dict(config), name="embedding")
  with pytest.raises(errors.InputError, match=re.escape(message)):
    _two_eager_calls(layer, _DENSE_USER, second)
  assert int(layer.step.numpy()) == 0


def test_a_step_whose_gradients_never_all_arrive_is_reported():
  layer = tee.EmbeddingLayer(_spec(), name="embedding")
  features = _DENSE_USER
  with tf.GradientTape():
    layer(features, training=True)  # No gradient is ever taken of this call.
  with tf.GradientTape() as tape:
    out = layer(features, training=True)
    loss = tf.reduce_sum(out["user"]) + tf.add_n(layer.losses)
  tape.gradient(loss, layer.trainable_variables)
  assert int(layer.step.numpy()) == 0
  with pytest.raises(errors.InputError, match=re.escape(
      "EmbeddingLayer 'embedding': gradients arrived for 1 of the 2 training "
      "calls of the last step, so its table step was not applied. Fix: take "
      "the gradient once per step, of a loss that depends on every training "
      "call (model.losses included), with respect to the layer's trainable "
      "variables.")):
    with tf.GradientTape():
      layer(features, training=True)


def test_tpu_engine_called_twice_in_one_step_is_rejected(monkeypatch):
  from tpu_embed_ext.keras import layer as layer_lib
  monkeypatch.setattr(layer_lib.dispatch, "create_embedding",
                      lambda *a, **k: fh.RecordingV2())
  monkeypatch.setattr(layer_lib.adapters, "for_engine",
                      layer_lib.adapters.SparseCoreAdapter)
  layer = tee.EmbeddingLayer(fh.feature_config(), name="embedding")
  features = {"user": tf.constant([1, 2]), "item": tf.constant([3, 4])}
  with pytest.raises(errors.InputError, match=re.escape(
      "EmbeddingLayer 'embedding' was called 2 times in one training step; a "
      "TPU engine takes one batch per step. Fix: call the layer once, with "
      "every feature in one structure.")):
    _two_eager_calls(layer, features, features)
  with pytest.raises(errors.ConfigError, match=re.escape(
      "EmbeddingLayer 'embedding': Keras weight files of a TPU engine are not "
      "supported (not run on a TPU). Fix: save with tf.train.Checkpoint, whose "
      "keys equal TPUEmbedding's.")):
    layer.save_own_variables({})


def test_hand_written_tf_function_loop_without_model_losses_applies_gradients_as_given():
  batches = _batches(16, n=3)
  model = _compiled(_model(), "sgd")
  reference = _reference_embedding(model)
  bce = keras.losses.BinaryCrossentropy(from_logits=True)

  @tf.function
  def step(features, label):
    with tf.GradientTape() as tape:
      loss = bce(label, model(features, training=True))  # model.losses left out
    tape.gradient(loss, model.trainable_variables)  # Tables step; dense stays.

  for features, label in batches:
    _reference_step(reference, model, features, label)
    step(features, label)
  _assert_tables_match(model, reference, steps=3, rtol=1e-6, atol=1e-7)
