"""The benchmark runs (tiny sizes) and writes well-formed JSON. No timing asserts."""

import json
import subprocess
import sys


def test_quick_benchmark_writes_json(tmp_path):
  subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--quick", "--out",
                  str(tmp_path)], check=True, capture_output=True)
  results = json.loads((tmp_path / "w1_quick.json").read_text())
  assert set(results["vocabularies"]) == {"1000", "10000"}
  for contenders in results["vocabularies"].values():
    assert set(contenders) == {"cpu_embedding", "cpu_embedding_unchecked",
                               "keras_embedding", "fused_floor"}
    assert all(c["median_ms"] > 0 for c in contenders.values())
