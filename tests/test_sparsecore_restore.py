"""Checkpoints of another layout restore into TPUEmbeddingV2's stacked tables.

TensorFlow 2.21's ``TPUEmbeddingV2`` restores a per-table checkpoint
(``TPUEmbedding``, ``CPUEmbedding``, ``TPUEmbeddingForServing``, a CPU Keras
model) and a stacked one of another topology through its checkpoint adapter.
Here two tables that stack ("item_user") are saved per table by each of those,
restored into the emulated ``TPUEmbeddingV2`` at 2 replicas (before and after
``build``); its lookups must give the saved rows, every slot must equal the
saved one, and one more step must equal a numpy reference of the TPU's math.
Where TensorFlow refuses, the error is TensorFlow's class and phrase, then
the table, the value and the fix, and no table changes.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.sparsecore import checkpoint_layouts, convert_checkpoint
from tpu_embed_ext.sparsecore.topology import Topology
from tests import sparsecore_program as sc
from tests.builders import emulated_tpu_strategy

api = tf.tpu.experimental.embedding
SLOTS = ("parameters", "accumulators")


def _saved(path):
  """{table: {slot: value}} of a per-table checkpoint saved as tf.train.Checkpoint(x=...)."""
  reader = tf.train.load_checkpoint(path)
  def key(table, slot):
    name = table if slot == "parameters" else f"{table}.S{slot}"
    return [k for k in reader.get_variable_to_shape_map()
            if k.endswith(f"/{name}/.ATTRIBUTES/VARIABLE_VALUE")][0]
  return {t: {s: reader.get_tensor(key(t, s)) for s in SLOTS} for t in sc.VOCAB}


def _state_after(steps):
  """The numpy reference's tables and accumulators after ``steps`` steps (float32)."""
  params, acc = sc.numpy_reference(sc.global_batches()[:steps])
  return {t: {"parameters": params[t].astype(np.float32),
              "accumulators": acc[t].astype(np.float32)} for t in sc.VOCAB}


def _assign(variables_of, state):
  for table, slots in state.items():
    for slot, value in slots.items():
      variables_of(table)[slot].assign(value)


def _per_replica(strategy, batch):
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: sc.as_tensors(batch, ctx.replica_id_in_sync_group * sc.PER_REPLICA,
                              (ctx.replica_id_in_sync_group + 1) * sc.PER_REPLICA))


def _lookup_and_train(strategy, embedding, batch):
  """One training step; returns each replica's activations (before the update)."""
  @tf.function
  def step(features):
    def replica_step(f):
      activations, preserved = embedding.embedding_lookup(f)
      embedding.apply_gradients(sc.gradients(activations), preserved)
      return activations
    return strategy.run(replica_step, args=(features,))
  out = step(_per_replica(strategy, batch))
  per_feature = {n: [v.numpy() for v in strategy.experimental_local_results(a)]
                 for n, a in out.items()}
  return [{n: per_feature[n][r] for n in per_feature} for r in range(sc.REPLICAS)]


def _expected_activations(tables, batch):
  """Sum-combined rows of ``tables`` for each replica's samples (numpy)."""
  ids, lengths = batch["item"]
  starts = np.concatenate([[0], np.cumsum(lengths)])
  out = []
  for r in range(sc.REPLICAS):
    samples = range(r * sc.PER_REPLICA, (r + 1) * sc.PER_REPLICA)
    out.append({
        "user": np.stack([tables["user"][batch["user"][s]] for s in samples]),
        "item": np.stack([tables["item"][ids[starts[s]:starts[s + 1]]].sum(axis=0)
                          for s in samples])})
  return out


def _restored_tpu_embedding(path, when, name="embedding"):
  """Inside emulate_tpu: a TPUEmbeddingV2 of the program's tables that
  ``path`` was restored into, before or after its build (``when``);
  (strategy, embedding, the restore's status)."""
  strategy = emulated_tpu_strategy()
  with strategy.scope():
    embedding = api.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None)
  if when == "after_build":
    embedding.build()
  status = tf.train.Checkpoint(**{name: embedding}).restore(path)
  embedding.build()
  return strategy, embedding, status


def _restore_and_check(path, when, name="embedding"):
  """Restores ``path`` into a TPUEmbeddingV2 (before or after build), checks
  lookups and slots against the saved values and one step against numpy."""
  saved = _saved(path)
  batch = sc.global_batches()[2]
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy, embedding, status = _restored_tpu_embedding(path, when, name)
    assert {l.stack for l in embedding._sparsecore.layouts} == {"item_user"}  # pylint: disable=protected-access
    for table in sc.VOCAB:
      for slot in SLOTS:
        np.testing.assert_array_equal(embedding.table_variables(table)[slot].numpy(),
                                      saved[table][slot], err_msg=f"{table}/{slot}")
    # Every object of the checkpoint was matched; only the layouts, which a
    # per-table checkpoint does not hold, stay unmatched (as in TensorFlow).
    with pytest.raises(AssertionError) as unmatched:
      status.assert_consumed()
    assert "_Layouts" in str(unmatched.value)
    assert "_StackedVariable" not in str(unmatched.value)
    activations = _lookup_and_train(strategy, embedding, batch)
    after = {t: {s: v.numpy() for s, v in embedding.table_variables(t).items()}
             for t in sc.VOCAB}
  for replica, expected in zip(activations, _expected_activations(
      {t: saved[t]["parameters"] for t in sc.VOCAB}, batch)):
    for feature in sc.VOCAB:
      np.testing.assert_allclose(replica[feature], expected[feature], rtol=1e-6,
                                 atol=1e-6)
  reference = _state_after(3)
  for table in sc.VOCAB:
    for slot in SLOTS:
      np.testing.assert_allclose(after[table][slot], reference[table][slot],
                                 rtol=3e-5, atol=1e-6, err_msg=f"{table}/{slot}")


@pytest.fixture(scope="module")
def per_table_checkpoints(tmp_path_factory):
  """A per-table checkpoint of the state after 2 steps, from each kind of saver."""
  root = tmp_path_factory.mktemp("per_table")
  state = _state_after(2)
  out = {}
  # CPUEmbedding (the v1 engine) trained 2 steps itself.
  cpu = tee.CPUEmbedding(sc.feature_config(sc.REPLICAS * sc.PER_REPLICA))
  for batch in sc.global_batches()[:2]:
    cpu.enqueue(sc.as_tensors(batch), training=True)
    cpu.apply_gradients(sc.gradients(cpu.dequeue()))
  out["cpu_embedding"] = tf.train.Checkpoint(embedding=cpu).write(str(root / "cpu"))
  # TPUEmbedding (the emulated TPU v1 mid-level API).
  with tee.emulate_tpu(replicas=sc.REPLICAS):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      v1 = api.TPUEmbedding(sc.feature_config(sc.PER_REPLICA), None)
      v1.build()
    _assign(lambda t: v1._variables[t], state)  # pylint: disable=protected-access
    out["tpu_embedding"] = tf.train.Checkpoint(embedding=v1).write(str(root / "v1"))
  # TensorFlow's own TPUEmbeddingForServing.
  serving = api.TPUEmbeddingForServing(sc.feature_config(sc.PER_REPLICA), None)
  serving.build()
  _assign(lambda t: serving._variables[t], state)  # pylint: disable=protected-access
  out["for_serving"] = tf.train.Checkpoint(embedding=serving).write(str(root / "serving"))
  return out


@pytest.mark.parametrize("when", ["before_build", "after_build"])
@pytest.mark.parametrize("source", ["cpu_embedding", "tpu_embedding", "for_serving"])
def test_per_table_checkpoint_restores_into_stacked_tables(per_table_checkpoints,
                                                           source, when):
  _restore_and_check(per_table_checkpoints[source], when)


def test_keras_model_checkpoint_restores_into_the_tpu_model(tmp_path):
  # The same Keras model: on CPU (CPUEmbedding) it saves per table; under a
  # TPUStrategy with SparseCore its EmbeddingLayer runs TPUEmbeddingV2.
  def model():
    features = {n: keras.Input(shape=(), dtype="int64", name=n) for n in sc.VOCAB}
    layer = tee.EmbeddingLayer(sc.feature_config(sc.PER_REPLICA), name="embedding")
    return keras.Model(features, layer(features)), layer
  state = _state_after(2)
  cpu_model, cpu_layer = model()
  cpu_layer.embedding.build()
  _assign(lambda t: cpu_layer.embedding.variables[t], state)
  path = tf.train.Checkpoint(model=cpu_model).write(str(tmp_path / "keras"))
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      tpu_model, tpu_layer = model()
    assert type(tpu_layer.embedding).__name__ == "TPUEmbeddingV2"
    tf.train.Checkpoint(model=tpu_model).read(path)
    tpu_layer.embedding.build()
    for table in sc.VOCAB:
      for slot in SLOTS:
        np.testing.assert_array_equal(
            tpu_layer.embedding.table_variables(table)[slot].numpy(),
            state[table][slot], err_msg=f"{table}/{slot}")


def _stacked_on(tmp_path, topology, state):
  other = tee.CPUEmbedding(sc.feature_config(sc.PER_REPLICA), engine="v2", topology=topology)
  other.build()
  _assign(lambda t: other.variables[t], state)
  return tf.train.Checkpoint(embedding=other).save(str(tmp_path / f"stacked{topology}"))


@pytest.mark.parametrize("when", ["before_build", "after_build"])
def test_stacked_checkpoint_of_another_topology_is_resharded(tmp_path, when):
  path = _stacked_on(tmp_path, Topology(4, 4), _state_after(2))
  assert checkpoint_layouts(path)[0].num_sparse_cores == 16
  # _saved reads per-table keys: give it the same values per table.
  per_table = tee.CPUEmbedding(sc.feature_config(sc.PER_REPLICA))
  per_table.build()
  _assign(lambda t: per_table.variables[t], _state_after(2))
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    _, embedding, status = _restored_tpu_embedding(path, when)
    status.assert_consumed()  # every stacked object and the layouts matched
    for table in sc.VOCAB:
      for slot in SLOTS:
        np.testing.assert_array_equal(embedding.table_variables(table)[slot].numpy(),
                                      _state_after(2)[table][slot])


def test_converted_checkpoint_restores_whatever_batch_size_it_was_made_for(tmp_path):
  # convert-checkpoint's layouts record a per-SparseCore batch size the
  # program's may not share; it places no row, so the restore is direct.
  cpu = tee.CPUEmbedding(sc.feature_config(sc.PER_REPLICA))
  cpu.build()
  _assign(lambda t: cpu.variables[t], _state_after(2))
  path = tf.train.Checkpoint(embedding=cpu).save(str(tmp_path / "cpu"))
  converted = str(tmp_path / "converted")
  convert_checkpoint(path, converted, sc.feature_config(3 * sc.PER_REPLICA), "2x4")
  assert checkpoint_layouts(converted)[0].per_sparse_core_batch_size != sc.PER_REPLICA // 4
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None)
    status = tf.train.Checkpoint(embedding=embedding).restore(converted)
    embedding.build()
    status.assert_consumed()
    for table in sc.VOCAB:
      for slot in SLOTS:
        np.testing.assert_array_equal(embedding.table_variables(table)[slot].numpy(),
                                      _state_after(2)[table][slot])


def _refused(path, error, message, config=None, wrapped=False):
  """Restoring ``path`` raises ``error`` with ``message``; no table changed.

  ``wrapped``: TensorFlow's restore puts its own line before a NotFoundError
  ("Error when restoring from checkpoint or SavedModel at <path>: ...")."""
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(config or sc.feature_config(sc.PER_REPLICA), None)
    embedding.build()
    before = {t: {s: v.numpy() for s, v in embedding.table_variables(t).items()}
              for t in embedding.embedding_layouts}
    with pytest.raises(error) as e:
      tf.train.Checkpoint(embedding=embedding).restore(path)
    for table, slots in before.items():
      for slot, value in slots.items():
        np.testing.assert_array_equal(embedding.table_variables(table)[slot].numpy(),
                                      value)
  got = e.value.message if hasattr(e.value, "message") else str(e.value)
  if wrapped:
    assert got.startswith(f"Error when restoring from checkpoint or SavedModel at "
                          f"{path}: {message}\n")
  else:
    assert got == message


def test_stacked_checkpoint_of_other_tables_is_refused_as_tensorflow_does(tmp_path):
  config = sc.feature_config(sc.PER_REPLICA)
  config["extra"] = api.FeatureConfig(api.TableConfig(16, sc.DIM, name="extra"),
                                      output_shape=[sc.PER_REPLICA])
  other = tee.CPUEmbedding(config, api.Adagrad(0.1), engine="v2", topology=Topology(2, 4))
  other.build()
  path = tf.train.Checkpoint(embedding=other).write(str(tmp_path / "three"))
  _refused(path, ValueError,
           "Layouts in checkpoint and embedding must have the same keys. found "
           "['extra', 'item', 'user'] and ['item', 'user'] (checkpoint "
           f"{path}: its SparseCore tables are not this embedding's). Fix: restore "
           "a checkpoint of the same tables, or one saved per table.")


def test_per_table_checkpoint_of_other_shapes_is_refused(tmp_path):
  config = sc.feature_config(sc.PER_REPLICA)
  config["user"] = api.FeatureConfig(api.TableConfig(sc.VOCAB["user"] + 1, sc.DIM, name="user"),
                                     output_shape=[sc.PER_REPLICA])
  cpu = tee.CPUEmbedding(config, api.Adagrad(0.2, initial_accumulator_value=0.1))
  cpu.build()
  path = tf.train.Checkpoint(embedding=cpu).write(str(tmp_path / "bigger"))
  _refused(path, tf.errors.InvalidArgumentError,
           f"shape in shape_and_slice spec [{sc.VOCAB['user']}, {sc.DIM}] does not match "
           f"the shape stored in checkpoint: [{sc.VOCAB['user'] + 1}, {sc.DIM}] (table "
           f"'user', key embedding/user/.ATTRIBUTES/VARIABLE_VALUE of {path}). Fix: "
           "restore a checkpoint of tables with this vocabulary_size and dim.")


def test_per_table_checkpoint_missing_a_table_of_a_stack_is_refused(tmp_path):
  config = {"user": sc.feature_config(sc.PER_REPLICA)["user"]}
  cpu = tee.CPUEmbedding(config)
  cpu.build()
  path = tf.train.Checkpoint(embedding=cpu).write(str(tmp_path / "user_only"))
  _refused(path, tf.errors.NotFoundError,
           "Key embedding/item/.ATTRIBUTES/VARIABLE_VALUE not found in checkpoint "
           f"(checkpoint {path} holds table 'user' but not 'item' of SparseCore stack "
           "'item_user', which is restored as one). Fix: restore a checkpoint with "
           "every table of this embedding.", wrapped=True)


def _single_table(value):
  """One table ("video", a stack of its own named like it) of constant ``value``."""
  return api.FeatureConfig(api.TableConfig(
      64, 8, name="video", initializer=tf.constant_initializer(value),
      optimizer=api.SGD(1.0)), name="watched", output_shape=[sc.PER_REPLICA])


def test_stacked_checkpoint_restores_before_build_over_another_initializer(tmp_path):
  # TensorFlow's tpu_embedding_v3_checkpoint_test, on public members: a
  # TPUEmbeddingV2 saved, restored before build into one whose initializer
  # differs; the saved rows win, shard by shard.
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      first = api.TPUEmbeddingV2(_single_table(1.0), api.SGD())
      first.build()
      first.table_variables("video")["parameters"].assign(
          tf.reshape(tf.range(64 * 8, dtype=tf.float32), [64, 8]))
      path = tf.train.Checkpoint(model=first).save(str(tmp_path / "save"))
      second = api.TPUEmbeddingV2(_single_table(2.0), api.SGD())
    status = tf.train.Checkpoint(model=second).restore(path)
    second.build()
    status.assert_consumed()
    saved, restored = (e.embedding_tables["video"] for e in (first, second))
    assert len(restored.values) == sc.REPLICAS
    for a, b in zip(saved.values, restored.values):
      np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(second.table_variables("video")["parameters"].numpy(),
                                  np.arange(64 * 8, dtype=np.float32).reshape(64, 8))


def _single_table_checkpoint(tmp_path, rows) -> str:
  """A per-table checkpoint (CPUEmbedding's) of ``_single_table`` holding ``rows``."""
  cpu = tee.CPUEmbedding(_single_table(0.0), api.SGD(1.0))
  cpu.build()
  cpu.variables["video"]["parameters"].assign(rows)
  return tf.train.Checkpoint(embedding=cpu).write(str(tmp_path / "per_table"))


@pytest.mark.parametrize("when", ["before_build", "after_build"])
def test_per_table_checkpoint_of_a_table_named_like_its_stack(tmp_path, when):
  # One table: its stack has its name, so the per-table key "video" names
  # the stacked variable too; the checkpoint's missing layouts tell them apart.
  rows = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  path = _single_table_checkpoint(tmp_path, rows)
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(_single_table(2.0), api.SGD())
    if when == "after_build":
      embedding.build()
    tf.train.Checkpoint(embedding=embedding).restore(path)
    embedding.build()
    np.testing.assert_array_equal(
        embedding.table_variables("video")["parameters"].numpy(), rows)


@pytest.mark.parametrize("last", ["per_table", "stacked"])
def test_two_restores_before_build_apply_in_order(tmp_path, last):
  # A per-table checkpoint (the router's) and one of this layout
  # (TensorFlow's own deferral) restored before build: the later one wins,
  # as between any two restores.
  per_table_rows = np.full((64, 8), 3.0, np.float32)
  per_table = _single_table_checkpoint(tmp_path, per_table_rows)
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      first = api.TPUEmbeddingV2(_single_table(5.0), api.SGD())
      first.build()
      stacked = tf.train.Checkpoint(embedding=first).write(str(tmp_path / "stacked"))
      embedding = api.TPUEmbeddingV2(_single_table(2.0), api.SGD())
    order = [stacked, per_table] if last == "per_table" else [per_table, stacked]
    for path in order:
      tf.train.Checkpoint(embedding=embedding).restore(path)
    embedding.build()
    expected = 3.0 if last == "per_table" else 5.0
    np.testing.assert_array_equal(
        embedding.table_variables("video")["parameters"].numpy(),
        np.full((64, 8), expected, np.float32))
