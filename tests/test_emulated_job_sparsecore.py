"""``train --tpu emulate:TOPOLOGY``: the job's SparseCore path (``TPUEmbeddingV2``).

As test_emulated_job.py, on an emulated TPU with SparseCore: the layer takes
the ``TPUEmbeddingV2`` branch, every feature gets the per-replica batch as its
``output_shape`` (``job.building.with_output_shapes``), and the checkpoint
holds the stacked tables of the topology. Converted to per-table keys
(``convert_checkpoint``, lossless), it must equal ``--tpu none``'s: every
table, slot, dense weight and optimizer variable, to float32 reordering, and
the held-out AUC to 1e-4. tiny (with the export) and criteo at 2 chips (2x4);
SparseCore at 8 chips runs in test_emulated_keras_multi_hot.py (model.fit),
and every config at v5p:8 in tests/emulated_job_matrix.py (by hand: it
costs about two minutes a config here).
"""

import pytest
import tensorflow as tf

from tests import jobs
from tpu_embed_ext.sparsecore import convert
from tpu_embed_ext.spec import EmbeddingSpec

STEPS = 4
TRAIN = {"steps_per_checkpoint": 2, "eval_batches": 1, "batch_size": 128}


def _same_as_cpu(config, root, tpu, name):
  cpu, _ = jobs.train_in_process(config, root / f"{name}_cpu", "none", STEPS)
  emulated, log = jobs.train_in_process(config, root / f"{name}_tpu", tpu, STEPS)
  stacked = jobs.checkpoint(root / f"{name}_tpu", STEPS)
  reader = tf.train.load_checkpoint(stacked)
  assert any("_sparse_core_table_layouts" in k for k in reader.get_variable_to_shape_map())
  per_table = str(root / f"{name}_per_table" / "ckpt")
  convert.convert_checkpoint(stacked, per_table, EmbeddingSpec.from_file(config),
                             log=lambda _: None)
  jobs.assert_same_checkpoints(per_table, jobs.checkpoint(root / f"{name}_cpu", STEPS))
  assert emulated["eval_auc"] == pytest.approx(cpu["eval_auc"], abs=1e-4)
  assert emulated["table_step"] == cpu["table_step"] == STEPS
  return log


def test_tiny_on_2_chips_equals_cpu_and_exports(tmp_path, tiny_data_dir):
  config = jobs.scaled_config(tmp_path, tiny_data_dir, "tiny", **TRAIN)
  log = _same_as_cpu(config, tmp_path, "emulate:2x4", "tiny")
  assert ("Training on emulated TPU 2x4 (2 chips x 4 SparseCores), 2 replicas "
          "(TPUEmbeddingV2, SparseCore).") in log
  # export restores the stacked checkpoint (converted to per-table keys).
  jobs.assert_exports_serve_alike(config, tiny_data_dir, tmp_path / "tiny_tpu",
                                  tmp_path / "tiny_cpu")


def test_criteo_on_2_chips_equals_cpu(tmp_path, tiny_data_dir):
  config = jobs.scaled_config(tmp_path, tiny_data_dir, "criteo", **TRAIN)
  _same_as_cpu(config, tmp_path, "emulate:2x4", "criteo")


def test_a_batch_that_does_not_split_over_the_chips_is_one_line(capsys, tmp_path,
                                                               tiny_data_dir):
  """TPUEmbeddingV2's output_shape is the per-replica batch: a global batch that
  does not split over the chips is refused before anything is built."""
  config = jobs.scaled_config(tmp_path, tiny_data_dir, "tiny", batch_size=100)
  line = jobs.one_line_error(capsys, "train", "--config", config, "--tpu", "emulate:v5p:8",
                             "--model_dir", str(tmp_path / "r"), "--steps", "2")
  assert line.endswith("train.batch_size: batch_size 100 does not split over 8 "
                       "replicas. Fix: use a batch size divisible by 8."), line
  assert not (tmp_path / "r" / "checkpoints").exists()
