"""Every shipped config trains 20 steps on CPU without a rejected step.

The configs' tables are too large for this machine (criteo.yaml: 2.3 billion
rows), so vocabularies are scaled down to at most 1,000 ids; optimizers,
overrides and schedules stay as shipped. Ten steps run from step 0 and ten
from just before each config's last schedule milestone (a warm-up end, a
decay end), so the rates at both ends of every schedule are trained with.
Gradients come from a logistic loss on the summed activations.
"""

import glob

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.spec import schedules
from tpu_embed_ext.spec import EmbeddingSpec

MAX_ROWS = 1000
BATCH = 16


def _scaled(path):
  config = EmbeddingSpec.from_file(path).to_dict()
  for table in config["tables"].values():
    table["vocabulary_size"] = min(table["vocabulary_size"], MAX_ROWS)
  return EmbeddingSpec.from_dict(config)


def _last_milestone(spec):
  steps = [0]
  for t in spec.tables:
    lr = spec.optimizer_for(t.name).learning_rate
    if isinstance(lr, schedules.Schedule):
      steps += schedules.milestones(lr)
  return max(steps)


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_config_trains_20_steps_without_a_rejected_step(path):
  spec = _scaled(path)
  emb = tee.CPUEmbedding(spec)
  rng = np.random.default_rng(0)
  rows = {f.name: spec.table(f.table).vocabulary_size for f in spec.features}
  late = max(_last_milestone(spec) - 5, 10)
  for i in range(20):
    if i == 10:
      emb.step.assign(late)
    ids = {name: tf.constant(rng.integers(0, n, size=[BATCH, 1]), tf.int64)
           for name, n in rows.items()}
    labels = tf.constant(rng.integers(0, 2, size=[BATCH]), tf.float32)
    emb.enqueue(ids, training=True)
    acts = emb.dequeue()
    with tf.GradientTape() as tape:
      tape.watch(acts)
      logits = tf.add_n([tf.reduce_sum(a, axis=-1) for a in acts.values()])
      loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))
    emb.apply_gradients(tape.gradient(loss, acts))  # raises on a rejected step
  assert int(emb.step.numpy()) == late + 10
  for table, variables in emb.variables.items():
    for slot, variable in variables.items():
      assert np.all(np.isfinite(variable.numpy())), (table, slot)
