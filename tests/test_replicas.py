"""Several replicas: MirroredStrategy over logical CPU devices.

The TPU sums the per-id gradients of all replicas and updates every touched id
once per step, on one copy of each table (docs/semantics.md, section 0).
Here that is checked against TensorFlow's TPU goldens at R = 2 and R = 8,
against the numpy contract reference over 10 steps at R = 2, and with ids
that only one replica sees.
"""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests import test_engine, test_engine_contract as contract

api = tf.tpu.experimental.embedding


def mirrored(replicas):
  if len(tf.config.list_logical_devices("CPU")) < replicas:
    pytest.fail(f"needs {replicas} logical CPU devices (tests/conftest.py)")
  return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])


def distribute(strategy, per_replica):
  """A distributed value whose replica r holds per_replica[r]."""
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: per_replica[ctx.replica_id_in_sync_group])


# --- TensorFlow's one-step TPU scenario, fed per replica ----------------------

def _scenario(optimizer, replicas):
  strategy = mirrored(replicas)
  with strategy.scope():
    emb = tee.CPUEmbedding(*test_engine._scenario_config(optimizer))
  # Upstream's data: 2 samples per replica, the 4-sample block repeated.
  per_replica = []
  for r in range(replicas):
    rows = slice(2 * (r % 2), 2 * (r % 2) + 2)
    per_replica.append({k: tf.ragged.constant(v[rows], tf.int64)
                        for k, v in test_engine.DATA.items()})
  features = distribute(strategy, per_replica)

  @tf.function
  def step():
    emb.enqueue(features, training=True)

    def replica_step():
      with tf.GradientTape() as tape:
        acts = emb.dequeue()
        tape.watch(acts)
        # Upstream's loss: mean over the replica's batch, divided by R.
        loss = tf.add_n([tf.reduce_sum(a * a) / 2 for a in acts.values()]) / replicas
      emb.apply_gradients(tape.gradient(loss, acts))
      return acts
    return strategy.run(replica_step)

  return emb, strategy, step()


@pytest.mark.parametrize("replicas", [2, 8])
@pytest.mark.parametrize("name", sorted(test_engine.GOLDENS))
def test_tensorflow_tpu_goldens_per_replica(name, replicas):
  optimizer, update = test_engine.GOLDENS[name]
  emb, strategy, acts = _scenario(optimizer, replicas)
  video, user = test_engine._expected(update)
  np.testing.assert_allclose(emb.variables["video"]["parameters"].numpy(), video,
                             rtol=1e-5)
  np.testing.assert_allclose(emb.variables["user"]["parameters"].numpy(), user,
                             rtol=1e-5)
  assert int(emb.step.numpy()) == 1
  # Forward goldens of core 0 (and every even core, which has the same data).
  core0 = {k: strategy.experimental_local_results(v)[0] for k, v in acts.items()}
  np.testing.assert_array_equal(core0["watched"], [[0, 1, 2, 3], [4, 6, 8, 10]])
  np.testing.assert_array_equal(core0["favorited"], [[4, 6, 8, 10], [4, 5, 6, 7]])
  np.testing.assert_array_equal(core0["friends"], [[6, 7], [2, 3]])


def test_one_copy_of_every_table_and_slot():
  emb, strategy, _ = _scenario(api.Adagrad(0.1), 2)
  for variables in emb.variables.values():
    for var in variables.values():
      assert type(var).__name__ == "ResourceVariable", var
  assert type(emb.step).__name__ == "ResourceVariable"


# --- the multi-step contract at R = 2 ----------------------------------------

def _inputs(raw, weights, rows):
  """TF inputs of a subset of the batch's rows (contract layouts)."""
  features, tf_weights = {}, {}
  for name, (_, _, layout) in contract.FEATURES.items():
    part = [raw[name][b] for b in rows]
    if layout == "dense":
      features[name] = tf.constant([r[0] for r in part], tf.int64)
    else:
      ragged = tf.ragged.constant(part, tf.int64, ragged_rank=1)
      features[name] = ragged.to_sparse() if layout == "sparse" else ragged
    tf_weights[name] = (tf.ragged.constant([weights[name][b] for b in rows],
                                           tf.float32, ragged_rank=1)
                        if name in contract.WEIGHTED else None)
  return features, tf_weights


def train_replicated(engine, strategy, replicas, use_function):
  per = contract.BATCH // replicas

  def step(features, weights, constant):
    engine.enqueue(features, weights, training=True)

    def replica_step(constant):
      with tf.GradientTape() as tape:
        acts = engine.dequeue()
        tape.watch(acts)
        loss = tf.add_n([tf.reduce_sum(a * a) / 2 + tf.reduce_sum(constant[n] * a)
                         for n, a in acts.items()])
      engine.apply_gradients(tape.gradient(loss, acts))
    strategy.run(replica_step, args=(constant,))

  if use_function:
    # reduce_retracing: few traces for the batches' varying ragged shapes.
    step = tf.function(step, reduce_retracing=True)
  for t in range(contract.STEPS):
    _, _, raw, weights = contract.make_batch(t)
    rng = np.random.RandomState(500 + t)
    constant = {}
    for n, (table, m, _) in contract.FEATURES.items():
      dim = contract.TABLES[table][1]
      constant[n] = rng.uniform(-1, 1, (contract.BATCH, m, dim) if m else
                                (contract.BATCH, dim)).astype(np.float32)
    parts = [_inputs(raw, weights, range(r * per, (r + 1) * per))
             for r in range(replicas)]
    step(distribute(strategy, [p[0] for p in parts]),
         distribute(strategy, [p[1] for p in parts]),
         distribute(strategy, [{n: c[r * per:(r + 1) * per]
                                for n, c in constant.items()}
                               for r in range(replicas)]))


# Every optimizer and option eagerly (strategy.run in threads); a few traced,
# which costs ~10 s each under MirroredStrategy.
CONTRACT_CASES = [
    (opt, options, False) for opt in sorted(contract.OPTIMIZERS)
    for options in sorted(contract.OPTIONS)] + [
    ("sgd", "plain", True), ("adam", "clipping", True),
    ("ftrl", "decay_times_lr", True)]


@pytest.mark.parametrize("optimizer_name,options_name,use_function", CONTRACT_CASES)
def test_contract_at_two_replicas(optimizer_name, options_name, use_function):
  row, options = contract.OPTIMIZERS[optimizer_name], contract.OPTIONS[options_name]
  strategy = mirrored(2)
  with strategy.scope():
    engine = contract.build_engine(row, options)
  train_replicated(engine, strategy, 2, use_function)
  want_tables, want_slots = contract.reference_run(row, options)
  assert int(engine.step.numpy()) == contract.STEPS
  for table in contract.TABLES:
    np.testing.assert_allclose(
        engine.variables[table]["parameters"].numpy(), want_tables[table],
        rtol=2e-5, atol=2e-6, err_msg=f"{table}/parameters")
    for slot in row.slots:
      np.testing.assert_allclose(
          engine.variables[table][slot].numpy(), want_slots[table][slot],
          rtol=2e-5, atol=2e-6, err_msg=f"{table}/{slot}")
