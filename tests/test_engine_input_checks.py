"""Ids and features the engine refuses, eagerly, in tf.function and under XLA:
ids out of the vocabulary (this file owns that message), SparseTensor indices
outside dense_shape, ids of the wrong kind or layout, non-finite weights. Each
names the feature and its table and changes no table, slot or step."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests.builders import (in_graph, SINGLE_TABLE_VALUES, TWO_SAMPLE_IDS, assert_same_state,
                            engine_state, single_table_engine, train_step)
from tests import references

api = tf.tpu.experimental.embedding


# --- ids out of the vocabulary: the one place that pins this message ----------

@pytest.mark.parametrize("ids,message", [
    ([[9]],
     "feature 'f' (table 't'): id 9 is out of range [0, 6). Fix: map ids into the "
     "vocabulary (e.g. hash them modulo 6) or enlarge vocabulary_size."),
    ([[-1]], "feature 'f' (table 't'): id -1 is out of range [0, 6)."),
], ids=["too_large", "negative"])
def test_out_of_range_ids_change_nothing(ids, message):
  emb = single_table_engine(api.Adam(0.1))
  train_step(emb, [[1, 2]], [[1.0, 1.0]])
  before = engine_state(emb)
  with pytest.raises(tee.InputError) as info:
    train_step(emb, ids, [[1.0, 1.0]])
  assert str(info.value).startswith(message), str(info.value)
  assert_same_state(engine_state(emb), before)


def test_out_of_range_ids_fail_inside_tf_function_before_any_write():
  emb = single_table_engine(api.SGD(0.1))
  before = engine_state(emb)

  @tf.function
  def step(ids):
    emb.enqueue({"f": ids}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(tf.ones_like, acts))

  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=in_graph(
                         "[feature 'f' (table 't'): id 6 is out of range [0, 6). Fix: map "
                         "ids into the vocabulary (e.g. hash them modulo 6) or enlarge "
                         "vocabulary_size.]")):
    step(tf.ragged.constant([[1], [6]], tf.int64))
  assert_same_state(engine_state(emb), before)


@pytest.mark.parametrize("ids,message", [
    ([[1, 9], [2]], "feature 'f' (table 't'): id 9 is out of range [0, 6)."),
    ([[-1], [2]], "feature 'f' (table 't'): id -1 is out of range [0, 6)."),
], ids=["too_large", "negative"])
def test_out_of_range_ids_under_xla_change_nothing_and_raise_at_the_next_eager_call(
    ids, message):
  """XLA clamps out-of-range gathers: the step writes nothing, the feature's
  activations are NaN, and the next eager call raises the eager message."""
  emb = single_table_engine(api.Adam(0.1))

  @tf.function(jit_compile=True)
  def step(ids):
    emb.enqueue({"f": ids}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(tf.ones_like, acts))
    return acts["f"]

  step(tf.ragged.constant(TWO_SAMPLE_IDS, tf.int64))  # a good step first
  before = engine_state(emb)
  acts = step(tf.ragged.constant(ids, tf.int64))
  assert np.isnan(acts.numpy()).all()
  for key in ("parameters", "momenta", "velocities"):
    np.testing.assert_array_equal(emb._variables["t"][key].numpy(),  # pylint: disable=protected-access
                                  before[f"t/{key}"], err_msg=key)
  with pytest.raises(tee.InputError, match=re.escape(
      "a step compiled with XLA was rejected and changed nothing: " + message)):
    emb.raise_if_failed()
  assert_same_state(engine_state(emb), before)
  step(tf.ragged.constant(TWO_SAMPLE_IDS, tf.int64))  # the engine goes on
  assert int(emb.step.numpy()) == 2


# --- features of the wrong structure, dtype or layout ---------------------------

@pytest.mark.parametrize("features,message", [
    ({"g": tf.constant([1])}, "features do not match the feature config's structure"),
    ({"f": tf.constant([1.5])},
     "feature 'f' (table 't'): ids must be integers, got dtype float32."),
    ({"f": tf.ragged.constant([[[1]]], tf.int64, ragged_rank=2)},
     "feature 'f' (table 't'): ragged ids must have rank 2"),
], ids=["unknown_key", "float_ids", "ragged_rank_3"])
def test_bad_features_are_named(features, message):
  emb = single_table_engine(api.SGD(0.1))
  with pytest.raises(tee.InputError) as info:
    emb.enqueue(features, training=True)
  assert message in str(info.value)


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
  before = engine_state(emb)
  with pytest.raises(tee.InputError) as info:
    emb.apply_gradients({"other": acts["s"]})
  assert str(info.value).startswith(
      "The two structures don't have the same nested structure. "
      "gradients do not match the feature config's structure: missing ['s'], "
      "unexpected ['other']. Fix: pass one gradient per feature")
  assert_same_state(engine_state(emb), before)


# --- SparseTensor indices outside dense_shape, in every mode ------------------

# ids [[1, 2], [3]] of a batch of 2 with one index moved outside dense_shape.
BAD_SPARSE = {
    "row_too_large": ([[0, 0], [0, 1], [5, 0]], [2, 3], 5,
                      "(5 is not in [0, 2) in dimension 0)"),
    "row_negative": ([[0, 0], [0, 1], [-1, 0]], [2, 3], -1,
                     "(-1 is not in [0, 2) in dimension 0)"),
    "position_too_large": ([[0, 0], [0, 4], [1, 0]], [2, 3], 4,
                           "(4 is not in [0, 3) in dimension 1)"),
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
  gradient and raise_if_failed() stayed silent. One message in every mode."""
  indices, shape, value, detail = BAD_SPARSE[case]
  table = api.TableConfig(6, 2, combiner=combiner, name="t",
                          initializer=tf.constant_initializer(
                              SINGLE_TABLE_VALUES.copy()))
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")}, api.Adagrad(0.1))
  good = tf.ragged.constant(TWO_SAMPLE_IDS, tf.int64).to_sparse()
  bad = tf.SparseTensor(indices, tf.constant([1, 2, 3], tf.int64), shape)

  def step(ids):
    emb.enqueue({"f": ids}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"f": tf.ones_like(acts["f"])})
    return acts["f"]

  run = {"eager": step, "tf_function": tf.function(step),
         "xla": tf.function(step, jit_compile=True)}[mode]
  run(good)
  before = engine_state(emb)
  head = (f"feature 'f' (table 't'): SparseTensor index {value} is outside the "
          "dense_shape of the ids")
  if mode == "eager":
    with pytest.raises(tee.InputError, match=re.escape(head + " " + detail + _SPARSE_REST)):
      run(bad)
    with pytest.raises(tee.InputError, match=re.escape(head)):
      emb({"f": bad})
  elif mode == "tf_function":
    graph_head = in_graph(head + " " + detail + _SPARSE_REST)
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
        "a step compiled with XLA was rejected and changed nothing: " + head + " " +
        detail + _SPARSE_REST)):
      emb.raise_if_failed()
  assert_same_state(engine_state(emb), before)
  # The engine goes on: a good step after the rejected one trains as numpy.
  run(good)
  np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy(),
                             _adagrad_twice(combiner), rtol=1e-6)
  assert int(emb.step.numpy()) == 2


def _adagrad_twice(combiner):
  """Two Adagrad(0.1) steps of ids [[1, 2], [3]] with dL/dact = 1 (numpy)."""
  table = SINGLE_TABLE_VALUES.copy()
  slots = references.initial_slots("adagrad", (6, 2))
  gain = {1: 1.0, 2: 1.0, 3: 1.0} if combiner == "sum" else {1: 0.5, 2: 0.5, 3: 1.0}
  for _ in range(2):
    references.train_step("adagrad", table, slots, list(gain),
                          [np.full(2, g) for g in gain.values()], 0.1)
  return table


# --- inputs named as the inputs they are: uint64 ids, non-finite weights, kinds --

_BIG = 2 ** 63 + 5
INPUT_CASES = {
    # Before: "id -9223372036854775803 is out of range" (the uint64 read as int64).
    "uint64_id_of_2_63_or_more": (
        lambda: tf.constant(np.array([[1], [_BIG]], np.uint64)), None,
        f"feature 'f' (table 't'): id {_BIG} is out of range [0, 6).",
        in_graph(f"feature 'f' (table 't'): id {_BIG} is out of range [0, 6).")),
    # Before: "table 't': gradient has NaN or Inf values" (blamed on the gradient).
    "nan_weight": (
        lambda: tf.ragged.constant(TWO_SAMPLE_IDS, tf.int64),
        lambda: tf.ragged.constant([[1.0, np.nan], [1.0]]),
        "feature 'f' (table 't'): weights have NaN or Inf values; no table, slot or "
        "step was changed.",
        r"feature \\'f\\' \(table \\'t\\'\): weights have NaN or Inf values"),
    "inf_weight_sparse": (
        lambda: tf.ragged.constant(TWO_SAMPLE_IDS, tf.int64).to_sparse(),
        lambda: tf.ragged.constant([[1.0, 2.0], [np.inf]]).to_sparse(),
        "feature 'f' (table 't'): weights have NaN or Inf values; no table, slot or "
        "step was changed.",
        r"feature \\'f\\' \(table \\'t\\'\): weights have NaN or Inf values"),
}


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
@pytest.mark.parametrize("case", sorted(INPUT_CASES))
def test_bad_inputs_are_named_as_inputs_in_every_mode(case, mode):
  make_ids, make_weights, message, graph_message = INPUT_CASES[case]
  emb = single_table_engine(api.Adagrad(0.1))
  before = engine_state(emb)

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
  assert_same_state(engine_state(emb), before)


def test_uint64_ids_below_2_63_train_as_int64_ids():
  emb = single_table_engine(api.SGD(0.1))
  emb.enqueue({"f": tf.constant(np.array([[1], [5]], np.uint64))}, training=True)
  emb.apply_gradients(tf.nest.map_structure(tf.ones_like, emb.dequeue()))
  want = SINGLE_TABLE_VALUES.copy()
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
    ({"f": tf.ragged.constant(TWO_SAMPLE_IDS, tf.int64)}, {"f": tf.ragged.constant([["a", "b"], ["c"]])},
     "feature 'f' (table 't'): weights must be numbers, got dtype string. Fix: give "
     "float32 weights (tf.strings.to_number(weights) for strings)."),
], ids=["python_list_ids", "python_list_features", "string_weights"])
def test_inputs_of_the_wrong_kind_say_what_was_given(features, weights, message):
  """Before: "unexpected ['f/0', 'f/1']"; string weights: TensorFlow's "Cast
  string to float is not supported"."""
  emb = single_table_engine(api.SGD(0.1))
  for call in (lambda: emb.enqueue(features, weights, training=True),
               lambda: tf.function(lambda: emb(features, weights))()):
    with pytest.raises(tee.InputError) as info:
      call()
    assert str(info.value).startswith(message), str(info.value)
