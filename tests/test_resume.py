"""Resume never loses work: damaged state file, corrupted checkpoints, step
accounting, checks before a restore, one run per model_dir, finished runs.

Every resume scenario ends by comparing every variable of the final
checkpoint (tables, slots, dense weights, the dense optimizer's state, the
step counters) with one uninterrupted run: bit-identical.
"""

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import yaml

from tests import jobs
from tests.builders import checkpoint_values
from tpu_embed_ext.host import model_dir as model_dir_lib
from tpu_embed_ext import job

CONFIG = jobs.TINY_CONFIG
STEPS = 30
BLOCK = 10


def _train(model_dir, data_dir, steps, config=CONFIG, **overrides):
  return jobs.train_tiny(model_dir, data_dir, steps, config,
                         **{"steps_per_checkpoint": BLOCK, **overrides})


_ckpt = jobs.checkpoint


@pytest.fixture(scope="module")
def straight_dir(tmp_path_factory, data_dir):
  """The uninterrupted run (checkpoints at 10, 20, 30); tests work on copies."""
  model_dir = tmp_path_factory.mktemp("straight")
  _train(model_dir, data_dir, STEPS)
  return model_dir


@pytest.fixture(scope="module")
def straight(straight_dir):
  """Every variable of the uninterrupted run at step 30."""
  return checkpoint_values(_ckpt(straight_dir, STEPS))


def _copy(straight_dir, tmp_path, *, keep_until=STEPS):
  """A copy of the uninterrupted run as if it had stopped at ``keep_until``."""
  model_dir = tmp_path / "run"
  shutil.copytree(straight_dir, model_dir)
  for path in (model_dir / "checkpoints").glob("ckpt-*"):
    if int(path.name.split(".")[0].split("-")[1]) > keep_until:
      path.unlink()
  if keep_until < STEPS:
    (model_dir / "metrics.json").unlink()
    tf.compat.v1.train.update_checkpoint_state(
        str(model_dir / "checkpoints"), _ckpt(model_dir, keep_until),
        all_model_checkpoint_paths=[_ckpt(model_dir, s) for s in (10, 20, 30)
                                    if s <= keep_until])
  return model_dir


def _assert_equal_to_straight(model_dir, straight):
  resumed = checkpoint_values(_ckpt(model_dir, STEPS))
  assert resumed.keys() == straight.keys()
  # Tables (26), slots, dense weights, Keras optimizer state, table_step...
  assert len(straight) > 26 + 26 and any("table_step" in k for k in straight)
  for key in straight:
    np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)


def _history_steps(model_dir):
  rows = (model_dir / "history.csv").read_text().strip().splitlines()
  return [int(r.split(",")[0]) for r in rows[1:]]


def test_damaged_state_file_resumes_from_the_newest_whole_checkpoint(
    tmp_path, data_dir, straight_dir, straight):
  tmp_path = _copy(straight_dir, tmp_path, keep_until=20)  # Stopped at step 20...
  (tmp_path / "checkpoints" / "checkpoint").write_text("model_checkpoint_path: \x00garbage{")
  kept = (tmp_path / "checkpoints" / "ckpt-10.index").read_bytes()
  metrics, log = _train(tmp_path, data_dir, STEPS)
  assert f"Resumed from {_ckpt(tmp_path, 20)} (step 20)." in log
  assert metrics["resumed_from_step"] == 20 and metrics["steps"] == STEPS
  assert (tmp_path / "checkpoints" / "ckpt-10.index").read_bytes() == kept
  assert _history_steps(tmp_path) == [10, 20, 30]  # No duplicated rows.
  _assert_equal_to_straight(tmp_path, straight)
  state = tf.train.get_checkpoint_state(str(tmp_path / "checkpoints"))
  assert state.model_checkpoint_path.endswith("ckpt-30")


def test_truncated_and_corrupted_checkpoints_fall_back_to_the_previous_good_one(
    tmp_path, data_dir, straight_dir, straight):
  tmp_path = _copy(straight_dir, tmp_path)
  (tmp_path / "metrics.json").unlink()  # As if killed before writing it.
  checkpoints = tmp_path / "checkpoints"
  index = checkpoints / "ckpt-30.index"
  index.write_bytes(index.read_bytes()[:40])           # Truncated.
  data = checkpoints / "ckpt-20.data-00000-of-00001"
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0xFF                            # One flipped byte.
  data.write_bytes(bytes(raw))
  metrics, log = _train(tmp_path, data_dir, STEPS)
  assert f"Checkpoint {_ckpt(tmp_path, 30)}.index is damaged and cannot be restored:" in log
  assert f"Checkpoint {_ckpt(tmp_path, 20)}.index is damaged and cannot be restored:" in log
  assert (f"Falling back to {_ckpt(tmp_path, 10)} (step 10): the newer checkpoints "
          f"{_ckpt(tmp_path, 30)}.index, {_ckpt(tmp_path, 20)}.index could not be "
          "read.") in log
  assert metrics["resumed_from_step"] == 10
  assert _history_steps(tmp_path) == [10, 20, 30]
  _assert_equal_to_straight(tmp_path, straight)  # The damaged ones were rewritten.


def test_no_readable_checkpoint_is_an_error_that_overwrites_nothing(
    tmp_path, data_dir, straight_dir):
  tmp_path = _copy(straight_dir, tmp_path, keep_until=BLOCK)
  index = tmp_path / "checkpoints" / "ckpt-10.index"
  index.write_bytes(b"")
  before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
  with pytest.raises(model_dir_lib.CheckpointError) as info:
    _train(tmp_path, data_dir, STEPS)
  assert str(info.value).startswith(
      f"no checkpoint in {tmp_path / 'checkpoints'} can be read ({index}). Fix: move "
      "them away to train from step 0, or restore a copy; nothing was overwritten.")
  after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
  assert after == before


def test_steps_then_resume_names_checkpoints_by_the_table_step(
    tmp_path, data_dir, straight):
  # `train --steps 5` then `train`: the second run continues from step 5.
  first, _ = _train(tmp_path, data_dir, 5, steps_per_checkpoint=20)
  assert first["steps"] == first["table_step"] == 5
  metrics, log = _train(tmp_path, data_dir, STEPS, steps_per_checkpoint=20)
  assert "Resumed from" in log and "(step 5)." in log
  assert metrics["steps"] == metrics["table_step"] == STEPS
  assert metrics["trained_steps"] == STEPS - 5 and metrics["resumed_from_step"] == 5
  assert model_dir_lib.checkpoint_steps(str(tmp_path / "checkpoints")) == [30, 20, 5]
  for step in (5, 20, 30):  # Each name is the step its tables hold.
    held = tf.train.load_variable(_ckpt(tmp_path, step),
                                  "model/embedding/table_step/.ATTRIBUTES/VARIABLE_VALUE")
    assert int(held) == step
  assert _history_steps(tmp_path) == [5, 20, 30]
  assert "step 20/30:" in log and "step 30/30:" in log
  _assert_equal_to_straight(tmp_path, straight)


def test_resume_with_other_settings_says_what_changed(tmp_path, data_dir, straight_dir):
  tmp_path = _copy(straight_dir, tmp_path, keep_until=BLOCK)
  _, log = _train(tmp_path, data_dir, 12, steps_per_checkpoint=2, batch_size=64)
  assert ("This run changed batch_size 128 -> 64, steps_per_checkpoint 10 -> 2 since "
          "the checkpoint. From here the input order differs from an uninterrupted "
          "run") in log
  runs = json.loads((tmp_path / "run.json").read_text())
  assert [(r["from_step"], r["to_step"], r["batch_size"]) for r in runs] == [
      (0, STEPS, 128), (10, 12, 64)]


def _changed_config(tmp_path, edit):
  with open(CONFIG) as f:
    config = yaml.safe_load(f)
  edit(config)
  path = tmp_path / "changed.yaml"
  path.write_text(yaml.safe_dump(config))
  return str(path)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["tables"]["t_c4"].update(vocabulary_size=300),
     "table 't_c4': checkpoint {ckpt} holds shape [200, 16], this spec has [300, 16]."),
    (lambda c: c["tables"]["t_c4"].update(optimizer={"type": "sgd"}),
     "table 't_c4': checkpoint {ckpt} holds optimizer slots ['accumulators'], its sgd "
     "optimizer needs []."),
    (lambda c: c["train"]["model"].update(top=[32, 32]),
     "variable model/top/_functional/_operations/1/_kernel: checkpoint {ckpt} holds "
     "shape [367, 64], the "
     "model of this config has [367, 32]."),
], ids=["table_shape", "table_slots", "dense_model"])
def test_restore_checks_the_checkpoint_first_and_changes_nothing(
    tmp_path, data_dir, straight_dir, edit, message):
  _copy(straight_dir, tmp_path, keep_until=BLOCK)
  before = {p.name: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()
            and "logs" not in p.parts}
  config = _changed_config(tmp_path, edit)
  for call in (lambda: _train(tmp_path / "run", data_dir, STEPS, config=config),
               lambda: job.export(config, model_dir=str(tmp_path / "run"),
                                        out=str(tmp_path / "serving"),
                                        overrides={"data_dir": data_dir})):
    with pytest.raises(model_dir_lib.CheckpointError) as info:
      call()
    assert message.format(ckpt=_ckpt(tmp_path / "run", BLOCK)) in str(info.value)
  after = {p.name: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()
           and "logs" not in p.parts and p.name != ".lock"}
  before.pop(".lock", None)
  assert sorted(after) == sorted(before)
  for name in before:
    assert after[name] == before[name], name
  assert not (tmp_path / "serving").exists()


def test_check_checkpoint_is_a_call_for_any_keras_model(tmp_path):
  # What EmbeddingLayer users call before restoring their own checkpoints.
  small = tf.keras.Sequential([tf.keras.layers.Dense(3)])
  small.build((None, 2))
  tf.train.Checkpoint(model=small).write(str(tmp_path / "c"))
  model_dir_lib.check_checkpoint(tf.train.Checkpoint(model=small), str(tmp_path / "c"))
  wide = tf.keras.Sequential([tf.keras.layers.Dense(4)])
  wide.build((None, 2))
  with pytest.raises(model_dir_lib.CheckpointError,
                     match=r"variable model/\S*kernel: checkpoint .* holds shape "
                           r"\[2, 3\], this model has \[2, 4\]"):
    model_dir_lib.check_checkpoint(tf.train.Checkpoint(model=wide), str(tmp_path / "c"))


def test_one_run_per_model_dir_and_a_stale_lock_does_not_block(
    tmp_path, data_dir, straight_dir):
  tmp_path = _copy(straight_dir, tmp_path)
  with model_dir_lib.lock(str(tmp_path)):
    with pytest.raises(model_dir_lib.ModelDirError) as info:
      _train(tmp_path, data_dir, BLOCK)
    assert str(info.value) == (
        f"model_dir {tmp_path} is in use by another run (pid {os.getpid()}). Fix: "
        "wait for it to finish, or pass another --model_dir.")
  # A lock file left by a dead process (no lock held on it) is not in the way.
  (tmp_path / ".lock").write_text("999999999")
  _, log = _train(tmp_path, data_dir, STEPS)
  assert "Already trained to step 30" in log


def test_rerunning_a_finished_job_keeps_its_metrics(tmp_path, data_dir, straight_dir):
  tmp_path = _copy(straight_dir, tmp_path)
  saved = (tmp_path / "metrics.json").read_bytes()
  for steps in (STEPS, BLOCK):  # Asked for as many steps, or fewer.
    again, log = _train(tmp_path, data_dir, steps)
    assert f"Already trained to step 30 (asked for {steps}): nothing to do" in log
    assert (tmp_path / "metrics.json").read_bytes() == saved
    assert again == json.loads(saved) and again["examples_per_second"] > 0
  assert _history_steps(tmp_path) == [10, 20, 30]
