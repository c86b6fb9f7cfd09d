"""Every table name round-trips through every key, or is refused when the spec
is made (derived_names.py): checkpoint object-graph keys (TensorFlow's own
escaping, with TensorFlow's code as the oracle), Keras weights keys, the
training job's resume and export; then a property-based test over generated
specs.
"""

import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml
from tensorflow.python.trackable import trackable_utils

import tpu_embed_ext as tee
from tests import jobs
from tpu_embed_ext.spec import names as derived_names
from tpu_embed_ext import errors
from tpu_embed_ext.keras import serving
from tpu_embed_ext.sparsecore.checkpoint import find_embedding

api = tf.tpu.experimental.embedding
CONFIG = "configs/tiny.yaml"
# "." and "/" are escaped by TensorFlow; "a.Sb" is what "a/b" escapes to
# without its "." doubled.
ODD_NAMES = ("t.c0", "t/c1", "a.Sb", "ü b")


# --- keys ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["t.c0", "t/c1", "a.Sb", "..", "/", "a//b", ".S",
                                  "ü b", "x.ATTRIBUTES"])
def test_checkpoint_key_escapes_as_tensorflow_does(name):
  assert derived_names.escape_local_name(name) == trackable_utils.escape_local_name(name)
  assert derived_names.checkpoint_key("emb", name, "momenta") == (
      "emb/" + trackable_utils.escape_local_name(f"{name}/momenta")
      + "/.ATTRIBUTES/VARIABLE_VALUE")


def _engine(names, optimizer, seed=0):
  rng = np.random.RandomState(seed)
  tables = {n: api.TableConfig(6, 2, name=n, initializer=tf.constant_initializer(
      rng.uniform(-1, 1, (6, 2)))) for n in names}
  return tee.CPUEmbedding({f"f{i}": api.FeatureConfig(t, name=f"f{i}")
                           for i, t in enumerate(tables.values())}, optimizer)


def _train(engine, steps=3):
  """``steps`` SGD-style steps with gradients 1 (values differ from init)."""
  for step in range(steps):
    features = {f: tf.constant([step % 6, (step + 2) % 6], tf.int64)
                for f in engine.feature_config}
    engine.enqueue(features, training=True)
    activations = engine.dequeue()
    engine.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))


def _values(engine):
  return {(t, s): v.numpy() for t, slots in engine.variables.items()
          for s, v in slots.items()}


def test_odd_names_round_trip_through_tf_train_checkpoint_and_tensorflow(tmp_path):
  trained = _engine(ODD_NAMES, api.Adagrad(0.1))
  _train(trained)
  path = tf.train.Checkpoint(embedding=trained).save(str(tmp_path / "c"))
  keys = dict(tf.train.list_variables(path))
  for name in ODD_NAMES:  # TensorFlow's escaping is the oracle.
    for local in (name, f"{name}/accumulators"):
      assert ("embedding/" + trackable_utils.escape_local_name(local)
              + "/.ATTRIBUTES/VARIABLE_VALUE") in keys
  fresh = _engine(ODD_NAMES, api.Adagrad(0.1), seed=1)
  fresh.build()
  fresh.check_checkpoint(path)
  tf.train.Checkpoint(embedding=fresh).restore(path).assert_consumed()
  want = _values(trained)
  assert _values(fresh).keys() == want.keys()
  for key, value in _values(fresh).items():
    np.testing.assert_array_equal(value, want[key], err_msg=str(key))
  # TensorFlow's own serving engine finds every table under our keys.
  serving = api.TPUEmbeddingForServing(
      {f"f{i}": api.FeatureConfig(api.TableConfig(6, 2, name=n), name=f"f{i}")
       for i, n in enumerate(ODD_NAMES)}, api.Adagrad(0.1))
  serving.build()
  tf.train.Checkpoint(embedding=serving).restore(path).expect_partial()
  for config, variable in serving.embedding_tables.items():
    np.testing.assert_array_equal(variable.numpy(), want[(config.name, "parameters")])


def test_slots_are_matched_by_exact_key():
  # A table named like another table's slot variable that this optimizer does
  # not have: "a/momenta" beside Adagrad "a" is a valid pair.
  names = ("a", "a/momenta")
  trained = _engine(names, api.Adagrad(0.1))
  _train(trained)
  with tempfile.TemporaryDirectory() as tmp:
    path = tf.train.Checkpoint(embedding=trained).save(os.path.join(tmp, "c"))
    fresh = _engine(names, api.Adagrad(0.1), seed=1)
    fresh.build()
    fresh.check_checkpoint(path)  # Was: "holds optimizer slots ['accumulators', 'momenta']".
    tf.train.Checkpoint(embedding=fresh).restore(path).assert_consumed()
  for key, value in _values(fresh).items():
    np.testing.assert_array_equal(value, _values(trained)[key], err_msg=str(key))


# --- the training job ---------------------------------------------------------------

def _job_config(tmp_path, data_dir, names):
  with open(CONFIG) as f:
    config = yaml.safe_load(f)
  optimizers = ({"type": "adagrad", "learning_rate": 0.05},
                {"type": "adam", "learning_rate": 0.002},
                {"type": "ftrl", "learning_rate": 0.05})
  config["tables"] = {n: {"vocabulary_size": 200, "dim": 16, "optimizer": optimizers[i % 3]}
                      for i, n in enumerate(names)}
  config.pop("overrides")
  config["features"] = {f"c{i}": {"table": n} for i, n in enumerate(names)}
  config["train"].update(data_dir=data_dir, steps_per_checkpoint=5, eval_batches=1)
  path = tmp_path / "names.yaml"
  path.write_text(yaml.safe_dump(config, allow_unicode=True))
  return str(path)


def test_odd_table_names_resume_and_export_through_the_cli(tmp_path, capsys):
  config = _job_config(tmp_path, str(tmp_path / "tfds"), ODD_NAMES)
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  for args in (["--steps", "10", "--model_dir", str(straight)],
               ["--steps", "5", "--model_dir", str(resumed)],
               ["--steps", "10", "--model_dir", str(resumed)]):
    status, _, err = jobs.run_cli(capsys, "train", "--config", config, "--tpu", "none",
                                  *args)
    assert status == 0, err
  want, got = (jobs.variables(jobs.checkpoint(d, 10)) for d in (straight, resumed))
  assert got.keys() == want.keys()
  for name in ODD_NAMES:
    assert derived_names.checkpoint_key("model/embedding/embedding", name) in want
  for key in want:  # The resumed run equals the uninterrupted one, bit for bit.
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  out = tmp_path / "serving"
  status, _, err = jobs.run_cli(capsys, "export", "--config", config, "--model_dir",
                                str(resumed), "--out", str(out))
  assert status == 0, err
  tables = [v.numpy() for v in tf.saved_model.load(str(out)).tables]
  for name in ODD_NAMES:
    stored = want[derived_names.checkpoint_key("model/embedding/embedding", name)]
    assert sum(np.array_equal(t, stored) for t in tables) == 1, name


# --- refused when the spec is made ----------------------------------------------------

def _spec(tables, optimizer="adagrad"):
  return {"optimizer": {"type": optimizer, "learning_rate": 0.1},
          "tables": {n: {"vocabulary_size": 4, "dim": 2, **extra}
                     for n, extra in tables.items()},
          "features": {f"f{i}": {"table": n} for i, n in enumerate(tables)}}


@pytest.mark.parametrize("tables, message", [
    ({"a": {}, "a.accumulators": {}},
     "tables.a.accumulators: tables 'a' and 'a.accumulators' both write the Keras "
     "weights key 'a.accumulators' (the accumulators slot of 'a', the table "
     "'a.accumulators'): save_weights would keep only one of them. Fix: rename table "
     "'a.accumulators' (a name ending in '.<slot name>' can collide)."),
    ({"a.momenta": {"optimizer": {"type": "sgd"}}, "a": {"optimizer": {"type": "adam"}}},
     "tables.a: tables 'a.momenta' and 'a' both write the Keras weights key "
     "'a.momenta' (the table 'a.momenta', the momenta slot of 'a'): save_weights would "
     "keep only one of them. Fix: rename table 'a'"),
    ({"x": {}, "x/accumulators": {}},
     "tables.x/accumulators: tables 'x' and 'x/accumulators' both give TensorFlow the "
     "variable name 'x/accumulators' (a slot variable of 'x', the table variable of "
     "'x/accumulators'): variables, slot variables and checkpoint keys would collide."),
    ({".step": {}},
     "tables..step: table '.step' would be saved under the Keras weights key '.step', "
     "which holds EmbeddingLayer's table step. Fix: rename table '.step' (keys "
     "starting with '.' are the layer's own)."),
    ({"a\nb": {}},
     "tables: table name 'a\\nb' contains the control character '\\n': names appear in "
     "one-line messages and in HDF5 weights files, which cut them there. Fix: rename "
     "the table without control characters or line breaks."),
    ({"_sparse_core_table_layouts": {}},
     "tables._sparse_core_table_layouts: table name '_sparse_core_table_layouts' is "
     "TPUEmbeddingV2's key for its "
     "SparseCore layouts: their checkpoint keys would collide. Fix: rename the table."),
], ids=["slot_key", "slot_key_other_order", "variable", "step_key", "control",
        "layouts"])
def test_names_that_would_share_a_key_are_refused_naming_both(tables, message):
  with pytest.raises(errors.ConfigError) as info:
    tee.EmbeddingSpec.from_dict(_spec(tables))
  assert str(info.value).startswith(message), str(info.value)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("feature, message", [
    ("user.id",
     "features: feature name 'user.id' is not kept by a serving signature: TensorFlow "
     "renames inputs other than letters, digits and '_' starting with a letter, so "
     "clients would have to send another name. Fix: rename the feature, e.g. "
     "'user_id'."),
    ("1st",
     "features: feature name '1st' is not kept by a serving signature: TensorFlow "
     "renames inputs other than letters, digits and '_' starting with a letter, so "
     "clients would have to send another name. Fix: rename the feature, e.g. "
     "'f_1st'."),
    ("dense",
     "features: feature name 'dense' is the serving signature's input of the dense "
     "(float) features: the two would share one input. Fix: rename the feature, e.g. "
     "'dense_ids'."),
    ("a\tb",
     "features: feature name 'a\\tb' contains the control character '\\t': names "
     "appear in one-line messages and in HDF5 weights files, which cut them there. "
     "Fix: rename the feature without control characters or line breaks."),
], ids=["dot", "digit_first", "dense", "control"])
def test_feature_names_a_serving_signature_would_change_are_refused(feature, message):
  config = _spec({"t": {}})
  config["features"] = {feature: {"table": "t"}}
  with pytest.raises(errors.ConfigError) as info:
    tee.EmbeddingSpec.from_dict(config)
  assert str(info.value) == message


def test_names_sharing_no_key_are_accepted():
  # Distinct under every scheme: "a/b" -> "a.Sb" (checkpoint), "a%2Fb" (HDF5).
  tee.EmbeddingSpec.from_dict(_spec({n: {} for n in ("a/b", "a.Sb", "a%2Fb", "a.b")}))
  tee.EmbeddingSpec.from_dict(_spec({"a": {}, "a.momenta": {}}))  # Adagrad has none.


def test_odd_table_names_round_trip_through_keras_weights(tmp_path):
  names = ("a/b", "a.Sb", "a%2Fb", ".", "..", "/x", "a//c")
  spec = tee.EmbeddingSpec.from_dict(_spec({n: {} for n in names}))
  model, batch = _keras_model(spec)
  model.train_on_batch(*batch)
  path = str(tmp_path / "m.weights.h5")
  model.save_weights(path)
  fresh, _ = _keras_model(spec, seed=1)
  fresh.load_weights(path)
  _assert_same_tables(fresh, model)


# --- property: generated specs ---------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

# Names that collide under some key scheme, or are reserved, or valid but odd.
_TRICKY = ["a", "a.accumulators", "a/accumulators", "a.momenta", "a/momenta", "a.Sb",
           "a/b", "a%2Fb", ".step", ".gradient_sink", "_sparse_core_table_layouts",
           ".", "..", "/", "t.c0", "ü b", "😀", "a\nb", "a\x00b", "a\u2028b", ""]
_ALPHABET = "ab.S/_% -ü😀"
_OPTIMIZERS = ["sgd", "adagrad", "adagrad_momentum", "adam", "ftrl"]
_FEATURES = ["f", "g1", "user_id", "dense", "a.b", "1x", "ü", "a b", "x/y"]


@st.composite
def _configs(draw):
  n = draw(st.integers(1, 3))
  tables = draw(st.lists(st.one_of(st.sampled_from(_TRICKY),
                                   st.text(_ALPHABET, min_size=1, max_size=6)),
                         min_size=n, max_size=n, unique=True))
  valid = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,5}", fullmatch=True)
  features = draw(st.lists(st.one_of(st.sampled_from(_FEATURES), valid, valid),
                           min_size=n, max_size=n, unique=True))
  return {
      "optimizer": {"type": draw(st.sampled_from(_OPTIMIZERS)), "learning_rate": 0.1},
      "tables": {t: {"vocabulary_size": draw(st.integers(1, 7)),
                     "dim": draw(st.integers(1, 3)),
                     "optimizer": {"type": draw(st.sampled_from(_OPTIMIZERS))}}
                 for t in tables},
      "features": {f: {"table": t} for f, t in zip(features, tables)},
  }


def _keras_model(spec, seed=0):
  keras.utils.set_random_seed(seed)
  inputs = {f.name: keras.Input(shape=(), dtype="int64", name=f.name)
            for f in spec.features}
  layer = tee.EmbeddingLayer(spec, name="embedding")
  activations = layer(inputs)
  x = keras.layers.Concatenate()([activations[f.name] for f in spec.features])
  model = keras.Model(inputs, keras.layers.Dense(1, name="head")(x))
  model.compile(optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.BinaryCrossentropy(from_logits=True))
  rng = np.random.RandomState(seed)
  ids = {f.name: tf.constant(rng.randint(0, spec.table(f.table).vocabulary_size, 4),
                             tf.int64) for f in spec.features}
  # Table values differ between seeds (spec initializers take no seed).
  for variables in layer.variables_by_table.values():
    table = variables["parameters"]
    table.assign(rng.uniform(-1, 1, table.shape).astype(np.float32))
  return model, (ids, tf.constant(rng.randint(0, 2, (4, 1)), tf.float32))


def _tables(model):
  layer = model.get_layer("embedding")
  out = {(t, s): v.numpy() for t, slots in layer.variables_by_table.items()
         for s, v in slots.items()}
  out["step"] = layer.step.numpy()
  return out


def _assert_same_tables(got_model, want_model):
  got, want = _tables(got_model), _tables(want_model)
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(config=_configs())
def test_generated_specs_round_trip_or_are_refused_with_our_error(config):
  try:
    spec = tee.EmbeddingSpec.from_dict(config)
  except errors.Error as e:  # Refused: our class, one line.
    hypothesis.event("refused")
    assert "\n" not in str(e) and "Fix:" in str(e), str(e)
    return
  with tempfile.TemporaryDirectory() as tmp:
    model, batch = _keras_model(spec)
    model.train_on_batch(*batch)
    # tf.train.Checkpoint: TensorFlow's keys (its escaping as the oracle).
    path = tf.train.Checkpoint(model=model).save(os.path.join(tmp, "ckpt"))
    keys = dict(tf.train.list_variables(path))
    emb = find_embedding(path, [t.name for t in spec.tables])
    for t in spec.tables:
      for slot in (None, *spec.optimizer_for(t.name).slot_names):
        local = t.name if slot is None else f"{t.name}/{slot}"
        key = f"{emb}/{trackable_utils.escape_local_name(local)}/.ATTRIBUTES/VARIABLE_VALUE"
        assert key == derived_names.checkpoint_key(emb, t.name, slot) and key in keys
    restored, _ = _keras_model(spec, seed=1)
    restored.get_layer("embedding").embedding.check_checkpoint(path, prefix=emb)
    tf.train.Checkpoint(model=restored).restore(path).assert_existing_objects_matched()
    _assert_same_tables(restored, model)
    # Keras save_weights / load_weights.
    weights = os.path.join(tmp, "m.weights.h5")
    model.save_weights(weights)
    loaded, _ = _keras_model(spec, seed=2)
    loaded.load_weights(weights)
    _assert_same_tables(loaded, model)
    # The serving export: every feature keeps its name, values equal.
    signature = {f.name: tf.TensorSpec([None], tf.int64, name=f.name)
                 for f in spec.features}
    out = os.path.join(tmp, "serving")
    serving.export_for_serving(restored, out, signature)
    serve = tf.saved_model.load(out).signatures["serving_default"]
    assert set(serve.structured_input_signature[1]) == {f.name for f in spec.features}
    np.testing.assert_allclose(serve(**batch[0])["outputs"].numpy(),
                               model(batch[0]).numpy(), rtol=1e-6, atol=1e-6)
