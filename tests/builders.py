"""What many test files build: small engines, their batches, their state.

Each builder's name says what it builds. A file keeps its own helper only
where its engine differs (other tables, other inputs); then the helper's name
says how. The numpy optimizer references live in tests/references.py.
"""

import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee

api = tf.tpu.experimental.embedding

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
