"""Every shipped config x every emulated TPU mode, against ``--tpu none``: by hand.

  .venv/bin/python tests/emulated_job_matrix.py --work /tmp/matrix [--steps 4]

``make test`` runs one mode per config (tests/test_emulated_job.py,
tests/test_emulated_job_sparsecore.py: every config and every mode at least
once, within the suite's time). This runs the whole matrix, the same way:
each config scaled down to the tiny dataset (``jobs.scaled_config``;
movielens on tfds's mock data) trained with ``--tpu none`` once and with
``emulate:2``, ``emulate:8``, ``emulate:8,hosts=2`` (``TPUEmbedding``; the
last a pod slice of 2 hosts, each reading its replicas' rows of the global
batches), ``emulate:2x4`` and ``emulate:v5p:8`` (``TPUEmbeddingV2``, its
stacked checkpoint converted to per-table keys; v5p:8 is 2 hosts of 4
chips), on the same global batches. For each run it checks every
checkpointed variable (``jobs.assert_same_checkpoints``: floats to rtol 1e-4,
atol 1e-5; ints equal) and the held-out AUC (1e-4), and prints one JSON line
with the worst relative difference (|a - b| / max(|b|, 1e-3)) and the AUC
difference. Exit status 0 when every check passed.
"""

import argparse
import json
import os
import pathlib
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)

import tensorflow as tf  # pylint: disable=g-import-not-at-top

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 8)

from tests import jobs  # pylint: disable=g-import-not-at-top
from tpu_embed_ext.sparsecore import convert  # pylint: disable=g-import-not-at-top
from tpu_embed_ext.spec import EmbeddingSpec  # pylint: disable=g-import-not-at-top

CONFIGS = ("tiny", "ranking", "criteo", "movielens")
MODES = ("emulate:2", "emulate:8", "emulate:8,hosts=2", "emulate:2x4", "emulate:v5p:8")


def _run(config, root, steps):
  """Yields one result per mode of ``config``."""
  cpu, _ = jobs.train_in_process(config, root / "cpu", "none", steps)
  for mode in MODES:
    start = time.perf_counter()
    model_dir = root / mode.replace(":", "_").replace(",", "_").replace("=", "")
    emulated, _ = jobs.train_in_process(config, model_dir, mode, steps)
    prefix = jobs.checkpoint(model_dir, steps)
    if "x" in mode.partition(",")[0] or "v5p" in mode:
      per_table = str(model_dir / "per_table" / "ckpt")
      convert.convert_checkpoint(prefix, per_table, EmbeddingSpec.from_file(config),
                                 log=lambda _: None)
      prefix = per_table
    worst = jobs.assert_same_checkpoints(prefix, jobs.checkpoint(root / "cpu", steps))
    auc = abs(emulated["eval_auc"] - cpu["eval_auc"])
    assert auc <= 1e-4, (mode, auc)
    yield {"mode": mode, "worst_relative_difference": worst, "auc_difference": auc,
           "seconds": round(time.perf_counter() - start, 1)}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--work", required=True)
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--configs", nargs="*", default=CONFIGS)
  args = parser.parse_args()
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tpu_embed_ext import data  # pylint: disable=g-import-not-at-top  # Registers it.
  del data
  work = pathlib.Path(args.work)
  data_dir = str(work / "data")
  tfds.builder("synthetic_clicks/tiny", data_dir=data_dir).download_and_prepare()
  train = {"steps_per_checkpoint": 2, "eval_batches": 1}
  for name in args.configs:
    root = work / name
    root.mkdir(parents=True, exist_ok=True)
    if name == "movielens":
      from tests.test_train import _movielens_examples  # pylint: disable=g-import-not-at-top
      config = jobs.scaled_config(root, None, name, batch_size=32, **train)
      with tfds.testing.mock_data(as_dataset_fn=_movielens_examples):
        results = list(_run(config, root, args.steps))
    else:
      config = jobs.scaled_config(root, data_dir, name, batch_size=128, **train)
      results = list(_run(config, root, args.steps))
    for result in results:
      print(json.dumps({"config": name, **result}), flush=True)


if __name__ == "__main__":
  main()
