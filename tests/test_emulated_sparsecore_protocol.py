"""TPUEmbeddingV2's protocol under the emulated TPU, as TensorFlow's own tests use it.

TensorFlow's ``tpu_embedding_v3_test.py`` (TF 2.21) trains through
``enqueue`` -> ``_copy_tensors_to_device`` -> ``apply_gradients`` without a
``dequeue``, profiles batches with ``TPUEmbeddingV2.compute_sparse_core_stats``,
reads ``strategy.extended._tpu_devices`` and initialises tables with callables.
Each is checked here against a numpy reference written in the test.
"""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tests.builders import emulated_tpu_strategy

api = tf.tpu.experimental.embedding
REPLICAS, PER_REPLICA, DIM, VOCAB, LR = 2, 8, 4, 64, 0.5


def _initial(shape):
  return (np.arange(np.prod(shape)).reshape(shape) % 7 / 7.0).astype(np.float32)


def _feature_config(initializer=None):
  table = api.TableConfig(VOCAB, DIM, name="video", combiner="sum",
                          initializer=initializer or tf.constant_initializer(
                              _initial((VOCAB, DIM))))
  return [api.FeatureConfig(table, name="watched", output_shape=[PER_REPLICA]),
          api.FeatureConfig(table, name="watched2", output_shape=[PER_REPLICA])]


def _ids(replica, feature):
  """Each sample holds three ids; ids repeat within and across replicas."""
  rng = np.random.RandomState(10 * replica + feature)
  return rng.randint(0, VOCAB, (PER_REPLICA, 3)).astype(np.int64)


def _inputs(kind, replica):
  out = []
  for feature in range(2):
    ids = _ids(replica, feature)
    if kind == "sparse":
      out.append(tf.sparse.from_dense(tf.constant(ids + 1)).with_values(
          tf.constant(ids.ravel())))
    else:
      out.append(tf.RaggedTensor.from_tensor(tf.constant(ids)))
  return out


def _gradients(replica):
  rng = np.random.RandomState(100 + replica)
  return [rng.uniform(-1, 1, (PER_REPLICA, DIM)).astype(np.float32) for _ in range(2)]


def _numpy_reference():
  """One SGD step: each id's gradient summed over every replica and feature."""
  table = _initial((VOCAB, DIM)).astype(np.float64)
  grad = np.zeros_like(table)
  for replica in range(REPLICAS):
    for feature, g in enumerate(_gradients(replica)):
      for sample, ids in enumerate(_ids(replica, feature)):
        for i in ids:
          grad[i] += g[sample]
  return table - LR * grad


def _train_once(kind, path):
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(_feature_config(), api.SGD(LR))
    features = strategy.experimental_distribute_values_from_function(
        lambda ctx: _inputs(kind, ctx.replica_id_in_sync_group))
    grads = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.constant(g) for g in _gradients(ctx.replica_id_in_sync_group)])

    def step(features, grads):
      if path == "csr":  # upstream's backward-pass tests: no dequeue
        partitioned = embedding.enqueue(features)
        preserved = embedding._copy_tensors_to_device(  # pylint: disable=protected-access
            partitioned_tensors=partitioned)
      else:
        _, preserved = embedding(features)
      embedding.apply_gradients(grads, preserved)

    tf.function(lambda f, g: strategy.run(step, args=(f, g)))(features, grads)
    return embedding.table_variables("video")["parameters"].numpy()


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_enqueue_copy_apply_equals_lookup_path_and_numpy(kind):
  reference = _numpy_reference()
  csr = _train_once(kind, "csr")
  np.testing.assert_allclose(csr, reference, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(csr, _train_once(kind, "lookup"))


def test_copy_tensors_to_device_checks_its_input():
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    with emulated_tpu_strategy().scope():
      embedding = api.TPUEmbeddingV2(_feature_config(), api.SGD(LR))
    with pytest.raises(errors.InputError) as e:
      embedding._copy_tensors_to_device({"user": 1})  # pylint: disable=protected-access
  assert str(e.value) == (
      "TPUEmbeddingV2._copy_tensors_to_device(partitioned_tensors) got dict with "
      "keys ['user'], not the preserved outputs of this object's lookup (a dict "
      "keyed by stacked table name: ['video']). Fix: pass the second output of "
      "embedding_lookup (or enqueue's output to dequeue), unchanged.")


def test_tpu_devices_and_sparsecores_per_chip():
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    devices = strategy.extended._tpu_devices  # pylint: disable=protected-access
    assert devices.shape == (REPLICAS, 1)
    assert list(devices[:, 0]) == list(strategy.extended.worker_devices)
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(_feature_config(), api.SGD(LR))
    assert embedding._num_sc_per_chip == 4  # pylint: disable=protected-access


def test_callable_initializers_fill_the_tables():
  """Upstream's element-id initializer: a callable of (shape, dtype)."""
  def element_id(shape, dtype):
    return tf.reshape(tf.range(shape[0] * shape[1], dtype=dtype), shape)

  ids = np.array([0, 5, 62, 17, 17, 2, 40, 1], np.int64)  # + replica < VOCAB
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    config = _feature_config(initializer=element_id)
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(config[0], api.SGD(LR))
    features = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(ids + ctx.replica_id_in_sync_group))
    result = tf.function(lambda f: strategy.run(
        lambda x: embedding(x)[0], args=(f,)))(features)
    looked_up = [r.numpy() for r in strategy.experimental_local_results(result)]
  table = np.arange(VOCAB * DIM, dtype=np.float32).reshape(VOCAB, DIM)
  for replica, rows in enumerate(looked_up):
    np.testing.assert_array_equal(rows, table[ids + replica])


def test_distributed_values_with_device_are_refused_as_tensorflow_does():
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(_feature_config(), api.SGD(LR))
    features = strategy.experimental_distribute_values_from_function(
        lambda ctx: _inputs("sparse", ctx.replica_id_in_sync_group))
    with pytest.raises(ValueError) as e:
      embedding.enqueue(features, device=strategy.extended.worker_devices[0])
    assert type(e.value) is errors.InputError
  assert str(e.value) == (
      "Input of unknown type <class 'tensorflow.python.distribute.values.PerReplica'>. "
      "Please only pass Tensor, SparseTensor or RaggedTensor as input to embedding "
      "lookup. (TPUEmbeddingV2.enqueue(device=...) takes one replica's batch, got "
      "PerReplica. Fix: pass strategy.experimental_local_results(x)[i] with "
      "device=strategy.extended.worker_devices[i], or enqueue inside strategy.run "
      "without device=.)")


# --- compute_sparse_core_stats ----------------------------------------------

CHIPS, SC_PER_CHIP = 2, 4


def _stats_reference(features_ids):
  """Max ids / unique ids one SparseCore of the chip sends to one SparseCore.

  One table, alone in its stack: row ``i`` lives on SparseCore ``i % S`` of
  the ``S = chips x 4`` (mod sharding); sample ``s`` of a feature's batch is
  preprocessed by the chip's SparseCore ``s // (batch / 4)``; a (sample, id)
  pair counts once.
  """
  s_total = CHIPS * SC_PER_CHIP
  pairs = np.zeros((SC_PER_CHIP, s_total), np.int64)
  distinct = [[set() for _ in range(s_total)] for _ in range(SC_PER_CHIP)]
  for ids in features_ids:
    per_sc = len(ids) // SC_PER_CHIP
    seen = set()
    for sample, row in enumerate(ids):
      for i in row:
        if (sample, i) in seen:
          continue
        seen.add((sample, i))
        pairs[sample // per_sc, i % s_total] += 1
        distinct[sample // per_sc][i % s_total].add(i)
  unique = max(len(d) for per_src in distinct for d in per_src)
  return int(pairs.max()), unique


def test_compute_sparse_core_stats_equals_numpy():
  features_ids = [_ids(0, 0), _ids(0, 1)]
  features_ids[0][0, 1] = features_ids[0][0, 0]  # a repeated (sample, id) pair
  with tee.emulate_tpu(replicas=CHIPS, sparsecore=True):
    config = _feature_config()
    max_ids, max_unique = api.TPUEmbeddingV2.compute_sparse_core_stats(
        features=[tf.RaggedTensor.from_tensor(tf.constant(x)) for x in features_ids],
        feature_config=config, num_tpu_chips=CHIPS, optimizer=api.SGD(LR))
  assert config[0].table.name == "video" and config[0].table.dim == DIM
  assert sorted(max_ids) == sorted(max_unique) == ["video"]
  assert max_ids["video"].dtype == tf.int32
  assert (int(max_ids["video"]), int(max_unique["video"])) == _stats_reference(
      features_ids)


def test_compute_sparse_core_stats_as_limits_accept_the_batch():
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    batch = _inputs("ragged", 0)
    max_ids, max_unique = api.TPUEmbeddingV2.compute_sparse_core_stats(
        batch, _feature_config(), num_tpu_chips=REPLICAS, optimizer=api.SGD(LR))
    limits = api.SparseCoreEmbeddingConfig(max_ids_per_table=max_ids,
                                           max_unique_ids_per_table=max_unique)
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(_feature_config(), api.SGD(LR),
                                     sparse_core_embedding_config=limits)
    features = strategy.experimental_distribute_values_from_function(
        lambda ctx: _inputs("ragged", 0))
    tf.function(lambda f: strategy.run(lambda x: embedding(x)[0], args=(f,)))(features)
    # One id fewer than the batch needs is refused, naming the limit.
    tight = api.SparseCoreEmbeddingConfig(
        max_ids_per_table={"video": int(max_ids["video"]) - 1})
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(_feature_config(), api.SGD(LR),
                                     sparse_core_embedding_config=tight)
    with pytest.raises((errors.InputError, tf.errors.InvalidArgumentError),
                       match=r"over the limit max_ids_per_table\['video'\]"):
      tf.function(lambda f: strategy.run(lambda x: embedding(x)[0], args=(f,)))(features)


def test_compute_sparse_core_stats_refuses_distributed_values():
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    features = strategy.experimental_distribute_values_from_function(
        lambda ctx: _inputs("ragged", ctx.replica_id_in_sync_group))
    with pytest.raises(ValueError) as e:
      api.TPUEmbeddingV2.compute_sparse_core_stats(
          features, _feature_config(), num_tpu_chips=REPLICAS, optimizer=api.SGD(LR))
    assert type(e.value) is errors.InputError
  assert str(e.value) == (
      "Input of unknown type <class 'tensorflow.python.distribute.values.PerReplica'>. "
      "Please only pass Tensor, SparseTensor or RaggedTensor as input to embedding "
      "lookup. (feature '0': compute_sparse_core_stats profiles one chip's batch. "
      "Fix: pass one replica's values, e.g. strategy.experimental_local_results(x)[0].)")


def test_a_batch_enqueued_in_another_function_is_dequeued_from_its_output():
  """Upstream's pattern: ``enqueue(batch, device=...)`` in one tf.function,
  its output passed to ``strategy.run``: every replica looks up that batch
  (a replicated input), and their gradients are summed."""
  batches = [_ids(0, f) for f in range(2)], [_ids(1, f) for f in range(2)]
  table = _initial((VOCAB, DIM)).astype(np.float64)
  for ids in batches:  # numpy: SGD on 0.5 * sum((a - 1)^2), REPLICAS copies
    grad = np.zeros_like(table)
    for feature in ids:
      for row in feature:
        activation = table[row].sum(axis=0)
        for i in row:
          grad[i] += REPLICAS * (activation - 1.0)
    table = table - LR * grad
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(_feature_config(), api.SGD(LR))

    @tf.function
    def enqueue(features):
      return embedding.enqueue(features, device=strategy.extended.worker_devices[0])

    def step(partitioned):
      activations, preserved = embedding.dequeue(partitioned)
      embedding.apply_gradients([a - 1.0 for a in activations], preserved)

    @tf.function
    def train(features):
      strategy.run(step, args=(enqueue(features),))

    for ids in batches:
      train([tf.RaggedTensor.from_tensor(tf.constant(x)) for x in ids])
    ours = embedding.table_variables("video")["parameters"].numpy()
  np.testing.assert_allclose(ours, table, rtol=1e-5, atol=1e-6)


def test_stacked_checkpoint_round_trip_in_one_topology(tmp_path):
  """Two tables of one stack, Adagrad slots: saved by one TPUEmbeddingV2 and
  restored into a fresh one on the same topology, every variable equal."""
  def config():
    optimizer = api.Adagrad(LR, initial_accumulator_value=0.1)
    tables = [api.TableConfig(VOCAB, DIM, name=n, combiner="sum", optimizer=optimizer,
                              initializer=tf.constant_initializer(
                                  _initial((VOCAB, DIM)) + k))
              for k, n in enumerate(["user", "video"])]
    return [api.FeatureConfig(t, output_shape=[PER_REPLICA]) for t in tables]

  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      trained = api.TPUEmbeddingV2(config())
    features = strategy.experimental_distribute_values_from_function(
        lambda ctx: _inputs("ragged", ctx.replica_id_in_sync_group))

    def step(x):
      activations, preserved = trained(x)
      trained.apply_gradients([a - 1.0 for a in activations], preserved)

    tf.function(lambda f: strategy.run(step, args=(f,)))(features)
    path = tf.train.Checkpoint(embedding=trained).write(str(tmp_path / "ckpt"))
    with strategy.scope():
      restored = api.TPUEmbeddingV2(config())
    status = tf.train.Checkpoint(embedding=restored).read(path)
    restored.build()  # restores as the variables are made, as upstream's
    status.assert_consumed()
    assert sorted(restored.embedding_tables) == ["user_video"]
    for name in ("user", "video"):
      for slot in ("parameters", "accumulators"):
        before = trained.table_variables(name)[slot].numpy()
        after = restored.table_variables(name)[slot].numpy()
        np.testing.assert_array_equal(after, before)
      # Training changed the table: the restore is not the initial value.
      assert not np.array_equal(restored.table_variables(name)["parameters"].numpy(),
                                _initial((VOCAB, DIM)) + (name == "video"))
