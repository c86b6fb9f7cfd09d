"""The native kernels against the TF-op path and TensorFlow's op floor.

``python -m benchmarks.native [--quick]`` (``make bench``). Three parts, each
in fresh processes, contenders stepped round robin on the same batches:

* ``steps``: W1 (10^7 rows) and W2, every benchmarked optimizer:
  ``native`` (``CPUEmbedding(kernels="native")``), ``tf_ops``
  (``kernels="tf"``, the path before the kernels), ``sparse_floor``
  (``workloads.sparse_floor``) and ``floor_huge_pages`` (the same floor
  with its tables on 2 MiB pages, as the native path puts its own). One
  fresh process per workload and optimizer, three runs in it; per run the
  median over repeats of the per-repeat ratio native / floor.
* ``breakdown``: where a native W2 step's time goes (lookup only, lookup +
  loss + gradient, the whole step, an empty ``tf.function`` call), against
  a memory-bound estimate: the bytes the step must touch at this machine's
  measured copy bandwidth.
* ``fit``: ``model.train_on_batch`` of the ranking model of
  configs/ranking.yaml (batch 1,024) with ``EmbeddingLayer`` (native and
  TF-op paths) against the same model built on ``keras.layers.Embedding``
  with a Keras Adagrad.

Writes ``results/native.json`` (``native_quick.json``) and, for a full run,
the section between the ``native`` markers of RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, END = "<!-- native -->", "<!-- /native -->"


def _run_python(code: str) -> dict:
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run([sys.executable, "-c", code], text=True,
                        capture_output=True, env=env, cwd=os.path.dirname(HERE))
  if done.returncode:
    raise RuntimeError(f"benchmark subprocess failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.split("RESULT ", 1)[1])


def _contenders(workload, optimizer):
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  import tpu_embed_ext as tee  # pylint: disable=import-outside-toplevel
  out = {}
  for name, kernels in (("native", "native"), ("tf_ops", "tf")):
    emb = tee.CPUEmbedding(workloads._feature_config(workload),  # pylint: disable=protected-access
                           workloads.OPTIMIZERS[optimizer]()[0], kernels=kernels)
    assert emb.kernels == kernels
    out[name] = _cpu_step(emb, workload)
  out["sparse_floor"] = workloads.sparse_floor(workload, optimizer)[0]
  out["floor_huge_pages"] = workloads.sparse_floor(workload, optimizer,
                                                   huge_pages=True)[0]
  return out


def _cpu_step(emb, workload):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  emb.build()

  @tf.function
  def step(features):
    emb.enqueue(features, training=True)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = workloads._loss(activations, workload.batch)  # pylint: disable=protected-access
    emb.apply_gradients(tape.gradient(loss, activations))
  step.emb = emb
  return step


def round_robin(steps, batches, repeats, warmup):
  """Per contender, step times (ms) of ``repeats`` interleaved repeats."""
  for step in steps.values():
    for i in range(warmup):
      step(batches[i % len(batches)])
  times = {name: [] for name in steps}
  for r in range(repeats):
    for name, step in steps.items():
      start = time.perf_counter()
      step(batches[r % len(batches)])
      times[name].append((time.perf_counter() - start) * 1e3)
  return times


def compare(workload_expr: str, optimizer: str, repeats: int, warmup: int,
            runs: int = 1):
  """``runs`` runs on the same contenders (call it in a fresh process).

  Each run: ``repeats`` round-robin repeats; medians and paired ratios.
  """
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel,unused-import
  workload = eval(workload_expr)  # pylint: disable=eval-used
  contenders = _contenders(workload, optimizer)
  batches = workload.batches(8)
  out = []
  for run in range(runs):
    times = round_robin(contenders, batches, repeats, warmup if run == 0 else 1)
    r = {name: statistics.median(t) for name, t in times.items()}
    for name in ("native", "tf_ops"):
      ratios = [a / b for a, b in zip(times[name], times["sparse_floor"])]
      r[f"{name}/floor"] = statistics.median(ratios)
      r[f"{name}/floor_p10"] = float(np.percentile(ratios, 10))
      r[f"{name}/floor_p90"] = float(np.percentile(ratios, 90))
    r["native/tf_ops"] = statistics.median(
        [a / b for a, b in zip(times["native"], times["tf_ops"])])
    r["native/floor_huge_pages"] = statistics.median(
        [a / b for a, b in zip(times["native"], times["floor_huge_pages"])])
    out.append(r)
  return out


def breakdown(workload_expr: str, optimizer: str, repeats: int, warmup: int):
  """Where a native step's time goes, and the memory-bound estimate."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from benchmarks import workloads  # pylint: disable=import-outside-toplevel
  import tpu_embed_ext as tee  # pylint: disable=import-outside-toplevel
  workload = eval(workload_expr)  # pylint: disable=eval-used
  emb = tee.CPUEmbedding(workloads._feature_config(workload),  # pylint: disable=protected-access
                         workloads.OPTIMIZERS[optimizer]()[0], kernels="native")
  emb.build()

  @tf.function
  def lookup(features):
    emb.enqueue(features, training=False)
    return tf.add_n([tf.reduce_sum(a) for a in emb.dequeue().values()])

  @tf.function
  def forward_backward(features):
    emb.enqueue(features, training=False)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = workloads._loss(activations, workload.batch)  # pylint: disable=protected-access
    return tf.add_n([tf.reduce_sum(g) for g in tape.gradient(loss, activations).values()])

  @tf.function
  def empty(features):
    del features
    return tf.constant(0.0)

  step = _cpu_step(emb, workload)
  batches = workload.batches(8)
  times = round_robin({"empty_call": empty, "lookup": lookup,
                       "lookup_loss_gradient": forward_backward, "step": step},
                      batches, repeats, warmup)
  out = {name: statistics.median(t) for name, t in times.items()}
  out["update"] = out["step"] - out["lookup_loss_gradient"]
  # Bytes a step must touch: every occurrence's row read (lookup) and its
  # gradient row written and read back (backward), every touched row of
  # the table and its slots read and written (update), activations written.
  slots = workloads.SLOTS[optimizer]
  occurrences = touched = activations = 0
  for t in workload.tables:
    ids = np.concatenate([np.asarray(b[t.name].values if hasattr(b[t.name], "values")
                                     else b[t.name]) for b in batches[:1]])
    occurrences += ids.size * t.dim * 4
    touched += np.unique(ids).size * t.dim * 4
    activations += workload.batch * t.dim * 4
  needed = 2 * occurrences + 2 * touched * (1 + slots) + 2 * activations
  src = np.ones(64 * 2**20 // 4, np.float32)  # 64 MiB, past the caches
  dst = np.empty_like(src)
  copies = []
  for _ in range(10):
    start = time.perf_counter()
    np.copyto(dst, src)
    copies.append(time.perf_counter() - start)
  bandwidth = 2 * src.nbytes / min(copies)  # read + write bytes per second
  out.update(bytes_needed=int(needed), copy_gb_s=bandwidth / 1e9,
             memory_bound_ms=needed / bandwidth * 1e3)
  return out


def fit(repeats: int, warmup: int, batch: int = 1024):
  """train_on_batch of the ranking model: EmbeddingLayer vs keras Embedding."""
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tpu_embed_ext as tee  # pylint: disable=import-outside-toplevel
  from tpu_embed_ext.emulation import native  # pylint: disable=import-outside-toplevel
  from tpu_embed_ext.keras.model import RankingModel  # pylint: disable=import-outside-toplevel
  spec = tee.EmbeddingSpec.from_file(os.path.join(os.path.dirname(HERE),
                                                  "configs", "ranking.yaml"))
  rng = np.random.default_rng(0)
  # c20..c25 are multi-hot in the synthetic_clicks data (1-3 ids a row here).
  multi = {f"t_c{i}" for i in range(20, 26)}
  vocab = {t.name: t.vocabulary_size for t in spec.tables}

  def make_batch():
    cat = {}
    for f in spec.features:
      v = vocab[f.table]
      if f.table in multi:
        lengths = rng.integers(1, 4, batch)
        cat[f.name] = tf.RaggedTensor.from_row_lengths(
            tf.constant(rng.integers(0, v, lengths.sum()), tf.int64), lengths)
      else:
        cat[f.name] = tf.constant(rng.integers(0, v, batch), tf.int64)
    dense = tf.constant(rng.normal(size=(batch, 13)).astype(np.float32))
    label = tf.constant(rng.integers(0, 2, (batch, 1)).astype(np.float32))
    return {"dense": dense, "categorical": cat}, label

  batches = [make_batch() for _ in range(4)]
  loss = keras.losses.BinaryCrossentropy(from_logits=True)
  models = {}
  for name, kernels in (("embedding_layer_native", "native"),
                        ("embedding_layer_tf_ops", "tf")):
    os.environ[native.ENV] = kernels
    model = RankingModel(spec)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    model.train_on_batch(*batches[0])
    assert model.embedding.embedding.kernels == kernels
    models[name] = model
  os.environ.pop(native.ENV)
  models["keras_embedding"] = _keras_ranking(spec, multi, loss)
  models["keras_embedding"].train_on_batch(*batches[0])
  steps = {name: (lambda m: lambda b: m.train_on_batch(*b))(m)
           for name, m in models.items()}
  times = round_robin(steps, batches, repeats, warmup)
  out = {name: statistics.median(t) for name, t in times.items()}
  out["keras_embedding/native"] = statistics.median(
      [a / b for a, b in zip(times["keras_embedding"], times["embedding_layer_native"])])
  out["tf_ops/native"] = statistics.median(
      [a / b for a, b in zip(times["embedding_layer_tf_ops"],
                             times["embedding_layer_native"])])
  return out


def _keras_ranking(spec, multi, loss):
  """RankingModel's architecture on keras.layers.Embedding + one Keras Adagrad."""
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tpu_embed_ext.keras import model as model_lib  # pylint: disable=import-outside-toplevel
  tables = {t.name: t for t in spec.tables}

  class KerasRanking(keras.Model):

    def __init__(self):
      super().__init__()
      self.tables = {t.name: keras.layers.Embedding(t.vocabulary_size, t.dim)
                     for t in spec.tables}
      self.bottom = model_lib._mlp((64, 16), "bottom_mlp")  # pylint: disable=protected-access
      self.top = model_lib._mlp((64, 32, 1), "top_mlp", last_activation=None)  # pylint: disable=protected-access
      self.features = [(f.name, f.table) for f in spec.features]

    def call(self, inputs, training=False):
      vectors = [self.bottom(inputs["dense"])]
      for name, table in self.features:
        ids = inputs["categorical"][name]
        if table in multi:
          rows = self.tables[table](ids.values)
          combiner = tables[table].combiner
          total = tf.math.unsorted_segment_sum(rows, ids.value_rowids(), ids.nrows())
          if combiner != "sum":
            n = tf.cast(ids.row_lengths(), tf.float32)[:, None]
            total = total / (n if combiner == "mean" else tf.sqrt(n))
          vectors.append(total)
        else:
          vectors.append(self.tables[table](ids))
      stacked = tf.stack(vectors, axis=1)
      dots = tf.linalg.matmul(stacked, stacked, transpose_b=True)
      n = len(vectors)
      upper = tf.constant([i * n + j for i in range(n) for j in range(i + 1, n)])
      pairs = tf.gather(tf.reshape(dots, [-1, n * n]), upper, axis=1)
      return self.top(tf.concat([vectors[0], pairs], axis=1))

  model = KerasRanking()
  model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss=loss)
  return model


def _call(function: str, *args) -> dict:
  return _run_python(
      "import json\nfrom benchmarks import native\n"
      f"r = native.{function}(*{args!r})\n"
      "print('RESULT ' + json.dumps(r))\n")


def main():
  from tpu_embed_ext.host import atomic  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--optimizers", default="sgd,adagrad,adam,ftrl")
  parser.add_argument("--parts", default="steps,breakdown,fit")
  parser.add_argument("--out", default=os.path.join(HERE, "results"))
  args = parser.parse_args()
  quick = args.quick
  runs, repeats, warmup = (1, 3, 1) if quick else (3, 30, 5)
  workloads_ = ({"W1-1e3": "workloads.w1(1000)", "W2": "workloads.w2(2000)"} if quick
                else {"W1-1e7": "workloads.w1(10**7)", "W2": "workloads.w2(500_000)"})
  results = {"runs": runs, "repeats": repeats, "warmup": warmup,
             "load_average_start": os.getloadavg(), "steps": {}}
  parts = args.parts.split(",")
  if "steps" in parts:
    for wname, expr in workloads_.items():
      for optimizer in args.optimizers.split(","):
        key = f"{wname}/{optimizer}"
        print(f"{key}: {runs} run(s)...", flush=True)
        results["steps"][key] = _call("compare", expr, optimizer, repeats, warmup, runs)
  if "breakdown" in parts:
    print("breakdown...", flush=True)
    results["breakdown"] = _call("breakdown", workloads_["W2"], "adagrad",
                                 repeats, warmup)
  if "fit" in parts:
    print("fit...", flush=True)
    results["fit"] = _call("fit", repeats, warmup)
  results["load_average_end"] = os.getloadavg()
  os.makedirs(args.out, exist_ok=True)
  name = "native_quick" if quick else "native"
  atomic.write_text(os.path.join(args.out, f"{name}.json"),
                    json.dumps(results, indent=2))
  text = markdown(results)
  print(text)
  if not quick and set(parts) == {"steps", "breakdown", "fit"}:
    path = os.path.join(HERE, "RESULTS.md")
    content = open(path).read()
    if BEGIN in content:
      head, rest = content.split(BEGIN, 1)
      content = head + BEGIN + "\n" + text + END + rest.split(END, 1)[1]
    else:
      content += "\n" + BEGIN + "\n" + text + END + "\n"
    atomic.write_text(path, content)


def markdown(results) -> str:
  lines = []
  if results["steps"]:
    lines += ["| workload / optimizer | native ms | TF-op path ms | floor ms | "
              "native / floor, per run | TF-op path / floor | native / TF-op path | "
              "floor on huge pages ms | native / it |",
              "|---|---|---|---|---|---|---|---|---|"]
    for key, runs in results["steps"].items():
      med = lambda k: statistics.median(r[k] for r in runs)  # pylint: disable=cell-var-from-loop
      per_run = ", ".join(f"{r['native/floor']:.2f}" for r in runs)
      lines.append(f"| {key} | {med('native'):.2f} | {med('tf_ops'):.2f} | "
                   f"{med('sparse_floor'):.2f} | **{per_run}** | "
                   f"{med('tf_ops/floor'):.2f} | {med('native/tf_ops'):.2f} | "
                   f"{med('floor_huge_pages'):.2f} | {med('native/floor_huge_pages'):.2f} |")
    lines.append("")
  b = results.get("breakdown")
  if b:
    lines += ["W2 Adagrad, native, where a step's time goes (median ms): "
              f"empty `tf.function` call {b['empty_call']:.2f}; lookup only "
              f"{b['lookup']:.2f}; lookup + loss + gradient {b['lookup_loss_gradient']:.2f}; "
              f"whole step {b['step']:.2f}, so the backward pass and update take "
              f"{b['update']:.2f}. Memory-bound estimate: {b['bytes_needed'] / 2**20:.0f} MiB "
              f"touched at {b['copy_gb_s']:.1f} GB/s (measured copy bandwidth) = "
              f"{b['memory_bound_ms']:.2f} ms.", ""]
  f = results.get("fit")
  if f:
    lines += ["Ranking model (configs/ranking.yaml, batch 1,024), `train_on_batch` "
              f"median ms: `EmbeddingLayer` native {f['embedding_layer_native']:.2f}, "
              f"TF-op path {f['embedding_layer_tf_ops']:.2f} "
              f"({f['tf_ops/native']:.2f}x native), `keras.layers.Embedding` "
              f"{f['keras_embedding']:.2f} ({f['keras_embedding/native']:.2f}x native).", ""]
  goals = []
  for key, runs in results["steps"].items():
    if not key.startswith("W2/"):
      continue
    goal = 0.35 if key.endswith("/adagrad") else 0.5
    ratios = [r["native/floor"] for r in runs]
    verdict = ("met in every run" if max(ratios) <= goal else
               "met in no run" if min(ratios) > goal else "met in some runs only")
    goals.append(f"{key} {min(ratios):.2f}-{max(ratios):.2f} (goal <= {goal}: {verdict})")
  if goals:
    lines += ["Against issue 23's goals, native / floor per run: " + "; ".join(goals)
              + ".", ""]
  la, lb = results["load_average_start"], results["load_average_end"]
  lines += [f"{results['runs']} run(s) of {results['repeats']} round-robin repeats after "
            f"{results['warmup']} warm-up steps, one process per row; load average {la[0]:.1f} at the start, "
            f"{lb[0]:.1f} at the end (2 shared cores: read the ratios).", ""]
  return "\n".join(lines)


if __name__ == "__main__":
  main()
