"""The engine's protocol: enqueue, dequeue, apply_gradients, one pending batch
per replica. Misuse is named and changes nothing; a rejected apply_gradients
keeps its batch for a corrected retry."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests.builders import (SINGLE_TABLE_VALUES, assert_same_state, engine_state,
                            single_table_engine, two_sample_ids)
from tests import references

api = tf.tpu.experimental.embedding


def _ones():
  return {"f": tf.ones([2, 2])}


PROTOCOL_MISUSE = {
    "enqueue_twice": (
        lambda emb: (emb.enqueue(two_sample_ids()), emb.enqueue(two_sample_ids())),
        "enqueue() was called again before the batch enqueued before it was "
        "dequeued: a TPU queues batches, the emulator holds one per replica and "
        "would lose the first. Fix: call dequeue() (and apply_gradients() when "
        "training=True) after each enqueue()."),
    "dequeue_twice": (
        lambda emb: (emb.enqueue(two_sample_ids()), emb.dequeue(), emb.dequeue()),
        "dequeue() was called twice for one enqueued batch: on a TPU the second "
        "call waits for the next enqueue(). Fix: enqueue a batch before each "
        "dequeue(), or reuse the activations of the first call."),
    "dequeue_first": (
        lambda emb: emb.dequeue(),
        "dequeue() called before enqueue(). Fix: call enqueue(features) first, "
        "once per step, in the same function as dequeue()."),
    "apply_twice": (
        lambda emb: (emb.enqueue(two_sample_ids()), emb.dequeue(),
                     emb.apply_gradients(_ones()), emb.apply_gradients(_ones())),
        "apply_gradients() called before enqueue(). Fix: call enqueue(features) "
        "first, once per step, in the same function as apply_gradients()."),
    "apply_after_inference_batch": (
        lambda emb: (emb.enqueue(two_sample_ids(), training=False), emb.dequeue(),
                     emb.apply_gradients(_ones())),
        "apply_gradients() needs a batch enqueued with training=True. Fix: call "
        "enqueue(features, training=True) and dequeue() first."),
}


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("case", sorted(PROTOCOL_MISUSE))
def test_protocol_misuse_is_named_and_changes_nothing(case, mode):
  calls, message = PROTOCOL_MISUSE[case]
  emb = single_table_engine(api.Adagrad(0.1))
  before = engine_state(emb)
  run = (lambda: calls(emb)) if mode == "eager" else tf.function(lambda: calls(emb))
  with pytest.raises(tee.InputError) as info:
    run()
  assert str(info.value) == message, str(info.value)
  after = engine_state(emb)
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
  emb = single_table_engine(api.Adagrad(0.1))
  table = SINGLE_TABLE_VALUES.copy()
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
        before = engine_state(emb)
        with pytest.raises(cls) as info:
          apply(gradients)
        assert str(info.value).startswith(message), str(info.value)
        assert_same_state(engine_state(emb), before)
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
  emb = single_table_engine(api.SGD(0.1))
  emb.enqueue(two_sample_ids(), training=True)
  emb.dequeue()
  before = engine_state(emb)
  emb.enqueue({"f": tf.ragged.constant([[0], [5]], tf.int64)}, training=True)
  acts = emb.dequeue()
  table = SINGLE_TABLE_VALUES.copy()
  np.testing.assert_allclose(acts["f"], table[[0, 5]], rtol=1e-6)
  for key in before:
    np.testing.assert_array_equal(engine_state(emb)[key], before[key], err_msg=key)
  emb.apply_gradients(_ones())
  table[[0, 5]] -= 0.1
  np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy(), table,
                             rtol=1e-6)
  assert int(emb.step.numpy()) == 1


def test_a_batch_enqueued_eagerly_is_not_used_by_a_tf_function():
  emb = single_table_engine(api.SGD(0.1))
  emb.enqueue(two_sample_ids(), training=True)
  with pytest.raises(tee.InputError, match=re.escape(
      "dequeue() called before enqueue() in this tf.function (a batch enqueued "
      "eagerly or in another tf.function cannot be used here).")):
    tf.function(emb.dequeue)()
  np.testing.assert_allclose(emb.dequeue()["f"], [[0.6, 0.8], [0.6, 0.7]], rtol=1e-6)


