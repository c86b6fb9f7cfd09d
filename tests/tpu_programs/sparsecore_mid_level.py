"""A SparseCore (TPUEmbeddingV2) program in the style of TensorFlow's TPU docs.

Written against TensorFlow's API only (nothing from tpu_embed_ext): it finds
the TPU, builds ``TPUStrategy`` and a ``TPUEmbeddingV2`` with two tables of
one dim and optimizer (SparseCore stacks them), trains a few steps with
``embedding_lookup`` and ``apply_gradients(gradients, preserved_outputs)``
inside ``strategy.run`` on ``experimental_distribute_dataset`` and saves a
``tf.train.Checkpoint`` (TPUEmbeddingV2's stacked layout). Its flags
(``--tpu``, ``--model_dir``) are the names ``python -m tpu_embed_ext`` uses.

Tests run it under ``python -m tpu_embed_ext emulate --sparsecore
--replicas N`` and check the tables against their own reference. Its inputs:
``np.random.RandomState(7)`` draws, per step, ``GLOBAL_BATCH`` item counts
in [1, 4), the users (one id each, in [0, 40)) and then the items (ids in
[0, 24)); both tables combine with ``sum``. The loss is
``0.5 * sum((activation - 1)^2)`` over both features, so each activation's
gradient is ``activation - 1``. Tables start at
``RandomState(len(name)).uniform(-1, 1, (rows, 4))`` (float32) and train with
Adagrad (0.2, initial accumulator 0.1). The global batch splits over every
replica's SparseCores (4 per chip by default), so at up to 8 replicas each
replica's 4 examples or more go one or more to each SparseCore.
"""

import os

from absl import app, flags
import numpy as np
import tensorflow as tf

FLAGS = flags.FLAGS
flags.DEFINE_string("tpu", "", "The TPU to use (name or address).")
flags.DEFINE_string("model_dir", None, "Where the checkpoint is written.")
flags.DEFINE_integer("steps", 3, "Training steps.")

GLOBAL_BATCH = 32
VOCAB = {"user": 40, "item": 24}
DIM = 4


def feature_config(per_replica_batch):
  optimizer = tf.tpu.experimental.embedding.Adagrad(
      learning_rate=0.2, initial_accumulator_value=0.1)
  tables = {
      name: tf.tpu.experimental.embedding.TableConfig(
          vocabulary_size=rows, dim=DIM, name=name, combiner="sum",
          optimizer=optimizer,
          initializer=tf.constant_initializer(
              np.random.RandomState(len(name)).uniform(
                  -1, 1, (rows, DIM)).astype(np.float32)))
      for name, rows in VOCAB.items()}
  return {name: tf.tpu.experimental.embedding.FeatureConfig(
              table=tables[name], output_shape=[per_replica_batch])
          for name in VOCAB}


def dataset(steps):
  """The global batches (see the module docstring), one per step."""
  rng = np.random.RandomState(7)
  batches = []
  for _ in range(steps):
    lengths = rng.randint(1, 4, GLOBAL_BATCH)
    users = rng.randint(0, VOCAB["user"], GLOBAL_BATCH).astype(np.int64)
    items = rng.randint(0, VOCAB["item"], lengths.sum()).astype(np.int64)
    batches.append({
        "user": tf.constant(users),
        "item": tf.RaggedTensor.from_row_lengths(items, lengths)})
  data = tf.data.Dataset.from_tensors(batches[0])
  for batch in batches[1:]:
    data = data.concatenate(tf.data.Dataset.from_tensors(batch))
  return data


def train(model_dir, steps, tpu=""):
  """The documented SparseCore loop; returns the checkpoint's path."""
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  strategy = tf.distribute.TPUStrategy(resolver)

  per_replica_batch = GLOBAL_BATCH // strategy.num_replicas_in_sync
  with strategy.scope():
    embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(
        feature_config(per_replica_batch), None)

  distributed = strategy.experimental_distribute_dataset(
      dataset(steps),
      options=tf.distribute.InputOptions(experimental_fetch_to_device=False))
  iterator = iter(distributed)

  @tf.function
  def training_step(iterator):
    def tpu_step(features):
      with tf.GradientTape() as tape:
        activations, preserved = embedding.embedding_lookup(features)
        tape.watch(activations)
        loss = sum(0.5 * tf.reduce_sum(tf.square(a - 1.0))
                   for a in tf.nest.flatten(activations))
      gradients = tape.gradient(loss, activations)
      embedding.apply_gradients(gradients, preserved)
      return loss

    return strategy.run(tpu_step, args=(next(iterator),))

  for _ in range(steps):
    training_step(iterator)

  checkpoint = tf.train.Checkpoint(embedding=embedding)
  return checkpoint.save(os.path.join(model_dir, "ckpt"))


def main(argv):
  del argv
  print("saved", train(FLAGS.model_dir, FLAGS.steps, FLAGS.tpu))


if __name__ == "__main__":
  flags.mark_flag_as_required("model_dir")
  app.run(main)
