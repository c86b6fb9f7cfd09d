"""``train --tpu emulate:N``: the job's TPU path, run on the emulated TPU.

The job resolves a TPU as on a Cloud TPU VM (resolver, initialize, TPUStrategy)
and its model's EmbeddingLayer takes the TPUEmbedding branch; every call
of the model runs in ``strategy.run``. Trained on the same global batches, its
checkpoint must equal ``--tpu none``'s: every table, slot, dense weight and
optimizer variable, to float32 reordering (the replicas' gradients are summed
in another order than one device sums them).
"""

import numpy as np

from tests import jobs
from tests.builders import checkpoint_values

STEPS = 10


MULTI_HOT = ("c20", "c21", "c22", "c23", "c24", "c25")  # tiny's multi-hot columns


def _write_config(tmp_path, data_dir, multi_hot=False):  # the session's tiny dataset (conftest)
  """tiny.yaml on the session's data; without its multi-hot features unless
  asked (the job cannot feed those to a TPU: test_multi_hot_features_...)."""
  def drop_multi_hot(config):
    for name in MULTI_HOT:
      del config["features"][name], config["tables"][f"t_{name}"]
    config["overrides"] = [o for o in config["overrides"] if o["match"] != "t_c2[0-5]"]
  return jobs.write_tiny_config(tmp_path, data_dir, None if multi_hot else drop_multi_hot)


def test_train_on_the_emulated_tpu_equals_cpu_emulation(capsys, tmp_path, tiny_data_dir):
  config = _write_config(tmp_path, tiny_data_dir)
  runs = {}
  for tpu in ("emulate:2", "none"):
    model_dir = tmp_path / tpu.replace(":", "_")
    status, out, _ = jobs.run_cli(capsys, "train", "--config", config, "--steps",
                                  str(STEPS), "--tpu", tpu, "--model_dir", str(model_dir))
    assert status == 0, out
    runs[tpu] = (out, checkpoint_values(jobs.checkpoint(model_dir, STEPS)))
  out, emulated = runs["emulate:2"]
  # The device line once, true.
  assert "Training on emulated TPU, 2 replicas (TPUEmbedding)." in out
  assert out.count("emulated TPU") == 1 and f"at step {STEPS}, " in out
  # Again on the finished model_dir: nothing to do, and where it trained.
  status, again, _ = jobs.run_cli(capsys, "train", "--config", config, "--steps",
                                  str(STEPS), "--tpu", "emulate:2", "--model_dir",
                                  str(tmp_path / "emulate_2"))
  assert status == 0 and again.count("emulated TPU") == 1, again
  assert (f"at step {STEPS} (already trained, on emulated TPU, 2 replicas "
          "(TPUEmbedding): nothing to do).") in again
  _, cpu = runs["none"]
  assert sorted(emulated) == sorted(cpu)
  assert any(k.startswith("model/embedding/embedding/t_c0") for k in cpu)
  for key, value in cpu.items():
    if np.asarray(value).dtype.kind == "f":
      np.testing.assert_allclose(emulated[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
    else:
      np.testing.assert_array_equal(emulated[key], value, err_msg=key)


def test_a_bad_emulated_tpu_is_one_line(capsys, tmp_path, tiny_data_dir):
  line = jobs.one_line_error(capsys, "train", "--config", _write_config(tmp_path, tiny_data_dir),
                             "--tpu", "emulate:0", "--model_dir", str(tmp_path / "r"))
  assert line == (
      "--tpu: 'emulate:0' is not an emulated TPU. Fix: write emulate (the "
      "default number of replicas) or emulate:N with N >= 1 replicas, e.g. "
      "emulate:2.")


def test_multi_hot_features_on_a_tpu_are_refused_before_anything_is_built(
    capsys, tmp_path, tiny_data_dir):
  """The job makes a multi-hot feature's ragged ids inside the step, which a
  TPU refuses (tpu_embedding_v2.py _raise_error_for_non_direct_inputs): the
  run says so in one line before it builds a model or writes a checkpoint."""
  model_dir = tmp_path / "run"
  line = jobs.one_line_error(
      capsys, "train", "--config", _write_config(tmp_path, tiny_data_dir, multi_hot=True),
      "--model_dir", str(model_dir), "--steps", str(STEPS), "--tpu", "emulate:2")
  assert line == (
      "--tpu: features c20, c21, c22, c23, c24, c25 are multi-hot: the job turns "
      "their padded ids into ragged ids inside the training step, and a TPU's "
      "TPUEmbedding refuses ids computed inside strategy.run (tpu_embedding_v2.py, "
      "_raise_error_for_non_direct_inputs), so this run would fail at its first "
      "step. Fix: train this config with --tpu none (CPU emulation), or leave the "
      "multi-hot features out of the config's features for a TPU run.")
  assert not (model_dir / "checkpoints").exists()
