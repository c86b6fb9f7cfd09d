"""One worker of the 2-process MultiWorkerMirroredStrategy test.

Run by tests/test_multiworker.py with TF_CONFIG set; trains the replica
test's scenario on this worker's half of every global batch and saves the
tables it ends with.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee
from tests import multiworker_data as data

api = tf.tpu.experimental.embedding


def main(out):
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
  with strategy.scope():
    engine = tee.CPUEmbedding(data.feature_config(), api.Adagrad(0.1))

  @tf.function
  def step(features):
    engine.enqueue(features, training=True)

    def replica_step():
      with tf.GradientTape() as tape:
        acts = engine.dequeue()
        tape.watch(acts)
        loss = data.loss(acts)
      engine.apply_gradients(tape.gradient(loss, acts))
    strategy.run(replica_step)

  for t in range(data.STEPS):
    batch = data.batch(t)
    per = len(batch) // data.WORKERS
    features = strategy.experimental_distribute_values_from_function(
        lambda ctx, t=t: {"watched": tf.ragged.constant(
            batch[ctx.replica_id_in_sync_group * per:
                  (ctx.replica_id_in_sync_group + 1) * per], tf.int64)})
    step(features)
  np.savez(out, step=engine.step.numpy(), task=task,
           replicas=strategy.num_replicas_in_sync,
           **{k: v.numpy() for k, v in engine.variables["video"].items()})


if __name__ == "__main__":
  main(sys.argv[1])
