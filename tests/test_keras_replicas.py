"""model.fit with EmbeddingLayer under MirroredStrategy equals one device.

Keras divides each replica's loss by the number of replicas, so the summed
per-replica gradients are the global batch's gradient; the engine sums the
replicas' per-id gradients and applies them once. Tables, slots, the table
step and the dense weights must then equal one device on the same global
batches, over 10 steps.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests import ranker_model as rk
from tests.builders import mirrored_strategy


def _train(strategy):
  with strategy.scope():
    model = rk.Ranker()
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
  model.fit(rk.dataset(), epochs=1, verbose=0)
  tables = {f"{t}/{k}": v.numpy()
            for t, slots in model.embedding.variables_by_table.items()
            for k, v in slots.items()}
  dense = [w.numpy() for w in model.head.weights]
  return tables, int(model.embedding.step.numpy()), dense


@pytest.fixture(scope="module")
def one_device():
  return _train(tf.distribute.get_strategy())


@pytest.mark.parametrize("replicas", [2, 4])
def test_fit_under_mirrored_strategy_equals_one_device(one_device, replicas):
  tables, step, dense = _train(mirrored_strategy(replicas))
  want_tables, want_step, want_dense = one_device
  assert step == want_step == rk.STEPS
  for name, value in want_tables.items():
    np.testing.assert_allclose(tables[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  for got, want in zip(dense, want_dense):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_xla_around_several_replicas_is_refused_with_the_fix(no_op_determinism):
  """TensorFlow cannot compile several CPU devices in one XLA cluster."""
  del no_op_determinism
  strategy = mirrored_strategy(2)
  with strategy.scope():
    model = rk.Ranker()
    model.compile(optimizer=keras.optimizers.SGD(0.5), jit_compile=True,
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
  assert model.jit_compile
  with pytest.raises(tee.ConfigError, match=(
      r"XLA \(jit_compile=True\) around 2 MirroredStrategy replicas cannot run on "
      r"CPU: .* Fix: emulate the replicas with jit_compile=False, or compile one "
      r"device with jit_compile=True")):
    model.fit(rk.dataset(), epochs=1, verbose=0)
  assert int(model.embedding.step.numpy()) == 0
