"""The benchmark runs (tiny sizes, one optimizer) and writes well-formed JSON.

No timing asserts: the numbers are for benchmarks/RESULTS.md, not for tests.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import run_all, workloads
from tpu_embed_ext.emulation import native as native_kernels


def test_quick_benchmark_writes_json_and_tables(tmp_path):
  subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--quick",
                  "--optimizers", "adagrad", "--out", str(tmp_path)],
                 check=True, capture_output=True)
  results = json.loads((tmp_path / "bench_quick.json").read_text())
  expected = set(workloads.CONTENDERS) - set(results["skipped"])
  assert set(results["w1"]["adagrad"]) == {"1000", "10000"}
  for contenders in [*results["w1"]["adagrad"].values(), results["w2"]["adagrad"]]:
    assert set(contenders) == expected
    assert all(c["p10_ms"] <= c["median_ms"] <= c["p90_ms"] for c in contenders.values())
  assert len(results["w2_tables"]) == 26
  assert set(results["scaling"]["adagrad"]) == {"1000", "10000"}
  memory = results["memory"]["adagrad"]
  assert memory["tables_and_slots_mib"] > 0
  assert memory["peak_mib"] >= memory["after_build_mib"] >= memory["before_build_mib"] > 0
  text = run_all.markdown(results)
  assert "### W1, adagrad" in text and "### W2" in text


@pytest.mark.parametrize("name", list(workloads.CONTENDERS))
def test_every_contender_takes_the_same_sgd_steps(name):
  """Two SGD steps on a small W2 equal a numpy reference, for every contender.

  Loss sum(act^2) / B, so dL/dact = 2 act / B; a single-hot table's row moves
  by -lr * sum over its occurrences; a mean-combined multi-hot row b sends
  dL/dact[b] / len(b) to each of its ids.
  """
  if name == "keras_rs" and workloads.keras_rs_available():
    pytest.skip(workloads.keras_rs_available())
  workload = workloads.w2(cap=50)
  step, tables = workloads.CONTENDERS[name](workload, "sgd")
  batches = workload.batches(2, seed=7)
  reference = {t.name: np.full((t.vocab, t.dim), workloads.INIT) for t in workload.tables}
  for features in batches:
    for table in workload.tables:
      w = reference[table.name]
      ids = features[table.name]
      if isinstance(ids, tf.RaggedTensor):
        rows = [np.asarray(r) for r in ids.to_list()]
        grad = np.zeros_like(w)
        for r in rows:
          act = w[r].mean(axis=0)
          np.add.at(grad, r, 2 * act / workload.batch / len(r))
      else:
        ids = ids.numpy()
        grad = np.zeros_like(w)
        np.add.at(grad, ids, 2 * w[ids] / workload.batch)
      reference[table.name] = w - 0.1 * grad
    step(features)
  # CPUEmbedding and the floor sum each id's gradients, then apply them once
  # (the TPU's accumulation). The Keras routes scatter every occurrence, one
  # float32 rounding each: a popular row drifts by ~1e-4 relative in 2 steps.
  rtol = 1e-3 if name in ("keras_embedding", "serving_keras", "keras_rs") else 1e-5
  for table in workload.tables:
    np.testing.assert_allclose(tables[table.name].numpy(), reference[table.name],
                               rtol=rtol, atol=1e-9, err_msg=f"{name} {table.name}")


@pytest.mark.skipif(native_kernels.load() is None,
                    reason=f"native kernels unavailable: {native_kernels.why_not()}")
def test_quick_native_benchmark_writes_json_and_tables(tmp_path):
  from benchmarks import native  # pylint: disable=import-outside-toplevel
  subprocess.run([sys.executable, "-m", "benchmarks.native", "--quick",
                  "--optimizers", "adagrad", "--out", str(tmp_path)],
                 check=True, capture_output=True)
  results = json.loads((tmp_path / "native_quick.json").read_text())
  assert set(results["steps"]) == {"W1-1e3/adagrad", "W2/adagrad"}
  for runs in results["steps"].values():
    for run in runs:
      assert {"native", "tf_ops", "sparse_floor", "native/floor"} <= set(run)
      assert run["native/floor_p10"] <= run["native/floor"] <= run["native/floor_p90"]
  breakdown = results["breakdown"]
  assert breakdown["bytes_needed"] > 0 and breakdown["memory_bound_ms"] > 0
  assert set(results["fit"]) >= {"embedding_layer_native", "embedding_layer_tf_ops",
                                 "keras_embedding"}
  text = native.markdown(results)
  assert "| W2/adagrad |" in text and "Ranking model" in text


def test_quick_emulation_benchmark_writes_json_and_steps_the_same_tables(tmp_path):
  """The emulated TPU program and the CPUEmbedding loop did the same work:
  after the same steps their checkpoints hold the same bytes (v1 and SparseCore)."""
  out = subprocess.run([sys.executable, "-m", "benchmarks.emulation", "--quick",
                        "--out", str(tmp_path)], check=True, capture_output=True,
                       text=True).stdout
  results = json.loads((tmp_path / "emulation_quick.json").read_text())
  assert results["replicas"] == 2 and results["goal_ratio"] == 1.05
  assert set(results["results"]) == {"W1-1000 adagrad", "W1-1000 adagrad, SparseCore"}
  for case in results["results"].values():
    assert case["same_tables"] is True
    for name in ("emulated", "direct"):
      assert case[name]["p10_ms"] <= case[name]["median_ms"] <= case[name]["p90_ms"]
    assert case["ratio"] == case["emulated"]["median_ms"] / case["direct"]["median_ms"]
  assert "| W1-1000 adagrad, SparseCore |" in out  # the table it prints


def test_quick_xla_costs_write_first_step_and_step_times_at_1_2_8_replicas(tmp_path):
  """benchmarks/emulation.py --xla-costs: XLA check on and off per replica count."""
  subprocess.run([sys.executable, "-m", "benchmarks.emulation", "--quick", "--xla-costs",
                  "--out", str(tmp_path)], check=True, capture_output=True, text=True,
                 timeout=300)
  results = json.loads((tmp_path / "emulation_xla_quick.json").read_text())["results"]
  assert set(results) == {"1 replicas", "2 replicas", "8 replicas"}
  for row in results.values():
    for mode in ("xla_on", "xla_off"):
      assert row[mode]["first_step_ms"] > 0 and row[mode]["median_ms"] > 0
    assert row["step_ratio_on_off"] == row["xla_on"]["median_ms"] / row["xla_off"]["median_ms"]


def test_quick_keras_step_benchmark_writes_json_and_trains_the_tables(tmp_path):
  """benchmarks/keras_step.py: both models stepped; the layer's tables took
  one table step per train_on_batch (warm-up included)."""
  out = subprocess.run([sys.executable, "-m", "benchmarks.keras_step", "--quick",
                        "--out", str(tmp_path)], check=True, capture_output=True,
                       text=True, timeout=600).stdout
  data = json.loads((tmp_path / "keras_step_quick.json").read_text())
  results = data["results"]
  for name in ("embedding_layer", "keras_embedding"):
    assert results[name]["p10_ms"] <= results[name]["median_ms"] <= results[name]["p90_ms"]
  assert results["ratio"] == (results["embedding_layer"]["median_ms"]
                              / results["keras_embedding"]["median_ms"])
  assert results["table_steps"] == 4 + data["repeats"]  # warm-up pool + repeats
  assert "| RankingModel (configs/ranking.yaml), batch 32 |" in out
