"""Weights that do not match their ids (row lengths, indices, counts, weights on
dense ids) are refused naming the feature in every mode; matching weights train
as numpy."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests.builders import (SINGLE_TABLE_VALUES, TWO_SAMPLE_IDS, assert_same_state,
                            engine_state, single_table_engine)

api = tf.tpu.experimental.embedding


def test_weights_on_dense_ids_and_mismatched_layout():
  emb = single_table_engine(api.SGD(0.1))
  with pytest.raises(tee.InputError, match="weights were given for a dense id tensor"):
    emb({"f": tf.constant([1])}, {"f": tf.constant([1.0])})
  with pytest.raises(tee.InputError, match=WEIGHTS_MESSAGE):
    emb({"f": tf.ragged.constant([[1, 2]], tf.int64)},
        {"f": tf.ragged.constant([[1.0], [2.0]])})


# --- weights that do not match their ids, in every mode ---------------------------

_WEIGHTS_REST = re.escape(
    "weights do not match the ids (other row lengths, other indices, or another "
    "number of weights). Fix: give one weight per id, in the same rows (ragged) or "
    "at the same indices (sparse).")
WEIGHTS_MESSAGE = re.escape("feature 'f' (table 't'): ") + _WEIGHTS_REST
# tf.debugging.Assert prints its strings with quotes escaped.
GRAPH_WEIGHTS_MESSAGE = r"feature \\'f\\' \(table \\'t\\'\): " + _WEIGHTS_REST
# One wording in every mode (eagerly it named the row lengths until issue 35).
WEIGHT_MISMATCHES = {
    # ids [[1, 2], [3]] (ragged) or their sparse form
    "ragged_other_row_lengths": (
        "ragged", lambda: tf.ragged.constant([[1.0], [2.0, 3.0]]), WEIGHTS_MESSAGE),
    "ragged_fewer_weights": (
        "ragged", lambda: tf.ragged.constant([[1.0], [2.0]]), WEIGHTS_MESSAGE),
    "sparse_other_indices": (
        "sparse", lambda: tf.SparseTensor([[0, 0], [1, 0], [1, 1]], [1.0, 2.0, 3.0],
                                          [2, 2]), WEIGHTS_MESSAGE),
    "sparse_more_weights": (
        "sparse", lambda: tf.SparseTensor([[0, 0], [0, 1], [1, 0], [1, 1]],
                                          [1.0, 2.0, 3.0, 4.0], [2, 2]), WEIGHTS_MESSAGE),
}


def _weighted_ids(layout):
  ids = tf.ragged.constant(TWO_SAMPLE_IDS, tf.int64)
  return ids if layout == "ragged" else ids.to_sparse()


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
@pytest.mark.parametrize("case", sorted(WEIGHT_MISMATCHES))
def test_weights_that_do_not_match_their_ids_raise_in_every_mode(case, mode):
  layout, make_weights, eager_message = WEIGHT_MISMATCHES[case]
  emb = single_table_engine(api.Adagrad(0.1))
  before = engine_state(emb)

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
  assert_same_state(engine_state(emb), before)


def test_static_weight_count_mismatch_is_named_when_traced():
  emb = single_table_engine(api.SGD(0.1))
  ids = tf.ragged.constant(TWO_SAMPLE_IDS, tf.int64).to_sparse()
  weights = tf.SparseTensor([[0, 0], [0, 1]], [1.0, 2.0], [2, 2])
  with pytest.raises(tee.InputError, match=WEIGHTS_MESSAGE[:-2] + ".*found "
                     r"when the function was traced: indices of shape \[2, 2\] for "
                     r"ids of shape \[3, 2\]"):
    tf.function(lambda: emb({"f": ids}, {"f": weights}))()


@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
def test_matching_weights_train_as_numpy_over_steps(mode):
  """The graph and XLA checks pass good weights through unchanged: 3 SGD steps."""
  emb = single_table_engine(api.SGD(0.1))
  table = SINGLE_TABLE_VALUES.copy()

  def step(ids, weights):
    emb.enqueue({"f": ids}, {"f": weights}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"f": tf.ones_like(acts["f"])})
    return acts["f"]

  run = {"eager": step, "tf_function": tf.function(step),
         "xla": tf.function(step, jit_compile=True)}[mode]
  for t in range(3):
    w = [[0.5 + t, 2.0], [1.5]]
    acts = run(tf.ragged.constant(TWO_SAMPLE_IDS, tf.int64), tf.ragged.constant(w))
    want = [w[0][0] * table[1] + w[0][1] * table[2], w[1][0] * table[3]]
    np.testing.assert_allclose(acts.numpy(), want, rtol=1e-6, atol=1e-7)
    for row, sample in enumerate(TWO_SAMPLE_IDS):
      for i, wi in zip(sample, w[row]):
        table[i] -= 0.1 * wi
    np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy(), table,
                               rtol=1e-6, atol=1e-7)


