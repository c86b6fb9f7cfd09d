"""Benchmark: converting the W2 tables' checkpoint to SparseCore's layout and back.

The W2 tables (``workloads.w2``: 26 Criteo-like tables, capped at 500,000
rows) with Adagrad (table + accumulator) are written as a per-table
checkpoint, then converted, each step in a fresh process:

* ``to_sparsecore``: per-table -> TPUEmbeddingV2's stacked layout on v5p:4
  (``sparsecore.convert_checkpoint``, streamed table by table);
* ``to_per_table``: back;
* ``in_memory``: the baseline a user would write with TensorFlow's own
  objects: restore every table into ``CPUEmbedding``, then save the stacked
  form (``sparsecore.trackable``), with the whole checkpoint in memory.

Reported: wall time, and the resident memory each step added over its
process's start (``VmHWM`` after ``/proc/self/clear_refs``), against the
checkpoint's size. The round trip is checked to be bit-identical.

Usage: ``python -m benchmarks.convert_checkpoint [--quick] [--dir DIR]``;
writes ``results/convert.json`` (``convert_quick.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import numpy as np

from benchmarks.run_all import HERE, _run_python
from tpu_embed_ext.host import atomic

_PRELUDE = (
    "import time, json\n"
    "import tensorflow as tf\n"
    "from benchmarks import workloads\n"
    "from tpu_embed_ext.sparsecore import convert_checkpoint\n"
    "E = tf.tpu.experimental.embedding\n"
    "def status(key):\n"
    "  for line in open('/proc/self/status'):\n"
    "    if line.startswith(key + ':'):\n"
    "      return int(line.split()[1]) / 1024\n"
    "w = workloads.w2({cap})\n"
    # TPUEmbeddingV2 (engine='v2') needs every feature's output shape.
    "config = {{n: E.FeatureConfig(f.table, name=f.name, output_shape=[w.batch])\n"
    "          for n, f in workloads._feature_config(w).items()}}\n"
    "optimizer = E.Adagrad(0.1, initial_accumulator_value=0.1)\n")

_MEASURE = (
    "before = status('VmRSS')\n"
    "open('/proc/self/clear_refs', 'w').write('5')\n"
    "start = time.perf_counter()\n"
    "{body}\n"
    "seconds = time.perf_counter() - start\n"
    "print('RESULT ' + json.dumps({{'seconds': seconds, "
    "'added_mib': status('VmHWM') - before}}))\n")

_WRITE = (
    "import tpu_embed_ext as tee\n"
    "emb = tee.CPUEmbedding(config, optimizer, engine='v2')\n"
    "emb.build()\n"
    "for i, slots in enumerate(emb.variables.values()):\n"
    "  for j, var in enumerate(slots.values()):\n"
    "    var.assign(tf.random.stateless_uniform(var.shape, seed=[i, j]))\n"
    "tf.train.Checkpoint(embedding=emb).write({path!r})\n")

_IN_MEMORY = (
    "import tpu_embed_ext as tee\n"
    "from tensorflow.python.trackable import autotrackable\n"
    "from tpu_embed_ext.sparsecore import layout, parse_topology, trackable\n"
    "emb = tee.CPUEmbedding(config, optimizer, engine='v2')\n"
    "tf.train.Checkpoint(embedding=emb).read({src!r})\n"
    "emb.build()\n"
    "layouts = layout.compute_layouts(layout.stacking_inputs(config, optimizer), "
    "parse_topology('v5p:4'))\n"
    "holder = autotrackable.AutoTrackable()\n"
    "fill = {{'parameters': 0.0, 'accumulators': 0.1}}\n"
    "trackable.track_stacked(holder, emb.variables, layouts, "
    "{{t: fill for t in emb.variables}})\n"
    "tf.train.Checkpoint(embedding=holder).write({dst!r})")


def _step(cap: int, body: str) -> dict:
  out = _run_python(_PRELUDE.format(cap=cap) + _MEASURE.format(body=body))
  return json.loads(out.split("RESULT ", 1)[1])


def _size(prefix: str) -> int:
  folder, name = os.path.split(prefix)
  return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
             if f.startswith(name + "."))


def _bit_identical(a: str, b: str) -> bool:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  ra, rb = tf.train.load_checkpoint(a), tf.train.load_checkpoint(b)
  keys = set(ra.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}
  if keys != set(rb.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}:
    return False
  return all(np.asarray(ra.get_tensor(k)).tobytes() == np.asarray(rb.get_tensor(k)).tobytes()
             for k in sorted(keys))


def run(cap: int, folder: str) -> dict:
  per_table = os.path.join(folder, "per_table", "ckpt")
  stacked = os.path.join(folder, "stacked", "ckpt")
  back = os.path.join(folder, "back", "ckpt")
  in_memory = os.path.join(folder, "in_memory", "ckpt")
  write = _step(cap, _WRITE.format(path=per_table))
  results = {
      "to_sparsecore": _step(cap, f"convert_checkpoint({per_table!r}, {stacked!r}, "
                                  "config, 'v5p:4', optimizer=optimizer)"),
      "to_per_table": _step(cap, f"convert_checkpoint({stacked!r}, {back!r}, config, "
                                 "optimizer=optimizer)"),
      "in_memory": _step(cap, _IN_MEMORY.format(src=per_table, dst=in_memory)),
  }
  size_mib = _size(per_table) / 2**20
  for r in results.values():
    r["added_over_checkpoint"] = r["added_mib"] / size_mib
  return {
      "workload": f"W2-cap{cap}, Adagrad (table + accumulator), topology v5p:4",
      "checkpoint_mib": size_mib, "stacked_mib": _size(stacked) / 2**20,
      "write_seconds": write["seconds"], "steps": results,
      "memory_vs_in_memory": results["to_sparsecore"]["added_mib"]
                             / results["in_memory"]["added_mib"],
      "time_vs_in_memory": results["to_sparsecore"]["seconds"]
                           / results["in_memory"]["seconds"],
      "round_trip_bit_identical": _bit_identical(per_table, back),
      "stacked_equals_in_memory": _bit_identical(stacked, in_memory),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tables capped at 20,000 rows")
  parser.add_argument("--dir", default=None, help="where to write the checkpoints "
                      "(default: a temporary directory, removed afterwards)")
  parser.add_argument("--out", default=os.path.join(HERE, "results"))
  args = parser.parse_args()
  folder = args.dir or tempfile.mkdtemp(prefix="convert-bench-")
  try:
    result = run(20_000 if args.quick else 500_000, folder)
  finally:
    if not args.dir:
      shutil.rmtree(folder, ignore_errors=True)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "convert_quick.json" if args.quick else "convert.json")
  atomic.write_text(path, json.dumps(result, indent=2))
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
