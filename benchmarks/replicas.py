"""Benchmark: the same global batch on 1, 2 and 4 replicas, and with XLA.

A TPU program runs R replicas; the emulator runs them as MirroredStrategy
replicas over logical CPU devices of this one machine (2 cores), so this
measures what emulating R replicas costs in CI, not a speed-up: the work of
a step is the same, split R ways, plus the merge of every replica's per-id
gradients. ``xla`` is one device with ``jit_compile=True``.

Method: every contender is built in this process (with 4 logical CPU devices),
warmed up on every batch of a small pool (XLA compiles each shape once), then
stepped round robin on the same batch (machine noise hits them alike); median
step time, p10/p90 in the JSON.

Usage: ``python -m benchmarks.replicas [--quick]`` (``make bench``). Writes
``results/replicas.json`` and its table in RESULTS.md.
"""

from __future__ import annotations

import argparse
import os

import tensorflow as tf

DEVICES = 4
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * DEVICES)

import tpu_embed_ext as tee  # pylint: disable=g-import-not-at-top
from benchmarks import round_robin, workloads  # pylint: disable=g-import-not-at-top

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "<!-- replicas -->"
POOL = 4  # distinct batches, cycled


def contender(workload, optimizer, replicas, jit=False):
  """A step over ``replicas`` replicas (0: no strategy, one device)."""
  strategy = (tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
              if replicas else tf.distribute.get_strategy())
  with strategy.scope():
    emb = tee.CPUEmbedding(workloads._feature_config(workload),  # pylint: disable=protected-access
                           workloads.OPTIMIZERS[optimizer]()[0])
    emb.build()

  def replica_step():
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = workloads._loss(acts, workload.batch)  # pylint: disable=protected-access
    emb.apply_gradients(tape.gradient(loss, acts))

  @tf.function(jit_compile=jit)
  def step(features):
    emb.enqueue(features, training=True)
    if replicas:
      strategy.run(replica_step)
    else:
      replica_step()

  def split(batch):
    if not replicas:
      return batch
    per = workload.batch // replicas
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: {k: v[ctx.replica_id_in_sync_group * per:
                          (ctx.replica_id_in_sync_group + 1) * per]
                     for k, v in batch.items()})
  return step, split


def run(workload, optimizer, repeats):
  batches = workload.batches(POOL, seed=1)
  names = {"1 device": (0, False), "xla, 1 device": (0, True),
           "MirroredStrategy(1)": (1, False), "MirroredStrategy(2)": (2, False),
           "MirroredStrategy(4)": (4, False)}
  built = {}
  for name, (replicas, jit) in names.items():
    step, split = contender(workload, optimizer, replicas, jit)
    built[name] = (step, [split(b) for b in batches])
  times = round_robin.time_steps(built, repeats)
  base = times["1 device"]["median_ms"]
  return {name: {**t, "vs_1_device": t["median_ms"] / base}
          for name, t in times.items()}


def markdown(results) -> str:
  names = list(next(iter(results.values())))
  lines = ["| workload | " + " | ".join(names) + " |",
           "|---|" + "---|" * len(names)]
  for key, row in results.items():
    lines.append(f"| {key} | " + " | ".join(
        f"{row[n]['median_ms']:.1f} ms ({row[n]['vs_1_device']:.2f}x)"
        for n in names) + " |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  cases = ([(workloads.w1(10_000), "adagrad")] if args.quick else
           [(workloads.w1(100_000), "adagrad"), (workloads.w2(100_000), "adagrad"),
            (workloads.w2(100_000), "adam")])
  repeats = 5 if args.quick else 30
  results = {f"{w.name} {o}": run(w, o, repeats) for w, o in cases}
  out = os.path.join(HERE, "results",
                     "replicas_quick.json" if args.quick else "replicas.json")
  round_robin.write_json(out, batch=workloads.BATCH, repeats=repeats,
                         results=results)
  table = markdown(results)
  print(table)
  if not args.quick:
    round_robin.write_section(os.path.join(HERE, "RESULTS.md"), MARK, table)


if __name__ == "__main__":
  main()
