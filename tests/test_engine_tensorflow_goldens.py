"""CPUEmbedding against TensorFlow's one-step TPU test scenario (docs/semantics.md):
the forward activations of core 0 and each optimizer's table after one step."""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests.builders import SCENARIO_IDS, scenario_features_by_name
from tests import references

api = tf.tpu.experimental.embedding
REPLICAS = 2


def _scenario_step(optimizer):
  """The global batch (2 samples x R replicas) in one step; loss / R as TF does."""
  emb = tee.CPUEmbedding(scenario_features_by_name(), optimizer)
  features = {k: tf.ragged.constant(v * (REPLICAS // 2), tf.int64)
              for k, v in SCENARIO_IDS.items()}
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
