"""CPUEmbedding(engine="v2", topology=...): stacked checkpoints and SparseCore's limits."""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.spec import names
from tpu_embed_ext import errors
from tests import jobs
from tpu_embed_ext.sparsecore import checkpoint_layouts, convert_checkpoint
from tests.test_sparsecore_convert import OPTIMIZERS, _config, _train, _values
from tests.test_sparsecore_limits import FA, FB

api = tf.tpu.experimental.embedding


def test_saves_and_restores_tpu_embedding_v2_layout(tmp_path):
  optimizer = "adagrad_momentum"
  # The reference run: per-table, 3 steps, saved, converted to 2 chips x 2 SparseCores.
  original = tee.CPUEmbedding(_config(optimizer), OPTIMIZERS[optimizer](), engine="v2")
  _train(original, 3)
  per_table = tf.train.Checkpoint(embedding=original).write(str(tmp_path / "per_table"))
  converted = str(tmp_path / "converted")
  convert_checkpoint(per_table, converted, _config(optimizer), "2x2",
                     optimizer=OPTIMIZERS[optimizer]())
  # An engine on that topology restores it (before build, as TPUEmbeddingV2 would) ...
  emb = tee.CPUEmbedding(_config(optimizer), OPTIMIZERS[optimizer](), engine="v2",
                         topology="2x2")
  emb.check_checkpoint(converted)
  status = tf.train.Checkpoint(embedding=emb).read(converted)
  emb.build()
  status.assert_consumed()
  # ... trains on, and equals the original run continued, to the last bit.
  _train(emb, 3, start=3)
  _train(original, 3, start=3)
  for table, slots in original.variables.items():
    for slot, var in slots.items():
      assert emb.variables[table][slot].numpy().tobytes() == var.numpy().tobytes()
  # Its own checkpoint is in TPUEmbeddingV2's layout: the converter's bytes ...
  saved = tf.train.Checkpoint(embedding=emb).write(str(tmp_path / "saved"))
  again = str(tmp_path / "again")
  convert_checkpoint(tf.train.Checkpoint(embedding=original).write(
      str(tmp_path / "per_table2")), again, _config(optimizer), "2x2",
      optimizer=OPTIMIZERS[optimizer]())
  ours, theirs = _values(saved), _values(again)
  assert ours.keys() == theirs.keys()
  assert all(np.asarray(ours[k]).tobytes() == np.asarray(theirs[k]).tobytes()
             for k in ours)
  assert checkpoint_layouts(saved)[0].num_sparse_cores == 4
  # ... and TPUEmbeddingForServing reads its tables.
  serving = api.TPUEmbeddingForServing(_config(optimizer), OPTIMIZERS[optimizer]())
  tf.train.Checkpoint(embedding=serving).restore(saved)
  serving.build()
  for table, var in serving.embedding_tables.items():
    np.testing.assert_array_equal(var.numpy(), emb.variables[table.name]["parameters"])


def _limits_engine(batch=8, **config):
  sgd = api.SGD(0.5)
  tables = {n: api.TableConfig(vocabulary_size=r, dim=2, name=n, optimizer=sgd,
                               combiner="mean",
                               initializer=tf.random_uniform_initializer(seed=r))
            for n, r in (("a", 64), ("b", 32))}
  features = {"fa": api.FeatureConfig(table=tables["a"], output_shape=[batch]),
              "fb": api.FeatureConfig(table=tables["b"], output_shape=[batch])}
  return tee.CPUEmbedding(features, engine="v2", topology="2x2",
                          sparse_core_config=api.SparseCoreEmbeddingConfig(**config))


def _ragged(f):
  return tf.RaggedTensor.from_value_rowids(f.ids, f.samples, f.sample_count)


def test_drops_ids_as_sparsecore_does():
  emb = _limits_engine(max_ids_per_chip_per_sample=2, allow_id_dropping=True)
  before = {t: v["parameters"].numpy() for t, v in emb.variables.items()}
  emb.enqueue({"fa": _ragged(FA), "fb": _ragged(FB)}, training=True)
  acts = emb.dequeue()
  # Kept ids, counted by hand in test_sparsecore_limits.test_dropping_by_hand.
  # The mean combiner's gain 1/n counts every id of the sample, dropped or not
  # (SparseCore rescales gains before it drops).
  keep = {"fa": np.array([1, 1, 1, 1, 0, 0, 1, 1, 0, 0], bool),
          "fb": np.array([0, 0, 1, 1], bool)}
  for name, f, table in (("fa", FA, "a"), ("fb", FB, "b")):
    n = np.bincount(f.samples, minlength=8)
    expected = np.zeros((8, 2), np.float32)
    for s, i, k in zip(f.samples, f.ids, keep[name]):
      if k:
        expected[s] += before[table][i] / n[s]
    np.testing.assert_allclose(acts[name].numpy(), expected, rtol=1e-6)
  emb.apply_gradients({"fa": tf.ones([8, 2]), "fb": tf.ones([8, 2])})
  for name, f, table in (("fa", FA, "a"), ("fb", FB, "b")):
    n = np.bincount(f.samples, minlength=8)
    expected = before[table].copy()
    for s, i, k in zip(f.samples, f.ids, keep[name]):
      if k:
        expected[i] -= 0.5 / n[s]
    np.testing.assert_allclose(emb.variables[table]["parameters"].numpy(), expected,
                               rtol=1e-6)


def test_limit_errors_leave_tables_unchanged():
  emb = _limits_engine(max_unique_ids_per_table={"a_b": 1})
  before = emb.variables["a"]["parameters"].numpy()
  with pytest.raises(errors.InputError, match=r"max_unique_ids_per_table\['a_b'\]=1"):
    emb.enqueue({"fa": _ragged(FA), "fb": _ragged(FB)}, training=True)
  np.testing.assert_array_equal(emb.variables["a"]["parameters"].numpy(), before)


def test_topology_needs_engine_v2():
  with pytest.raises(errors.ConfigError) as e:
    tee.CPUEmbedding(_config("sgd"), OPTIMIZERS["sgd"](), topology="v5p:1")
  assert str(e.value) == (
      "topology='v5p:1' needs engine=\"v2\": only TPUEmbeddingV2 (SparseCore) stacks "
      "tables. Fix: pass engine=\"v2\", or drop topology.")


def test_batch_must_split_over_sparsecores():
  emb = tee.CPUEmbedding(_config("sgd"), OPTIMIZERS["sgd"](), engine="v2",
                         topology="v6e:4")
  with pytest.raises(errors.InputError) as e:
    _train(emb, 1)
  assert str(e.value) == (
      "feature 'a' (table 'a') has 4 samples, not a multiple of 4 chips x 2 SparseCores"
      " per chip: the TPU splits each chip's batch evenly over its SparseCores. Fix: "
      "use a batch size divisible by 8.")


def test_dropping_inside_tf_function_equals_eager():
  config = dict(max_ids_per_chip_per_sample=2, allow_id_dropping=True)
  eager, graph = _limits_engine(**config), _limits_engine(**config)
  features = {"fa": _ragged(FA), "fb": _ragged(FB)}

  def step(emb):
    emb.enqueue(features, training=True)
    acts = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(lambda a: a + 1.0, acts))
    return acts

  step(eager)
  tf.function(lambda: step(graph))()
  for table in ("a", "b"):
    assert (eager.variables[table]["parameters"].numpy().tobytes()
            == graph.variables[table]["parameters"].numpy().tobytes())


def test_what_is_not_emulated_says_so():
  table = api.TableConfig(vocabulary_size=8, dim=2, name="t", optimizer=api.SGD(0.1))
  with pytest.raises(errors.ConfigError) as e:
    tee.CPUEmbedding({"s": api.FeatureConfig(table=table, max_sequence_length=3,
                                             output_shape=[4, 3])},
                     engine="v2", topology="2x2")
  assert str(e.value) == (
      "SparseCore input limits are not emulated for sequence features (s). Fix: drop "
      "topology= and convert checkpoints with python -m tpu_embed_ext "
      "convert-checkpoint.")
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    emb = tee.CPUEmbedding({"f": api.FeatureConfig(table=table, output_shape=[4])},
                           engine="v2",
                           topology="4x2")
  ids = strategy.experimental_distribute_values_from_function(
      lambda ctx: {"f": tf.constant([1, 2, 3, 4], tf.int64)})
  with pytest.raises(errors.ConfigError) as e:
    emb.enqueue(ids, training=True)
  assert str(e.value) == (
      "SparseCore input limits are emulated with each CPU replica as one chip (or "
      "one replica holding the global batch): the topology 4x2 (4 chips x 2 "
      "SparseCores) has 4 chips, the strategy 2 replicas. Fix: give a topology of 2 "
      "chips in one process, or drop topology=.")


def test_stacked_checkpoint_holding_nan_is_refused_naming_the_stack(tmp_path):
  optimizer = "adagrad"
  emb = tee.CPUEmbedding(_config(optimizer), OPTIMIZERS[optimizer](), engine="v2",
                         topology="2x2")
  _train(emb, 2)
  path = tf.train.Checkpoint(embedding=emb).write(str(tmp_path / "stacked"))
  emb.check_checkpoint(path)  # Finite: passes.
  layouts = checkpoint_layouts(path)
  stack = layouts[0].stack
  tables = ", ".join(f"'{l.table}'" for l in layouts if l.stack == stack)
  key = names.checkpoint_key("embedding", stack, "accumulators")
  jobs.rewrite_checkpoint(path, key, np.nan)
  with pytest.raises(tee.Error) as info:
    emb.check_checkpoint(path)
  assert str(info.value).startswith(
      f"SparseCore stack '{stack}' of table(s) {tables} (slot 'accumulators'): "
      f"checkpoint {path} holds "), str(info.value)
  assert "non-finite values (NaN or Inf)" in str(info.value)


def _halves(f):
  """Chip k's samples of a 2-chip global batch, as replica k receives them."""
  half = f.sample_count // 2
  return [tf.RaggedTensor.from_value_rowids(
      f.ids[(f.samples >= k * half) & (f.samples < (k + 1) * half)],
      f.samples[(f.samples >= k * half) & (f.samples < (k + 1) * half)] - k * half,
      half) for k in (0, 1)]


@pytest.mark.parametrize("inside_run", [True, False])
def test_each_replica_is_a_chip(inside_run):
  # 2 replicas on a 2-chip topology drop (and fail) as one replica holding
  # the global batch does: replica k's ids are chip k's.
  config = dict(max_ids_per_chip_per_sample=2, allow_id_dropping=True)
  whole = _limits_engine(**config)
  whole.enqueue({"fa": _ragged(FA), "fb": _ragged(FB)}, training=True)
  expected = whole.dequeue()
  whole.apply_gradients({"fa": tf.ones([8, 2]), "fb": tf.ones([8, 2])})
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    emb = _limits_engine(batch=4, **config)  # each replica holds 4 samples
  fa, fb = _halves(FA), _halves(FB)
  batch = strategy.experimental_distribute_values_from_function(
      lambda ctx: {"fa": fa[ctx.replica_id_in_sync_group],
                   "fb": fb[ctx.replica_id_in_sync_group]})

  def step(features):
    if inside_run:
      emb.enqueue(features, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"fa": tf.ones([4, 2]), "fb": tf.ones([4, 2])})
    return acts

  if not inside_run:
    emb.enqueue(batch, training=True)
  acts = strategy.run(step, args=(batch,))
  for name in ("fa", "fb"):
    np.testing.assert_array_equal(
        np.concatenate([a.numpy() for a in
                        strategy.experimental_local_results(acts[name])]),
        expected[name].numpy())
  for table in ("a", "b"):
    np.testing.assert_array_equal(emb.variables[table]["parameters"].numpy(),
                                  whole.variables[table]["parameters"].numpy())
