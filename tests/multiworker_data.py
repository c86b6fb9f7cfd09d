"""The data of the multi-worker test, shared by the workers and the test."""

import numpy as np
import tensorflow as tf

api = tf.tpu.experimental.embedding
STEPS, WORKERS, GLOBAL_BATCH = 5, 2, 8


def feature_config():
  table = api.TableConfig(20, 4, name="video", combiner="mean",
                          initializer=tf.constant_initializer(
                              np.arange(80.).reshape(20, 4) / 40))
  return {"watched": api.FeatureConfig(table, name="watched")}


def batch(t):
  """The global batch of step t: ids shared by both halves and not."""
  rng = np.random.RandomState(t)
  return [list(rng.randint(0, 20, rng.randint(1, 4))) for _ in range(GLOBAL_BATCH)]


def loss(acts):
  return tf.reduce_sum(acts["watched"] ** 2) / 2
