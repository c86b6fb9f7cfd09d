"""TPUEmbeddingV2 under emulate_tpu(sparsecore=True): a SparseCore program, unchanged.

The program is written as TensorFlow's TPU embedding docs write one (the
resolver, initialize_tpu_system, TPUStrategy, TPUEmbeddingV2 under its scope,
``embedding_lookup`` and ``apply_gradients(gradients, preserved_outputs)``
inside ``strategy.run``). Over several steps at 2 replicas its tables must
equal ``CPUEmbedding(engine="v2")`` on the same global batches and a numpy
reference of the TPU's math written here: each id's gradient summed over every
replica, one Adagrad update per step. Its checkpoint is TPUEmbeddingV2's
stacked layout, which TensorFlow's ``TPUEmbeddingForServing`` reads.
"""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore import checkpoint_layouts, convert_checkpoint
from tests.jobs import variables as checkpoint_values
from tests import references

api = tf.tpu.experimental.embedding
REPLICAS, PER_REPLICA, STEPS, DIM = 2, 8, 3, 4
VOCAB = {"user": 40, "item": 24}
LR, INITIAL_ACCUMULATOR = 0.2, 0.1


def _initial(name):
  return np.random.RandomState(len(name)).uniform(-1, 1, (VOCAB[name], DIM)).astype(
      np.float32)


def _feature_config(batch):
  """Two tables of one dim and optimizer: SparseCore stacks them ("item_user")."""
  optimizer = api.Adagrad(LR, initial_accumulator_value=INITIAL_ACCUMULATOR)
  tables = {n: api.TableConfig(VOCAB[n], DIM, name=n, combiner="sum",
                               optimizer=optimizer,
                               initializer=tf.constant_initializer(_initial(n)))
            for n in VOCAB}
  return {"user": api.FeatureConfig(tables["user"], output_shape=[batch]),
          "item": api.FeatureConfig(tables["item"], output_shape=[batch])}


def _global_batches(n=REPLICAS * PER_REPLICA):
  """STEPS global batches of n samples: single-hot users, multi-hot items (ragged).

  tests/tpu_programs/sparsecore_mid_level.py draws its batches the same way.
  """
  rng = np.random.RandomState(7)
  out = []
  for _ in range(STEPS):
    lengths = rng.randint(1, 4, n)
    out.append({"user": rng.randint(0, VOCAB["user"], n).astype(np.int64),
                "item": (rng.randint(0, VOCAB["item"], lengths.sum()).astype(np.int64),
                         lengths)})
  return out


def _as_tensors(batch, lo=0, hi=None):
  """Samples [lo, hi) of a global batch as the engine takes them."""
  ids, lengths = batch["item"]
  items = tf.RaggedTensor.from_row_lengths(ids, lengths)[lo:hi]
  return {"user": tf.constant(batch["user"][lo:hi]), "item": items}


def _gradients(activations):
  """dL/da of L = 0.5 * sum((a - 1)^2) over the batch: a - 1."""
  return tf.nest.map_structure(lambda a: a - 1.0, activations)


def _numpy_reference(batches=None):
  """The TPU's math: per-id gradients summed over the global batch, Adagrad once per step."""
  params = {n: _initial(n).astype(np.float64) for n in VOCAB}
  acc = {n: np.full((VOCAB[n], DIM), INITIAL_ACCUMULATOR) for n in VOCAB}
  for batch in batches or _global_batches():
    occurrences = {"user": [(s, [i]) for s, i in enumerate(batch["user"])]}
    ids, lengths = batch["item"]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    occurrences["item"] = [(s, list(ids[starts[s]:starts[s + 1]]))
                           for s in range(len(lengths))]
    grads = {}
    for name, rows in occurrences.items():
      g = np.zeros((VOCAB[name], DIM))
      for _, row in rows:
        activation = params[name][row].sum(axis=0)   # sum combiner
        for i in row:
          g[i] += activation - 1.0
      grads[name] = g
    for name, g in grads.items():  # a zero gradient changes no row
      params[name], slots = references.update(
          "adagrad", params[name], {"accumulators": acc[name]}, g, LR)
      acc[name] = slots["accumulators"]
  return params, acc


def _tpu_program(batches, sparse_core_config=None):
  """A SparseCore training loop as TPU users write it; returns the embedding."""
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  strategy = tf.distribute.TPUStrategy(resolver)
  with strategy.scope():
    embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(
        _feature_config(PER_REPLICA), None,
        sparse_core_embedding_config=sparse_core_config)

  @tf.function
  def step(batch):
    def replica_step(features):
      activations, preserved = embedding.embedding_lookup(features)
      embedding.apply_gradients(_gradients(activations), preserved)
      return activations["user"]
    return strategy.run(replica_step, args=(batch,))

  for batch in batches:
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx, b=batch: _as_tensors(
            b, ctx.replica_id_in_sync_group * PER_REPLICA,
            (ctx.replica_id_in_sync_group + 1) * PER_REPLICA))
    step(per_replica)
  return strategy, embedding


def _cpu_run(batches=None):
  batches = batches or _global_batches()
  emb = tee.CPUEmbedding(_feature_config(len(batches[0]["user"])), engine="v2")
  for batch in batches:
    emb.enqueue(_as_tensors(batch), training=True)
    emb.apply_gradients(_gradients(emb.dequeue()))
  return emb


def test_mid_level_loop_equals_cpu_engine_and_numpy(tmp_path):
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy, embedding = _tpu_program(_global_batches())
    assert type(embedding).__module__ == "tpu_embed_ext.emulated_tpu.sparsecore"
    assert strategy.num_replicas_in_sync == REPLICAS
    ours = {n: {s: v.numpy() for s, v in embedding.table_variables(n).items()}
            for n in VOCAB}
    saved = tf.train.Checkpoint(embedding=embedding).write(str(tmp_path / "tpu"))
    per_chip = embedding._topology.sparsecores_per_chip
  cpu = _cpu_run()
  params, acc = _numpy_reference()
  for name in VOCAB:
    np.testing.assert_array_equal(ours[name]["parameters"],
                                  cpu.variables[name]["parameters"].numpy())
    np.testing.assert_array_equal(ours[name]["accumulators"],
                                  cpu.variables[name]["accumulators"].numpy())
    np.testing.assert_allclose(ours[name]["parameters"], params[name], rtol=2e-5,
                               atol=1e-6)
    np.testing.assert_allclose(ours[name]["accumulators"], acc[name], rtol=2e-5)
  # The checkpoint is TPUEmbeddingV2's stacked layout on 2 chips: the same
  # bytes as the CPU engine's per-table checkpoint converted to that topology.
  assert {l.stack for l in checkpoint_layouts(saved)} == {"item_user"}
  assert checkpoint_layouts(saved)[0].num_sparse_cores == REPLICAS * per_chip
  converted = str(tmp_path / "converted")
  convert_checkpoint(tf.train.Checkpoint(embedding=cpu).write(str(tmp_path / "cpu")),
                     converted, _feature_config(PER_REPLICA),  # as each chip sees it
                     f"{REPLICAS}x{per_chip}")
  ours_ck, theirs_ck = checkpoint_values(saved), checkpoint_values(converted)
  assert sorted(ours_ck) == sorted(theirs_ck)
  for key in ours_ck:
    assert np.asarray(ours_ck[key]).tobytes() == np.asarray(theirs_ck[key]).tobytes(), key
  # TensorFlow's own TPUEmbeddingForServing restores the tables from it.
  serving = api.TPUEmbeddingForServing(_feature_config(PER_REPLICA), api.Adagrad(LR))
  tf.train.Checkpoint(embedding=serving).restore(saved)
  serving.build()
  for table, var in serving.embedding_tables.items():
    np.testing.assert_array_equal(var.numpy(), ours[table.name]["parameters"])


def test_limits_fail_the_replica_that_exceeds_them():
  # Every replica sends several ids of "item_user" to some SparseCore.
  config = api.SparseCoreEmbeddingConfig(max_ids_per_table={"item_user": 1})
  batch = _global_batches()[0]
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    with pytest.raises((errors.InputError, tf.errors.InvalidArgumentError),
                       match=r"over the limit max_ids_per_table\['item_user'\]=1"):
      _tpu_program([batch], config)


def test_preserved_outputs_are_checked():
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
    strategy = tf.distribute.TPUStrategy(resolver)
    with strategy.scope():
      embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(
          _feature_config(PER_REPLICA), None)
    batch = _global_batches()[0]

    def replica_step(features):
      activations, _ = embedding(features)
      embedding.apply_gradients(_gradients(activations), {"user": 0})

    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: _as_tensors(batch, ctx.replica_id_in_sync_group * PER_REPLICA,
                                (ctx.replica_id_in_sync_group + 1) * PER_REPLICA))
    with pytest.raises(errors.InputError) as e:
      tf.function(lambda x: strategy.run(replica_step, args=(x,)))(per_replica)
  assert str(e.value) == (
      "TPUEmbeddingV2.apply_gradients(preserved_outputs) got dict with keys "
      "['user'], not the preserved outputs of this object's lookup (a dict keyed "
      "by stacked table name: ['item_user']). Fix: pass the second output of "
      "embedding_lookup (or enqueue's output to dequeue), unchanged.")


def test_stacked_tables_are_read_only_views_and_need_a_tpu_strategy():
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    # As upstream: TPUEmbeddingV2 outside a TPUStrategy is refused.
    with pytest.raises(RuntimeError, match="TPUEmbeddingV2 should be created under "
                       "TPUStrategy but found"):
      tf.tpu.experimental.embedding.TPUEmbeddingV2(_feature_config(PER_REPLICA), None)
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    with strategy.scope():
      embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(
          _feature_config(PER_REPLICA), None)
    stacked = embedding.embedding_tables["item_user"]
    # One shard per replica (chip), which together are the stacked variable
    # whose rows hold each table's rows where its layout puts them.
    shards = stacked.values
    assert len(shards) == REPLICAS
    whole = np.concatenate([s.numpy() for s in shards])
    np.testing.assert_array_equal(whole, stacked.numpy())
    layouts = {l.table_name: l for l in embedding.embedding_layouts.values()}
    for name in VOCAB:
      from tpu_embed_ext.sparsecore import layout as sc_layout
      ours = [l for l in sc_layout.layouts_from_proto(
          sc_layout.layouts_to_proto(embedding._sparsecore.layouts)) if l.table == name][0]
      rows = ours.stacked_index(np.arange(VOCAB[name]))
      np.testing.assert_array_equal(whole[rows, :DIM], _initial(name))
      assert layouts[name].stacked_table_name == "item_user"
    with pytest.raises(errors.ConfigError) as e:
      stacked.assign(whole)
  assert str(e.value) == (
      "stacked table 'item_user' is a read-only view in the emulated TPUEmbeddingV2 "
      "(its tables are kept per table). Fix: restore a checkpoint "
      "(tf.train.Checkpoint(embedding=...).restore) to change the tables.")
