"""Benchmark: one Keras training step with ``EmbeddingLayer``, against ``keras.layers.Embedding``.

A small ranking-like model (a DLRM's shape): dense features through a bottom
``Dense``, single-hot categorical features through embedding tables, their
concatenation through a two-layer top MLP to one logit, binary cross-entropy.
Two contenders, built in this process and stepped with
``model.train_on_batch`` (Keras's compiled ``train_step``) on the same batches:

* **embedding_layer**: the tables in one ``tee.EmbeddingLayer`` on the CPU
  engine (``CPUEmbedding``), trained by the TPU's Adagrad; the MLPs by Keras's.
* **keras_embedding**: one ``keras.layers.Embedding`` per table, everything
  trained by Keras's Adagrad (same hyperparameters).

The ratio (embedding_layer / keras_embedding) is what the layer's step costs
relative to the Keras route on the same machine in the same seconds. Method:
``round_robin.time_steps``; median step time, p10/p90 in the JSON.

Usage: ``python -m benchmarks.keras_step [--quick]`` (``make bench``). Writes
``results/keras_step.json`` (``keras_step_quick.json``) and its table in
RESULTS.md (full run only).
"""

from __future__ import annotations

import argparse
import os

import keras
import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee
from benchmarks import round_robin

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "<!-- keras_step -->"
POOL = 4  # distinct batches, cycled
E = tf.tpu.experimental.embedding

FULL = dict(tables=8, vocab=10_000, dim=16, batch=1024, dense=13, repeats=40)
QUICK = dict(tables=2, vocab=100, dim=4, batch=32, dense=3, repeats=3)


class _KerasTables(keras.layers.Layer):
  """One ``keras.layers.Embedding`` per feature: the baseline's lookup."""

  def __init__(self, names, vocab, dim):
    super().__init__(name="keras_tables")
    self.tables = {name: keras.layers.Embedding(
        vocab, dim, embeddings_initializer=keras.initializers.Constant(0.01))
                   for name in names}

  def call(self, features):
    return {name: self.tables[name](ids) for name, ids in features.items()}


class Ranker(keras.Model):
  """Bottom MLP on dense features + embeddings -> top MLP -> one logit."""

  def __init__(self, embedding, dim):
    super().__init__()
    self.embedding = embedding
    self.bottom = keras.layers.Dense(dim, activation="relu")
    self.top = [keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)]

  def call(self, inputs, training=False):
    activations = self.embedding(inputs["ids"], training=training)
    x = tf.concat([self.bottom(inputs["dense"])]
                  + [activations[name] for name in sorted(activations)], 1)
    for layer in self.top:
      x = layer(x)
    return x


def _names(size):
  return [f"c{i}" for i in range(size["tables"])]


def _embedding_layer(size):
  config = {name: E.FeatureConfig(E.TableConfig(
      size["vocab"], size["dim"], initializer=tf.constant_initializer(0.01),
      name=name), name=name) for name in _names(size)}
  return tee.EmbeddingLayer(config, E.Adagrad(0.1, initial_accumulator_value=0.1))


def _model(embedding, size):
  model = Ranker(embedding, size["dim"])
  model.compile(optimizer=keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.1),
                loss=keras.losses.BinaryCrossentropy(from_logits=True))
  return model


def batches(size, count=POOL, seed=0):
  """``count`` batches ``({"ids": {name: [batch]}, "dense": [batch, d]}, labels)``."""
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(count):
    ids = {name: tf.constant(np.minimum(rng.zipf(1.2, size["batch"]) - 1,
                                        size["vocab"] - 1).astype(np.int64))
           for name in _names(size)}
    dense = tf.constant(rng.rand(size["batch"], size["dense"]).astype(np.float32))
    labels = tf.constant(rng.randint(0, 2, (size["batch"], 1)).astype(np.float32))
    out.append(({"ids": ids, "dense": dense}, labels))
  return out


def run(size, repeats):
  """``{contender: {median_ms, p10_ms, p90_ms}, "ratio": ...}``."""
  pool = batches(size)
  models = {"embedding_layer": _model(_embedding_layer(size), size),
            "keras_embedding": _model(_KerasTables(_names(size), size["vocab"],
                                                   size["dim"]), size)}

  def stepper(model):
    return lambda batch: model.train_on_batch(*batch)
  out = round_robin.time_steps(
      {name: (stepper(model), pool) for name, model in models.items()}, repeats)
  out["ratio"] = out["embedding_layer"]["median_ms"] / out["keras_embedding"]["median_ms"]
  out["table_steps"] = int(models["embedding_layer"].embedding.step.numpy())
  return out


def markdown(size, results) -> str:
  return "\n".join([
      "| model | embedding_layer | keras_embedding | ratio |", "|---|---|---|---|",
      f"| {size['tables']} tables x {size['vocab']:,} rows, dim {size['dim']}, "
      f"batch {size['batch']:,}, Adagrad | {results['embedding_layer']['median_ms']:.2f} ms | "
      f"{results['keras_embedding']['median_ms']:.2f} ms | {results['ratio']:.3f} |"])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes and few repeats (a smoke test)")
  parser.add_argument("--out", default=os.path.join(HERE, "results"))
  parser.add_argument("--repeats", type=int, help="override the repeats")
  args = parser.parse_args()
  size = dict(QUICK if args.quick else FULL)
  repeats = args.repeats or size.pop("repeats")
  size.pop("repeats", None)
  results = run(size, repeats)
  name = "keras_step_quick.json" if args.quick else "keras_step.json"
  round_robin.write_json(os.path.join(args.out, name), size=size,
                         repeats=repeats, results=results)
  table = markdown(size, results)
  print(table)
  if not args.quick:
    round_robin.write_section(os.path.join(HERE, "RESULTS.md"), MARK, table)


if __name__ == "__main__":
  main()
