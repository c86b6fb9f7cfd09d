"""A SparseCore program on two tables that SparseCore stacks ("item_user"):
its feature config, its global batches, the TPU training loop as TPU users
write it, the CPU engine's run of the same batches, and the TPU's math in
numpy. The emulated-SparseCore tests (and tests/tpu_programs/
sparsecore_mid_level.py, which draws the same batches) share it.
"""

import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee
from tests import references

api = tf.tpu.experimental.embedding
REPLICAS, PER_REPLICA, STEPS, DIM = 2, 8, 3, 4
VOCAB = {"user": 40, "item": 24}
LR, INITIAL_ACCUMULATOR = 0.2, 0.1


def initial(name):
  return np.random.RandomState(len(name)).uniform(-1, 1, (VOCAB[name], DIM)).astype(
      np.float32)


def feature_config(batch):
  """Two tables of one dim and optimizer: SparseCore stacks them ("item_user")."""
  optimizer = api.Adagrad(LR, initial_accumulator_value=INITIAL_ACCUMULATOR)
  tables = {n: api.TableConfig(VOCAB[n], DIM, name=n, combiner="sum",
                               optimizer=optimizer,
                               initializer=tf.constant_initializer(initial(n)))
            for n in VOCAB}
  return {"user": api.FeatureConfig(tables["user"], output_shape=[batch]),
          "item": api.FeatureConfig(tables["item"], output_shape=[batch])}


def global_batches(n=REPLICAS * PER_REPLICA):
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


def as_tensors(batch, lo=0, hi=None):
  """Samples [lo, hi) of a global batch as the engine takes them."""
  ids, lengths = batch["item"]
  items = tf.RaggedTensor.from_row_lengths(ids, lengths)[lo:hi]
  return {"user": tf.constant(batch["user"][lo:hi]), "item": items}


def gradients(activations):
  """dL/da of L = 0.5 * sum((a - 1)^2) over the batch: a - 1."""
  return tf.nest.map_structure(lambda a: a - 1.0, activations)


def numpy_reference(batches=None):
  """The TPU's math: per-id gradients summed over the global batch, Adagrad once per step."""
  params = {n: initial(n).astype(np.float64) for n in VOCAB}
  acc = {n: np.full((VOCAB[n], DIM), INITIAL_ACCUMULATOR) for n in VOCAB}
  for batch in batches or global_batches():
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


def tpu_program(batches, sparse_core_config=None):
  """A SparseCore training loop as TPU users write it; returns the embedding."""
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  strategy = tf.distribute.TPUStrategy(resolver)
  with strategy.scope():
    embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(
        feature_config(PER_REPLICA), None,
        sparse_core_embedding_config=sparse_core_config)

  @tf.function
  def step(batch):
    def replica_step(features):
      activations, preserved = embedding.embedding_lookup(features)
      embedding.apply_gradients(gradients(activations), preserved)
      return activations["user"]
    return strategy.run(replica_step, args=(batch,))

  for batch in batches:
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx, b=batch: as_tensors(
            b, ctx.replica_id_in_sync_group * PER_REPLICA,
            (ctx.replica_id_in_sync_group + 1) * PER_REPLICA))
    step(per_replica)
  return strategy, embedding


def cpu_run(batches=None):
  batches = batches or global_batches()
  emb = tee.CPUEmbedding(feature_config(len(batches[0]["user"])), engine="v2")
  for batch in batches:
    emb.enqueue(as_tensors(batch), training=True)
    emb.apply_gradients(gradients(emb.dequeue()))
  return emb
