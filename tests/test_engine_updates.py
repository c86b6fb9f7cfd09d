"""CPUEmbedding's updates beyond one plain step: optimizer modes (no gradient
accumulation, lazy and dense Adam, SparseCore's clipping), None gradients, empty
batches, and learning rates from callables and Keras schedules, each step
against numpy."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests.builders import (SINGLE_TABLE_VALUES, assert_same_state, engine_state,
                            single_table_engine, train_step)
from tests import references

api = tf.tpu.experimental.embedding


# --- optimizer modes ---------------------------------------------------------

def test_without_gradient_accumulation_duplicates_update_in_rounds():
  emb = single_table_engine(api.Adagrad(0.5, use_gradient_accumulation=False))
  # id 1 occurs twice (rows 0 and 1): two sequential Adagrad steps on it.
  train_step(emb, [[1], [1, 2]], [[1.0, 2.0], [3.0, -1.0]])
  w0 = SINGLE_TABLE_VALUES.copy()
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
  lazy = single_table_engine(api.Adam(0.1))
  dense = single_table_engine(api.Adam(0.1, lazy_adam=False))
  for emb in (lazy, dense):
    train_step(emb, [[0]], [[1.0, 1.0]])
    train_step(emb, [[1]], [[1.0, 1.0]])
  w0 = SINGLE_TABLE_VALUES.astype(np.float32)
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
  v1, v2 = single_table_engine(optimizer), single_table_engine(optimizer, engine="v2")
  for emb in (v1, v2):
    train_step(emb, [[3]], [[-2.0, 2.0]])
  w3 = np.array([0.6, 0.7])
  np.testing.assert_allclose(v1.variables["t"]["parameters"][3],
                             np.minimum(w3 - np.clip([-2.0, 2.0], -0.5, 0.5), 0.0))
  np.testing.assert_allclose(v2.variables["t"]["parameters"][3], w3 - [-2.0, 2.0])
  with pytest.raises(tee.ConfigError) as info:
    single_table_engine(api.SGD(0.1, weight_decay_factor=0.1), engine="v2")
  assert str(info.value) == (
      "table 't': weight_decay_factor=0.1 is rejected by TPUEmbeddingV2 (SparseCore). "
      'Fix: remove weight decay, or emulate TPUEmbedding with engine="v1".')


# --- gradients that move nothing: None, an empty batch ----------------------------

def test_none_gradient_is_a_zero_gradient_on_touched_rows():
  emb = single_table_engine(api.Adam(0.1))
  train_step(emb, [[0]], [[1.0, 1.0]])
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


def test_empty_batch_is_a_valid_no_op():
  emb = single_table_engine(api.Adagrad(0.1))
  before = engine_state(emb)
  emb.enqueue({"f": tf.ragged.constant([[], []], tf.int64)}, training=True)
  acts = emb.dequeue()
  np.testing.assert_array_equal(acts["f"], np.zeros((2, 2)))
  emb.apply_gradients({"f": tf.ones([2, 2])})
  after = engine_state(emb)
  assert after.pop("step") == 1 and before.pop("step") == 0
  assert_same_state(after, before)


# --- a callable learning rate out of range, in every mode ----------------------

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
      SINGLE_TABLE_VALUES.copy())) for n in ("a", "b")]
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
  before = engine_state(emb)
  rate.assign(bad)
  shown = {-1.0: "-1", 1e30: "1e+30"}.get(bad, "nan")
  eager_message = (re.escape(f"table 'a': its learning-rate callable gave {shown} "
                             "this step; ") + _RATE_RULE)
  if mode == "eager":
    with pytest.raises(tee.InputError, match=eager_message):
      run()
  elif mode == "tf_function":
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=eager_message.replace("'", r"\\'")):
      run()
  else:
    run()
    with pytest.raises(tee.InputError, match="a step compiled with XLA was rejected "
                       "and changed nothing: " + eager_message):
      emb.raise_if_failed()
  assert_same_state(engine_state(emb), before)
  rate.assign(0.2)
  run()
  a = SINGLE_TABLE_VALUES.copy()
  a[[1, 2]] -= 0.1 + 0.2  # two accepted steps: rates 0.1 and 0.2, gradient 1
  b = SINGLE_TABLE_VALUES.copy()
  b[3] -= 2 * 0.5 * 2  # two steps of SGD(0.5), id 3 twice a step
  np.testing.assert_allclose(emb.variables["a"]["parameters"].numpy(), a, rtol=1e-6,
                             atol=1e-7)
  np.testing.assert_allclose(emb.variables["b"]["parameters"].numpy(), b, rtol=1e-6,
                             atol=1e-7)
  assert int(emb.step.numpy()) == 2


# --- a Keras schedule object as an optimizer's learning_rate -------------------

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


