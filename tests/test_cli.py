"""The command line: every user error is one line and exit status 2; the
closing summary of `train` names every output and an export command that works.

Most cases run the CLI's ``main`` in this process (flags parsed as absl
does); one runs ``python -m tpu_embed_ext`` to check the real exit status and
stderr.
"""

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests import jobs
from tpu_embed_ext import model_dir as model_dir_lib

TINY = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """The tiny dataset, built here so that its progress bars stay out of stderr."""
  import tensorflow_datasets as tfds
  from tpu_embed_ext import data  # Registers synthetic_clicks.
  del data
  path = str(tmp_path_factory.mktemp("tfds"))
  tfds.builder("synthetic_clicks/tiny", data_dir=path).download_and_prepare()
  return path


def _config(tmp_path, data_dir, edit=None, name="c.yaml"):
  with open(TINY) as f:
    config = yaml.safe_load(f)
  config["train"].update(data_dir=data_dir, steps_per_checkpoint=5)
  if edit:
    edit(config)
  path = tmp_path / name
  path.write_text(yaml.safe_dump(config))
  return str(path)


_cli = jobs.run_cli
_one_line_error = jobs.one_line_error


def _set(path, value):
  def edit(config):
    node = config
    for key in path[:-1]:
      node = node[key]
    node[path[-1]] = value
  return edit


@pytest.mark.parametrize("path,value,message", [
    (("train", "seed"), "x",
     "train.seed: seed must be an integer >= 0, got seed='x'. Fix: write e.g. 0."),
    (("train", "eval_batches"), 0,
     "train.eval_batches: eval_batches must be a positive integer, got eval_batches=0. "
     "Fix: write e.g. 512."),
    (("train", "dense_optimizer"), {"class": "Adamm", "learning_rate": 0.01},
     "train.dense_optimizer: Keras cannot build the dense optimizer {'class': 'Adamm', "
     "'learning_rate': 0.01}: Could not interpret optimizer identifier:"),
    (("train", "model", "bottom"), [64, 0],
     "train.model.bottom: bottom must be a list of layer widths (positive integers), "
     "got [64, 0]. Fix: write e.g. [64, 16]."),
    (("train", "model", "bottom"), [64, 8],
     "train.model.bottom: interaction='dot' needs every table and the bottom MLP's last "
     "layer to have one width, got table dims [16] and bottom [64, 8]. Fix: make them "
     "equal or use interaction='concat'."),
    (("train", "model", "interaction"), "cross",
     "train.model.interaction: interaction must be \"dot\" or \"concat\", got 'cross'."),
    (("train", "dataset"), "synthetic_klicks/tiny",
     "train.dataset: unknown tfds dataset 'synthetic_klicks/tiny':"),
    (("train", "features"), {"c0": {"format": "dense_ids"}},
     "train.features.c0.format: unknown format \"dense_ids\". Did you mean \"dense\"? "
     "Valid: \"dense\", "
     "\"ragged\", \"sparse\"."),
    (("train", "eval_split"), "test[:0]",
     "train.eval_split: the split 'test[:0]' of synthetic_clicks/tiny/"),
], ids=["seed", "eval_batches_0", "optimizer_class", "model_width", "dot_widths",
        "interaction", "dataset", "feature_format", "empty_eval_split"])
def test_train_section_errors_are_one_line(capsys, tmp_path, data_dir, path, value,
                                           message):
  config = _config(tmp_path, data_dir, _set(path, value))
  line = _one_line_error(capsys, "train", "--config", config, "--tpu", "none",
                         "--model_dir", str(tmp_path / "run"))
  assert line.startswith(f"{config}: {message}"), line
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_dense_optimizer_typo_suggests_the_class(capsys, tmp_path, data_dir):
  config = _config(tmp_path, data_dir,
                   _set(("train", "dense_optimizer"), {"class": "Adamm"}))
  line = _one_line_error(capsys, "train", "--config", config, "--tpu", "none",
                         "--model_dir", str(tmp_path / "run"))
  assert 'Did you mean "Adam"? Fix: write e.g. {class: Adam, learning_rate: 0.001}' in line


@pytest.mark.parametrize("steps", ["0", "-20"])
def test_steps_must_be_positive(capsys, tmp_path, data_dir, steps):
  line = _one_line_error(capsys, "train", "--config", _config(tmp_path, data_dir),
                         "--steps", steps, "--model_dir", str(tmp_path / "run"))
  assert line == (
      f"--steps: --steps must be a positive integer (the table step to train to), got "
      f"{steps}. Fix: pass e.g. --steps 60, or leave it out for the config's "
      "train.steps.")


def test_directory_as_config(capsys, tmp_path):
  for command in ("plan", "train", "export"):
    line = _one_line_error(capsys, command, "--config", str(tmp_path),
                           "--model_dir", str(tmp_path / "run"), "--out", str(tmp_path))
    assert line == (f"{tmp_path}: is a directory, not a config file. Fix: name a .yaml "
                    "or .json file, e.g. configs/ranking.yaml.")


def _make_read_only(path):
  """chmod is not enough for root: the immutable attribute is."""
  os.makedirs(path)
  if os.geteuid() == 0:
    if shutil.which("chattr") is None or subprocess.run(
        ["chattr", "+i", str(path)], capture_output=True).returncode:
      pytest.skip("cannot make a directory read-only for root here")
  else:
    os.chmod(path, 0o500)


def test_read_only_model_dir_is_found_before_training(capsys, tmp_path, data_dir):
  model_dir = tmp_path / "ro"
  _make_read_only(model_dir)
  try:
    line = _one_line_error(capsys, "train", "--config", _config(tmp_path, data_dir),
                           "--tpu", "none", "--model_dir", str(model_dir))
  finally:
    if os.geteuid() == 0:
      subprocess.run(["chattr", "-i", str(model_dir)], check=True)
  assert line.startswith(f"cannot write to model_dir {model_dir}: ")
  assert line.endswith("Fix: pass a writable --model_dir.")
  assert os.listdir(model_dir) == []


def test_tpu_name_that_does_not_resolve(capsys, tmp_path, data_dir):
  line = _one_line_error(capsys, "train", "--config", _config(tmp_path, data_dir),
                         "--tpu", "no-such-tpu-name", "--model_dir", str(tmp_path / "r"))
  assert line.startswith("--tpu: TPU 'no-such-tpu-name' cannot be reached: ")
  assert line.endswith("Fix: check the name (gcloud compute tpus list), use --tpu auto "
                       "on a TPU VM, or --tpu none for CPU emulation.")


def test_model_dir_in_use(capsys, tmp_path, data_dir):
  with model_dir_lib.lock(str(tmp_path)):
    line = _one_line_error(capsys, "train", "--config", _config(tmp_path, data_dir),
                           "--tpu", "none", "--model_dir", str(tmp_path))
  assert line == (f"model_dir {tmp_path} is in use by another run (pid {os.getpid()}). "
                  "Fix: wait for it to finish, or pass another --model_dir.")


def test_tables_larger_than_memory_are_named_before_allocating(capsys, tmp_path,
                                                               data_dir):
  config = _config(tmp_path, data_dir,
                   _set(("tables", "t_c7", "vocabulary_size"), 10 ** 11))
  line = _one_line_error(capsys, "train", "--config", config, "--tpu", "none",
                         "--model_dir", str(tmp_path / "run"))
  assert line.startswith("the tables and optimizer slots need 11,920.9 GiB (float32) but "
                         "this machine has ")
  assert ("the largest is table 't_c7' (100,000,000,000 x 16, 1 slot(s): 11,920.9 GiB). "
          "Fix: lower its vocabulary_size for CPU emulation, or train on a TPU (--tpu).") in line
  assert not (tmp_path / "run" / "checkpoints").exists()
  status, out, _ = _cli(capsys, "plan", "--config", config)
  assert status == 0
  assert "CPU emulation (train --tpu none) would not fit: the tables and optimizer " in out
  assert "the largest is table 't_c7'" in out


def test_damaged_checkpoints_are_one_line(capsys, tmp_path):
  checkpoints = tmp_path / "checkpoints"
  checkpoints.mkdir()
  (checkpoints / "ckpt-20.index").write_bytes(b"\x00" * 10)
  line = _one_line_error(capsys, "export", "--config", TINY, "--model_dir",
                         str(tmp_path), "--out", str(tmp_path / "serving"))
  assert line == (f"no checkpoint in {checkpoints} can be read ({checkpoints}/ckpt-20"
                  ".index). Fix: move them away to train from step 0, or restore a "
                  "copy; nothing was overwritten.")


def test_verbose_raises_with_the_traceback(capsys, tmp_path):
  from tpu_embed_ext import errors
  with pytest.raises(errors.ConfigError, match="is a directory"):
    _cli(capsys, "plan", "--config", str(tmp_path), "--verbose")


def test_real_process_prints_one_line_and_exits_2(tmp_path):
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
  command = [sys.executable, "-m", "tpu_embed_ext", "train", "--config", str(tmp_path),
             "--steps", "5", "--tpu", "none", "--model_dir", str(tmp_path / "run")]
  out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
  assert out.returncode == 2
  ours = [l for l in out.stderr.splitlines() if "Traceback" in l or l.startswith("error:")]
  assert ours == [f"error: {tmp_path}: is a directory, not a config file. Fix: name a "
                  ".yaml or .json file, e.g. configs/ranking.yaml. (--verbose shows the "
                  "traceback)"]
  out = subprocess.run(command + ["--verbose"], capture_output=True, text=True, env=env,
                       timeout=300)
  assert out.returncode == 1 and "Traceback (most recent call last)" in out.stderr


def test_train_ends_with_where_everything_went_and_the_export_command_works(
    capsys, tmp_path, data_dir):
  config = _config(tmp_path, data_dir)
  model_dir = str(tmp_path / "run")
  status, out, err = _cli(capsys, "train", "--config", config, "--steps", "10",
                          "--tpu", "none", "--model_dir", model_dir)
  assert status == 0, err
  summary = out[out.index(f"Results in {model_dir}:"):].splitlines()
  join = os.path.join
  assert summary[1:6] == [
      f"  checkpoints       {join(model_dir, 'checkpoints')} (newest: ckpt-10)",
      f"  metrics           {join(model_dir, 'metrics.json')}",
      f"  learning curve    {join(model_dir, 'learning_curve.png')}",
      f"  history           {join(model_dir, 'history.csv')}",
      f"  TensorBoard logs  {join(model_dir, 'logs')}   (tensorboard --logdir "
      f"{join(model_dir, 'logs')})"]
  for name in ("metrics.json", "learning_curve.png", "history.csv", "logs"):
    assert os.path.exists(join(model_dir, name)), name
  assert summary[6] == "Next, export for serving:"
  export = summary[7].split()
  assert export[:3] == ["python", "-m", "tpu_embed_ext"]
  status, out, err = _cli(capsys, *export[3:])
  assert status == 0, err
  assert out.strip().splitlines() == [
      f"Exporting {join(model_dir, 'checkpoints', 'ckpt-10')} (table step 10).",
      f"SavedModel written to {join(model_dir, 'serving')}"]
  assert os.path.exists(join(model_dir, "serving", "saved_model.pb"))
