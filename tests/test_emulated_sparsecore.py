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
from tests import sparsecore_program as sc
from tests.builders import checkpoint_values

api = tf.tpu.experimental.embedding


def test_mid_level_loop_equals_cpu_engine_and_numpy(tmp_path):
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy, embedding = sc.tpu_program(sc.global_batches())
    assert type(embedding).__module__ == "tpu_embed_ext.emulated_tpu.sparsecore"
    assert strategy.num_replicas_in_sync == sc.REPLICAS
    ours = {n: {s: v.numpy() for s, v in embedding.table_variables(n).items()}
            for n in sc.VOCAB}
    saved = tf.train.Checkpoint(embedding=embedding).write(str(tmp_path / "tpu"))
    per_chip = embedding._topology.sparsecores_per_chip
  cpu = sc.cpu_run()
  params, acc = sc.numpy_reference()
  for name in sc.VOCAB:
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
  assert checkpoint_layouts(saved)[0].num_sparse_cores == sc.REPLICAS * per_chip
  converted = str(tmp_path / "converted")
  convert_checkpoint(tf.train.Checkpoint(embedding=cpu).write(str(tmp_path / "cpu")),
                     converted, sc.feature_config(sc.PER_REPLICA),  # as each chip sees it
                     f"{sc.REPLICAS}x{per_chip}")
  ours_ck, theirs_ck = checkpoint_values(saved), checkpoint_values(converted)
  assert sorted(ours_ck) == sorted(theirs_ck)
  for key in ours_ck:
    assert np.asarray(ours_ck[key]).tobytes() == np.asarray(theirs_ck[key]).tobytes(), key
  # TensorFlow's own TPUEmbeddingForServing restores the tables from it.
  serving = api.TPUEmbeddingForServing(sc.feature_config(sc.PER_REPLICA), api.Adagrad(sc.LR))
  tf.train.Checkpoint(embedding=serving).restore(saved)
  serving.build()
  for table, var in serving.embedding_tables.items():
    np.testing.assert_array_equal(var.numpy(), ours[table.name]["parameters"])


def test_limits_fail_the_replica_that_exceeds_them():
  # Every replica sends several ids of "item_user" to some SparseCore.
  config = api.SparseCoreEmbeddingConfig(max_ids_per_table={"item_user": 1})
  batch = sc.global_batches()[0]
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    with pytest.raises((errors.InputError, tf.errors.InvalidArgumentError),
                       match=r"over the limit max_ids_per_table\['item_user'\]=1"):
      sc.tpu_program([batch], config)


def test_preserved_outputs_are_checked():
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
    strategy = tf.distribute.TPUStrategy(resolver)
    with strategy.scope():
      embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(
          sc.feature_config(sc.PER_REPLICA), None)
    batch = sc.global_batches()[0]

    def replica_step(features):
      activations, _ = embedding(features)
      embedding.apply_gradients(sc.gradients(activations), {"user": 0})

    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: sc.as_tensors(batch, ctx.replica_id_in_sync_group * sc.PER_REPLICA,
                                (ctx.replica_id_in_sync_group + 1) * sc.PER_REPLICA))
    with pytest.raises(errors.InputError) as e:
      tf.function(lambda x: strategy.run(replica_step, args=(x,)))(per_replica)
  assert str(e.value) == (
      "TPUEmbeddingV2.apply_gradients(preserved_outputs) got dict with keys "
      "['user'], not the preserved outputs of this object's lookup (a dict keyed "
      "by stacked table name: ['item_user']). Fix: pass the second output of "
      "embedding_lookup (or enqueue's output to dequeue), unchanged.")


def test_stacked_tables_are_read_only_views_and_need_a_tpu_strategy():
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    # As upstream: TPUEmbeddingV2 outside a TPUStrategy is refused.
    with pytest.raises(RuntimeError, match="TPUEmbeddingV2 should be created under "
                       "TPUStrategy but found"):
      tf.tpu.experimental.embedding.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None)
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    with strategy.scope():
      embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(
          sc.feature_config(sc.PER_REPLICA), None)
    stacked = embedding.embedding_tables["item_user"]
    # One shard per replica (chip), which together are the stacked variable
    # whose rows hold each table's rows where its layout puts them.
    shards = stacked.values
    assert len(shards) == sc.REPLICAS
    whole = np.concatenate([s.numpy() for s in shards])
    np.testing.assert_array_equal(whole, stacked.numpy())
    layouts = {l.table_name: l for l in embedding.embedding_layouts.values()}
    for name in sc.VOCAB:
      from tpu_embed_ext.sparsecore import layout as sc_layout
      ours = [l for l in sc_layout.layouts_from_proto(
          sc_layout.layouts_to_proto(embedding._sparsecore.layouts)) if l.table == name][0]
      rows = ours.stacked_index(np.arange(sc.VOCAB[name]))
      np.testing.assert_array_equal(whole[rows, :sc.DIM], sc.initial(name))
      assert layouts[name].stacked_table_name == "item_user"
    with pytest.raises(errors.ConfigError) as e:
      stacked.assign(whole)
  assert str(e.value) == (
      "stacked table 'item_user' is a read-only view in the emulated TPUEmbeddingV2 "
      "(its tables are kept per table). Fix: restore a checkpoint "
      "(tf.train.Checkpoint(embedding=...).restore) to change the tables.")
