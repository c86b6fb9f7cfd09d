"""Gradients the engine refuses: NaN or Inf values, a wrong shape, per-id sums
that overflow, and updates that would write NaN or Inf. Each names the table,
eagerly and in tf.function, and changes no table, slot or step."""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests.builders import in_graph, assert_same_state, engine_state, single_table_engine, train_step

api = tf.tpu.experimental.embedding


# --- non-finite or misshapen gradients ------------------------------------------

@pytest.mark.parametrize("ids,grad,message", [
    ([[1]], [[np.nan, 1.0]],
     "table 't': gradient has NaN or Inf values; no table, slot or step was changed."),
    ([[1]], [[1.0, 1.0], [2.0, 2.0]],
     "feature 'f' (table 't'): gradient shape [2, 2] does not match its activation "
     "shape [1, 2]."),
], ids=["nan_gradient", "gradient_shape"])
def test_rejected_gradient_changes_nothing(ids, grad, message):
  emb = single_table_engine(api.Adam(0.1))
  train_step(emb, [[1, 2]], [[1.0, 1.0]])
  before = engine_state(emb)
  with pytest.raises(tee.InputError) as info:
    train_step(emb, ids, grad)
  assert str(info.value).startswith(message), str(info.value)
  assert_same_state(engine_state(emb), before)


def test_non_finite_gradient_fails_inside_tf_function_naming_the_table():
  tables = [api.TableConfig(6, 2, initializer=tf.ones_initializer(), name=n)
            for n in ("a", "b")]
  emb = tee.CPUEmbedding({"x": api.FeatureConfig(tables[0]),
                          "y": api.FeatureConfig(tables[1])}, api.Adagrad(0.1))
  before = engine_state(emb)

  @tf.function
  def step(grad_b):
    emb.enqueue({"x": tf.constant([1, 2]), "y": tf.constant([3, 3])}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"x": tf.ones_like(acts["x"]), "y": grad_b})

  # Two finite contributions whose per-id sum overflows are rejected too.
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=in_graph("[table 'b': gradient has NaN or Inf values; no "
                                     "table, slot or step was changed. Fix: ")):
    step(tf.fill([2, 2], 3e38))
  assert_same_state(engine_state(emb), before)


# --- an update that would overflow is rejected like a non-finite gradient -------

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
  before = engine_state(emb)

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
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
      tf.function(step)(tf.constant(grad))
  assert_same_state(engine_state(emb), before)
  assert int(emb.step.numpy()) == 0


