"""Benchmarks: one training step of embedding tables, per contender.

Workloads (``benchmarks/workloads.py``): W1, one table of dim 16 at vocabulary
1e5, 1e6 and 1e7; W2, the 26 Criteo-like tables (Criteo's cardinalities,
capped so that every contender's tables fit this machine; six multi-hot
features). Batch 4096 Zipf(1.2) ids; optimizers SGD, Adagrad, Adam and FTRL.

Method: for one (workload, optimizer) all contenders are built in one fresh
process, warmed up, then stepped round robin (each repeat runs every contender
once on the same batch, so machine noise hits them alike); the median step
time is reported, with p10/p90 in the JSON. ``scaling`` times CPUEmbedding
alone, consecutive steps as in a training loop, at each W1 vocabulary.
``memory`` runs CPUEmbedding alone in a subprocess per optimizer and compares
its peak RSS with the bytes of its tables and slots.

Usage: ``python -m benchmarks.run_all [--quick]`` (``make bench``). Writes
``results/bench.json`` (``bench_quick.json``), the tables in RESULTS.md and
``results/w1.png`` (full run only).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from benchmarks import round_robin, workloads
from tpu_embed_ext.host import atomic

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "<!-- results -->"


def _summary(times):
  return {"median_ms": statistics.median(times),
          "p10_ms": float(np.percentile(times, 10)),
          "p90_ms": float(np.percentile(times, 90))}


def compare_in_subprocess(workload_expr, optimizer, contenders, repeats, warmup):
  """``compare`` in a fresh process: no memory carried over between runs.

  At 10^7 rows the six contenders hold about 12 GB of tables and slots; a
  fresh process per comparison keeps the peak at one comparison's.
  """
  code = (
      "import json\n"
      "from benchmarks import run_all, workloads\n"
      f"r = run_all.compare({workload_expr}, {optimizer!r}, {contenders!r}, "
      f"{repeats}, {warmup})\n"
      "import resource\n"
      "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
      "print('RESULT ' + json.dumps([r, peak]))\n")
  timings, peak = json.loads(_run_python(code).split("RESULT ", 1)[1])
  _PEAK_RSS_MIB[0] = max(_PEAK_RSS_MIB[0], peak)
  return timings


_PEAK_RSS_MIB = [0.0]  # The largest comparison process's peak RSS.


def _run_python(code: str) -> str:
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run([sys.executable, "-c", code], text=True,
                        capture_output=True, env=env, cwd=os.path.dirname(HERE))
  if done.returncode:
    raise RuntimeError(f"benchmark subprocess failed ({done.returncode}):\n"
                       f"{done.stderr[-3000:]}")
  return done.stdout


def compare(workload, optimizer, contenders, repeats, warmup):
  """Median step time of each contender, interleaved round robin."""
  steps = {name: workloads.CONTENDERS[name](workload, optimizer)
           for name in contenders}
  batches = workload.batches(8)
  for step, _ in steps.values():
    for i in range(warmup):
      step(batches[i % len(batches)])
  times = {name: [] for name in steps}
  for r in range(repeats):
    for name, (step, _) in steps.items():
      start = time.perf_counter()
      step(batches[r % len(batches)])
      times[name].append((time.perf_counter() - start) * 1e3)
  del steps
  gc.collect()
  return {name: _summary(t) for name, t in times.items()}


def scaling(vocabs, optimizer, steps, warmup):
  """CPUEmbedding alone: consecutive steps, as in a training loop."""
  return {str(vocab): compare(workloads.w1(vocab), optimizer, ["cpu_embedding"],
                              steps, warmup)["cpu_embedding"]
          for vocab in vocabs}


def memory(workload_name, optimizer, steps):
  """Resident memory of a fresh process running CPUEmbedding alone, in MiB.

  ``built - before`` is what building the tables and slots added; ``peak -
  built`` is the most the training steps ever held on top of that (the
  high-water mark is reset after building, through /proc/self/clear_refs).
  """
  code = (
      "import gc\n"
      "from benchmarks import workloads\n"
      "def status(key):\n"
      "  for line in open('/proc/self/status'):\n"
      "    if line.startswith(key + ':'):\n"
      "      return int(line.split()[1]) / 1024\n"
      f"w = {workload_name}\n"
      "b = w.batches(4)\n"
      "gc.collect()\n"
      "before = status('VmRSS')\n"
      f"step, tables = workloads.cpu_embedding(w, {optimizer!r})\n"
      "gc.collect()\n"
      "built = status('VmRSS')\n"
      "open('/proc/self/clear_refs', 'w').write('5')\n"
      f"for i in range({steps}): step(b[i % 4])\n"
      "peak = status('VmHWM')\n"
      f"state = w.parameters * 4 * (1 + workloads.SLOTS[{optimizer!r}]) / 2**20\n"
      "print(before, built, peak, state)\n")
  before, built, peak, state = map(float, _run_python(code).split()[-4:])
  return {"before_build_mib": before, "after_build_mib": built, "peak_mib": peak,
          "tables_and_slots_mib": state, "build_added_mib": built - before,
          "steps_added_mib": peak - built}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes and few repeats (a smoke test)")
  parser.add_argument("--out", default=os.path.join(HERE, "results"))
  parser.add_argument("--optimizers", default="sgd,adagrad,adam,ftrl")
  args = parser.parse_args()
  optimizers = args.optimizers.split(",")
  if args.quick:
    vocabs, w2_cap, repeats, warmup, scaling_steps = [10**3, 10**4], 2000, 3, 1, 10
  else:
    vocabs, w2_cap, repeats, warmup, scaling_steps = [10**5, 10**6, 10**7], 500_000, 20, 3, 300
  contenders = list(workloads.CONTENDERS)
  skipped = {}
  reason = workloads.keras_rs_available()
  if reason:
    contenders.remove("keras_rs")
    skipped["keras_rs"] = reason
  results = {
      "machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                  "python": platform.python_version(),
                  "tensorflow": tf.__version__, "keras": keras.__version__},
      "batch": workloads.BATCH, "repeats": repeats, "warmup": warmup,
      "skipped": skipped, "w1": {}, "w2": {}, "scaling": {}, "memory": {}}
  results["w2_tables"] = [dict(name=t.name, vocab=t.vocab, dim=t.dim,
                               combiner=t.combiner, max_ids=t.max_ids)
                          for t in workloads.w2(w2_cap).tables]
  for optimizer in optimizers:
    results["w1"][optimizer] = {}
    for vocab in vocabs:
      print(f"W1 {optimizer} vocabulary {vocab:,}...", flush=True)
      results["w1"][optimizer][str(vocab)] = compare_in_subprocess(
          f"workloads.w1({vocab})", optimizer, contenders, repeats, warmup)
    print(f"W2 {optimizer}...", flush=True)
    results["w2"][optimizer] = compare_in_subprocess(
        f"workloads.w2({w2_cap})", optimizer, contenders, repeats, warmup)
    results["scaling"][optimizer] = scaling(vocabs, optimizer, scaling_steps, warmup)
    results["memory"][optimizer] = memory(
        f"workloads.w1({vocabs[-1]})", optimizer, 3 if args.quick else 50)
  results["peak_rss_mib"] = max(
      _PEAK_RSS_MIB[0], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
  os.makedirs(args.out, exist_ok=True)
  name = "bench_quick" if args.quick else "bench"
  atomic.write_text(os.path.join(args.out, f"{name}.json"),
                    json.dumps(results, indent=2))
  text = markdown(results)
  print(text)
  if not args.quick:
    plot(results, os.path.join(args.out, "w1.png"))
    # Only the tables between the two marks: the sections after them are
    # other benchmarks' (replicas, emulation, job_tpu).
    round_robin.write_section(os.path.join(HERE, "RESULTS.md"), MARK, text.rstrip("\n"))


def _ms(x):
  return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def markdown(results) -> str:
  """The RESULTS.md tables: median ms, and each contender's time / CPUEmbedding's."""
  lines = []
  for optimizer, by_vocab in results["w1"].items():
    lines += [f"### W1, {optimizer}: one table, dim 16 (median ms per step; "
              "x = time / cpu_embedding's)", ""]
    names = list(next(iter(by_vocab.values())))
    lines += ["| vocabulary | " + " | ".join(names) + " |",
              "|---|" + "---|" * len(names)]
    for vocab, r in by_vocab.items():
      ours = r["cpu_embedding"]["median_ms"]
      cells = [_ms(r[n]["median_ms"]) + (
          "" if n == "cpu_embedding" else f" ({r[n]['median_ms'] / ours:.2f}x)")
               for n in names]
      lines.append(f"| {int(vocab):,} | " + " | ".join(cells) + " |")
    s = results["scaling"][optimizer]
    first, last = list(s)[0], list(s)[-1]
    m = results["memory"][optimizer]
    lines += ["", f"cpu_embedding alone, consecutive steps: {_ms(s[first]['median_ms'])} ms "
              f"at {int(first):,} rows, {_ms(s[last]['median_ms'])} ms at {int(last):,} "
              f"rows: **{s[last]['median_ms'] / s[first]['median_ms']:.2f}x**. Memory at "
              f"{int(last):,} rows: tables + slots {m['tables_and_slots_mib']:,.0f} MiB; "
              f"building them added {m['build_added_mib']:,.0f} MiB of resident memory, "
              f"{m['steps_added_mib']:,.0f} MiB more at the peak of "
              f"training steps.", ""]
  names = list(next(iter(results["w2"].values()))) if results["w2"] else []
  if names:
    lines += ["### W2: 26 Criteo-like tables (median ms per step; x = time / "
              "cpu_embedding's)", "",
              "| optimizer | " + " | ".join(names) + " |",
              "|---|" + "---|" * len(names)]
    for optimizer, r in results["w2"].items():
      ours = r["cpu_embedding"]["median_ms"]
      cells = [_ms(r[n]["median_ms"]) + (
          "" if n == "cpu_embedding" else f" ({r[n]['median_ms'] / ours:.2f}x)")
               for n in names]
      lines.append(f"| {optimizer} | " + " | ".join(cells) + " |")
  if results["skipped"]:
    lines += [""] + [f"Skipped {k}: {v}" for k, v in results["skipped"].items()]
  m = results["machine"]
  lines += ["", f"Machine: {m['cores']} cores, Python {m['python']}, TensorFlow "
            f"{m['tensorflow']}, Keras {m['keras']}; {results['repeats']} "
            f"interleaved repeats after {results['warmup']} warm-up steps; peak RSS "
            f"of the largest comparison process (all six contenders' tables) "
            f"{results['peak_rss_mib']:,.0f} MiB.", ""]
  return "\n".join(lines)


def plot(results, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  optimizers = list(results["w1"])
  fig, axes = plt.subplots(1, len(optimizers), figsize=(4 * len(optimizers), 3.8),
                           sharey=True)
  for ax, optimizer in zip(np.atleast_1d(axes), optimizers):
    by_vocab = results["w1"][optimizer]
    vocabs = [int(v) for v in by_vocab]
    for name in next(iter(by_vocab.values())):
      ax.plot(vocabs, [by_vocab[str(v)][name]["median_ms"] for v in vocabs],
              marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"W1 {optimizer}")
    ax.set_xlabel("vocabulary (rows)")
    ax.grid(alpha=0.3, which="both")
  np.atleast_1d(axes)[0].set_ylabel("median step time (ms)")
  np.atleast_1d(axes)[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


if __name__ == "__main__":
  main()
