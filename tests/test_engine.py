"""CPUEmbedding: TF's TPU goldens, lookup parity, checkpoints, engines, errors."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.emulation import dispatch
from tests import references

api = tf.tpu.experimental.embedding


# --- TensorFlow's one-step TPU test scenario (docs/semantics.md) ----------

def _scenario_config(optimizer):
  video = api.TableConfig(8, 4, initializer=tf.constant_initializer(
      np.arange(32).reshape(8, 4)), combiner="sum", name="video")
  user = api.TableConfig(16, 2, initializer=tf.constant_initializer(
      np.arange(32).reshape(16, 2)), combiner="mean", name="user")
  config = {"watched": api.FeatureConfig(video, name="watched"),
            "favorited": api.FeatureConfig(video, name="favorited"),
            "friends": api.FeatureConfig(user, name="friends")}
  return config, optimizer


REPLICAS = 2
DATA = {"watched": [[0], [0, 1], [0, 1], [1]],
        "favorited": [[0, 1], [1], [0], [0, 1]],
        "friends": [[3], [0, 1, 2], [3], [0, 1, 2]]}


def _scenario_step(optimizer):
  """The global batch (2 samples x R replicas) in one step; loss / R as TF does."""
  emb = tee.CPUEmbedding(*_scenario_config(optimizer))
  features = {k: tf.ragged.constant(v * (REPLICAS // 2), tf.int64)
              for k, v in DATA.items()}
  emb.enqueue(features, training=True)
  with tf.GradientTape() as tape:
    acts = emb.dequeue()
    tape.watch(acts)
    # Per replica: sum over features of mean_b sum_d act^2, divided by R.
    loss = tf.add_n([tf.reduce_sum(a * a) / 2 for a in acts.values()]) / REPLICAS
  emb.apply_gradients(tape.gradient(loss, acts))
  return emb, acts


def test_forward_goldens_of_core_0():
  _, acts = _scenario_step(api.SGD(0.1))
  np.testing.assert_array_equal(acts["watched"][:2], [[0, 1, 2, 3], [4, 6, 8, 10]])
  np.testing.assert_array_equal(acts["favorited"][:2], [[4, 6, 8, 10], [4, 5, 6, 7]])
  np.testing.assert_array_equal(acts["friends"][:2], [[6, 7], [2, 3]])


VIDEO_GRAD = {0: np.array([8, 13, 18, 23.]), 1: np.array([12, 17, 22, 27.])}
USER_GRAD = {0: np.array([2 / 3, 1]), 1: np.array([2 / 3, 1]), 2: np.array([2 / 3, 1]),
             3: np.array([6, 7.])}
LR = 0.1


def _expected(update):
  video, user = np.arange(32.).reshape(8, 4), np.arange(32.).reshape(16, 2)
  for table, grads in ((video, VIDEO_GRAD), (user, USER_GRAD)):
    for i, g in grads.items():
      table[i] = update(table[i], g)
  return video, user


def _one_step(name, **hparams):
  """The reference's first step of ``name`` from its initial slots (TF's BT
  goldens: ``tpu_embedding_v2_correctness_base_test``)."""
  def update(w, g):
    slots = references.initial_slots(name, w.shape, **hparams)
    return references.update(name, w, slots, g, LR, **hparams)[0]
  return update


GOLDENS = {
    "sgd": (api.SGD(LR), _one_step("sgd")),
    "adagrad": (api.Adagrad(LR), _one_step("adagrad")),
    "adam": (api.Adam(LR), _one_step("adam")),
    "ftrl": (api.FTRL(LR), _one_step("ftrl")),
    "adagrad_momentum": (api.AdagradMomentum(
        LR, momentum=0.9, use_nesterov=True, exponent=3, epsilon=0.1, beta2=0.9),
                         _one_step("adagrad_momentum", momentum=0.9,
                                   use_nesterov=True, exponent=3, epsilon=0.1,
                                   beta2=0.9)),
}


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_tensorflow_one_step_tpu_goldens(name):
  optimizer, update = GOLDENS[name]
  emb, _ = _scenario_step(optimizer)
  video, user = _expected(update)
  np.testing.assert_allclose(emb.variables["video"]["parameters"].numpy(), video,
                             rtol=1e-5)
  np.testing.assert_allclose(emb.variables["user"]["parameters"].numpy(), user,
                             rtol=1e-5)


# --- lookups: TPUEmbeddingForServing semantics ----------------------------------

def _lookup_config(quantize=False):
  q = api.QuantizationConfig(num_buckets=5, lower=-0.5, upper=0.5) if quantize else None
  tables = {c: api.TableConfig(20, 3, combiner=c, name=f"t_{c}", quantization_config=q,
                               initializer=tf.random_uniform_initializer(seed=1))
            for c in ("sum", "mean", "sqrtn")}
  return {
      "dense": api.FeatureConfig(tables["sum"], name="dense"),
      "ragged_sum": api.FeatureConfig(tables["sum"], name="ragged_sum"),
      "ragged_mean": api.FeatureConfig(tables["mean"], name="ragged_mean"),
      "sparse_sqrtn": api.FeatureConfig(tables["sqrtn"], name="sparse_sqrtn"),
      "sequence": api.FeatureConfig(tables["mean"], max_sequence_length=3,
                                    name="sequence"),
      "sparse_sequence": api.FeatureConfig(tables["sqrtn"], max_sequence_length=2,
                                           name="sparse_sequence"),
      "reshaped": api.FeatureConfig(tables["sum"], output_shape=[2, 2],
                                    name="reshaped"),
  }


def _lookup_inputs():
  ragged = tf.ragged.constant([[1, 2, 2], [], [5], [7, 8, 9, 10]], tf.int64)
  weights = tf.ragged.constant([[0.5, 1.0, 2.0], [], [3.0], [1.0, 1.0, 0.5, 0.25]])
  # Dense ids of rank 1: the one dense shape on which TPUEmbedding and
  # TPUEmbeddingForServing agree (tests/test_parity.py covers the others).
  features = {"dense": tf.constant([1, 3, 0, 19], tf.int64),
              "ragged_sum": ragged, "ragged_mean": ragged,
              "sparse_sqrtn": ragged.to_sparse(), "sequence": ragged,
              "sparse_sequence": ragged.to_sparse(), "reshaped": ragged}
  w = {k: None for k in features}
  w.update(ragged_sum=weights, ragged_mean=weights, sparse_sqrtn=weights.to_sparse())
  return features, w


def test_lookups_equal_tpu_embedding_for_serving():
  config = _lookup_config()
  ours = tee.CPUEmbedding(config, api.SGD(0.1))
  theirs = api.TPUEmbeddingForServing(config, api.SGD(0.1))
  theirs.build()
  for table, var in ours.embedding_tables.items():
    var.assign(theirs.embedding_tables[table])
  features, weights = _lookup_inputs()
  got, want = ours(features, weights), theirs(features, weights)
  for name in features:
    assert got[name].shape == want[name].shape, name
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7,
                               err_msg=name)
  # Same inside tf.function, and through enqueue/dequeue.
  traced = tf.function(lambda f, w: ours(f, w))(features, weights)
  ours.enqueue(features, weights, training=False)
  dequeued = ours.dequeue()
  for name in features:
    np.testing.assert_allclose(traced[name], want[name], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dequeued[name], want[name], rtol=1e-6, atol=1e-7)


def test_simulated_quantization_forward_and_straight_through_backward():
  config = _lookup_config(quantize=True)
  emb = tee.CPUEmbedding(config, api.SGD(1.0))
  table = emb.variables["t_sum"]["parameters"]
  before = table.numpy()
  features, weights = _lookup_inputs()
  features["dense"] = tf.constant([[3], [4], [3], [4]], tf.int64)
  emb.enqueue(features, weights, training=True)
  acts = emb.dequeue()
  quantum = 1.0 / 4
  rows = np.clip(before[[3, 4, 3, 4]], -0.5, 0.5)
  expected = np.floor((rows + 0.5) / quantum + 0.5) * quantum - 0.5
  np.testing.assert_allclose(acts["dense"], expected, atol=1e-6)  # [B, 1] -> [B, dim]
  grads = tf.nest.map_structure(tf.zeros_like, acts)
  grads["dense"] = tf.ones_like(acts["dense"])
  emb.apply_gradients(grads)
  # Straight-through: each of ids 3 and 4 gets gradient 2 (two occurrences).
  after = table.numpy()
  np.testing.assert_allclose(after[3], before[3] - 2.0, atol=1e-6)
  np.testing.assert_allclose(after[4], before[4] - 2.0, atol=1e-6)


# --- checkpoints -----------------------------------------------------------------

def _trained(optimizer, steps=3):
  config = _lookup_config()
  emb = tee.CPUEmbedding(config, optimizer)
  features, weights = _lookup_inputs()
  for _ in range(steps):
    emb.enqueue(features, weights, training=True)
    acts = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(lambda a: 0.3 * tf.ones_like(a), acts))
  return emb


def test_checkpoint_keys_and_values_round_trip_with_tpu_embedding_for_serving(tmp_path):
  ours = _trained(api.Adam(0.1))
  path = tf.train.Checkpoint(embedding=ours).save(str(tmp_path / "ours"))
  serving = api.TPUEmbeddingForServing(_lookup_config(), api.Adam(0.1))
  serving.build()
  tf.train.Checkpoint(embedding=serving).restore(path).assert_consumed()
  for name, slots in ours.variables.items():
    for key, var in slots.items():
      np.testing.assert_array_equal(serving.variables[name][key], var, err_msg=f"{name}/{key}")

  # The reverse: TPUEmbeddingForServing's checkpoint restores into CPUEmbedding.
  for slots in serving.variables.values():
    for var in slots.values():
      var.assign(var + 1.0)
  back = tf.train.Checkpoint(embedding=serving).save(str(tmp_path / "theirs"))
  fresh = tee.CPUEmbedding(_lookup_config(), api.Adam(0.1))
  status = tf.train.Checkpoint(embedding=fresh).restore(back)  # Before build:
  fresh.build()                                  # filled in at creation.
  status.assert_consumed()
  for name, slots in serving.variables.items():
    for key, var in slots.items():
      np.testing.assert_array_equal(fresh.variables[name][key], var)
  ours_keys = {k for k, _ in tf.train.list_variables(path)}
  assert ours_keys == {k for k, _ in tf.train.list_variables(back)}
  assert "embedding/t_mean.Svelocities/.ATTRIBUTES/VARIABLE_VALUE" in ours_keys


def test_restore_before_build_fills_variables_at_creation(tmp_path):
  ours = _trained(api.Adagrad(0.1))
  path = tf.train.Checkpoint(embedding=ours).save(str(tmp_path / "c"))
  fresh = tee.CPUEmbedding(_lookup_config(), api.Adagrad(0.1))
  tf.train.Checkpoint(embedding=fresh).restore(path)
  fresh.build()
  np.testing.assert_array_equal(fresh.variables["t_sum"]["accumulators"],
                                ours.variables["t_sum"]["accumulators"])


def test_user_table_configs_are_never_mutated():
  table = api.TableConfig(10, 2)  # No name, no optimizer.
  config = {"f": api.FeatureConfig(table)}
  emb = tee.CPUEmbedding(config, api.SGD(0.1))
  assert table.name is None and table.optimizer is None
  assert list(emb.variables) == ["table_0"]
  assert emb.embedding_tables[table] is emb.variables["table_0"]["parameters"]


# --- optimizer modes ---------------------------------------------------------------

def _single_table(optimizer, engine="v1"):
  table = api.TableConfig(6, 2, combiner="sum", name="t",
                          initializer=tf.constant_initializer(
                              np.arange(12.).reshape(6, 2) / 10))
  # TPUEmbeddingV2 needs every feature's output_shape (one id per step here).
  output_shape = [1] if engine == "v2" else None
  return tee.CPUEmbedding(
      {"f": api.FeatureConfig(table, name="f", output_shape=output_shape)},
      optimizer, engine=engine)


def _step(emb, ids, grad_rows):
  emb.enqueue({"f": tf.ragged.constant(ids, tf.int64)}, training=True)
  emb.dequeue()
  emb.apply_gradients({"f": tf.constant(grad_rows, tf.float32)})


def test_without_gradient_accumulation_duplicates_update_in_rounds():
  emb = _single_table(api.Adagrad(0.5, use_gradient_accumulation=False))
  # id 1 occurs twice (rows 0 and 1): two sequential Adagrad steps on it.
  _step(emb, [[1], [1, 2]], [[1.0, 2.0], [3.0, -1.0]])
  w0 = np.arange(12.).reshape(6, 2) / 10
  w, slots = w0[1], references.initial_slots("adagrad", 2)
  for g in (np.array([1.0, 2.0]), np.array([3.0, -1.0])):
    w, slots = references.update("adagrad", w, slots, g, 0.5)
  np.testing.assert_allclose(emb.variables["t"]["parameters"][1], w, rtol=1e-6)
  np.testing.assert_allclose(emb.variables["t"]["accumulators"][1],
                             slots["accumulators"], rtol=1e-6)
  w2, _ = references.update("adagrad", w0[2], references.initial_slots("adagrad", 2),
                            np.array([3.0, -1.0]), 0.5)
  np.testing.assert_allclose(emb.variables["t"]["parameters"][2], w2, rtol=1e-6)


def test_non_lazy_adam_updates_every_row_lazy_only_touched():
  lazy, dense = _single_table(api.Adam(0.1)), _single_table(api.Adam(0.1, lazy_adam=False))
  for emb in (lazy, dense):
    _step(emb, [[0]], [[1.0, 1.0]])
    _step(emb, [[1]], [[1.0, 1.0]])
  w0 = (np.arange(12.).reshape(6, 2) / 10).astype(np.float32)
  # Row 5 is never looked up: untouched by lazy Adam; dense Adam gives g=0 steps,
  # which leave m = v = 0 and w unchanged too.
  np.testing.assert_array_equal(lazy.variables["t"]["parameters"][5], w0[5])
  # Row 0, looked up at step 0 only: dense Adam keeps moving it at step 1.
  w_after_0, slots = references.update("adam", w0[0], references.initial_slots(
      "adam", 2), np.ones(2), 0.1)
  np.testing.assert_allclose(lazy.variables["t"]["parameters"][0], w_after_0, rtol=1e-6)
  np.testing.assert_allclose(
      dense.variables["t"]["parameters"][0],
      references.update("adam", w_after_0, slots, np.zeros(2), 0.1)[0], rtol=1e-6)


def test_sparsecore_engine_ignores_clipping_and_rejects_weight_decay():
  optimizer = api.SGD(1.0, clip_weight_max=0.0, clipvalue=0.5)
  v1, v2 = _single_table(optimizer), _single_table(optimizer, engine="v2")
  for emb in (v1, v2):
    _step(emb, [[3]], [[-2.0, 2.0]])
  w3 = np.array([0.6, 0.7])
  np.testing.assert_allclose(v1.variables["t"]["parameters"][3],
                             np.minimum(w3 - np.clip([-2.0, 2.0], -0.5, 0.5), 0.0))
  np.testing.assert_allclose(v2.variables["t"]["parameters"][3], w3 - [-2.0, 2.0])
  with pytest.raises(tee.ConfigError) as info:
    _single_table(api.SGD(0.1, weight_decay_factor=0.1), engine="v2")
  assert str(info.value) == (
      "table 't': weight_decay_factor=0.1 is rejected by TPUEmbeddingV2 (SparseCore). "
      'Fix: remove weight decay, or emulate TPUEmbedding with engine="v1".')


def test_none_gradient_is_a_zero_gradient_on_touched_rows():
  emb = _single_table(api.Adam(0.1))
  _step(emb, [[0]], [[1.0, 1.0]])
  before = emb.variables["t"]["parameters"].numpy()
  emb.enqueue({"f": tf.ragged.constant([[0]], tf.int64)}, training=True)
  emb.dequeue()
  emb.apply_gradients({"f": None})
  # Decayed moments still move row 0 (the moments of step 0's gradient of 1).
  _, slots = references.update("adam", before[0], references.initial_slots(
      "adam", 2), np.ones(2), 0.1)
  np.testing.assert_allclose(
      emb.variables["t"]["parameters"][0],
      references.update("adam", before[0], slots, np.zeros(2), 0.1)[0], rtol=1e-6)
  np.testing.assert_array_equal(emb.variables["t"]["parameters"][1:], before[1:])


# --- bad input: clear errors, nothing changes ------------------------------------

def _snapshot(emb):
  out = {f"{t}/{k}": v.numpy().copy() for t, s in emb.variables.items()
         for k, v in s.items()}
  out["step"] = emb.step.numpy()
  return out


@pytest.mark.parametrize("ids,grad,message", [
    ([[9]], [[1.0, 1.0]],
     "feature 'f' (table 't'): id 9 is out of range [0, 6). Fix: map ids into the "
     "vocabulary (e.g. hash them modulo 6) or enlarge vocabulary_size."),
    ([[-1]], [[1.0, 1.0]], "feature 'f' (table 't'): id -1 is out of range [0, 6)."),
    ([[1]], [[np.nan, 1.0]],
     "table 't': gradient has NaN or Inf values; no table, slot or step was changed."),
    ([[1]], [[1.0, 1.0], [2.0, 2.0]],
     "feature 'f' (table 't'): gradient shape [2, 2] does not match its activation "
     "shape [1, 2]."),
], ids=["too_large", "negative", "nan_gradient", "gradient_shape"])
def test_rejected_step_changes_nothing(ids, grad, message):
  emb = _single_table(api.Adam(0.1))
  _step(emb, [[1, 2]], [[1.0, 1.0]])
  before = _snapshot(emb)
  with pytest.raises(tee.InputError) as info:
    _step(emb, ids, grad)
  assert str(info.value).startswith(message), str(info.value)
  after = _snapshot(emb)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_out_of_range_ids_fail_inside_tf_function_before_any_write():
  emb = _single_table(api.SGD(0.1))
  before = _snapshot(emb)

  @tf.function
  def step(ids):
    emb.enqueue({"f": ids}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(tf.ones_like, acts))

  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"feature \\?'f\\?' \(table \\?'t\\?'\): ids must be in "
                           r"\[0, 6\)\. Fix: map ids into the vocabulary or enlarge "
                           r"vocabulary_size\.\] \[Smallest and largest ids:\] \[1\] \[6\]"):
    step(tf.ragged.constant([[1], [6]], tf.int64))
  after = _snapshot(emb)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key])


def test_non_finite_gradient_fails_inside_tf_function_naming_the_table():
  tables = [api.TableConfig(6, 2, initializer=tf.ones_initializer(), name=n)
            for n in ("a", "b")]
  emb = tee.CPUEmbedding({"x": api.FeatureConfig(tables[0]),
                          "y": api.FeatureConfig(tables[1])}, api.Adagrad(0.1))
  before = _snapshot(emb)

  @tf.function
  def step(grad_b):
    emb.enqueue({"x": tf.constant([1, 2]), "y": tf.constant([3, 3])}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"x": tf.ones_like(acts["x"]), "y": grad_b})

  # Two finite contributions whose per-id sum overflows are rejected too.
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"gradient has NaN or Inf values; no table, slot or step "
                           r"was changed\. Fix: .* Tables:\] \[table \\?'b\\?'\]"):
    step(tf.fill([2, 2], 3e38))
  after = _snapshot(emb)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)


@pytest.mark.parametrize("features,message", [
    ({"g": tf.constant([1])}, "features do not match the feature config's structure"),
    ({"f": tf.constant([1.5])},
     "feature 'f' (table 't'): ids must be integers, got dtype float32."),
    ({"f": tf.ragged.constant([[[1]]], tf.int64, ragged_rank=2)},
     "feature 'f' (table 't'): ragged ids must have rank 2"),
], ids=["unknown_key", "float_ids", "ragged_rank_3"])
def test_bad_features_are_named(features, message):
  emb = _single_table(api.SGD(0.1))
  with pytest.raises(tee.InputError) as info:
    emb.enqueue(features, training=True)
  assert message in str(info.value)


def test_weights_on_dense_ids_and_mismatched_layout():
  emb = _single_table(api.SGD(0.1))
  with pytest.raises(tee.InputError, match="weights were given for a dense id tensor"):
    emb({"f": tf.constant([1])}, {"f": tf.constant([1.0])})
  with pytest.raises(tee.InputError, match=r"weights have row lengths \[1, 1\] but ids \[2\]"):
    emb({"f": tf.ragged.constant([[1, 2]], tf.int64)},
        {"f": tf.ragged.constant([[1.0], [2.0]])})


def test_empty_batch_is_a_valid_no_op():
  emb = _single_table(api.Adagrad(0.1))
  before = _snapshot(emb)
  emb.enqueue({"f": tf.ragged.constant([[], []], tf.int64)}, training=True)
  acts = emb.dequeue()
  np.testing.assert_array_equal(acts["f"], np.zeros((2, 2)))
  emb.apply_gradients({"f": tf.ones([2, 2])})
  after = _snapshot(emb)
  for key in before:
    if key != "step":
      np.testing.assert_array_equal(after[key], before[key])
  assert after["step"] == 1


# --- dispatch ----------------------------------------------------------------------

def test_create_embedding_dispatch_with_a_stand_in_tpu_strategy(monkeypatch):
  from tensorflow.python.distribute import tpu_strategy
  from tensorflow.python.tpu import tpu_embedding_v3
  real_v2 = tpu_embedding_v3.TPUEmbeddingV2

  class FakeStrategy(tpu_strategy.TPUStrategyV2):
    def __init__(self, sparsecore):  # No TPU: skip the real constructor.
      self.sparsecore = sparsecore

  made = []

  class Recorder:
    def __init__(self, kind):
      self.kind = kind

    def __call__(self, config, optimizer):
      made.append((self.kind, optimizer))
      return object.__new__(real_v2) if self.kind == "v2" else \
          type("FakeV1", (), {})()

  monkeypatch.setattr(api, "TPUEmbedding", Recorder("v1"))
  monkeypatch.setattr(tpu_embedding_v3, "TPUEmbeddingV2", Recorder("v2"))
  monkeypatch.setattr(dispatch, "_sparsecore", lambda s: s.sparsecore)
  config = {"f": api.FeatureConfig(api.TableConfig(5, 2, name="t"), output_shape=[2])}
  dispatch.create_embedding(config, tee.SGD(learning_rate=0.2),
                              strategy=FakeStrategy(False))
  dispatch.create_embedding(config, api.SGD(0.1), strategy=FakeStrategy(True))
  dispatch.create_embedding(config, api.SGD(0.1), engine="v2",
                              strategy=FakeStrategy(False))
  assert [k for k, _ in made] == ["v1", "v2", "v2"]
  assert isinstance(made[0][1], api.SGD) and made[0][1].learning_rate == 0.2
  cpu = dispatch.create_embedding(config, api.SGD(0.1), engine="v2")
  assert isinstance(cpu, tee.CPUEmbedding) and cpu.engine == "v2"


@pytest.mark.parametrize("vocab,optimizer,message", [
    (12, api.Adagrad(0.1),
     "table 't': checkpoint {path} holds shape [6, 2], this spec has [12, 2]. Fix: "
     "restore into a spec with the same vocabulary_size and dim."),
    (6, api.Adam(0.1),
     "table 't': checkpoint {path} holds optimizer slots ['accumulators'], its adam "
     "optimizer needs ['momenta', 'velocities']. Fix: restore with the optimizer the "
     "checkpoint was trained with."),
    (6, api.SGD(0.1),
     "table 't': checkpoint {path} holds optimizer slots ['accumulators'], its sgd "
     "optimizer needs []."),
], ids=["shape", "other_slots", "fewer_slots"])
def test_checkpoint_of_another_spec_is_refused_naming_the_table(tmp_path, vocab,
                                                                optimizer, message):
  trained = _single_table(api.Adagrad(0.1))
  trained.build()
  path = tf.train.Checkpoint(embedding=trained).save(str(tmp_path / "c"))
  trained.check_checkpoint(path)  # Its own checkpoint passes.
  table = api.TableConfig(vocab, 2, name="t")
  other = tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")}, optimizer)
  with pytest.raises(tee.ConfigError) as info:
    other.check_checkpoint(path)
  assert str(info.value).startswith(message.format(path=path)), str(info.value)


def test_dense_ids_for_a_sequence_feature_and_gradient_structure():
  table = api.TableConfig(6, 2, name="t")
  emb = tee.CPUEmbedding({"s": api.FeatureConfig(table, max_sequence_length=3, name="s")},
                         api.SGD(0.1))
  with pytest.raises(tee.InputError) as info:
    emb({"s": tf.constant([[1, 2, 3]])})
  assert str(info.value).startswith(
      "feature 's' (table 't'): dense ids of shape [1, 3] have a last dimension of 3, "
      "but TPUEmbedding needs dense ids of rank >= 2 to end in a dimension of 1")
  emb.enqueue({"s": tf.ragged.constant([[1, 2, 3, 4]], tf.int64)}, training=True)
  acts = emb.dequeue()
  assert acts["s"].shape == (1, 3, 2)  # Truncated to max_sequence_length.
  before = _snapshot(emb)
  with pytest.raises(tee.InputError) as info:
    emb.apply_gradients({"other": acts["s"]})
  assert str(info.value).startswith(
      "The two structures don't have the same nested structure. "
      "gradients do not match the feature config's structure: missing ['s'], "
      "unexpected ['other']. Fix: pass one gradient per feature")
  after = _snapshot(emb)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key])


# --- an update that would overflow is rejected like a non-finite gradient -----

OVERFLOWS = {
    # SGD: finite lr x finite gradient beyond float32.
    "sgd_parameters": (lambda: api.SGD(3e38), 10.0, "parameters"),
    # Adagrad: g^2 overflows the accumulator.
    "adagrad_accumulators": (lambda: api.Adagrad(0.1), 1e20, "accumulators"),
}


@pytest.mark.parametrize("name", sorted(OVERFLOWS))
@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_update_that_would_write_inf_changes_nothing(name, mode):
  optimizer, grad, variable = OVERFLOWS[name]
  table = api.TableConfig(6, 2, initializer=tf.ones_initializer(), name="t")
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")}, optimizer())
  before = _snapshot(emb)

  def step(g):
    emb.enqueue({"f": tf.constant([1, 2])}, training=True)
    emb.dequeue()
    emb.apply_gradients({"f": tf.fill([2, 2], g)})

  message = (rf"table \\?'t\\?': the update would write NaN or Inf into its "
             rf"{variable}; no table, slot or step was changed\. Fix: lower the "
             r"learning rate, or clip gradients \(clipvalue\) or weights")
  if mode == "eager":
    with pytest.raises(tee.InputError, match=message):
      step(grad)
  else:
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"the update would write NaN or Inf; no table, slot or "
                             r"step was changed\. .*"
                             rf"Where:\] \[table \\?'t\\?' {variable}\]"):
      tf.function(step)(tf.constant(grad))
  after = _snapshot(emb)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)
  assert int(emb.step.numpy()) == 0


# --- the protocol: one pending batch per replica (issue 22) ------------------------

IDS = [[1, 2], [3]]


def _ids():
  return {"f": tf.ragged.constant(IDS, tf.int64)}


def _ones():
  return {"f": tf.ones([2, 2])}


PROTOCOL_MISUSE = {
    "enqueue_twice": (
        lambda emb: (emb.enqueue(_ids()), emb.enqueue(_ids())),
        "enqueue() was called again before the batch enqueued before it was "
        "dequeued: a TPU queues batches, the emulator holds one per replica and "
        "would lose the first. Fix: call dequeue() (and apply_gradients() when "
        "training=True) after each enqueue()."),
    "dequeue_twice": (
        lambda emb: (emb.enqueue(_ids()), emb.dequeue(), emb.dequeue()),
        "dequeue() was called twice for one enqueued batch: on a TPU the second "
        "call waits for the next enqueue(). Fix: enqueue a batch before each "
        "dequeue(), or reuse the activations of the first call."),
    "dequeue_first": (
        lambda emb: emb.dequeue(),
        "dequeue() called before enqueue(). Fix: call enqueue(features) first, "
        "once per step, in the same function as dequeue()."),
    "apply_twice": (
        lambda emb: (emb.enqueue(_ids()), emb.dequeue(),
                     emb.apply_gradients(_ones()), emb.apply_gradients(_ones())),
        "apply_gradients() called before enqueue(). Fix: call enqueue(features) "
        "first, once per step, in the same function as apply_gradients()."),
    "apply_after_inference_batch": (
        lambda emb: (emb.enqueue(_ids(), training=False), emb.dequeue(),
                     emb.apply_gradients(_ones())),
        "apply_gradients() needs a batch enqueued with training=True. Fix: call "
        "enqueue(features, training=True) and dequeue() first."),
}


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("case", sorted(PROTOCOL_MISUSE))
def test_protocol_misuse_is_named_and_changes_nothing(case, mode):
  calls, message = PROTOCOL_MISUSE[case]
  emb = _single_table(api.Adagrad(0.1))
  before = _snapshot(emb)
  run = (lambda: calls(emb)) if mode == "eager" else tf.function(lambda: calls(emb))
  with pytest.raises(tee.InputError) as info:
    run()
  assert str(info.value) == message, str(info.value)
  after = _snapshot(emb)
  # Eagerly the first apply_gradients of "apply_twice" was a good step; a
  # trace that raised ran nothing.
  applied = case == "apply_twice" and mode == "eager"
  assert after["step"] == int(applied)
  if not applied:
    for key in before:
      np.testing.assert_array_equal(after[key], before[key], err_msg=key)


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_rejected_apply_gradients_keeps_the_batch_for_a_corrected_retry(mode):
  """Wrong shape, wrong structure, non-tensor and NaN gradients are rejected with
  tables, slots, step and the pending batch as they were; the retry applies the
  batch. Three steps against numpy Adagrad."""
  emb = _single_table(api.Adagrad(0.1))
  table = np.arange(12.).reshape(6, 2) / 10
  slots = references.initial_slots("adagrad", (6, 2))
  wrap = (lambda f: f) if mode == "eager" else tf.function
  bad = [({"f": tf.ones([3, 2])}, tee.InputError,
          "feature 'f' (table 't'): gradient shape [3, 2] does not match its "
          "activation shape [2, 2]."),
         ([tf.ones([2, 2])], tee.InputTypeError,
          "The two structures don't have the same nested structure. "
          "gradients do not match the feature config's structure"),
         ({"f": 1.0}, tee.InputError,
          "found non-tensor type: <class 'float'> at path f. "
          "feature 'f' (table 't'): gradient is a float, not a tf.Tensor.")]
  if mode == "eager":  # in a graph a NaN gradient fails when the step runs
    bad.append(({"f": tf.constant([[np.nan, 1.0], [1.0, 1.0]])}, tee.InputError,
                "table 't': gradient has NaN or Inf values; no table, slot or "
                "step was changed."))
  for step in range(3):
    ids = [[step % 6, (step + 1) % 6], [(step + 3) % 6]]
    grad = [[1.0 + step, -0.5], [0.25, 2.0 - step]]
    enqueue = wrap(lambda ids=ids: emb.enqueue(
        {"f": tf.ragged.constant(ids, tf.int64)}, training=True) or emb.dequeue())
    apply = wrap(lambda g: emb.apply_gradients(g))
    if mode == "eager":
      enqueue()
      for gradients, cls, message in bad:
        before = _snapshot(emb)
        with pytest.raises(cls) as info:
          apply(gradients)
        assert str(info.value).startswith(message), str(info.value)
        after = _snapshot(emb)
        for key in before:
          np.testing.assert_array_equal(after[key], before[key], err_msg=key)
      apply({"f": tf.constant(grad)})
    else:
      # A tf.function holds its own batches: the whole step is one function.
      def full(gradients, ids=ids):
        emb.enqueue({"f": tf.ragged.constant(ids, tf.int64)}, training=True)
        emb.dequeue()
        for g, cls, _ in bad:
          with pytest.raises(cls):
            emb.apply_gradients(g)
        emb.apply_gradients(gradients)
      tf.function(full)({"f": tf.constant(grad)})
    # numpy: per-id sums of the rows' gradients (sum combiner), one update each.
    references.train_step("adagrad", table, slots, [i for s in ids for i in s],
                          [g for s, g in zip(ids, grad) for _ in s], 0.1)
    np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy(), table,
                               rtol=1e-6)
    np.testing.assert_allclose(emb.variables["t"]["accumulators"].numpy(),
                               slots["accumulators"], rtol=1e-6)
    assert int(emb.step.numpy()) == step + 1


def test_a_dequeued_batch_may_be_replaced_and_its_step_is_skipped():
  """A training batch dequeued but never applied is dropped by the next enqueue
  (documented in emulation/protocol.py): the step does not advance."""
  emb = _single_table(api.SGD(0.1))
  emb.enqueue(_ids(), training=True)
  emb.dequeue()
  before = _snapshot(emb)
  emb.enqueue({"f": tf.ragged.constant([[0], [5]], tf.int64)}, training=True)
  acts = emb.dequeue()
  table = np.arange(12.).reshape(6, 2) / 10
  np.testing.assert_allclose(acts["f"], table[[0, 5]], rtol=1e-6)
  for key in before:
    np.testing.assert_array_equal(_snapshot(emb)[key], before[key], err_msg=key)
  emb.apply_gradients(_ones())
  table[[0, 5]] -= 0.1
  np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy(), table,
                             rtol=1e-6)
  assert int(emb.step.numpy()) == 1


def test_a_batch_enqueued_eagerly_is_not_used_by_a_tf_function():
  emb = _single_table(api.SGD(0.1))
  emb.enqueue(_ids(), training=True)
  with pytest.raises(tee.InputError, match=re.escape(
      "dequeue() called before enqueue() in this tf.function (a batch enqueued "
      "eagerly or in another tf.function cannot be used here).")):
    tf.function(emb.dequeue)()
  np.testing.assert_allclose(emb.dequeue()["f"], [[0.6, 0.8], [0.6, 0.7]], rtol=1e-6)


# --- weights that do not match their ids, in every mode (issue 22) ------------------

WEIGHT_MISMATCHES = {
    # ids [[1, 2], [3]] (ragged) or their sparse form
    "ragged_other_row_lengths": (
        "ragged", lambda: tf.ragged.constant([[1.0], [2.0, 3.0]]),
        r"weights have row lengths \[1, 2\] but ids \[2, 1\]"),
    "ragged_fewer_weights": (
        "ragged", lambda: tf.ragged.constant([[1.0], [2.0]]),
        r"weights have row lengths \[1, 1\] but ids \[2, 1\]"),
    "sparse_other_indices": (
        "sparse", lambda: tf.SparseTensor([[0, 0], [1, 0], [1, 1]], [1.0, 2.0, 3.0],
                                          [2, 2]),
        r"weights' indices do not match the ids' indices"),
    "sparse_more_weights": (
        "sparse", lambda: tf.SparseTensor([[0, 0], [0, 1], [1, 0], [1, 1]],
                                          [1.0, 2.0, 3.0, 4.0], [2, 2]),
        r"weights' indices do not match the ids' indices"),
}
_WEIGHTS_REST = re.escape(
    "weights do not match the ids (other row lengths, other indices, or another "
    "number of weights). Fix: give one weight per id, in the same rows (ragged) or "
    "at the same indices (sparse).")
WEIGHTS_MESSAGE = re.escape("feature 'f' (table 't'): ") + _WEIGHTS_REST
# tf.debugging.Assert prints its strings with quotes escaped.
GRAPH_WEIGHTS_MESSAGE = r"feature \\'f\\' \(table \\'t\\'\): " + _WEIGHTS_REST


def _weighted_ids(layout):
  ids = tf.ragged.constant(IDS, tf.int64)
  return ids if layout == "ragged" else ids.to_sparse()


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
@pytest.mark.parametrize("case", sorted(WEIGHT_MISMATCHES))
def test_weights_that_do_not_match_their_ids_raise_in_every_mode(case, mode):
  layout, make_weights, eager_message = WEIGHT_MISMATCHES[case]
  emb = _single_table(api.Adagrad(0.1))
  before = _snapshot(emb)

  def step(ids, weights):
    emb.enqueue({"f": ids}, {"f": weights}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"f": tf.ones_like(acts["f"])})
    return acts["f"]

  ids, weights = _weighted_ids(layout), make_weights()
  if mode == "eager":
    with pytest.raises(tee.InputError, match=eager_message):
      step(ids, weights)
    with pytest.raises(tee.InputError, match=eager_message):
      emb(dict(f=ids), dict(f=weights))
  elif mode == "tf_function":
    # Not TensorFlow's "Incompatible shapes": the feature is named.
    with pytest.raises(tf.errors.InvalidArgumentError, match=GRAPH_WEIGHTS_MESSAGE):
      tf.function(step)(ids, weights)
    with pytest.raises(tf.errors.InvalidArgumentError, match=GRAPH_WEIGHTS_MESSAGE):
      tf.function(lambda i, w: emb({"f": i}, {"f": w}))(ids, weights)
  else:
    acts = tf.function(step, jit_compile=True)(ids, weights)
    assert np.isnan(acts.numpy()).all()
    after = {k: v.numpy() for k, v in emb._variables["t"].items()}
    for key in ("parameters", "accumulators"):
      np.testing.assert_array_equal(after[key], before[f"t/{key}"], err_msg=key)
    with pytest.raises(tee.InputError, match="a step compiled with XLA was rejected "
                       "and changed nothing: " + WEIGHTS_MESSAGE):
      emb.variables  # pylint: disable=pointless-statement
  after = _snapshot(emb)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_static_weight_count_mismatch_is_named_when_traced():
  emb = _single_table(api.SGD(0.1))
  ids = tf.ragged.constant(IDS, tf.int64).to_sparse()
  weights = tf.SparseTensor([[0, 0], [0, 1]], [1.0, 2.0], [2, 2])
  with pytest.raises(tee.InputError, match=WEIGHTS_MESSAGE[:-2] + ".*found "
                     r"when the function was traced: indices of shape \[2, 2\] for "
                     r"ids of shape \[3, 2\]"):
    tf.function(lambda: emb({"f": ids}, {"f": weights}))()


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
def test_matching_weights_train_as_numpy_over_steps(mode):
  """The graph and XLA checks pass good weights through unchanged: 3 SGD steps."""
  emb = _single_table(api.SGD(0.1))
  table = np.arange(12.).reshape(6, 2) / 10

  def step(ids, weights):
    emb.enqueue({"f": ids}, {"f": weights}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"f": tf.ones_like(acts["f"])})
    return acts["f"]

  run = {"eager": step, "tf_function": tf.function(step),
         "xla": tf.function(step, jit_compile=True)}[mode]
  for t in range(3):
    w = [[0.5 + t, 2.0], [1.5]]
    acts = run(tf.ragged.constant(IDS, tf.int64), tf.ragged.constant(w))
    want = [w[0][0] * table[1] + w[0][1] * table[2], w[1][0] * table[3]]
    np.testing.assert_allclose(acts.numpy(), want, rtol=1e-6, atol=1e-7)
    for row, sample in enumerate(IDS):
      for i, wi in zip(sample, w[row]):
        table[i] -= 0.1 * wi
    np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy(), table,
                               rtol=1e-6, atol=1e-7)


# --- SparseTensor indices outside dense_shape, in every mode (issue 28) ---------

# ids [[1, 2], [3]] of a batch of 2 with one index moved outside dense_shape.
BAD_SPARSE = {
    "row_too_large": ([[0, 0], [0, 1], [5, 0]], [2, 3], 5,
                      "[2, 3] (index [5, 0]: 5 is not in [0, 2) in dimension 0)"),
    "row_negative": ([[0, 0], [0, 1], [-1, 0]], [2, 3], -1,
                     "[2, 3] (index [-1, 0]: -1 is not in [0, 2) in dimension 0)"),
    "position_too_large": ([[0, 0], [0, 4], [1, 0]], [2, 3], 4,
                           "[2, 3] (index [0, 4]: 4 is not in [0, 3) in dimension 1)"),
}
_SPARSE_REST = ("; its id would be looked up into, and trained by, another output "
                "row. Fix: build the SparseTensor with every index in "
                "[0, dense_shape) in its dimension")


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("case", sorted(BAD_SPARSE))
def test_sparse_indices_outside_dense_shape_are_named_in_every_mode(case, combiner,
                                                                    mode):
  """Before: eagerly and in tf.function TensorFlow's "rows[1] = 5 is not in
  [0, 2)" naming no feature; under XLA the id trained on another row's
  gradient and raise_if_failed() stayed silent."""
  indices, shape, value, detail = BAD_SPARSE[case]
  table = api.TableConfig(6, 2, combiner=combiner, name="t",
                          initializer=tf.constant_initializer(
                              np.arange(12.).reshape(6, 2) / 10))
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")}, api.Adagrad(0.1))
  good = tf.ragged.constant(IDS, tf.int64).to_sparse()
  bad = tf.SparseTensor(indices, tf.constant([1, 2, 3], tf.int64), shape)

  def step(ids):
    emb.enqueue({"f": ids}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"f": tf.ones_like(acts["f"])})
    return acts["f"]

  run = {"eager": step, "tf_function": tf.function(step),
         "xla": tf.function(step, jit_compile=True)}[mode]
  run(good)
  before = _snapshot(emb)
  head = (f"feature 'f' (table 't'): SparseTensor index {value} is outside the "
          "dense_shape of the ids")
  if mode == "eager":
    with pytest.raises(tee.InputError, match=re.escape(head + " " + detail + _SPARSE_REST)):
      run(bad)
    with pytest.raises(tee.InputError, match=re.escape(head)):
      emb({"f": bad})
  elif mode == "tf_function":
    graph_head = (r"feature \\'f\\' \(table \\'t\\'\): SparseTensor index \(below\) is "
                  r"outside the dense_shape of the ids;.*Index outside:\] \[" + str(value))
    with pytest.raises(tf.errors.InvalidArgumentError, match=graph_head):
      run(bad)
    with pytest.raises(tf.errors.InvalidArgumentError, match=graph_head):
      tf.function(lambda i: emb({"f": i}))(bad)
  else:
    acts = run(bad)
    assert np.isnan(acts.numpy()).all()
    after = {k: v.numpy() for k, v in emb._variables["t"].items()}
    for key in ("parameters", "accumulators"):
      np.testing.assert_array_equal(after[key], before[f"t/{key}"], err_msg=key)
    with pytest.raises(tee.InputError, match=re.escape(
        "a step compiled with XLA was rejected and changed nothing: " + head + _SPARSE_REST)):
      emb.raise_if_failed()
  after = _snapshot(emb)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)
  # The engine goes on: a good step after the rejected one trains as numpy.
  run(good)
  np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy(),
                             _adagrad_twice(combiner), rtol=1e-6)
  assert int(emb.step.numpy()) == 2


def _adagrad_twice(combiner):
  """Two Adagrad(0.1) steps of ids [[1, 2], [3]] with dL/dact = 1 (numpy)."""
  table = np.arange(12.).reshape(6, 2) / 10
  slots = references.initial_slots("adagrad", (6, 2))
  gain = {1: 1.0, 2: 1.0, 3: 1.0} if combiner == "sum" else {1: 0.5, 2: 0.5, 3: 1.0}
  for _ in range(2):
    references.train_step("adagrad", table, slots, list(gain),
                          [np.full(2, g) for g in gain.values()], 0.1)
  return table


# --- a callable learning rate out of range, in every mode (issue 28) -------------

_RATE_RULE = re.escape(
    "a rate must be a finite number in [0, 1e+06] (below 0 the step climbs the loss; "
    "above, one step moves a weight by lr * g and float32 overflows). No table, slot "
    "or step was changed.")


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
@pytest.mark.parametrize("bad", [-1.0, 1e30, float("nan")], ids=["negative", "1e30", "nan"])
def test_a_callable_learning_rate_out_of_range_changes_nothing(bad, mode):
  """Before: SGD(learning_rate=lambda: -1.0) climbed the loss and lambda: 1e30
  moved rows by 1e30, on both kernel paths. The rate is read each step: good,
  then bad (rejected: neither table changes), then good again."""
  rate = tf.Variable(0.1)
  tables = [api.TableConfig(6, 2, name=n, initializer=tf.constant_initializer(
      np.arange(12.).reshape(6, 2) / 10)) for n in ("a", "b")]
  tables[1] = api.TableConfig(6, 2, name="b", optimizer=api.SGD(0.5),
                              initializer=tables[1].initializer)
  emb = tee.CPUEmbedding({"x": api.FeatureConfig(tables[0], name="x"),
                          "y": api.FeatureConfig(tables[1], name="y")},
                         api.SGD(learning_rate=lambda: rate.read_value()))

  def step():
    emb.enqueue({"x": tf.constant([1, 2]), "y": tf.constant([3, 3])}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(tf.ones_like, acts))

  run = {"eager": step, "tf_function": tf.function(step),
         "xla": tf.function(step, jit_compile=True)}[mode]
  run()
  before = _snapshot(emb)
  rate.assign(bad)
  shown = {-1.0: "-1", 1e30: "1e+30"}.get(bad, "nan")
  eager_message = (re.escape(f"table 'a': its learning-rate callable gave {shown} "
                             "this step; ") + _RATE_RULE)
  if mode == "eager":
    with pytest.raises(tee.InputError, match=eager_message):
      run()
  elif mode == "tf_function":
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="a learning-rate callable gave a rate out of range this "
                       r"step; .*Tables and rates:\] \[table \\'a\\'\] \[" + re.escape(shown)):
      run()
  else:
    run()
    with pytest.raises(tee.InputError, match="a step compiled with XLA was rejected "
                       "and changed nothing: " + eager_message):
      emb.raise_if_failed()
  after = _snapshot(emb)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)
  rate.assign(0.2)
  run()
  a = np.arange(12.).reshape(6, 2) / 10
  a[[1, 2]] -= 0.1 + 0.2  # two accepted steps: rates 0.1 and 0.2, gradient 1
  b = np.arange(12.).reshape(6, 2) / 10
  b[3] -= 2 * 0.5 * 2  # two steps of SGD(0.5), id 3 twice a step
  np.testing.assert_allclose(emb.variables["a"]["parameters"].numpy(), a, rtol=1e-6,
                             atol=1e-7)
  np.testing.assert_allclose(emb.variables["b"]["parameters"].numpy(), b, rtol=1e-6,
                             atol=1e-7)
  assert int(emb.step.numpy()) == 2


# --- a Keras schedule object as an optimizer's learning_rate (issue 28) ----------

@pytest.mark.parametrize("kind", ["tf_optimizer", "our_spec"])
@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_a_keras_schedule_as_learning_rate_follows_the_engine_step(kind, mode):
  """Before: TypeError "missing 1 required positional argument: 'step'" at the
  first apply_gradients. Now bound to the engine's step, as a spec's schedules:
  the rate at table step t is the schedule's value at t (numpy formula)."""
  import keras  # pylint: disable=g-import-not-at-top
  schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)
  opt = (api.Adagrad(learning_rate=schedule) if kind == "tf_optimizer"
         else tee.optimizers.Adagrad(learning_rate=schedule))
  table = api.TableConfig(6, 2, name="t", initializer=tf.zeros_initializer())
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")}, opt)

  def step():
    emb.enqueue({"f": tf.constant([1, 4])}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"f": tf.ones_like(acts["f"])})

  run = tf.function(step) if mode == "tf_function" else step
  want, slots = np.zeros(2), references.initial_slots("adagrad", 2)
  for t in range(4):
    run()
    want, slots = references.update("adagrad", want, slots, np.ones(2),
                                    0.1 * 0.5 ** (t / 2))
    np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy()[[1, 4]],
                               [want, want], rtol=1e-6)


def test_a_keras_schedule_out_of_range_is_refused_naming_the_table():
  import keras  # pylint: disable=g-import-not-at-top
  schedule = keras.optimizers.schedules.InverseTimeDecay(0.1, 10, decay_rate=-0.5)
  table = api.TableConfig(6, 2, name="t")
  with pytest.raises(tee.ConfigError, match=re.escape(
      "table 't'.learning_rate: InverseTimeDecay gives the learning rate inf at "
      "step 20;")):
    tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")},
                     api.SGD(learning_rate=schedule))


def test_tables_larger_than_memory_are_refused_by_build_naming_the_table(monkeypatch):
  """Before: ResourceExhaustedError from build() naming no table (2^40 rows)."""
  from tpu_embed_ext.host import memory as host_memory  # pylint: disable=g-import-not-at-top
  huge = api.TableConfig(2 ** 40, 8, name="huge")
  small = api.TableConfig(6, 2, name="small")
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(huge, name="f"),
                          "g": api.FeatureConfig(small, name="g")}, api.Adagrad(0.1))
  with pytest.raises(host_memory.MemoryLimitError, match=re.escape(
      "table 'huge' (1,099,511,627,776 x 8, 1 slot(s)) needs 65,536.0 GiB (float32), "
      "and all tables and slots 65,536.0 GiB, but this machine has ")):
    emb.build()
  assert emb._variables is None  # pylint: disable=protected-access
  # The bound is what the machine has: 6 x 2 x 4 bytes x 2 = 96 bytes.
  monkeypatch.setattr(host_memory, "available_memory", lambda: 95)
  with pytest.raises(host_memory.MemoryLimitError, match=re.escape(
      "table 'small' (6 x 2, 1 slot(s)) needs 0.0 GiB")):
    tee.CPUEmbedding({"g": api.FeatureConfig(small, name="g")}, api.Adagrad(0.1)).build()
  monkeypatch.setattr(host_memory, "available_memory", lambda: 96)
  tee.CPUEmbedding({"g": api.FeatureConfig(small, name="g")}, api.Adagrad(0.1)).build()


# --- inputs named as the inputs they are (issue 28) -------------------------------

_BIG = 2 ** 63 + 5
INPUT_CASES = {
    # Before: "id -9223372036854775803 is out of range" (the uint64 read as int64).
    "uint64_id_of_2_63_or_more": (
        lambda: tf.constant(np.array([[1], [_BIG]], np.uint64)), None,
        f"feature 'f' (table 't'): id {_BIG} is out of range [0, 6).",
        r"feature \\'f\\' \(table \\'t\\'\): ids must be in \[0, 6\)\..*Largest id:\] "
        rf"\[{_BIG}\]"),
    # Before: "table 't': gradient has NaN or Inf values" (blamed on the gradient).
    "nan_weight": (
        lambda: tf.ragged.constant(IDS, tf.int64),
        lambda: tf.ragged.constant([[1.0, np.nan], [1.0]]),
        "feature 'f' (table 't'): weights have NaN or Inf values; no table, slot or "
        "step was changed.",
        r"feature \\'f\\' \(table \\'t\\'\): weights have NaN or Inf values"),
    "inf_weight_sparse": (
        lambda: tf.ragged.constant(IDS, tf.int64).to_sparse(),
        lambda: tf.ragged.constant([[1.0, 2.0], [np.inf]]).to_sparse(),
        "feature 'f' (table 't'): weights have NaN or Inf values; no table, slot or "
        "step was changed.",
        r"feature \\'f\\' \(table \\'t\\'\): weights have NaN or Inf values"),
}


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
@pytest.mark.parametrize("case", sorted(INPUT_CASES))
def test_bad_inputs_are_named_as_inputs_in_every_mode(case, mode):
  make_ids, make_weights, message, graph_message = INPUT_CASES[case]
  emb = _single_table(api.Adagrad(0.1))
  before = _snapshot(emb)

  def step(ids, weights=None):
    emb.enqueue({"f": ids}, None if weights is None else {"f": weights},
                training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"f": tf.ones_like(acts["f"])})
    return acts["f"]

  args = [make_ids()] + ([make_weights()] if make_weights else [])
  if mode == "eager":
    with pytest.raises(tee.InputError, match=re.escape(message)):
      step(*args)
  elif mode == "tf_function":
    with pytest.raises(tf.errors.InvalidArgumentError, match=graph_message):
      tf.function(step)(*args)
  else:
    acts = tf.function(step, jit_compile=True)(*args)
    assert np.isnan(acts.numpy()).all()
    with pytest.raises(tee.InputError, match=re.escape(
        "a step compiled with XLA was rejected and changed nothing: " + message)):
      emb.raise_if_failed()
  after = _snapshot(emb)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_uint64_ids_below_2_63_train_as_int64_ids():
  emb = _single_table(api.SGD(0.1))
  emb.enqueue({"f": tf.constant(np.array([[1], [5]], np.uint64))}, training=True)
  emb.apply_gradients(tf.nest.map_structure(tf.ones_like, emb.dequeue()))
  want = np.arange(12.).reshape(6, 2) / 10
  want[[1, 5]] -= 0.1
  np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy(), want, rtol=1e-6)


@pytest.mark.parametrize("features,weights,message", [
    ({"f": [1, 2]}, None,
     "The two structures don't have the same nested structure. "
     "features entry 'f' is a Python list, but each feature takes one tf.Tensor, "
     "tf.SparseTensor or tf.RaggedTensor. Fix: convert it, e.g. tf.constant(ids, "
     "tf.int64) for one id per row, or tf.ragged.constant(ids, tf.int64) for several."),
    ([1, 2], None,
     "The two structures don't have the same nested structure. "
     "features do not match the feature config's structure: missing ['f'], unexpected "
     "['0', '1'] (the feature config is a dict, features a list)."),
    ({"f": tf.ragged.constant(IDS, tf.int64)}, {"f": tf.ragged.constant([["a", "b"], ["c"]])},
     "feature 'f' (table 't'): weights must be numbers, got dtype string. Fix: give "
     "float32 weights (tf.strings.to_number(weights) for strings)."),
], ids=["python_list_ids", "python_list_features", "string_weights"])
def test_inputs_of_the_wrong_kind_say_what_was_given(features, weights, message):
  """Before: "unexpected ['f/0', 'f/1']"; string weights: TensorFlow's "Cast
  string to float is not supported"."""
  emb = _single_table(api.SGD(0.1))
  for call in (lambda: emb.enqueue(features, weights, training=True),
               lambda: tf.function(lambda: emb(features, weights))()):
    with pytest.raises(tee.InputError) as info:
      call()
    assert str(info.value).startswith(message), str(info.value)
