"""XLA (jit_compile=True): the same values as without XLA, checks included.

XLA drops assertions and clamps out-of-range gathers, so under XLA a failed
check cannot stop the step: the step then writes nothing, the bad feature's
activations are NaN, and the InputError is raised at the next eager call.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests import test_engine_contract as contract
from tests import fixed_head_model as fh
from tests import references

api = tf.tpu.experimental.embedding


def jit_train(engine):
  """The contract's 10-step loop, compiled with XLA."""
  original = contract.tf.function
  contract.tf.function = lambda fn, **kw: original(fn, jit_compile=True, **kw)
  try:
    contract.train(engine, use_function=True)
  finally:
    contract.tf.function = original


# XLA compiles each of the 10 batch shapes (30-100 s a case on 2 cores), so
# one optimizer with state, options on; test_xla_optimizers covers the rest.
@pytest.mark.parametrize("optimizer_name,options_name", [("adam", "decay")])
def test_xla_training_matches_reference(optimizer_name, options_name):
  row, options = contract.OPTIMIZERS[optimizer_name], contract.OPTIONS[options_name]
  engine = contract.build_engine(row, options)
  jit_train(engine)
  contract.assert_matches_reference(engine, row, options, atol=2e-5)


LENGTHS = [3, 2, 4, 1]  # fixed, so XLA compiles the step once


@pytest.mark.parametrize("name", sorted(contract.OPTIMIZERS))
def test_xla_optimizers_over_ten_steps(name):
  """Every optimizer row, 10 steps with duplicate ids, against numpy."""
  row = contract.OPTIMIZERS[name]
  o = references.hparams(row.reference, **row.hparams)
  init = np.random.RandomState(3).uniform(-1, 1, (10, 3))
  table = api.TableConfig(10, 3, name="t", combiner="sum",
                          initializer=tf.constant_initializer(init))
  engine = tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")},
                            row.tf_class(learning_rate=0.1, **row.hparams))

  @tf.function(jit_compile=True)
  def step(ids, c):
    engine.enqueue({"f": ids}, training=True)
    with tf.GradientTape() as tape:
      acts = engine.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(acts["f"] ** 2) / 2 + tf.reduce_sum(c * acts["f"])
    engine.apply_gradients(tape.gradient(loss, acts))

  E = init.copy()
  S = {s: np.full(E.shape, v) for s, v in row.slots.items()}
  for t in range(10):
    rng = np.random.RandomState(t)
    ids = [list(rng.randint(0, 5, n)) for n in LENGTHS]
    c = rng.uniform(-1, 1, (len(LENGTHS), 3))
    step(tf.ragged.constant(ids, tf.int64), tf.constant(c, tf.float32))
    acts = np.stack([E[r].sum(0) for r in ids])
    g = {}
    for b, r in enumerate(ids):
      for i in r:
        g[i] = g.get(i, 0) + acts[b] + c[b]
    for i, gi in g.items():
      E[i], slots = references.REFERENCES[row.reference].rule(
          E[i], {s: S[s][i] for s in S}, gi, 0.1, o)
      for s, v in slots.items():
        S[s][i] = v
  np.testing.assert_allclose(engine.variables["t"]["parameters"].numpy(), E,
                             rtol=2e-5, atol=2e-6)
  for s in S:
    np.testing.assert_allclose(engine.variables["t"][s].numpy(), S[s],
                               rtol=2e-5, atol=2e-6, err_msg=s)


def _one_table_engine(optimizer=None):
  table = api.TableConfig(6, 2, name="t", initializer=tf.constant_initializer(
      np.arange(12.).reshape(6, 2)))
  return tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")},
                          optimizer or api.Adam(0.1))


def _jit_step(engine):
  @tf.function(jit_compile=True)
  def step(ids, scale=tf.constant(1.0)):
    engine.enqueue({"f": ids}, training=True)
    with tf.GradientTape() as tape:
      acts = engine.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(acts["f"]) * scale
    engine.apply_gradients(tape.gradient(loss, acts))
    return acts["f"]
  return step


def _table_t_as_stored(engine):
  """Table 't' and its slots as stored (``variables`` would raise a failed step)."""
  return {k: v.numpy().copy() for k, v in engine._variables["t"].items()}


# Ids out of range under XLA: tests/test_engine_input_checks.py (which owns
# that message).
@pytest.mark.parametrize("ids,scale,message", [
    ([[1, 2], [3]], np.inf, "table 't': gradient has NaN or Inf values"),
    ([[1, 2], [3]], 3e38, "table 't': the update would write NaN or Inf into "
     "its velocities"),
], ids=["inf_gradient", "overflowing_update"])
def test_xla_rejected_step_changes_nothing_and_raises_at_next_eager_call(
    ids, scale, message):
  engine = _one_table_engine()
  step = _jit_step(engine)
  step(tf.ragged.constant([[1, 2], [3]], tf.int64))  # a good step first
  before, step_before = _table_t_as_stored(engine), int(engine.step.numpy())
  acts = step(tf.ragged.constant(ids, tf.int64), tf.constant(scale, tf.float32))
  assert np.isfinite(acts.numpy()).all()  # the lookup was good
  after = {k: v.numpy() for k, v in engine._variables["t"].items()}
  for name in before:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)
  assert int(engine.step.numpy()) == step_before
  with pytest.raises(tee.InputError, match="a step compiled with XLA was "
                     "rejected and changed nothing: " + message.replace(
                         "(", r"\(").replace(")", r"\)").replace("[", r"\[")):
    engine.variables  # pylint: disable=pointless-statement
  engine.variables  # raised once; the engine goes on  # pylint: disable=pointless-statement
  step(tf.ragged.constant([[1, 2], [3]], tf.int64))
  assert int(engine.step.numpy()) == step_before + 1


def test_xla_refuses_what_it_cannot_emulate_exactly():
  engine = _one_table_engine(api.Adagrad(0.1, use_gradient_accumulation=False))
  with pytest.raises(tee.ConfigError, match=r"table 't': use_gradient_accumulation"
                     r"=False cannot be compiled with XLA by the emulator"):
    _jit_step(engine)(tf.ragged.constant([[1, 1]], tf.int64))


def test_model_fit_with_jit_compile_equals_without(no_op_determinism):
  del no_op_determinism
  results = []
  for jit in (False, True):
    model = fh.FixedHead(fh.feature_config())
    model.compile(optimizer=keras.optimizers.Adam(0.5), jit_compile=jit,
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    assert model.jit_compile is jit  # Keras kept XLA on for this model
    for features, label in fh.batches():
      model.train_on_batch(features, label)
    results.append((fh.tables(model.embedding.embedding),
                    int(model.embedding.step.numpy())))
  (eager_tables, eager_step), (jit_tables, jit_step) = results
  assert eager_step == jit_step == fh.STEPS
  for table, slots in eager_tables.items():
    for name, value in slots.items():
      np.testing.assert_allclose(jit_tables[table][name], value, rtol=1e-5,
                                 atol=1e-6, err_msg=f"{table}/{name}")
