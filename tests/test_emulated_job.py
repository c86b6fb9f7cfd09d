"""``train --tpu emulate:N``: the job's TPU path (``TPUEmbedding``) on the emulated TPU.

The job resolves a TPU as on a Cloud TPU VM (resolver, initialize,
TPUStrategy); its model's EmbeddingLayer takes the TPUEmbedding branch and
every call of the model runs in ``strategy.run``. Multi-hot ids come as
ragged ids straight from the distributed dataset (host side), as a TPU takes
them. Trained on the same global batches, its checkpoint must equal
``--tpu none``'s: every table, slot, dense weight and optimizer variable, to
float32 reordering (the replicas' gradients are summed in another order
than one device sums them), and the held-out AUC to 1e-4.

On a pod slice (``emulate:4,hosts=2``) each host reads its replicas' rows
of the same global batches (``replicated.fit_dataset``: DATA auto-shard).

Every shipped config runs here or in test_emulated_job_sparsecore.py, scaled
down to the session's tiny dataset (``jobs.scaled_config``): tiny at 2
replicas (with a killed-and-resumed run and the export), ranking at 8,
movielens (tfds mocked) at 2; SparseCore there.
"""

import warnings

import pytest
import tensorflow as tf

from tests import jobs
from tests.test_train import _movielens_examples
from tpu_embed_ext import errors
from tpu_embed_ext.emulated_tpu import pod
from tpu_embed_ext.job import loop, strategy as job_strategy

STEPS = 4
TRAIN = {"steps_per_checkpoint": 2, "eval_batches": 1, "batch_size": 128}


def _same_as_cpu(config, root, tpu, name):
  """Trains ``config`` on CPU and on ``tpu``; asserts they agree; the TPU run's log."""
  cpu, _ = jobs.train_in_process(config, root / f"{name}_cpu", "none", STEPS)
  emulated, log = jobs.train_in_process(config, root / f"{name}_tpu", tpu, STEPS)
  jobs.assert_same_checkpoints(jobs.checkpoint(root / f"{name}_tpu", STEPS),
                               jobs.checkpoint(root / f"{name}_cpu", STEPS))
  assert emulated["eval_auc"] == pytest.approx(cpu["eval_auc"], abs=1e-4)
  assert emulated["table_step"] == cpu["table_step"] == STEPS
  return log


class _Killed(Exception):
  pass


def test_tiny_at_2_replicas_equals_cpu_resumes_and_exports(tmp_path, tiny_data_dir,
                                                           monkeypatch):
  config = jobs.scaled_config(tmp_path, tiny_data_dir, "tiny", **TRAIN)
  log = _same_as_cpu(config, tmp_path, "emulate:2", "tiny")
  assert "Training on emulated TPU, 2 replicas (TPUEmbedding)." in log

  # Killed in step 3 (after ckpt-2 was written), then resumed: the same
  # checkpoint as the uninterrupted run.
  killed = tmp_path / "killed"
  end = loop._Blocks.on_train_batch_end

  def dies_in_step_3(self, batch, logs=None):
    end(self, batch, logs)
    if self.start + batch + 1 == 3:
      raise _Killed()
  with monkeypatch.context() as patch:
    patch.setattr(loop._Blocks, "on_train_batch_end", dies_in_step_3)
    with pytest.raises(_Killed):
      jobs.train_in_process(config, killed, "emulate:2", STEPS)
  assert tf.train.latest_checkpoint(str(killed / "checkpoints")).endswith("ckpt-2")
  _, log = jobs.train_in_process(config, killed, "emulate:2", STEPS)
  assert any("Resumed from" in line and "(step 2)" in line for line in log), log
  jobs.assert_same_checkpoints(jobs.checkpoint(killed, STEPS),
                               jobs.checkpoint(tmp_path / "tiny_tpu", STEPS))

  # The export of the TPU run's checkpoint serves the CPU run's predictions.
  jobs.assert_exports_serve_alike(config, tiny_data_dir, tmp_path / "tiny_tpu",
                                  tmp_path / "tiny_cpu")


def test_ranking_at_8_replicas_equals_cpu(tmp_path, tiny_data_dir):
  config = jobs.scaled_config(tmp_path, tiny_data_dir, "ranking", **TRAIN)
  log = _same_as_cpu(config, tmp_path, "emulate:8", "ranking")
  assert "Training on emulated TPU, 8 replicas (TPUEmbedding)." in log


def test_movielens_at_2_replicas_equals_cpu(tmp_path):
  import tensorflow_datasets as tfds
  config = jobs.scaled_config(tmp_path, None, "movielens", batch_size=16,
                              steps_per_checkpoint=2, eval_batches=1)
  with tfds.testing.mock_data(as_dataset_fn=_movielens_examples):
    _same_as_cpu(config, tmp_path, "emulate:2", "movielens")


def test_a_bad_emulated_tpu_is_one_line(capsys, tmp_path, tiny_data_dir):
  config = jobs.scaled_config(tmp_path, tiny_data_dir, "tiny")
  for tpu, why in (
      ("emulate:0", ""),
      ("emulate:v5p:3", ": topology 'v5p:3'")):
    line = jobs.one_line_error(capsys, "train", "--config", config, "--tpu", tpu,
                               "--model_dir", str(tmp_path / "r"))
    assert line.startswith(f"--tpu: {tpu!r} is not an emulated TPU{why}"), line
  line = jobs.one_line_error(capsys, "train", "--config", config, "--tpu", "emulate:0",
                             "--model_dir", str(tmp_path / "r"))
  assert line == (
      "--tpu: 'emulate:0' is not an emulated TPU. Fix: write emulate (the default "
      "number of replicas), emulate:N with N >= 1 replicas (TPUEmbedding), e.g. "
      "emulate:2, or emulate:TOPOLOGY, a TPU slice: e.g. emulate:v5e:4 or "
      "emulate:v3:4 (TPUEmbedding), emulate:v5p:4, emulate:v6e:8 or emulate:8x2 "
      "(SparseCore, TPUEmbeddingV2); add ,hosts=H for a pod slice of H hosts, "
      "e.g. emulate:8,hosts=2.")
  assert not (tmp_path / "r" / "checkpoints").exists()


def test_tiny_on_one_v5e_chip_equals_cpu(tmp_path, tiny_data_dir):
  """``--tpu emulate:v5e:1``: a slice without SparseCore runs TPUEmbedding,
  its tables checked against v5e's HBM at build (issue 44); one replica, whose
  step applies the tables outside any tf.cond (a MirroredVariable's update is
  a merge_call, refused inside one), and equals --tpu none."""
  config = jobs.scaled_config(tmp_path, tiny_data_dir, "tiny", **TRAIN)
  log = _same_as_cpu(config, tmp_path, "emulate:v5e:1", "v5e")
  assert "Training on emulated TPU v5e:1, 1 replica (TPUEmbedding)." in log


def test_tiny_on_a_pod_of_2_hosts_equals_cpu(tmp_path, tiny_data_dir):
  """``--tpu emulate:4,hosts=2``: 2 hosts of 2 replicas, each host its own
  input pipeline (TensorFlow's input_lib: a clone per host, rebatched and
  sharded by host). Each step's global batch over both hosts holds the
  examples of --tpu none's step, so the checkpoint equals it; no host reads
  another's examples (no DuplicateInputWarning)."""
  config = jobs.scaled_config(tmp_path, tiny_data_dir, "tiny", **TRAIN)
  with warnings.catch_warnings():
    warnings.simplefilter("error", pod.DuplicateInputWarning)
    log = _same_as_cpu(config, tmp_path, "emulate:4,hosts=2", "pod")
  assert "Training on emulated TPU, 4 replicas on 2 hosts (TPUEmbedding)." in log


@pytest.mark.parametrize("tpu, replicas, hosts", [
    ("emulate:8,hosts=2", 8, 2), ("emulate,hosts=2", 0, 2), ("emulate:v5p:8", 8, 2),
    ("emulate:v3:8", 16, 2), ("emulate:v5p:8,hosts=2", 8, 2), ("emulate:8x2", 8, 1),
    ("emulate:8", 8, 1)])
def test_the_pod_spelling_and_topologies_name_the_hosts(tpu, replicas, hosts):
  asked = job_strategy.emulated_tpu_of(tpu)
  assert (asked.replicas, asked.hosts) == (replicas, hosts)


@pytest.mark.parametrize("tpu, message", [
    ("emulate:8,hosts=3", "'emulate:8,hosts=3' is not an emulated TPU: 8 replicas "
     "do not split over 3 hosts (each host feeds as many cores). Fix: a multiple "
     "of 3 replicas, e.g. emulate:6,hosts=3."),
    ("emulate:8,hosts=0", "'emulate:8,hosts=0' is not an emulated TPU: a pod slice "
     "has at least 1 host. Fix: emulate:8,hosts=2 for 2 hosts, or emulate:8 for one."),
    ("emulate:v5p:8,hosts=1", "'emulate:v5p:8,hosts=1' is not an emulated TPU: "
     "topology 'v5p:8' has 2 hosts (4 replicas each, as Cloud TPU's VMs hold them). "
     "Fix: write emulate:v5p:8 (its 2 hosts), or emulate:8x4 (8 chips of 4 "
     "SparseCores on one host)."),
    ("emulate:v3:8,hosts=4", "'emulate:v3:8,hosts=4' is not an emulated TPU: "
     "topology 'v3:8' has 2 hosts (8 replicas each, as Cloud TPU's VMs hold them). "
     "Fix: write emulate:v3:8 (its 2 hosts), or emulate:16,hosts=4 (16 replicas on "
     "4 hosts, no named slice)."),
    ("emulate:8,hosts=two", "'emulate:8,hosts=two' is not an emulated TPU. Fix: "
     "write emulate"),
], ids=["hosts_not_dividing", "no_hosts", "other_than_a_sparsecore_topologys",
        "other_than_the_topologys", "not_a_number"])
def test_a_bad_pod_is_one_line(tpu, message):
  with pytest.raises(errors.ConfigError) as e:
    job_strategy.emulated_tpu_of(tpu)
  assert str(e.value).startswith(f"--tpu: {message}")
