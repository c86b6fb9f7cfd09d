"""The job under faults: truncated checkpoints, resumes that must not pile up
checkpoints, torn history.csv, outputs missing after a kill, TensorBoard
points of a killed block, full and read-only disks, exports that would
overwrite their input, and the exported model's input checks.

Every resume ends compared with one uninterrupted run, bit for bit. Full and
read-only disks are real tmpfs mounts where the test may mount (root in a
container; skipped elsewhere); a full disk is also simulated in-process
(CheckpointManager.save raising TensorFlow's ENOSPC error) so that the path
is tested everywhere.
"""

import collections
import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tests import jobs, mounts
from tests.builders import checkpoint_values
from tpu_embed_ext.host import atomic
from tpu_embed_ext.host import model_dir as model_dir_lib
from tpu_embed_ext import job as train_lib

CONFIG = jobs.TINY_CONFIG


_TRAIN = {"steps_per_checkpoint": 5, "eval_batches": 1}  # the config's train: fields


def _overrides(data_dir):
  return {"data_dir": data_dir, **_TRAIN}


def _train(model_dir, data_dir, steps, config=CONFIG):
  return jobs.train_tiny(model_dir, data_dir, steps, config, **_TRAIN)


_ckpt = jobs.checkpoint


@pytest.fixture(scope="module")
def straight_dir(tmp_path_factory, data_dir):
  """The uninterrupted run: checkpoints at 5 and 10; tests work on copies."""
  model_dir = tmp_path_factory.mktemp("straight")
  _train(model_dir, data_dir, 10)
  return model_dir


def _copy(straight_dir, tmp_path, keep_until=10):
  """A copy of the straight run as a run killed right after checkpoint ``keep_until``."""
  model_dir = tmp_path / "run"
  shutil.copytree(straight_dir, model_dir)
  for step in (5, 10):
    if step > keep_until:
      for name in atomic.prefix_files(_ckpt(model_dir, step)):
        os.remove(name)
  return model_dir


def _assert_equal_to_straight(model_dir, straight_dir, step=10):
  want, got = checkpoint_values(_ckpt(straight_dir, step)), checkpoint_values(_ckpt(model_dir, step))
  assert want.keys() == got.keys() and want
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _history_steps(model_dir):
  with open(os.path.join(model_dir, "history.csv")) as f:
    return [int(float(r.split(",")[0])) for r in f.read().splitlines()[1:]]


def test_truncated_data_file_falls_back_in_train_and_export(tmp_path, data_dir,
                                                            straight_dir):
  model_dir = _copy(straight_dir, tmp_path)
  data = _ckpt(model_dir, 10) + ".data-00000-of-00001"
  os.truncate(data, os.path.getsize(data) // 2)
  lines = []
  train_lib.export(CONFIG, model_dir=str(model_dir), out=str(tmp_path / "serving"),
                   overrides=_overrides(data_dir), log=lines.append)
  assert lines[0] == (f"Checkpoint {_ckpt(model_dir, 10)}.index is damaged and cannot "
                      "be restored: Read less bytes than requested")
  assert lines[-1] == f"Exporting {_ckpt(model_dir, 5)} (table step 5)."
  _, log = _train(model_dir, data_dir, 10)
  assert f"Falling back to {_ckpt(model_dir, 5)} (step 5)" in log
  _assert_equal_to_straight(model_dir, straight_dir)
  assert _history_steps(model_dir) == [5, 10]


def test_checkpoints_keep_max_to_keep_across_resumes(tmp_path, data_dir, straight_dir):
  model_dir = _copy(straight_dir, tmp_path)
  for steps in (15, 20, 25):  # three resumes, one block each
    _train(model_dir, data_dir, steps)
  assert model_dir_lib.checkpoint_steps(str(model_dir / "checkpoints")) == [25, 20, 15]
  state = tf.train.get_checkpoint_state(str(model_dir / "checkpoints"))
  assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [
      "ckpt-15", "ckpt-20", "ckpt-25"]


def test_torn_last_history_row_does_not_block_resume(tmp_path, data_dir, straight_dir):
  model_dir = _copy(straight_dir, tmp_path, keep_until=5)
  history = model_dir / "history.csv"
  lines = history.read_text().splitlines(keepends=True)
  # A short write cut the row of step 10 (its value still parses: "0.5").
  history.write_text("".join(lines[:2]) + lines[2][:len(lines[2]) // 2])
  from tpu_embed_ext.job import outputs
  assert outputs.read_history(str(model_dir))[-1]["step"] == 5
  _train(model_dir, data_dir, 10)
  assert _history_steps(model_dir) == [5, 10]
  assert history.read_text() == (straight_dir / "history.csv").read_text()
  _assert_equal_to_straight(model_dir, straight_dir)


def test_finished_job_completes_missing_outputs(tmp_path, data_dir, straight_dir):
  model_dir = _copy(straight_dir, tmp_path)
  os.remove(model_dir / "learning_curve.png")  # killed after metrics.json
  metrics, log = _train(model_dir, data_dir, 10)
  assert "nothing to do" in log
  assert "learning_curve.png was missing: drawn from history.csv." in log
  assert (model_dir / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert metrics == json.loads((straight_dir / "metrics.json").read_text())


def _scalar_steps(log_dir):
  from tensorflow.core.util import event_pb2
  steps = {}
  for name in sorted(os.listdir(log_dir)):
    for record in tf.data.TFRecordDataset(os.path.join(log_dir, name)):
      event = event_pb2.Event.FromString(record.numpy())
      for value in event.summary.value:
        steps.setdefault(value.tag, []).append(event.step)
  return steps


def test_no_duplicate_tensorboard_points_after_a_kill_mid_block(tmp_path, data_dir,
                                                               straight_dir):
  # Killed after the summaries of block 10, before its checkpoint.
  model_dir = _copy(straight_dir, tmp_path, keep_until=5)
  _train(model_dir, data_dir, 10)
  steps = _scalar_steps(model_dir / "logs")
  assert sorted(steps["train/loss"]) == [5, 10]
  assert sorted(steps["learning_rate/dense"]) == list(range(1, 11))
  assert sorted(steps["train/loss_per_step"]) == list(range(1, 11))
  want = {k: sorted(v) for k, v in _scalar_steps(straight_dir / "logs").items()}
  assert {k: sorted(v) for k, v in steps.items()} == want
  _assert_equal_to_straight(model_dir, straight_dir)


def test_full_disk_during_a_save_is_one_line_and_keeps_the_checkpoints(
    tmp_path, data_dir, straight_dir, monkeypatch):
  """Simulated in-process: the save raises TensorFlow's error for ENOSPC."""
  model_dir = _copy(straight_dir, tmp_path, keep_until=5)
  before = checkpoint_values(_ckpt(model_dir, 5))

  def full(self, *args, **kwargs):
    raise tf.errors.ResourceExhaustedError(
        None, None, f"{self.directory}/ckpt-10_temp/part-00000-of-00001.data-00000-of"
        "-00001.tempstate1; No space left on device")
  monkeypatch.setattr(tf.train.CheckpointManager, "save", full)
  with pytest.raises(atomic.OutputError) as info:
    _train(model_dir, data_dir, 10)
  assert str(info.value) == (
      f"cannot write checkpoint {model_dir}/checkpoints/ckpt-10: {model_dir}/checkpoints/"
      "ckpt-10_temp/part-00000-of-00001.data-00000-of-00001.tempstate1; No space left on "
      "device. The checkpoints before it are intact; run the same command again to resume "
      "from the newest one. Fix: free space on that disk, or write elsewhere.")
  after = checkpoint_values(_ckpt(model_dir, 5))
  assert all(np.array_equal(before[k], after[k]) for k in before)
  monkeypatch.undo()
  _train(model_dir, data_dir, 10)  # the same command again resumes
  _assert_equal_to_straight(model_dir, straight_dir)


_cli = jobs.run_cli
_one_line = jobs.one_line_error


def _write_config(tmp_path, data_dir, edit=None):
  return jobs.write_tiny_config(tmp_path, data_dir, edit, **_TRAIN)


def test_real_full_disk_during_training_is_one_line(tmp_path, data_dir, capsys):
  config = _write_config(tmp_path, data_dir)
  with mounts.tmpfs(tmp_path / "small", size="300k") as small:
    line = _one_line(capsys, "train", "--config", config, "--tpu", "none", "--steps",
                     "5", "--model_dir", str(small))
    assert line.startswith("cannot write ")
    assert "No space left on device" in line
    assert line.endswith("The checkpoints before it are intact; run the same command "
                         "again to resume from the newest one. Fix: free space on that "
                         "disk, or write elsewhere.")


def test_read_only_checkpoints_directory_is_found_before_training(tmp_path, data_dir,
                                                                  capsys):
  config = _write_config(tmp_path, data_dir)
  model_dir = tmp_path / "run"
  with mounts.tmpfs(model_dir / "checkpoints", read_only=True):
    line = _one_line(capsys, "train", "--config", config, "--tpu", "none",
                     "--model_dir", str(model_dir))
  assert line == (f"cannot write to the checkpoints directory {model_dir}/checkpoints: "
                  "Read-only file system. Fix: pass a writable --model_dir.")
  assert not (model_dir / "history.csv").exists()


def test_feature_without_a_dataset_column_is_one_line(tmp_path, data_dir, capsys):
  config = _write_config(tmp_path, data_dir, lambda c: c["train"].update(
      features={"c3": {"column": "c33"}}))
  line = _one_line(capsys, "train", "--config", config, "--tpu", "none",
                   "--model_dir", str(tmp_path / "run"))
  assert line.startswith(
      f"{config}: train.features.c3.column: feature 'c3' reads column 'c33', which the "
      'dataset does not have. Did you mean "c3"? Its columns: c0, c1, ')
  assert line.endswith("Fix: map the feature to a column (train.features: {<feature>: "
                       "{column: <column>}}), or correct the name.")


def test_export_refuses_an_out_that_overlaps_or_cannot_be_written(
    tmp_path, data_dir, straight_dir, capsys):
  model_dir = _copy(straight_dir, tmp_path)
  config = _write_config(tmp_path, data_dir)
  before = sorted(os.listdir(model_dir / "checkpoints"))
  for out, what in ((model_dir, "the checkpoints of --model_dir"),
                    (model_dir / "checkpoints", "the checkpoints of --model_dir"),
                    (model_dir / "checkpoints" / "s", "the checkpoints of --model_dir"),
                    (tmp_path, "the checkpoints of --model_dir")):
    line = _one_line(capsys, "export", "--config", config, "--model_dir",
                     str(model_dir), "--out", str(out))
    assert line == (f"--out {out} would overwrite {what} {model_dir}/checkpoints (the "
                    "output equals, contains or lies inside it); nothing was written. "
                    "Fix: pass another --out, outside the input.")
  (tmp_path / "file").write_text("x")
  line = _one_line(capsys, "export", "--config", config, "--model_dir", str(model_dir),
                   "--out", str(tmp_path / "file"))
  assert line == (f"--out {tmp_path}/file is a file; the output is a directory. Fix: "
                  "pass a directory path for --out.")
  with mounts.tmpfs(tmp_path / "ro", read_only=True):
    line = _one_line(capsys, "export", "--config", config, "--model_dir",
                     str(model_dir), "--out", str(tmp_path / "ro" / "serving"))
  assert line == (f"cannot write --out {tmp_path}/ro/serving: Read-only file system. "
                  "Nothing was replaced; the previous output, if any, is intact. Fix: "
                  "make it writable, or write elsewhere.")
  assert sorted(os.listdir(model_dir / "checkpoints")) == before


@pytest.fixture(scope="module")
def exported(straight_dir, data_dir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("export") / "serving")
  train_lib.export(CONFIG, model_dir=str(straight_dir), out=out,
                   overrides=_overrides(data_dir), log=lambda line: None)
  return tf.saved_model.load(out).signatures["serving_default"]


def _inputs(batch=4):
  inputs = {"dense": tf.reshape(tf.linspace(-1.0, 1.0, batch * 13), [batch, 13])}
  for i in range(26):
    if i < 20:
      inputs[f"c{i}"] = tf.constant([j % 3 for j in range(batch)], tf.int64)
    else:
      inputs[f"c{i}"] = tf.constant([[j % 3, -1] for j in range(batch)], tf.int64)
  return inputs


def test_exported_model_takes_single_hot_as_batch_or_batch_by_one(exported):
  flat = exported(**_inputs())["outputs"].numpy()
  single = {f"c{i}" for i in range(20)}
  column = exported(**{k: (v[:, None] if k in single else v)
                       for k, v in _inputs().items()})
  np.testing.assert_array_equal(column["outputs"].numpy(), flat)
  assert flat.shape == (4, 1) and np.isfinite(flat).all()


SERVING_CASES = [
    ("two_ids_for_single_hot", {"c5": tf.constant([[1, 2]] * 4, tf.int64)},
     r"input c5: a single-hot feature takes one id per example, int64 \[batch\] or "
     r"\[batch, 1\]; got shape\] \[4 2\] \[\(no id is ever dropped\). Fix: send one id "
     r"per example"),
    ("rank_3_single_hot", {"c0": tf.zeros([4, 1, 1], tf.int64)},
     r"input c0: a single-hot feature takes one id per example"),
    ("nan_dense", {"dense": tf.tensor_scatter_nd_update(
        tf.zeros([4, 13]), [[2, 7]], [float("nan")])},
     r"input dense: float values must be finite; NaN or Inf at \[row, column\]:\] "
     r"\[\[2 7\]\] \[Fix: replace missing or overflowing values"),
    ("dense_width", {"dense": tf.zeros([4, 12])},
     r"input dense: float32 \[batch, 13\] expected, got shape\] \[4 12\]"),
    ("batch_sizes_differ", {"c21": tf.constant([[1, -1]] * 3, tf.int64)},
     r"input c21: batch size \(shape\] \[3 2\] \[\) differs from the batch size of "
     r"input"),
    ("out_of_vocabulary", {"c5": tf.constant([0, 1, 24, 2], tf.int64)},
     r"feature c5: ids must be in \[0, 24\); out-of-vocabulary ids are refused"),
    # Before: TensorFlow's "Invalid reduction dimension", naming no input.
    ("rank_1_dense", {"dense": tf.zeros([4])},
     r"input dense: float32 \[batch, 13\] expected, got shape\] \[4\]"),
    ("rank_1_multi_hot", {"c21": tf.constant([1, 2, 3, 4], tf.int64)},
     r"input c21: a multi-hot feature takes int64 \[batch, n\] ids padded with -1; "
     r"got shape\] \[4\] \[Fix: send one row of ids per example, padded with -1"),
]


@pytest.mark.parametrize("name,value,message", SERVING_CASES,
                         ids=[c[0] for c in SERVING_CASES])
def test_exported_model_checks_every_input(exported, name, value, message):
  with pytest.raises(tf.errors.InvalidArgumentError, match=message):
    exported(**{**_inputs(), **value})


# --- non-finite checkpoints ----------------------------------------------------------

_rewrite = jobs.rewrite_checkpoint
_EMB = "model/embedding/embedding"


@pytest.mark.parametrize("key, what, count", [
    (f"{_EMB}/t_c0/.ATTRIBUTES/VARIABLE_VALUE", "table 't_c0'", 200 * 16),
    (f"{_EMB}/t_c9.Svelocities/.ATTRIBUTES/VARIABLE_VALUE",
     "table 't_c9' (slot 'velocities')", 200 * 16),
], ids=["table", "slot"])
@pytest.mark.parametrize("fill", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_checkpoint_is_refused_by_train_and_export(
    tmp_path, data_dir, straight_dir, capsys, key, what, count, fill):
  model_dir = _copy(straight_dir, tmp_path)
  ckpt = _ckpt(model_dir, 10)
  _rewrite(ckpt, key, fill)
  config = _write_config(tmp_path, data_dir)
  message = (f"{what}: checkpoint {ckpt} holds {count:,} non-finite values (NaN or "
             f"Inf) of {count:,}; training diverged before it was saved, and restoring "
             "it would train or serve garbage. Nothing was restored. Fix: resume from "
             f"an older checkpoint (move {ckpt}.index and ckpt-10.data-* away), and "
             "lower the learning rate.")
  def files():  # All but the lock and the libraries' log.
    return {p: os.path.getmtime(p) for p in model_dir.rglob("*") if p.is_file()
            and "logs" not in p.parts and p.name != ".lock"}
  before = files()
  assert _one_line(capsys, "train", "--config", config, "--tpu", "none", "--steps",
                   "15", "--model_dir", str(model_dir)) == message
  out = tmp_path / "serving"
  assert _one_line(capsys, "export", "--config", config, "--model_dir", str(model_dir),
                   "--out", str(out)) == message
  assert not out.exists()
  assert files() == before  # Nothing written, the state file untouched.


def test_check_checkpoint_refuses_non_finite_dense_weights_and_tables(
    tmp_path, data_dir, straight_dir):
  from tpu_embed_ext.job.building import build_model, build_variables
  from tpu_embed_ext.job.config import load
  from tpu_embed_ext.job.data import example_batch
  model_dir = _copy(straight_dir, tmp_path)
  ckpt = _ckpt(model_dir, 10)
  spec, cfg = load(CONFIG, _overrides(data_dir))
  model = build_model(spec, cfg)
  build_variables(model, example_batch(spec, cfg))
  checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
  model_dir_lib.check_checkpoint(checkpoint, ckpt)  # A finite one passes.
  model.embedding.embedding.check_checkpoint(ckpt, prefix=_EMB)
  # The top tower's last kernel [32, 1] (keyed through the dense optimizer).
  _rewrite(ckpt, "optimizer/_trainable_variables/9/.ATTRIBUTES/VARIABLE_VALUE", np.nan)
  with pytest.raises(model_dir_lib.CheckpointError, match=re.escape(
      f": checkpoint {ckpt} holds ")) as info:
    model_dir_lib.check_checkpoint(checkpoint, ckpt)
  assert str(info.value).startswith("variable model/top/"), str(info.value)
  assert " holds 32 non-finite values (NaN or Inf) of 32;" in str(info.value)
  model.embedding.embedding.check_checkpoint(ckpt, prefix=_EMB)  # Tables are finite.
  _rewrite(ckpt, f"{_EMB}/t_c3.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE", -np.inf)
  with pytest.raises(model_dir_lib.CheckpointError, match=re.escape(
      f"table 't_c3' (slot 'accumulators'): checkpoint {ckpt} holds 3,200 non-finite")):
    model.embedding.embedding.check_checkpoint(ckpt, prefix=_EMB)


def test_checks_before_a_restore_read_each_tensor_once(tmp_path, data_dir, straight_dir,
                                                       monkeypatch):
  # resume_point's CRC read counts the non-finite values too; the engine's and
  # the model's checks reuse that count instead of reading the tables again.
  model_dir = _copy(straight_dir, tmp_path)
  reads = collections.Counter()
  load = tf.train.load_checkpoint

  class Counting:
    def __init__(self, prefix):
      self._reader = load(prefix)

    def __getattr__(self, name):
      return getattr(self._reader, name)

    def get_tensor(self, key):
      reads[key] += 1
      return self._reader.get_tensor(key)

  monkeypatch.setattr(tf.train, "load_checkpoint", Counting)
  train_lib.export(CONFIG, model_dir=str(model_dir), out=str(tmp_path / "serving"),
                   overrides=_overrides(data_dir), log=lambda line: None)
  tables = [k for k in reads if k.startswith(_EMB)]
  assert len(tables) > 26 and set(reads.values()) == {1}, reads


# --- paths a run writes that are of the wrong kind --------------------------------

WRONG_KIND = ["metrics.json", "history.csv", "learning_curve.png", "run.json", ".lock",
              "logs", "checkpoints"]


@pytest.mark.parametrize("name", WRONG_KIND)
def test_an_output_path_of_the_wrong_kind_is_one_line_before_any_work(
    tmp_path, data_dir, capsys, name):
  """Before: IsADirectoryError or FailedPreconditionError with a traceback,
  for metrics.json and learning_curve.png after all the training; a
  checkpoints file trained, failed, and said to run again."""
  config = _write_config(tmp_path, data_dir)
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  is_dir = name in ("logs", "checkpoints")
  if is_dir:
    (model_dir / name).write_text("x")
  else:
    (model_dir / name).mkdir()
  kind, other = ("file", "directory") if is_dir else ("directory", "file")
  message = (f"{model_dir}/{name} is a {kind}, but a run writes its {name} "
             f"{other} there. Fix: move it away, or pass another --model_dir; "
             "nothing was written.")
  with pytest.raises(model_dir_lib.ModelDirError) as info:
    _train(model_dir, data_dir, 5, config=config)
  assert str(info.value) == message
  assert sorted(os.listdir(model_dir)) == [name]
  assert _one_line(capsys, "train", "--config", config, "--tpu", "none",
                   "--model_dir", str(model_dir)) == message
