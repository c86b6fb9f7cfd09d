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

``--xla-costs``: what the XLA check (``emulate_tpu(xla=True)``, the
default; ``emulated_tpu/xla_check.py``) costs at 1, 2 and 8 replicas: the
first step (trace, the check of each replica's ops, and the XLA compilation
of replica 0's TensorCore program, ``emulated_tpu/xla_compile.py``, timed
alone as ``compile_ms``) and the median step after it, with XLA on and off, for a
TPUEmbedding step with a Keras dense layer. Written to
``results/emulation_xla[_quick].json``; runs one after the other (one
emulation at a time), so machine noise is not shared as in the round robin.

``--keras-xla-costs NAME``: the check's cost for a small Keras ``fit`` (two
``Dense`` layers, 8 steps of 16 samples per replica) at 2 and 8 replicas
with ``steps_per_execution`` 1 and 8: the seconds spent inside the check
(``xla_check.check_ops`` and ``compile_program``, the first time XLA's
kernels register included) and the first ``fit`` with XLA on and off, two
interleaved rounds, written to ``results/NAME``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

REPLICAS = 2
XLA_REPLICAS = (1, 2, 8)
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] *
    (max(XLA_REPLICAS) if any(a.endswith("xla-costs") or a.startswith("--keras-xla-costs")
                              for a in sys.argv) else REPLICAS))

import tpu_embed_ext as tee  # pylint: disable=g-import-not-at-top
from benchmarks import round_robin, workloads  # pylint: disable=g-import-not-at-top
from tpu_embed_ext.emulated_tpu import xla_compile  # pylint: disable=g-import-not-at-top

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


def _xla_cost(workload, replicas, xla, repeats):
  """First step and median step of a TPU program with a dense layer."""
  import keras  # pylint: disable=g-import-not-at-top
  batches = workload.batches(POOL, seed=1)
  with tee.emulate_tpu(replicas=replicas, xla=xla):
    strategy, embedding = _emulated(workload, "adagrad", False)
    with strategy.scope():
      dense = keras.layers.Dense(1)
      optimizer = keras.optimizers.SGD(0.1)

    def replica_step(features):
      embedding.enqueue(features, training=True)
      activations = embedding.dequeue()
      with tf.GradientTape() as tape:
        tape.watch(activations)
        flat = tf.concat([tf.reshape(a, [tf.shape(a)[0], -1])
                          for a in tf.nest.flatten(activations)], 1)
        loss = tf.reduce_mean(dense(flat) ** 2)
      grads = tape.gradient(loss, [activations] + dense.trainable_variables)
      embedding.apply_gradients(grads[0])
      optimizer.apply_gradients(zip(grads[1:], dense.trainable_variables))

    @tf.function
    def step(features):
      strategy.run(replica_step, args=(features,))

    per = workload.batch // replicas
    inputs = [strategy.experimental_distribute_values_from_function(
        lambda ctx, b=b: {k: v[ctx.replica_id_in_sync_group * per:
                               (ctx.replica_id_in_sync_group + 1) * per]
                          for k, v in b.items()}) for b in batches]
    with strategy.scope():  # the dense variables, before tracing
      dense.build((None, sum(f.table.dim for f in tf.nest.flatten(
          embedding.feature_config))))
      optimizer.build(dense.trainable_variables)
    compile_ms = []
    compile_program = xla_compile.compile_replica_program

    def timed_compile(*args):
      start = time.perf_counter()
      try:
        return compile_program(*args)
      finally:
        compile_ms.append((time.perf_counter() - start) * 1e3)

    xla_compile.compile_replica_program = timed_compile
    try:
      start = time.perf_counter()
      step(inputs[0])
      first = (time.perf_counter() - start) * 1e3
    finally:
      xla_compile.compile_replica_program = compile_program
    times = []
    for r in range(repeats):
      start = time.perf_counter()
      step(inputs[r % len(inputs)])
      times.append((time.perf_counter() - start) * 1e3)
  return {"first_step_ms": first, "median_ms": float(np.median(times)),
          "compile_ms": sum(compile_ms), "compilations": len(compile_ms)}


def xla_costs(workload, repeats):
  out = {}
  for replicas in XLA_REPLICAS:
    row = {f"xla_{'on' if xla else 'off'}": _xla_cost(workload, replicas, xla, repeats)
           for xla in (True, False)}
    row["first_step_check_ms"] = (row["xla_on"]["first_step_ms"]
                                  - row["xla_off"]["first_step_ms"])
    row["step_ratio_on_off"] = row["xla_on"]["median_ms"] / row["xla_off"]["median_ms"]
    out[f"{replicas} replicas"] = row
  return out


def _keras_fit_seconds(replicas, xla, spe):
  """Seconds of the first ``fit`` (trace, check, compile, 8 steps) of a small
  Keras model under ``TPUStrategy``, and of a second ``fit`` (traced already)."""
  import keras  # pylint: disable=g-import-not-at-top
  from tpu_embed_ext.emulated_tpu import xla_check  # pylint: disable=g-import-not-at-top
  inside = []  # seconds spent in the check itself (its op check and compile)
  saved = {name: getattr(xla_check, name) for name in ("check_ops", "compile_program")}

  def timed(function):
    def run(*args, **kwargs):
      start = time.perf_counter()
      try:
        return function(*args, **kwargs)
      finally:
        inside.append(time.perf_counter() - start)
    return run
  for name, function in saved.items():
    setattr(xla_check, name, timed(function))
  try:
    times = _keras_fits(replicas, xla, spe, keras)
  finally:
    for name, function in saved.items():
      setattr(xla_check, name, function)
  return times, sum(inside)


def _keras_fits(replicas, xla, spe, keras):
  with tee.emulate_tpu(replicas=replicas, xla=xla):
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    with strategy.scope():
      model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                keras.layers.Dense(1)])
      model.compile(optimizer="sgd", loss="mse", steps_per_execution=spe)
    x = np.random.RandomState(0).rand(16 * replicas * 8, 8).astype(np.float32)
    times = []
    for _ in range(2):
      start = time.perf_counter()
      model.fit(x, x.sum(1, keepdims=True), batch_size=16 * replicas, epochs=1, verbose=0)
      times.append(time.perf_counter() - start)
  return times


def keras_xla_costs(rounds=2):
  """The check's cost for a small Keras fit at 2 and 8 replicas,
  steps_per_execution 1 and 8: the seconds spent in the check (its op check
  and XLA compile, timed inside), and the first fit with XLA on and off;
  ``rounds`` interleaved."""
  out = {}
  for replicas in (2, 8):
    for spe in (1, 8):
      on, off, inside = [], [], []
      for _ in range(rounds):
        times, check = _keras_fit_seconds(replicas, True, spe)
        on.append(times[0])
        inside.append(check)
        off.append(_keras_fit_seconds(replicas, False, spe)[0][0])
      out[f"{replicas} replicas, steps_per_execution={spe}"] = {
          "first_fit_s_on": on, "first_fit_s_off": off, "check_s": inside}
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
  parser.add_argument("--xla-costs", action="store_true",
                      help="Only the XLA check's costs at 1, 2 and 8 replicas.")
  parser.add_argument("--keras-xla-costs", metavar="JSON_NAME",
                      help="Only the XLA check's cost for a small Keras fit at 2 "
                           "and 8 replicas, written to results/JSON_NAME.")
  args = parser.parse_args()
  if args.keras_xla_costs:
    results = keras_xla_costs()
    round_robin.write_json(os.path.join(args.out, args.keras_xla_costs), results=results)
    for key, row in results.items():
      print(f"{key}: check " + ", ".join(f"{c:.2f} s" for c in row["check_s"]) +
            " (first fit on " + ", ".join(f"{c:.2f}" for c in row["first_fit_s_on"]) +
            "; off " + ", ".join(f"{c:.2f}" for c in row["first_fit_s_off"]) + ")")
    return
  if args.xla_costs:
    workload = workloads.w1(1_000 if args.quick else 100_000)
    repeats = 5 if args.quick else 20
    results = xla_costs(workload, repeats)
    name = "emulation_xla_quick.json" if args.quick else "emulation_xla.json"
    round_robin.write_json(os.path.join(args.out, name), batch=workload.batch,
                           repeats=repeats, results=results)
    for key, row in results.items():
      print(f"{key}: first step {row['xla_on']['first_step_ms']:.0f} ms with XLA "
            f"check (XLA compile {row['xla_on']['compile_ms']:.0f} ms), "
            f"{row['xla_off']['first_step_ms']:.0f} ms without; step "
            f"{row['xla_on']['median_ms']:.2f} / {row['xla_off']['median_ms']:.2f} ms")
    return
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
