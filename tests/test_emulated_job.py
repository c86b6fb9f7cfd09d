"""``train --tpu emulate:N``: the job's TPU path, run on the emulated TPU.

The job resolves a TPU as on a Cloud TPU VM (resolver, initialize, TPUStrategy)
and its model's EmbeddingLayer takes the TPUEmbedding branch; every call
of the model runs in ``strategy.run``. Trained on the same global batches, its
checkpoint must equal ``--tpu none``'s: every table, slot, dense weight and
optimizer variable, to float32 reordering (the replicas' gradients are summed
in another order than one device sums them).
"""

import numpy as np
import pytest
import yaml

from tests import jobs

TINY = "configs/tiny.yaml"
STEPS = 10


def _config(tmp_path, data_dir):  # the session's tiny dataset (conftest)
  with open(TINY) as f:
    config = yaml.safe_load(f)
  config["train"].update(data_dir=data_dir, steps_per_checkpoint=5)
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump(config))
  return str(path)


@pytest.mark.xfail(strict=True, reason=(
    "issue 32: RankingModel.call turns the multi-hot features' padded ids into "
    "RaggedTensors inside the training step, i.e. inside strategy.run; a TPU's "
    "TPUEmbedding refuses ids computed there (tpu_embedding_v2.py "
    "_raise_error_for_non_direct_inputs), and so does the emulated TPU now. "
    "Fix (job): build the ragged ids in the input pipeline."))
def test_train_on_the_emulated_tpu_equals_cpu_emulation(capsys, tmp_path, tiny_data_dir):
  config = _config(tmp_path, tiny_data_dir)
  runs = {}
  for tpu in ("emulate:2", "none"):
    model_dir = tmp_path / tpu.replace(":", "_")
    status, out, _ = jobs.run_cli(capsys, "train", "--config", config, "--steps",
                                  str(STEPS), "--tpu", tpu, "--model_dir", str(model_dir))
    assert status == 0, out
    runs[tpu] = (out, jobs.variables(jobs.checkpoint(model_dir, STEPS)))
  out, emulated = runs["emulate:2"]
  # The device line once (issue 36), true.
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
  line = jobs.one_line_error(capsys, "train", "--config", _config(tmp_path, tiny_data_dir),
                             "--tpu", "emulate:0", "--model_dir", str(tmp_path / "r"))
  assert line == (
      "--tpu: 'emulate:0' is not an emulated TPU. Fix: write emulate (the "
      "default number of replicas) or emulate:N with N >= 1 replicas, e.g. "
      "emulate:2.")
