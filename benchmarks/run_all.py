"""Benchmarks: one training step of an embedding table, per contender.

W1: one table, dim 16, a batch of 4096 single-hot Zipf ids, vocabulary 1e5,
1e6, 1e7; Adagrad. Contenders, run interleaved in this one process (round
robin, after warm-up), median of the repeats reported:

* ``cpu_embedding``: tpu_embed_ext.CPUEmbedding (enqueue, dequeue,
  apply_gradients) -- the TPU's Adagrad on the touched rows only, with its
  default input validation; ``cpu_embedding_unchecked``: ``validate=False``.
* ``keras_embedding``: keras.layers.Embedding + keras.optimizers.Adagrad, what a
  Keras user writes; Keras 3 updates the whole table every step.
* ``fused_floor``: the least work a sparse step can do in TensorFlow: unique +
  segment sum + one fused ``ResourceSparseApplyAdagradV2`` kernel.

Each step computes the same loss, sum(activations^2) / batch. Usage:
``python -m benchmarks.run_all [--quick]`` (``make bench``); writes
benchmarks/results/w1.json, the table in benchmarks/RESULTS.md and
benchmarks/results/w1.png.
"""

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import time

import numpy as np
import tensorflow as tf
import keras

import tpu_embed_ext as tee

HERE = os.path.dirname(os.path.abspath(__file__))
DIM, BATCH, LR = 16, 4096, 0.1


def zipf_ids(vocab, n, seed):
  rng = np.random.default_rng(seed)
  ranks = np.minimum(rng.zipf(1.2, n) - 1, vocab - 1)
  return tf.constant(rng.permutation(vocab)[ranks], tf.int64)


def cpu_embedding(vocab, validate=True):
  table = tf.tpu.experimental.embedding.TableConfig(
      vocab, DIM, initializer=tf.zeros_initializer(), name="t")
  emb = tee.CPUEmbedding({"f": tf.tpu.experimental.embedding.FeatureConfig(table)},
                         tf.tpu.experimental.embedding.Adagrad(LR), validate=validate)
  emb.build()

  @tf.function
  def step(ids):
    emb.enqueue({"f": ids}, training=True)
    with tf.GradientTape() as tape:
      act = emb.dequeue()
      tape.watch(act)
      loss = tf.reduce_sum(act["f"] ** 2) / BATCH
    emb.apply_gradients(tape.gradient(loss, act))
  return step, emb


def keras_embedding(vocab):
  layer = keras.layers.Embedding(vocab, DIM, embeddings_initializer="zeros")
  layer.build((None,))
  opt = keras.optimizers.Adagrad(LR)
  opt.build(layer.trainable_variables)

  @tf.function
  def step(ids):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer(ids) ** 2) / BATCH
    grads = tape.gradient(loss, layer.trainable_variables)
    opt.apply_gradients(zip(grads, layer.trainable_variables))
  return step, (layer, opt)


def fused_floor(vocab):
  var = tf.Variable(tf.zeros([vocab, DIM]))
  acc = tf.Variable(tf.fill([vocab, DIM], 0.1))

  @tf.function
  def step(ids):
    unique, index = tf.unique(ids)
    rows = tf.gather(var, ids)
    grad = tf.math.unsorted_segment_sum(2.0 * rows / BATCH, index, tf.size(unique))
    tf.raw_ops.ResourceSparseApplyAdagradV2(
        var=var.handle, accum=acc.handle, lr=LR, epsilon=0.0, grad=grad,
        indices=unique, update_slots=True)
  return step, (var, acc)


CONTENDERS = {"cpu_embedding": cpu_embedding,
              "cpu_embedding_unchecked": lambda v: cpu_embedding(v, validate=False),
              "keras_embedding": keras_embedding, "fused_floor": fused_floor}


def measure(vocab, repeats, warmup):
  steps = {name: make(vocab) for name, make in CONTENDERS.items()}
  batches = [zipf_ids(vocab, BATCH, s) for s in range(8)]
  for name, (step, _) in steps.items():
    for i in range(warmup):
      step(batches[i % len(batches)])
  times = {name: [] for name in steps}
  for r in range(repeats):
    for name, (step, _) in steps.items():  # Round robin: same machine noise.
      ids = batches[r % len(batches)]
      start = time.perf_counter()
      step(ids)
      times[name].append((time.perf_counter() - start) * 1e3)
  del steps
  gc.collect()
  return {name: {"median_ms": statistics.median(t),
                 "p10_ms": float(np.percentile(t, 10)),
                 "p90_ms": float(np.percentile(t, 90))} for name, t in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
  parser.add_argument("--out", default=os.path.join(HERE, "results"))
  args = parser.parse_args()
  vocabs = [10**3, 10**4] if args.quick else [10**5, 10**6, 10**7]
  repeats, warmup = (5, 2) if args.quick else (30, 5)
  results = {"machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                         "tensorflow": tf.__version__, "keras": keras.__version__},
             "workload": {"name": "W1", "dim": DIM, "batch": BATCH,
                          "optimizer": "adagrad", "ids": "zipf(1.2), single-hot"},
             "repeats": repeats, "vocabularies": {}}
  for vocab in vocabs:
    print(f"vocabulary {vocab:,}...", flush=True)
    results["vocabularies"][str(vocab)] = measure(vocab, repeats, warmup)
  results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  os.makedirs(args.out, exist_ok=True)
  name = "w1_quick" if args.quick else "w1"
  with open(os.path.join(args.out, f"{name}.json"), "w") as f:
    json.dump(results, f, indent=2)
  table = markdown(results)
  print(table)
  if not args.quick:
    plot(results, os.path.join(args.out, f"{name}.png"))
    write_results_md(table)


def markdown(results):
  vocabs = list(results["vocabularies"])
  lines = ["| vocabulary | " + " | ".join(CONTENDERS) +
           " | keras / cpu_embedding | cpu_embedding / floor |",
           "|---|" + "---|" * (len(CONTENDERS) + 2)]
  for v in vocabs:
    r = results["vocabularies"][v]
    ms = {n: r[n]["median_ms"] for n in CONTENDERS}
    lines.append(f"| {int(v):,} | " + " | ".join(f"{ms[n]:.2f} ms" for n in CONTENDERS)
                 + f" | {ms['keras_embedding'] / ms['cpu_embedding']:.1f}x"
                 + f" | {ms['cpu_embedding'] / ms['fused_floor']:.2f}x |")
  first, last = vocabs[0], vocabs[-1]
  ratio = (results["vocabularies"][last]["cpu_embedding"]["median_ms"]
           / results["vocabularies"][first]["cpu_embedding"]["median_ms"])
  lines.append("")
  lines.append(f"cpu_embedding step time at {int(last):,} rows / at {int(first):,} rows: "
               f"{ratio:.2f}x. Peak RSS of the process: {results['peak_rss_mib']:,.0f} MiB.")
  return "\n".join(lines)


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  vocabs = [int(v) for v in results["vocabularies"]]
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in CONTENDERS:
    ax.plot(vocabs, [results["vocabularies"][str(v)][name]["median_ms"] for v in vocabs],
            marker="o", label=name)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("vocabulary (rows)")
  ax.set_ylabel("median step time (ms)")
  ax.set_title("W1: Adagrad step, dim 16, batch 4096")
  ax.grid(alpha=0.3, which="both")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def write_results_md(table):
  path = os.path.join(HERE, "RESULTS.md")
  head = open(path).read().split("<!-- w1 -->")[0] if os.path.exists(path) else ""
  with open(path, "w") as f:
    f.write(head + "<!-- w1 -->\n" + table + "\n")


if __name__ == "__main__":
  main()
