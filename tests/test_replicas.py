"""Several replicas: MirroredStrategy over logical CPU devices.

The TPU sums the per-id gradients of all replicas and updates every touched id
once per step, on one copy of each table (docs/semantics.md, replicas).
Here that is checked against TensorFlow's TPU goldens at R = 2 and R = 8,
against the numpy contract reference over 10 steps at R = 2, and with ids
that only one replica sees.
"""

import functools
import re

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests import test_engine_contract as contract
from tests import test_engine_tensorflow_goldens as goldens
from tests.builders import SCENARIO_IDS, scenario_features_by_name
from tests.builders import mirrored_strategy
from tests import references

api = tf.tpu.experimental.embedding


def distribute(strategy, per_replica):
  """A distributed value whose replica r holds per_replica[r]."""
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: per_replica[ctx.replica_id_in_sync_group])


# --- TensorFlow's one-step TPU scenario, fed per replica ----------------------

def _scenario(optimizer, replicas):
  strategy = mirrored_strategy(replicas)
  with strategy.scope():
    emb = tee.CPUEmbedding(scenario_features_by_name(), optimizer)
  # Upstream's data: 2 samples per replica, the 4-sample block repeated.
  per_replica = []
  for r in range(replicas):
    rows = slice(2 * (r % 2), 2 * (r % 2) + 2)
    per_replica.append({k: tf.ragged.constant(v[rows], tf.int64)
                        for k, v in SCENARIO_IDS.items()})
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
@pytest.mark.parametrize("name", sorted(goldens.GOLDENS))
def test_tensorflow_tpu_goldens_per_replica(name, replicas):
  optimizer, update = goldens.GOLDENS[name]
  emb, strategy, acts = _scenario(optimizer, replicas)
  video, user = goldens._expected(update)
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

    strategy.run(contract.train_dequeued, args=(engine, constant))

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
  strategy = mirrored_strategy(2)
  with strategy.scope():
    engine = contract.build_engine(row, options)
  train_replicated(engine, strategy, 2, use_function)
  contract.assert_matches_reference(engine, row, options)


# --- ids seen by one replica, ids seen by several: a spec with overrides ------

SPEC = {
    "optimizer": {"type": "adagrad", "learning_rate": "decay",
                  "initial_accumulator_value": 0.2},
    "schedules": {"decay": {"class": "ExponentialDecay", "initial_learning_rate": 0.2,
                            "decay_steps": 3, "decay_rate": 0.7}},
    "tables": {
        "ada": {"vocabulary_size": 12, "dim": 3, "combiner": "sum"},
        "sgd_t": {"vocabulary_size": 12, "dim": 3, "combiner": "sum"},
        "mom": {"vocabulary_size": 12, "dim": 3, "combiner": "sum", "optimizer": {
            "type": "adagrad_momentum", "learning_rate": 0.1, "momentum": 0.9,
            "use_nesterov": True, "exponent": 3.0, "beta2": 0.9, "epsilon": 0.1}},
        "adam_t": {"vocabulary_size": 12, "dim": 3, "combiner": "sum", "optimizer": {
            "type": "adam", "learning_rate": "decay", "beta_1": 0.8, "beta_2": 0.95,
            "epsilon": 1e-3}},
        "ftrl_t": {"vocabulary_size": 12, "dim": 3, "combiner": "sum", "optimizer": {
            "type": "ftrl", "learning_rate": 0.1, "l1_regularization_strength": 0.01,
            "l2_regularization_strength": 0.02, "beta": 0.1,
            "initial_accumulator_value": 0.1}},
    },
    "overrides": [{"match": "sgd_*", "optimizer": {
        "type": "sgd", "learning_rate": "decay", "clip_weight_min": -0.6,
        "clip_weight_max": 0.6}}],
    "features": {f"f_{t}": {"table": t} for t in
                 ("ada", "sgd_t", "mom", "adam_t", "ftrl_t")},
}
# table: (optimizer in tests/references.py, hyperparameters, slots and their
# initial values)
RULES = {
    "ada": ("adagrad", {}, {"accumulators": 0.2}),
    "sgd_t": ("sgd", {}, {}),
    "mom": ("adagrad_momentum",
            {"momentum": 0.9, "use_nesterov": True, "exponent": 3.0, "beta2": 0.9,
             "epsilon": 0.1}, {"accumulators": 0.0, "momenta": 0.0}),
    "adam_t": ("adam", {"beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-3,
                        "sum_inside_sqrt": True},
               {"momenta": 0.0, "velocities": 0.0}),
    "ftrl_t": ("ftrl", {"learning_rate_power": -0.5,
                        "l1_regularization_strength": 0.01,
                        "l2_regularization_strength": 0.02, "beta": 0.1,
                        "multiply_linear_by_learning_rate": False},
               {"accumulators": 0.1, "linears": 0.0}),
}
SCHEDULED = {"ada", "sgd_t", "adam_t"}
PER_REPLICA = 3


def _replica_ids(rng, replica):
  """Ids 0-3 go to both replicas; 4-7 only to replica 0; 8-11 only to 1."""
  own = list(range(4, 8)) if replica == 0 else list(range(8, 12))
  pool = list(range(4)) + own
  return [list(rng.choice(pool, rng.randint(1, 4))) for _ in range(PER_REPLICA)]


def test_ids_in_one_or_several_replicas_are_updated_once_with_the_summed_gradient():
  strategy = mirrored_strategy(2)
  with strategy.scope():
    engine = tee.CPUEmbedding(tee.EmbeddingSpec.from_dict(SPEC))
  E, S = {}, {}
  for i, (table, (_, _, slots)) in enumerate(sorted(RULES.items())):
    E[table] = np.random.RandomState(i).uniform(-0.5, 0.5, (12, 3))
    engine.variables[table]["parameters"].assign(E[table])
    S[table] = {s: np.full((12, 3), v) for s, v in slots.items()}

  for t in range(10):
    rng = np.random.RandomState(t)
    ids = {f"f_{table}": [_replica_ids(rng, r) for r in range(2)] for table in RULES}
    constant = {n: rng.uniform(-1, 1, (2, PER_REPLICA, 3)) for n in ids}
    engine.enqueue(distribute(strategy, [
        {n: tf.ragged.constant(v[r], tf.int64) for n, v in ids.items()}
        for r in range(2)]), training=True)
    strategy.run(contract.train_dequeued, args=(engine, distribute(strategy, [
        {n: tf.constant(c[r], tf.float32) for n, c in constant.items()}
        for r in range(2)]),))
    # numpy: per-id sums over both replicas, one update per touched id.
    lr_decay = 0.2 * 0.7 ** (t / 3)
    for table, (optimizer, hparams, _) in RULES.items():
      name = f"f_{table}"
      grads = {}
      for r in range(2):
        for b, sample in enumerate(ids[name][r]):
          act = E[table][sample].sum(0)
          for i in sample:
            grads[i] = grads.get(i, 0) + act + constant[name][r, b]
      lr = lr_decay if table in SCHEDULED else 0.1
      for i, g in grads.items():
        w, slots = references.update(
            optimizer, E[table][i], {s: S[table][s][i] for s in S[table]}, g, lr,
            **hparams)
        E[table][i] = np.clip(w, -0.6, 0.6) if table == "sgd_t" else w
        for s, v in slots.items():
          S[table][s][i] = v
  assert int(engine.step.numpy()) == 10
  for table in RULES:
    np.testing.assert_allclose(engine.variables[table]["parameters"].numpy(),
                               E[table], rtol=2e-5, atol=2e-6, err_msg=table)
    for s in S[table]:
      np.testing.assert_allclose(engine.variables[table][s].numpy(), S[table][s],
                                 rtol=2e-5, atol=2e-6, err_msg=f"{table}/{s}")


# --- checkpoints cross between strategies ------------------------------------

def _step_on(engine, strategy, replicas, batch):
  """One SGD-loss step of the global ``batch`` split over ``replicas``."""
  per = len(batch) // replicas
  parts = [{"watched": tf.ragged.constant(batch[r * per:(r + 1) * per], tf.int64)}
           for r in range(replicas)]

  def replica_step():
    with tf.GradientTape() as tape:
      acts = engine.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(acts["watched"] ** 2)
    engine.apply_gradients(tape.gradient(loss, acts))

  if strategy is None:
    engine.enqueue(parts[0], training=True)
    replica_step()
  else:
    engine.enqueue(distribute(strategy, parts), training=True)
    strategy.run(replica_step)


def _video_engine(strategy=None):
  table = api.TableConfig(8, 4, name="video", combiner="mean",
                          initializer=tf.constant_initializer(
                              np.arange(32.).reshape(8, 4) / 10))
  config = {"watched": api.FeatureConfig(table, name="watched")}
  if strategy is None:
    return tee.CPUEmbedding(config, api.Adam(0.1))
  with strategy.scope():
    return tee.CPUEmbedding(config, api.Adam(0.1))


BATCH_A = [[0, 1], [1], [2, 3, 3], [5]]
BATCH_B = [[4], [0, 4], [7], [1, 2]]


@pytest.mark.parametrize("save_replicas,restore_replicas", [(2, 1), (1, 2)])
def test_checkpoints_cross_between_strategies(tmp_path, save_replicas,
                                              restore_replicas):
  def make(replicas):
    strategy = mirrored_strategy(replicas) if replicas > 1 else None
    return _video_engine(strategy), strategy

  saved, saved_strategy = make(save_replicas)
  _step_on(saved, saved_strategy, save_replicas, BATCH_A)
  path = tf.train.Checkpoint(embedding=saved).save(str(tmp_path / "ckpt"))
  restored, restored_strategy = make(restore_replicas)
  restored.build()
  tf.train.Checkpoint(embedding=restored).restore(path).assert_consumed()
  for name in ("parameters", "momenta", "velocities"):
    np.testing.assert_array_equal(restored.variables["video"][name].numpy(),
                                  saved.variables["video"][name].numpy())
  _step_on(saved, saved_strategy, save_replicas, BATCH_B)
  _step_on(restored, restored_strategy, restore_replicas, BATCH_B)
  for name in ("parameters", "momenta", "velocities"):
    np.testing.assert_allclose(restored.variables["video"][name].numpy(),
                               saved.variables["video"][name].numpy(), rtol=1e-6)


def test_a_strategy_that_cannot_be_emulated_is_named():
  strategy = tf.distribute.experimental.CentralStorageStrategy()
  with strategy.scope(), pytest.raises(
      tee.ConfigError, match=r"CPUEmbedding cannot emulate the TPU engine under "
      r"CentralStorageStrategy: .* Supported: the default strategy, "
      r"OneDeviceStrategy, MirroredStrategy or MultiWorkerMirroredStrategy"):
    _video_engine()


def test_one_device_strategy():
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  engine = _video_engine(strategy)
  reference = _video_engine()
  for batch in (BATCH_A, BATCH_B):
    _step_on(engine, strategy, 1, batch)
    _step_on(reference, None, 1, batch)
  np.testing.assert_array_equal(engine.variables["video"]["parameters"].numpy(),
                                reference.variables["video"]["parameters"].numpy())
  assert int(engine.step.numpy()) == 2


# --- per-device enqueue --------------------------------------------------------

def _per_device_batches(replicas, step):
  """Replica r's ragged batch of step ``step`` (2 samples, ids 0-7)."""
  rng = np.random.RandomState(100 * step + replicas)
  return [{"watched": tf.ragged.constant(
      [list(rng.randint(0, 8, rng.randint(1, 4))) for _ in range(2)], tf.int64)}
      for _ in range(replicas)]


# api.Adam(0.1)'s hyperparameters, for the contract's numpy rule.
ADAM = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "sum_inside_sqrt": True}


@pytest.mark.parametrize("replicas", [2, 4])
def test_enqueue_per_device_equals_the_per_replica_path(replicas):
  """valid_input_test.test_enqueue_per_device: each replica's batch enqueued
  with device=strategy.extended.worker_devices[i] (inside
  experimental_distribute_values_from_function, as upstream does) gives the
  activations and updates of the distributed-values path, and both equal
  numpy (Adam, mean combiner) over 3 steps."""
  strategy = mirrored_strategy(replicas)
  per_replica, per_device = _video_engine(strategy), _video_engine(strategy)

  def replica_step(engine):
    with tf.GradientTape() as tape:
      acts = engine.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(acts["watched"] ** 2)
    engine.apply_gradients(tape.gradient(loss, acts))
    return acts["watched"]

  @tf.function
  def step_distributed(features):
    per_replica.enqueue(features, training=True)
    return strategy.run(replica_step, args=(per_replica,))

  @tf.function
  def step_per_device(batches):
    def enqueue_fn(ctx):
      i = ctx.replica_id_in_sync_group
      per_device.enqueue(batches[i], training=True,
                         device=strategy.extended.worker_devices[i])
      return 0.0
    strategy.experimental_distribute_values_from_function(enqueue_fn)
    return strategy.run(replica_step, args=(per_device,))

  table = np.arange(32.).reshape(8, 4) / 10
  m, v = np.zeros_like(table), np.zeros_like(table)
  for t in range(3):
    batches = _per_device_batches(replicas, t)
    a = strategy.experimental_local_results(
        step_distributed(distribute(strategy, batches)))
    b = strategy.experimental_local_results(step_per_device(batches))
    grads = {}
    for r, batch in enumerate(batches):
      rows = batch["watched"].to_list()
      want = np.array([table[row].mean(0) for row in rows])
      np.testing.assert_allclose(a[r], want, rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(b[r], a[r])
      for row, act in zip(rows, want):
        for i in row:  # d(sum act^2)/d act = 2 act, spread by the mean
          grads[i] = grads.get(i, 0) + 2 * act / len(row)
    for i, g in grads.items():  # lazy TPU Adam: touched rows only
      table[i], slots = references.update(
          "adam", table[i], {"momenta": m[i], "velocities": v[i]}, g, 0.1, **ADAM)
      m[i], v[i] = slots["momenta"], slots["velocities"]
    for engine in (per_replica, per_device):
      np.testing.assert_allclose(engine.variables["video"]["parameters"].numpy(),
                                 table, rtol=1e-5, atol=1e-6)
  for name in ("parameters", "momenta", "velocities"):
    np.testing.assert_array_equal(per_device.variables["video"][name].numpy(),
                                  per_replica.variables["video"][name].numpy())
  assert int(per_device.step.numpy()) == 3


def test_per_device_enqueue_errors_name_the_device():
  strategy = mirrored_strategy(2)
  engine = _video_engine(strategy)
  batches = _per_device_batches(2, 0)
  devices = list(strategy.extended.worker_devices)
  with pytest.raises(tee.InputError, match=re.escape(
      f"enqueue(device='/cpu:5') names no replica of MirroredStrategy: its "
      f"replicas' devices are {devices}. Fix: pass "
      "strategy.extended.worker_devices[i] for replica i's batch, or distributed "
      "values without device=.")):
    engine.enqueue(batches[0], device="/cpu:5")
  with pytest.raises(tee.InputError, match=re.escape(
      "enqueue(device='/cpu:1') was given distributed values. Fix: pass one "
      "replica's values with device=")):
    engine.enqueue(distribute(strategy, batches), device="/cpu:1")
  with pytest.raises(tee.InputError, match=re.escape(
      "enqueue() outside strategy.run got 1 batch(es) for 2 replicas. Fix: pass "
      "distributed values (strategy.experimental_distribute_dataset(...)), one "
      "replica's values with device=strategy.extended.worker_devices[i], or call "
      "enqueue inside strategy.run with each replica's batch.")):
    engine.enqueue(batches[0])
  # Eagerly, device names accepted in any spelling of the same device.
  engine.enqueue(batches[1], device="/cpu:1", training=False)
  engine.enqueue(batches[0], device=devices[0], training=False)
  acts = strategy.experimental_local_results(strategy.run(engine.dequeue))
  table = np.arange(32.).reshape(8, 4) / 10
  for r in range(2):
    np.testing.assert_allclose(
        acts[r]["watched"],
        [table[row].mean(0) for row in batches[r]["watched"].to_list()], rtol=1e-6)


def _assert_one_adam_step(engine, before, batches):
  """numpy: one Adam step (lr 0.1, ADAM) of table 'video' from all replicas'
  rows of mean-combined ids (``batches``: each replica's rows), each
  activation's gradient 1."""
  grads = {}
  for rows in batches:
    for row in rows:
      for i in row:
        grads[i] = grads.get(i, 0) + 1.0 / len(row)
  table = before.astype(np.float64)
  for i, g in grads.items():
    table[i], _ = references.update(
        "adam", table[i], {"momenta": 0.0, "velocities": 0.0}, g, 0.1, **ADAM)
  np.testing.assert_allclose(engine.variables["video"]["parameters"].numpy(), table,
                             rtol=1e-5)


# --- the protocol under MirroredStrategy(2) ---------------------------------------

def test_protocol_misuse_and_retry_under_two_replicas():
  strategy = mirrored_strategy(2)
  engine = _video_engine(strategy)
  batches = _per_device_batches(2, 1)
  engine.enqueue(distribute(strategy, batches), training=True)
  with pytest.raises(tee.InputError, match=re.escape(
      "enqueue() was called again (replica 0) before the batch enqueued before it "
      "was dequeued")):
    engine.enqueue(distribute(strategy, batches), training=True)
  with pytest.raises(tee.InputError, match=re.escape(
      "apply_gradients() was called outside strategy.run under MirroredStrategy "
      "with 2 replicas.")):
    engine.apply_gradients({"watched": tf.ones([2, 4])})
  before = {k: v.numpy() for k, v in engine.variables["video"].items()}

  def bad_step():
    acts = engine.dequeue()
    engine.apply_gradients({"watched": tf.ones([3, 4])})  # wrong shape
    return acts["watched"]

  with pytest.raises(tee.InputError, match=re.escape(
      "feature 'watched' (table 'video'): gradient shape [3, 4] does not match its "
      "activation shape [2, 4].")):
    strategy.run(bad_step)
  for k, v in engine.variables["video"].items():
    np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
  assert int(engine.step.numpy()) == 0

  # The retry applies the batch still pending on both replicas.
  def retry():
    engine.apply_gradients({"watched": tf.ones([2, 4])})
  strategy.run(retry)
  assert int(engine.step.numpy()) == 1
  _assert_one_adam_step(engine, before["parameters"],
                        [b["watched"].to_list() for b in batches])
  with pytest.raises(tee.InputError, match=re.escape(
      "apply_gradients() called before enqueue().")):
    strategy.run(retry)


# --- a SparseTensor index outside dense_shape on one replica ---------------------

def _ones_step(engine, strategy, use_function):
  """``step(batches)``: one step of dL/dact = 1 on every replica's batch."""
  def step(batches):
    engine.enqueue(distribute(strategy, batches), training=True)

    def replica_step():
      acts = engine.dequeue()
      engine.apply_gradients({"watched": tf.ones_like(acts["watched"])})
    strategy.run(replica_step)
  return tf.function(step) if use_function else step


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "tf_function"])
def test_a_sparse_index_outside_dense_shape_on_one_replica_changes_nothing(
    use_function):
  strategy = mirrored_strategy(2)
  engine = _video_engine(strategy)
  good = tf.ragged.constant([[0, 1], [2]], tf.int64).to_sparse()
  bad = tf.SparseTensor([[0, 0], [2, 0]], tf.constant([4, 5], tf.int64), [2, 2])

  run = _ones_step(engine, strategy, use_function)
  before = {k: v.numpy() for k, v in engine.variables["video"].items()}
  message = re.escape("feature 'watched' (table 'video'): SparseTensor index 2 is "
                      "outside the dense_shape of the ids (2 is not in [0, 2) in "
                      "dimension 0)")
  error = tf.errors.InvalidArgumentError if use_function else tee.InputError
  if use_function:
    message = message.replace("'", "\\\\'")
  with pytest.raises(error, match=message):
    run(batches=[{"watched": good}, {"watched": bad}])
  for k, v in engine.variables["video"].items():
    np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
  assert int(engine.step.numpy()) == 0


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "tf_function"])
def test_bad_ids_on_later_replicas_of_one_enqueue_are_named_and_change_nothing(
    use_function):
  """One enqueue of all 8 replicas' batches is checked once over their ids
  concatenated (issue 34): the first bad id in replica order is named with
  its feature, nothing changes; a corrected batch then trains as numpy
  says."""
  strategy = mirrored_strategy(8)
  engine = _video_engine(strategy)
  rows = [BATCH_A, BATCH_B] * 4
  batches = [{"watched": tf.ragged.constant(r, tf.int64)} for r in rows]
  bad = list(batches)
  bad[3] = {"watched": tf.ragged.constant([[1], [9, 2], [0], [3]], tf.int64)}
  bad[5] = {"watched": tf.ragged.constant([[-4], [1], [2], [3]], tf.int64)}
  run = _ones_step(engine, strategy, use_function)
  before = {k: v.numpy() for k, v in engine.variables["video"].items()}
  message = re.escape("feature 'watched' (table 'video'): id 9 is out of range")
  error = tf.errors.InvalidArgumentError if use_function else tee.InputError
  if use_function:
    message = message.replace("'", "\\\\'")
  with pytest.raises(error, match=message):
    run(batches=bad)
  for k, v in engine.variables["video"].items():
    np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
  assert int(engine.step.numpy()) == 0
  run(batches=batches)
  _assert_one_adam_step(engine, before["parameters"], rows)
  assert int(engine.step.numpy()) == 1


@pytest.mark.parametrize("case", ["nan_weight", "uint64_id"])
def test_a_weight_or_uint64_id_on_one_of_four_replicas_is_named_in_a_function(case):
  """The feature's own checks of one enqueue of 4 replicas' batches run once
  over the replicas' values concatenated: replica 2's bad value is named,
  nothing changes."""
  strategy = mirrored_strategy(4)
  engine = _video_engine(strategy)
  dtype = tf.uint64 if case == "uint64_id" else tf.int64
  ids = [tf.ragged.constant(BATCH_A, dtype) for _ in range(4)]
  weights = [tf.ragged.constant([[1.0] * len(r) for r in BATCH_A]) for _ in range(4)]
  if case == "uint64_id":
    ids[2] = tf.ragged.constant([[0, 1], [2 ** 63 + 5], [2, 3, 3], [5]], tf.uint64)
    message = "feature 'watched' (table 'video'): id 9223372036854775813 is out of range"
  else:
    weights[2] = tf.ragged.constant([[1.0, 1.0], [np.nan], [1.0] * 3, [1.0]])
    message = "feature 'watched' (table 'video'): weights have NaN or Inf values"

  @tf.function
  def step(ids, weights):
    engine.enqueue({"watched": ids}, {"watched": weights}, training=True)

    def replica_step():
      acts = engine.dequeue()
      engine.apply_gradients({"watched": tf.ones_like(acts["watched"])})
    strategy.run(replica_step)

  before = {k: v.numpy() for k, v in engine.variables["video"].items()}
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=re.escape(message).replace("'", "\\\\'")):
    step(distribute(strategy, ids), distribute(strategy, weights))
  for k, v in engine.variables["video"].items():
    np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
  assert int(engine.step.numpy()) == 0


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "tf_function"])
def test_a_callable_learning_rate_out_of_range_under_two_replicas(use_function):
  strategy = mirrored_strategy(2)
  rate = tf.Variable(0.1)
  table = api.TableConfig(8, 4, name="video", initializer=tf.constant_initializer(
      np.arange(32.).reshape(8, 4) / 10))
  with strategy.scope():
    engine = tee.CPUEmbedding({"watched": api.FeatureConfig(table, name="watched")},
                              api.SGD(learning_rate=lambda: rate.read_value()))
  batches = [{"watched": tf.ragged.constant([[0, 1], [2]], tf.int64)},
             {"watched": tf.ragged.constant([[1], [7]], tf.int64)}]

  run = functools.partial(_ones_step(engine, strategy, use_function), batches)
  before = {k: v.numpy() for k, v in engine.variables["video"].items()}
  rate.assign(-1.0)
  message = re.escape("table 'video': its learning-rate callable gave -1 this step")
  if use_function:  # The same text; tf.debugging.Assert escapes the quotes.
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=message.replace("'", "\\\\'")):
      run()
  else:
    with pytest.raises(tee.InputError, match=message):
      run()
  for k, v in engine.variables["video"].items():
    np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
  assert int(engine.step.numpy()) == 0
  rate.assign(0.1)
  run()
  want = before["parameters"].astype(np.float64)
  for i, g in {0: 0.5, 1: 1.5, 2: 1.0, 7: 1.0}.items():  # mean combiner
    want[i] -= 0.1 * g
  np.testing.assert_allclose(engine.variables["video"]["parameters"].numpy(), want,
                             rtol=1e-6)
