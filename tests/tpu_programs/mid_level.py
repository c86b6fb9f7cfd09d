"""A TPU embedding program in the style of TensorFlow's TPU embedding guide.

Written against TensorFlow's API only (nothing from tpu_embed_ext): it finds
the TPU, builds ``TPUStrategy`` and a ``TPUEmbedding`` with two tables (the
video table shared by a ragged and a sparse feature), trains a few steps of
the mid-level loop (``enqueue`` outside ``strategy.run``, ``dequeue`` and
``apply_gradients`` inside it) on ``experimental_distribute_dataset`` and
saves a ``tf.train.Checkpoint``. Its flags (``--tpu``, ``--model_dir``)
are the names ``python -m tpu_embed_ext`` also uses.

Tests run it under ``python -m tpu_embed_ext emulate --replicas N`` and under
``pytest --emulate-tpu=N`` and check the tables against their own reference.
Its inputs, per step ``s`` and example ``e`` of the global batch of
``GLOBAL_BATCH``:

* ``watched`` (ragged, video): ``1 + (s + e) % 3`` ids ``(3 s + 5 e + 2 j) % 16``;
* ``favorited`` (sparse, video): ``(s * e) % 3`` ids ``(7 e + s + 4 j) % 16``
  (some examples have none); the video table combines with TableConfig's
  default, ``mean``;
* ``friend`` (dense, user): ``(e + 2 s) % 12``;
* label ``y = (e % 4 - 1.5) / 2``; loss ``0.5 * sum((activation - y)^2)``
  over every feature, so each activation's gradient is ``activation - y``.

Tables start at ``video[i, d] = 0.01 (i + 1) - 0.02 d``,
``user[i, d] = 0.03 (i % 5) + 0.01 d``; video trains with Adagrad (0.1,
initial accumulator 0.1), user with the program's SGD (0.05).
"""

import os

from absl import app, flags
import numpy as np
import tensorflow as tf

FLAGS = flags.FLAGS
flags.DEFINE_string("tpu", "", "The TPU to use (name or address).")
flags.DEFINE_string("model_dir", None, "Where the checkpoint is written.")
flags.DEFINE_integer("steps", 4, "Training steps.")

GLOBAL_BATCH = 16
VIDEO_ROWS, VIDEO_DIM = 16, 4
USER_ROWS, USER_DIM = 12, 2


def feature_config():
  video = tf.tpu.experimental.embedding.TableConfig(
      vocabulary_size=VIDEO_ROWS, dim=VIDEO_DIM, name="video",
      initializer=tf.constant_initializer(
          0.01 * (np.arange(VIDEO_ROWS)[:, None] + 1)
          - 0.02 * np.arange(VIDEO_DIM)[None, :]),
      optimizer=tf.tpu.experimental.embedding.Adagrad(
          learning_rate=0.1, initial_accumulator_value=0.1))
  user = tf.tpu.experimental.embedding.TableConfig(
      vocabulary_size=USER_ROWS, dim=USER_DIM, name="user",
      initializer=tf.constant_initializer(
          0.03 * (np.arange(USER_ROWS)[:, None] % 5)
          + 0.01 * np.arange(USER_DIM)[None, :]))
  return {
      "watched": tf.tpu.experimental.embedding.FeatureConfig(
          table=video, name="watched"),
      "favorited": tf.tpu.experimental.embedding.FeatureConfig(
          table=video, name="favorited"),
      "friend": tf.tpu.experimental.embedding.FeatureConfig(
          table=user, name="friend"),
  }


def global_batch(step):
  """The features and labels of one step (see the module docstring)."""
  examples = range(GLOBAL_BATCH)
  watched = [[(3 * step + 5 * e + 2 * j) % VIDEO_ROWS
              for j in range(1 + (step + e) % 3)] for e in examples]
  indices, values = [], []
  for e in examples:
    for j in range((step * e) % 3):
      indices.append([e, j])
      values.append((7 * e + step + 4 * j) % VIDEO_ROWS)
  favorited = tf.sparse.SparseTensor(
      tf.constant(indices, tf.int64, shape=[len(indices), 2]),
      tf.constant(values, tf.int64), [GLOBAL_BATCH, 2])
  features = {
      "watched": tf.ragged.constant(watched, dtype=tf.int64),
      "favorited": favorited,
      "friend": tf.constant([(e + 2 * step) % USER_ROWS for e in examples],
                            tf.int64),
  }
  labels = tf.constant([(e % 4 - 1.5) / 2 for e in examples], tf.float32)
  return features, labels


def dataset(steps):
  data = tf.data.Dataset.from_tensors(global_batch(0))
  for step in range(1, steps):
    data = data.concatenate(tf.data.Dataset.from_tensors(global_batch(step)))
  return data


def train(model_dir, steps, tpu=""):
  """The guide's mid-level loop; returns the checkpoint's path."""
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  strategy = tf.distribute.TPUStrategy(resolver)

  with strategy.scope():
    embedding = tf.tpu.experimental.embedding.TPUEmbedding(
        feature_config=feature_config(),
        optimizer=tf.tpu.experimental.embedding.SGD(learning_rate=0.05))

  distributed = strategy.experimental_distribute_dataset(
      dataset(steps),
      options=tf.distribute.InputOptions(experimental_fetch_to_device=False))
  iterator = iter(distributed)

  @tf.function
  def training_step(iterator):
    def tpu_step(labels):
      with tf.GradientTape() as tape:
        activations = embedding.dequeue()
        tape.watch(activations)
        loss = sum(0.5 * tf.reduce_sum(tf.square(a - labels[:, None]))
                   for a in tf.nest.flatten(activations))
      gradients = tape.gradient(loss, activations)
      embedding.apply_gradients(gradients)
      return loss

    features, labels = next(iterator)
    embedding.enqueue(features, training=True)
    return strategy.run(tpu_step, args=(labels,))

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
