"""``TPUEmbeddingV2``'s private members under the emulated TPU, against numpy.

TensorFlow's own ``tpu_embedding_v3_checkpoint_test.py`` reads
``_variables[stack]["parameters"]`` (a ``TPUEmbeddingShardedVariable`` with one
shard per chip) and replaces ``_batch_initialize_tables`` to prove that a
restore before ``build`` initialises nothing (emulated_tpu/sharded_views.py).
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.tpu import tpu_embedding_v3

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tests import sparsecore_program as sc
from tests.builders import emulated_tpu_strategy

api = tf.tpu.experimental.embedding
STACK = "item_user"


def _stacked_reference(embedding, tables):
  """numpy: ``{stack: {slot: stacked array}}`` from per-table arrays
  ``{table: {slot: (vocab, dim)}}``, placed by the layout proto's fields
  (sparse_core_layout.proto: padded row r is on SparseCore
  (r % N + rotation) % N, at row_offset + r // N of that core's rows).
  Padding holds 0 (parameters) or the slot's initial value."""
  out = {}
  for name, layout in embedding.embedding_layouts.items():
    n = layout.num_sparse_cores
    per_core = layout.total_rows_per_sparse_core_shard
    for slot, value in tables[name].items():
      fill = 0.0 if slot == "parameters" else sc.INITIAL_ACCUMULATOR
      whole = out.setdefault(layout.stacked_table_name, {}).setdefault(
          slot, np.full((n * per_core, layout.unsharded_padded_shape[1]), fill))
      for r in range(layout.unsharded_shape[0]):
        core = (r % n + layout.sparse_core_shard_rotation) % n
        whole[core * per_core + layout.sparse_core_shard_row_offset + r // n,
              :value.shape[1]] = value[r]
  return out


def _initial_tables():
  return {n: {"parameters": sc.initial(n),
              "accumulators": np.full((sc.VOCAB[n], 4), sc.INITIAL_ACCUMULATOR)} for n in sc.VOCAB}


def _assert_shards(shards, whole):
  """``shards`` are ``whole`` split evenly over the replicas (the chips)."""
  assert len(shards) == sc.REPLICAS
  for i, shard in enumerate(shards):
    rows = whole.shape[0] // sc.REPLICAS
    np.testing.assert_allclose(np.asarray(shard), whole[i * rows:(i + 1) * rows],
                               rtol=2e-5, atol=1e-6)


READ_ONLY = ("stacked table 'item_user' is a read-only view in the emulated "
             "TPUEmbeddingV2 (its tables are kept per table). Fix: restore a "
             "checkpoint (tf.train.Checkpoint(embedding=...).restore) to change "
             "the tables.")


def test_private_variables_are_tensorflows_sharded_variables_of_the_stacked_layout():
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy, embedding = sc.tpu_program(sc.global_batches())
    params, acc = sc.numpy_reference()
    expected = _stacked_reference(embedding, {
        n: {"parameters": params[n], "accumulators": acc[n]} for n in sc.VOCAB})
    variables = embedding._variables  # pylint: disable=protected-access
    assert sorted(variables) == [STACK]
    assert sorted(variables[STACK]) == ["accumulators", "parameters"]
    for slot, var in variables[STACK].items():
      assert isinstance(var, tpu_embedding_v3.TPUEmbeddingShardedVariable)
      assert isinstance(var, tf.Variable)
      assert var.shape == expected[STACK][slot].shape
      _assert_shards([s.numpy() for s in var.values], expected[STACK][slot])
      _assert_shards([s.numpy() for s in embedding.variables[STACK][slot].values],
                     expected[STACK][slot])
      # Converted on the host, TensorFlow's sharded variable is its first shard.
      np.testing.assert_array_equal(tf.convert_to_tensor(var).numpy(),
                                    var.values[0].numpy())
    assert embedding.embedding_tables[STACK].name == STACK
    # The engine's own variables stay per table.
    np.testing.assert_allclose(embedding.table_variables("user")["parameters"].numpy(),
                               params["user"], rtol=2e-5, atol=1e-6)
    parameters = variables[STACK]["parameters"]
    before = parameters.numpy()
    for write in (lambda: parameters.assign(tf.zeros(parameters.shape)),
                  lambda: parameters.assign_add(tf.ones(parameters.shape)),
                  lambda: parameters.scatter_update(
                      tf.IndexedSlices(tf.zeros([1, 8]), tf.constant([0])))):
      with pytest.raises(errors.ConfigError) as e:
        write()
      assert str(e.value) == READ_ONLY
    np.testing.assert_array_equal(parameters.numpy(), before)
    assert strategy.num_replicas_in_sync == sc.REPLICAS


def _never_initialized(hook):
  del hook
  pytest.fail("initialized")


def _restored_then_built(strategy, path, initialize):
  """A TPUEmbeddingV2 restored from ``path`` before ``build``; its
  ``_batch_initialize_tables`` calls ``initialize(TensorFlow's own)``."""
  with strategy.scope():
    embedding = api.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None)
    hook = embedding._batch_initialize_tables  # pylint: disable=protected-access
    embedding._batch_initialize_tables = lambda: initialize(hook)  # pylint: disable=protected-access
  tf.train.Checkpoint(model=embedding).restore(path)
  embedding.build()
  return embedding


def test_batch_initialize_tables_is_called_once_unless_a_restore_fills_every_table(tmp_path):
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy(initialize=False)
    with strategy.scope():
      first = api.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None)
      calls, returned = [], []
      hook = first._batch_initialize_tables  # pylint: disable=protected-access

      def spy(*args, **kwargs):
        calls.append((args, kwargs))
        returned.append(hook())
        return returned[-1]
      first._batch_initialize_tables = spy  # pylint: disable=protected-access
      first.build()
      first.build()
    assert calls == [((), {})]  # once, without arguments, as upstream calls it
    initial = _stacked_reference(first, _initial_tables())
    assert sorted(returned[0]) == [STACK]
    for slot in ("parameters", "accumulators"):
      _assert_shards([s.numpy() for s in returned[0][STACK][slot]], initial[STACK][slot])
    saved = tf.train.Checkpoint(model=first).write(str(tmp_path / "stacked"))

    # A restore waiting for build fills every variable: no initialisation.
    second = _restored_then_built(strategy, saved, _never_initialized)
    _assert_shards([s.numpy() for s in second._variables[STACK]["parameters"].values],  # pylint: disable=protected-access
                   initial[STACK]["parameters"])

    # So does a per-table checkpoint with every slot (restored through the router).
    cpu = tee.CPUEmbedding(sc.feature_config(sc.PER_REPLICA))
    cpu.build()
    per_table = tf.train.Checkpoint(model=cpu).write(str(tmp_path / "per_table"))
    _restored_then_built(strategy, per_table, _never_initialized)

    # One without the accumulators: they need initial values, so it is called.
    sgd = tee.CPUEmbedding({n: api.FeatureConfig(
        api.TableConfig(sc.VOCAB[n], 4, name=n, initializer=tf.constant_initializer(
            sc.initial(n) * 2)), output_shape=[sc.PER_REPLICA]) for n in sc.VOCAB},
        api.SGD(0.1))
    sgd.build()
    partial = tf.train.Checkpoint(model=sgd).write(str(tmp_path / "sgd"))
    fourth_calls = []
    fourth = _restored_then_built(
        strategy, partial, lambda hook: (fourth_calls.append(1), hook())[1])
    assert fourth_calls == [1]
    expected = _stacked_reference(fourth, {n: {
        "parameters": sc.initial(n) * 2,
        "accumulators": np.full((sc.VOCAB[n], 4), sc.INITIAL_ACCUMULATOR)} for n in sc.VOCAB})
    for slot in ("parameters", "accumulators"):
      _assert_shards([s.numpy() for s in fourth._variables[STACK][slot].values],  # pylint: disable=protected-access
                     expected[STACK][slot])


def test_batch_initialize_tables_replacement_gives_the_initial_values(tmp_path):
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy(initialize=False)
    with strategy.scope():
      other = api.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None)
      other.build()
    saved = tf.train.Checkpoint(model=other).write(str(tmp_path / "initial"))
    rng = np.random.RandomState(3)
    theirs = {n: {"parameters": rng.uniform(-1, 1, (sc.VOCAB[n], 4)),
                  "accumulators": rng.uniform(0.1, 1, (sc.VOCAB[n], 4))} for n in sc.VOCAB}
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None)
    stacked = _stacked_reference(embedding, theirs)
    embedding._batch_initialize_tables = lambda: {  # pylint: disable=protected-access
        STACK: {slot: np.split(whole.astype(np.float32), sc.REPLICAS)
                for slot, whole in stacked[STACK].items()}}

    @tf.function
    def first_use():  # builds while tracing, as a first step does
      embedding.build()
      return tf.constant(0)

    first_use()
    for name in sc.VOCAB:
      for slot, value in theirs[name].items():
        np.testing.assert_allclose(embedding.table_variables(name)[slot].numpy(), value,
                                   rtol=1e-6)
    for slot in ("parameters", "accumulators"):
      _assert_shards([s.numpy() for s in embedding._variables[STACK][slot].values],  # pylint: disable=protected-access
                     stacked[STACK][slot])
    # The initial values were written once, outside the traced function.
    tf.train.Checkpoint(model=embedding).restore(saved)
    first_use()
    for name in sc.VOCAB:
      np.testing.assert_array_equal(embedding.table_variables(name)["parameters"].numpy(),
                                    sc.initial(name))


BAD_INITIAL_VALUES = {
    "one shard": (
        lambda whole: [whole],
        "_batch_initialize_tables() returned 1 shard(s) of total shape (128, 8) for "
        "stacked table 'item_user', slot 'accumulators'; it needs 2 shards (one per "
        "chip) of shape (64, 8). Fix: return one shard per chip of the stacked layout."),
    "no slot": (
        None,
        "_batch_initialize_tables() returned no shards for stacked table 'item_user', "
        "slot 'accumulators' (KeyError('accumulators')). Fix: return {stacked table "
        "name: {slot: [one tensor per chip]}} for every stacked table."),
}


@pytest.mark.parametrize("case", sorted(BAD_INITIAL_VALUES))
def test_bad_batch_initialize_tables_values_are_refused_and_change_nothing(case):
  shards, message = BAD_INITIAL_VALUES[case]
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    with emulated_tpu_strategy(initialize=False).scope():
      embedding = api.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None)
    whole = np.zeros((128, 8), np.float32)
    embedding._batch_initialize_tables = lambda: {STACK: (  # pylint: disable=protected-access
        {"parameters": np.split(whole, sc.REPLICAS)} if shards is None else
        {"parameters": np.split(whole, sc.REPLICAS), "accumulators": shards(whole)})}
    with pytest.raises(errors.ConfigError) as e:
      embedding.build()
    assert str(e.value) == message
    for name in sc.VOCAB:
      np.testing.assert_array_equal(
          embedding.table_variables(name)["parameters"].numpy(), sc.initial(name))


def test_a_view_in_a_checkpoint_of_its_own_saves_and_restores_the_tables(tmp_path):
  """Not a silent no-op: the view writes the stacked variable, and reading it
  back writes every table of the stack."""
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    _, trained = sc.tpu_program(sc.global_batches())
    path = tf.train.Checkpoint(v=trained._variables[STACK]["parameters"]).write(  # pylint: disable=protected-access
        str(tmp_path / "view"))
    with emulated_tpu_strategy(initialize=False).scope():
      fresh = api.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None)
    fresh.build()
    tf.train.Checkpoint(v=fresh._variables[STACK]["parameters"]).read(path).assert_consumed()  # pylint: disable=protected-access
    params, _ = sc.numpy_reference()
    for name in sc.VOCAB:
      np.testing.assert_allclose(fresh.table_variables(name)["parameters"].numpy(),
                                 params[name], rtol=2e-5, atol=1e-6)
      np.testing.assert_array_equal(fresh.table_variables(name)["accumulators"].numpy(),
                                    np.full((sc.VOCAB[name], 4), sc.INITIAL_ACCUMULATOR,
                                            np.float32))
