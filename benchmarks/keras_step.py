"""Benchmark: one Keras training step with ``EmbeddingLayer``, against ``keras.layers.Embedding``.

The model is the package's ranking model (``keras/model.py`` ``RankingModel``
on configs/ranking.yaml: 26 tables of 3 to 50,000 rows, six of them
multi-hot ragged features, per-table Adagrad, Adam, SGD and FTRL; a DLRM's
bottom MLP, dot interaction and top MLP), trained with binary
cross-entropy. Two contenders, built in this process and stepped with
``model.train_on_batch`` (Keras's compiled ``train_step``) on the same
batches:

* **embedding_layer**: ``RankingModel``, its tables in one
  ``tee.EmbeddingLayer`` on the CPU engine (``CPUEmbedding``, default kernels
  and validation), trained by their own optimizers; the MLPs by Keras's Adam.
* **keras_embedding**: the same architecture on one ``keras.layers.Embedding``
  per table, everything trained by one Keras Adagrad (``benchmarks/native.py``
  ``_keras_ranking``, the route a Keras user writes).

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
from benchmarks import native, round_robin
from tpu_embed_ext.keras.model import RankingModel

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "<!-- keras_step -->"
CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(native.__file__))),
                      "configs", "ranking.yaml")
POOL = 4  # distinct batches, cycled
MULTI_HOT = {f"t_c{i}" for i in range(20, 26)}  # 1-3 ids a row, ragged
FULL = dict(batch=1024, repeats=40)
QUICK = dict(batch=32, repeats=3)


def batches(spec, batch, count=POOL, seed=0):
  """``count`` batches ``({"dense": [B, 13], "categorical": {name: ids}}, labels)``."""
  rng = np.random.default_rng(seed)
  vocab = {t.name: t.vocabulary_size for t in spec.tables}
  out = []
  for _ in range(count):
    categorical = {}
    for f in spec.features:
      if f.table in MULTI_HOT:
        lengths = rng.integers(1, 4, batch)
        categorical[f.name] = tf.RaggedTensor.from_row_lengths(
            tf.constant(rng.integers(0, vocab[f.table], lengths.sum()), tf.int64),
            lengths)
      else:
        categorical[f.name] = tf.constant(rng.integers(0, vocab[f.table], batch),
                                          tf.int64)
    dense = tf.constant(rng.normal(size=(batch, 13)).astype(np.float32))
    labels = tf.constant(rng.integers(0, 2, (batch, 1)).astype(np.float32))
    out.append(({"dense": dense, "categorical": categorical}, labels))
  return out


def run(batch, repeats):
  """``{contender: {median_ms, p10_ms, p90_ms}, "ratio": ..., "table_steps": ...}``."""
  spec = tee.EmbeddingSpec.from_file(CONFIG)
  loss = keras.losses.BinaryCrossentropy(from_logits=True)
  ours = RankingModel(spec)
  ours.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
  models = {"embedding_layer": ours,
            "keras_embedding": native._keras_ranking(spec, MULTI_HOT, loss)}  # pylint: disable=protected-access
  pool = batches(spec, batch)
  out = round_robin.time_steps(
      {name: ((lambda m: lambda b: m.train_on_batch(*b))(model), pool)
       for name, model in models.items()}, repeats)
  out["ratio"] = out["embedding_layer"]["median_ms"] / out["keras_embedding"]["median_ms"]
  # Warm-up (one step per batch of the pool) and the timed steps.
  out["table_steps"] = int(ours.embedding.step.numpy())
  return out


def markdown(batch, results) -> str:
  return "\n".join([
      "| model | embedding_layer | keras_embedding | ratio |", "|---|---|---|---|",
      f"| RankingModel (configs/ranking.yaml), batch {batch:,} | "
      f"{results['embedding_layer']['median_ms']:.2f} ms | "
      f"{results['keras_embedding']['median_ms']:.2f} ms | {results['ratio']:.3f} |"])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="batch 32 and 3 repeats (a smoke test)")
  parser.add_argument("--out", default=os.path.join(HERE, "results"))
  parser.add_argument("--repeats", type=int, help="override the repeats")
  args = parser.parse_args()
  size = QUICK if args.quick else FULL
  repeats = args.repeats or size["repeats"]
  results = run(size["batch"], repeats)
  name = "keras_step_quick.json" if args.quick else "keras_step.json"
  round_robin.write_json(os.path.join(args.out, name), batch=size["batch"],
                         repeats=repeats, results=results)
  table = markdown(size["batch"], results)
  print(table)
  if not args.quick:
    round_robin.write_section(os.path.join(HERE, "RESULTS.md"), MARK, table)


if __name__ == "__main__":
  main()
