"""Benchmark: what the emulated TPU adds to a step, against the same loop on CPUEmbedding.

Two programs per case, built in this process on the same logical CPU devices
and stepped on the same batches:

* **emulated**: a TPU program, unchanged: the resolver,
  ``initialize_tpu_system``, ``TPUStrategy`` and
  ``tf.tpu.experimental.embedding.TPUEmbedding`` (or ``TPUEmbeddingV2`` with
  ``sparsecore``), inside ``emulate_tpu``;
* **direct**: the same loop written on ``CPUEmbedding`` (``engine="v2"`` on
  the same SparseCore topology for the SparseCore case) under
  ``MirroredStrategy`` over the same devices.

Both run the same engine, so the ratio is the emulation's own cost (its
adapters and strategy); the goal is at most 1.05. Method: ``round_robin.time_steps``;
median step time, p10/p90 in the JSON.

Usage: ``python -m benchmarks.emulation [--quick]`` (``make bench``). Writes
``results/emulation.json`` and its table in RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import tensorflow as tf

REPLICAS = 2
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * REPLICAS)

import tpu_embed_ext as tee  # pylint: disable=g-import-not-at-top
from benchmarks import round_robin, workloads  # pylint: disable=g-import-not-at-top

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "<!-- emulation -->"
POOL = 4  # distinct batches, cycled


def _feature_config(workload, sparsecore):
  """The workload's tables; with SparseCore every feature's per-replica output_shape."""
  config = workloads._feature_config(workload)  # pylint: disable=protected-access
  if sparsecore:
    for feature in config.values():
      feature.output_shape = tf.TensorShape([workload.batch // REPLICAS])
  return config


def _program(strategy, embedding, workload, v2_protocol):
  """One training step, as a TPU program writes it, on ``embedding``.

  ``v2_protocol``: TPUEmbeddingV2's (a lookup returning preserved outputs);
  else TPUEmbedding's (enqueue, dequeue), which CPUEmbedding speaks.
  """

  def replica_step(features):
    with tf.GradientTape() as tape:
      if v2_protocol:
        activations, preserved = embedding(features)
      else:
        embedding.enqueue(features, training=True)
        activations = embedding.dequeue()
      tape.watch(activations)
      loss = workloads._loss(activations, workload.batch)  # pylint: disable=protected-access
    gradients = tape.gradient(loss, activations)
    if v2_protocol:
      embedding.apply_gradients(gradients, preserved)
    else:
      embedding.apply_gradients(gradients)

  @tf.function
  def step(features):
    strategy.run(replica_step, args=(features,))
  return step


def _split(strategy, workload, batch):
  per = workload.batch // REPLICAS
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: {k: v[ctx.replica_id_in_sync_group * per:
                        (ctx.replica_id_in_sync_group + 1) * per]
                   for k, v in batch.items()})


def _emulated(workload, optimizer, sparsecore):
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  strategy = tf.distribute.TPUStrategy(resolver)
  api = tf.tpu.experimental.embedding
  with strategy.scope():
    cls = api.TPUEmbeddingV2 if sparsecore else api.TPUEmbedding
    embedding = cls(_feature_config(workload, sparsecore),
                    workloads.OPTIMIZERS[optimizer]()[0])
  return strategy, embedding


def _direct(workload, optimizer, sparsecore, topology):
  strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
  with strategy.scope():
    embedding = tee.CPUEmbedding(
        _feature_config(workload, sparsecore), workloads.OPTIMIZERS[optimizer]()[0],
        engine="v2" if sparsecore else "v1", topology=topology)
  return strategy, embedding


def _same_tables(embeddings) -> bool:
  """Whether both programs' checkpoints hold the same bytes (TPUEmbedding's
  keys, or TPUEmbeddingV2's stacked ones, for both)."""
  with tempfile.TemporaryDirectory() as tmp:
    values = []
    for name, embedding in embeddings.items():
      prefix = tf.train.Checkpoint(embedding=embedding).write(os.path.join(tmp, name))
      values.append({k: np.asarray(tf.train.load_variable(prefix, k)).tobytes()
                     for k, _ in tf.train.list_variables(prefix)
                     if k.startswith("embedding/")})
  return values[0] == values[1]


def run(workload, optimizer, sparsecore, repeats):
  batches = workload.batches(POOL, seed=1)
  built, embeddings = {}, {}
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=sparsecore):
    strategy, embeddings["emulated"] = _emulated(workload, optimizer, sparsecore)
    topology = (embeddings["emulated"]._topology  # pylint: disable=protected-access
                if sparsecore else None)
    built["emulated"] = (_program(strategy, embeddings["emulated"], workload, sparsecore),
                         [_split(strategy, workload, b) for b in batches])
    strategy, embeddings["direct"] = _direct(workload, optimizer, sparsecore, topology)
    built["direct"] = (_program(strategy, embeddings["direct"], workload, False),
                       [_split(strategy, workload, b) for b in batches])
    out = round_robin.time_steps(built, repeats)
  out["ratio"] = out["emulated"]["median_ms"] / out["direct"]["median_ms"]
  # Both stepped the same batches as often: the same work, the same tables.
  out["same_tables"] = _same_tables(embeddings)
  return out


def markdown(results) -> str:
  lines = ["| case | direct (CPUEmbedding) | emulated TPU program | ratio | same tables |",
           "|---|---|---|---|---|"]
  for key, row in results.items():
    lines.append(f"| {key} | {row['direct']['median_ms']:.2f} ms | "
                 f"{row['emulated']['median_ms']:.2f} ms | {row['ratio']:.3f} | "
                 f"{'yes' if row['same_tables'] else 'NO'} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default=os.path.join(HERE, "results"))
  args = parser.parse_args()
  if args.quick:
    cases = [(workloads.w1(1_000), "adagrad", False), (workloads.w1(1_000), "adagrad", True)]
  else:
    cases = [(workloads.w1(100_000), "adagrad", False),
             (workloads.w2(100_000), "adagrad", False),
             (workloads.w1(100_000), "adagrad", True)]
  repeats = 5 if args.quick else 40
  results = {f"{w.name} {o}{', SparseCore' if sc else ''}": run(w, o, sc, repeats)
             for w, o, sc in cases}
  out = os.path.join(args.out, "emulation_quick.json" if args.quick else "emulation.json")
  round_robin.write_json(out, replicas=REPLICAS, batch=workloads.BATCH,
                         repeats=repeats, goal_ratio=1.05, results=results)
  table = markdown(results)
  print(table)
  if not args.quick:
    round_robin.write_section(os.path.join(HERE, "RESULTS.md"), MARK, table)


if __name__ == "__main__":
  main()
