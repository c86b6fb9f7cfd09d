"""What many test files build: small engines, their batches, their state.

Each builder's name says what it builds. A file keeps its own helper only
where its engine differs (other tables, other inputs); then the helper's name
says how. The numpy optimizer references live in tests/references.py.
"""

import re
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee

api = tf.tpu.experimental.embedding

# --- strategies ------------------------------------------------------------------

def mirrored_strategy(replicas):
  """MirroredStrategy over the first ``replicas`` logical CPUs (tests/conftest.py)."""
  if len(tf.config.list_logical_devices("CPU")) < replicas:
    pytest.fail(f"needs {replicas} logical CPU devices (tests/conftest.py)")
  # ReductionToOneDevice: collective all-reduces of strategies of different
  # sizes in one process clash over group keys (a TensorFlow limitation;
  # a program has one strategy).
  return tf.distribute.MirroredStrategy(
      [f"/cpu:{i}" for i in range(replicas)],
      cross_device_ops=tf.distribute.ReductionToOneDevice())


def emulated_tpu_strategy(initialize=True):
  """The TPUStrategy a TPU program builds (inside tee.emulate_tpu): its resolver,
  initialize_tpu_system (unless ``initialize`` is False), the strategy."""
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
  if initialize:
    tf.tpu.experimental.initialize_tpu_system(resolver)
  return tf.distribute.TPUStrategy(resolver)


# --- one table 't' of 6 x 2 fed by feature 'f' --------------------------------------

# The single-table engine's table 't': 6 rows of dim 2, row i = [2i, 2i+1] / 10.
SINGLE_TABLE_VALUES = np.arange(12.).reshape(6, 2) / 10
# A batch of two samples for feature 'f': ids [1, 2] and [3].
TWO_SAMPLE_IDS = [[1, 2], [3]]


def single_table_engine(optimizer, engine="v1", **engine_kwargs):
  """CPUEmbedding of feature 'f' on table 't' (SINGLE_TABLE_VALUES, sum)."""
  table = api.TableConfig(6, 2, combiner="sum", name="t",
                          initializer=tf.constant_initializer(SINGLE_TABLE_VALUES))
  # TPUEmbeddingV2 needs every feature's output_shape (one id per step here).
  output_shape = [1] if engine == "v2" else None
  return tee.CPUEmbedding(
      {"f": api.FeatureConfig(table, name="f", output_shape=output_shape)},
      optimizer, engine=engine, **engine_kwargs)


def two_sample_ids():
  """TWO_SAMPLE_IDS for feature 'f', ragged."""
  return {"f": tf.ragged.constant(TWO_SAMPLE_IDS, tf.int64)}


def train_step(emb, ids, grad_rows, feature="f"):
  """One eager step of ragged ``ids`` with the activations' gradient ``grad_rows``."""
  emb.enqueue({feature: tf.ragged.constant(ids, tf.int64)}, training=True)
  emb.dequeue()
  emb.apply_gradients({feature: tf.constant(grad_rows, tf.float32)})


def engine_state(emb):
  """Every table and slot (by 'table/slot') and the table step, as numpy copies."""
  out = {f"{t}/{k}": v.numpy().copy() for t, s in emb.variables.items()
         for k, v in s.items()}
  out["step"] = emb.step.numpy()
  return out


def assert_same_state(after, before):
  """Two engine_state()s are equal, key by key (a rejected step changed nothing)."""
  assert after.keys() == before.keys()
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def three_combiner_feature_config(quantize=False):
  """Features of every input layout over three tables (sum, mean, sqrtn): dense,
  ragged, sparse, sequence and reshaped output; ``quantize``: simulated
  quantization on every table."""
  q = api.QuantizationConfig(num_buckets=5, lower=-0.5, upper=0.5) if quantize else None
  tables = {c: api.TableConfig(20, 3, combiner=c, name=f"t_{c}", quantization_config=q,
                               initializer=tf.random_uniform_initializer(seed=1))
            for c in ("sum", "mean", "sqrtn")}
  return {
      "dense": api.FeatureConfig(tables["sum"], name="dense"),
      "ragged_sum": api.FeatureConfig(tables["sum"], name="ragged_sum"),
      "ragged_mean": api.FeatureConfig(tables["mean"], name="ragged_mean"),
      "sparse_sqrtn": api.FeatureConfig(tables["sqrtn"], name="sparse_sqrtn"),
      "sequence": api.FeatureConfig(tables["mean"], max_sequence_length=3,
                                    name="sequence"),
      "sparse_sequence": api.FeatureConfig(tables["sqrtn"], max_sequence_length=2,
                                           name="sparse_sequence"),
      "reshaped": api.FeatureConfig(tables["sum"], output_shape=[2, 2],
                                    name="reshaped"),
  }


def three_combiner_inputs():
  """(features, weights) of a batch of 4 for three_combiner_feature_config()."""
  ragged = tf.ragged.constant([[1, 2, 2], [], [5], [7, 8, 9, 10]], tf.int64)
  weights = tf.ragged.constant([[0.5, 1.0, 2.0], [], [3.0], [1.0, 1.0, 0.5, 0.25]])
  # Dense ids of rank 1: the one dense shape on which TPUEmbedding and
  # TPUEmbeddingForServing agree (tests/test_engine_matches_tpu_embedding.py covers the others).
  features = {"dense": tf.constant([1, 3, 0, 19], tf.int64),
              "ragged_sum": ragged, "ragged_mean": ragged,
              "sparse_sqrtn": ragged.to_sparse(), "sequence": ragged,
              "sparse_sequence": ragged.to_sparse(), "reshaped": ragged}
  w = {k: None for k in features}
  w.update(ragged_sum=weights, ragged_mean=weights, sparse_sqrtn=weights.to_sparse())
  return features, w


# --- four tables that SparseCore stacks (three in one stack), fed 4 rows a step

# name: (rows, dim): "b" and "c" stack with "a" when optimizers are equal;
# dims 5 and 13 pad to 8 and 16 columns, rows to a multiple of 8 x SparseCores.
FOUR_TABLES = {"a": (100, 8), "b": (13, 5), "c": (70, 8), "d": (9, 13)}
# One TensorFlow embedding optimizer of each kind, by name (factories).
EMBEDDING_OPTIMIZERS = {
    "sgd": lambda: api.SGD(0.1),
    "adagrad": lambda: api.Adagrad(0.1, initial_accumulator_value=0.5),
    "adagrad_momentum": lambda: api.AdagradMomentum(0.1, momentum=0.9),
    "adam": lambda: api.Adam(0.01),
    "ftrl": lambda: api.FTRL(0.1, initial_accumulator_value=0.2, beta=0.1),
}


def four_table_feature_config():
  """One feature per FOUR_TABLES table (output_shape [4]), random initial values."""
  tables = {n: api.TableConfig(vocabulary_size=r, dim=d, name=n,
                               initializer=tf.random_uniform_initializer(-1, 1, seed=i))
            for i, (n, (r, d)) in enumerate(FOUR_TABLES.items())}
  return {n: api.FeatureConfig(table=t, name=n, output_shape=[4])
          for n, t in tables.items()}


def four_table_batch(step):
  """Step ``step``'s ragged ids (1 to 3 a row, 4 rows) of every FOUR_TABLES feature."""
  rng = np.random.default_rng(step)
  return {n: tf.ragged.constant([list(rng.integers(0, r, size=rng.integers(1, 4)))
                                 for _ in range(4)], dtype=tf.int64)
          for n, (r, _) in FOUR_TABLES.items()}


def train_four_tables(emb, steps, start=0):
  """Steps start..start+steps-1 of four_table_batch, gradient sin(act + step)."""
  for step in range(start, start + steps):
    emb.enqueue(four_table_batch(step), training=True)
    acts = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(
        lambda a: tf.sin(a + float(step)), acts))  # pylint: disable=cell-var-from-loop


def checkpoint_values(path):
  """Every tensor of the checkpoint at ``path`` (a prefix), by key."""
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


# --- TensorFlow's own TPU embedding test scenario (tpu_embedding_base_test.py) --

# Table "video" (8 x 4, sum) feeds "watched" and "favorited"; "user" (16 x 2,
# mean) feeds "friends"; row i holds its own index range.
SCENARIO_VIDEO = np.arange(32, dtype=np.float32).reshape(8, 4)
SCENARIO_USER = np.arange(32, dtype=np.float32).reshape(16, 2)
# Upstream's sparse data set: one replica's batch of 4.
SCENARIO_IDS = {"watched": [[0], [0, 1], [0, 1], [1]],
                "favorited": [[0, 1], [1], [0], [0, 1]],
                "friends": [[3], [0, 1, 2], [3], [0, 1, 2]]}


def scenario_tables():
  """(video, user) TableConfigs of the scenario, no optimizer of their own."""
  video = api.TableConfig(8, 4, initializer=tf.constant_initializer(SCENARIO_VIDEO),
                          combiner="sum", name="video")
  user = api.TableConfig(16, 2, initializer=tf.constant_initializer(SCENARIO_USER),
                         combiner="mean", name="user")
  return video, user


def scenario_features(**feature_kwargs):
  """The scenario's (watched, favorited, friends) FeatureConfigs, as upstream's
  tuple; ``feature_kwargs`` go to each (e.g. output_shape)."""
  video, user = scenario_tables()
  return (api.FeatureConfig(video, name="watched", **feature_kwargs),
          api.FeatureConfig(video, name="favorited", **feature_kwargs),
          api.FeatureConfig(user, name="friends", **feature_kwargs))


def scenario_features_by_name(**feature_kwargs):
  """scenario_features() as a dict by feature name."""
  return {f.name: f for f in scenario_features(**feature_kwargs)}


def in_graph(message: str) -> str:
  """A regex of ``message`` as ``tf.debugging.Assert`` prints it (quotes escaped)."""
  return re.escape(message).replace("'", r"\\'")
