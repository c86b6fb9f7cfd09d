"""The command line: every user error is one line and exit status 2; the
closing summary of `train` names every output and an export command that works.

Most cases run the CLI's ``main`` in this process (flags parsed as absl
does); one runs ``python -m tpu_embed_ext`` to check the real exit status and
stderr.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests import jobs
from tpu_embed_ext.cli import console
from tpu_embed_ext.host import model_dir as model_dir_lib

TINY = "configs/tiny.yaml"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  for command, *flags in (("plan",), ("train", "--model_dir", str(tmp_path / "run")),
                          ("export", "--model_dir", str(tmp_path / "run"), "--out",
                           str(tmp_path))):
    line = _one_line_error(capsys, command, "--config", str(tmp_path), *flags)
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
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0"}  # test_cli_stderr.py: why 0.
  command = [sys.executable, "-m", "tpu_embed_ext", "train", "--config", str(tmp_path),
             "--steps", "5", "--tpu", "none", "--model_dir", str(tmp_path / "run")]
  out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
  assert (out.returncode, out.stdout) == (2, "")
  assert out.stderr == (f"error: {tmp_path}: is a directory, not a config file. Fix: "
                        "name a .yaml or .json file, e.g. configs/ranking.yaml. "
                        "(--verbose shows the traceback)\n")
  assert not (tmp_path / "run").exists()
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
      f"  TensorBoard logs  {join(model_dir, 'logs')}   "
      f"({console.tool('tensorboard', 'tensorboard.main')} --logdir "
      f"{join(model_dir, 'logs')})"]
  assert summary[6] == (f"  library log       {join(model_dir, 'logs', 'libraries.log')}"
                        "   (TensorFlow's and other libraries' lines)")
  for name in ("metrics.json", "learning_curve.png", "history.csv", "logs",
               "logs/libraries.log"):
    assert os.path.exists(join(model_dir, name)), name
  assert summary[7] == "Next, export for serving:"
  # Spelled to run as printed from here, the virtualenv active or not.
  export = summary[8].split()
  assert export[0] == console.program() and os.access(export[0], os.X_OK), export
  assert export[1] == "export"
  status, out, err = _cli(capsys, *export[1:])
  assert status == 0, err
  assert out.strip().splitlines() == [
      f"Exporting {join(model_dir, 'checkpoints', 'ckpt-10')} (table step 10).",
      f"SavedModel written to {join(model_dir, 'serving')}"]
  assert os.path.exists(join(model_dir, "serving", "saved_model.pb"))


# --- The command line itself: commands, flags, help, config names, extras ----

def _usage_error(capsys, *args) -> str:
  """The one line of a command line mistake: exit 2, nothing on stdout."""
  status, out, err = _cli(capsys, *args)
  lines = err.splitlines()
  assert status == 2 and not out, (status, out, err)
  assert len(lines) == 1 and lines[0].startswith("error: "), err
  return lines[0][len("error: "):]


_PLAN_FLAGS = ("--config, --proto, --engine, --topology, --batch_size, --data, "
               "--hotness, --ids, --verbose (tpu-embed plan --help).")


@pytest.mark.parametrize("args,message", [
    (("trian",), "unknown command 'trian'. Did you mean \"train\"? Commands: plan, "
     "train, export, convert-checkpoint, emulate (tpu-embed --help)."),
    (("--config", "tiny", "plan"), "the command comes first: tpu-embed COMMAND "
     "[flags], got '--config'. Commands: plan, train, export, convert-checkpoint, "
     "emulate (tpu-embed --help)."),
    (("train", "--confg", "tiny"), "unknown flag --confg for train. Did you mean "
     "\"--config\"? train takes --config, --steps, --model_dir, --tpu, --verbose "
     "(tpu-embed train --help)."),
    (("plan", "--steps", "3"), "unknown flag --steps for plan (a flag of train). "
     "plan takes " + _PLAN_FLAGS),
    (("plan", "--out", "x"), "unknown flag --out for plan (a flag of export and "
     "convert-checkpoint). plan takes " + _PLAN_FLAGS),
    (("train", "--steps", "abc"), "--steps: 'abc' is not a valid value (invalid "
     "literal for int() with base 10: 'abc'). Fix: see tpu-embed train --help."),
    (("plan", "--engine", "v3"), "--engine: 'v3' is not a valid value (value should "
     "be one of <v1|v2>). Fix: see tpu-embed plan --help."),
    (("train", "tiny"), "unexpected argument 'tiny' after train. Fix: give values "
     "with their flags (tpu-embed train --help)."),
], ids=["command", "command_not_first", "flag", "other_commands_flag",
        "flag_of_two", "int_value", "enum_value", "positional"])
def test_command_line_mistakes_are_one_line_exit_2(capsys, args, message):
  assert _usage_error(capsys, *args) == message


def test_help_lists_commands_and_each_command_has_its_own(capsys):
  status, out, _ = _cli(capsys, "--help")
  assert status == 0
  for command in ("plan", "train", "export", "convert-checkpoint", "emulate"):
    assert f"\n  {command}: " in out, command
  assert "--steps" not in out and "tpu-embed COMMAND --help" in out
  assert "shipped config: criteo, movielens, ranking, tiny." in out
  status, out, _ = _cli(capsys, "train", "--help")
  assert status == 0 and out.startswith("usage: tpu-embed train [flags]\n")
  flags = [l.strip() for l in out.splitlines() if l.startswith("  --")]
  assert flags == ["--config", "--steps", "--model_dir", "--tpu", "--verbose"]
  assert "examples:\n  tpu-embed train --config ranking\n" in out
  assert len(out.splitlines()) < 40
  status, out, _ = _cli(capsys, "convert-checkpoint", "-h")
  assert status == 0
  assert [l.strip() for l in out.splitlines() if l.startswith("  --")] == [
      "--config", "--checkpoint", "--out", "--topology", "--prefix", "--verbose"]
  status, out, _ = _cli(capsys)
  assert status == 2 and out.startswith("usage: tpu-embed COMMAND [flags]")


def test_commands_never_define_absl_global_flags(capsys, monkeypatch, tmp_path):
  """A script run by ``emulate`` defines its own --tpu, --model_dir: ours
  live in a FlagValues of their own, so absl's FLAGS never hold them."""
  from absl import flags
  import types
  monkeypatch.chdir(tmp_path)
  status, _, err = _cli(capsys, "plan", "--config", "tiny")
  assert status == 0, err
  calls = []
  runner = types.SimpleNamespace(main=lambda argv, **_: calls.append(argv) or 7)
  package = types.SimpleNamespace(runner=runner)
  monkeypatch.setitem(sys.modules, "tpu_embed_ext.emulated_tpu", package)
  monkeypatch.setitem(sys.modules, "tpu_embed_ext.emulated_tpu.runner", runner)
  status, _, _ = _cli(capsys, "emulate", "--replicas", "2", "job.py", "--tpu", "x")
  assert (status, calls) == (7, [["--replicas", "2", "job.py", "--tpu", "x"]])
  for name in ("config", "model_dir", "tpu", "steps", "verbose", "out"):
    assert name not in flags.FLAGS, name


def test_emulate_without_its_module_is_one_line(capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "tpu_embed_ext.emulated_tpu", None)
  assert _usage_error(capsys, "emulate", "job.py") == (
      "emulate is not available in this installation of tpu_embed_ext. Fix: "
      "install a version that has it.")


def test_shipped_configs_by_name(capsys, monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)  # No configs/ here: the names are package data.
  status, by_name, err = _cli(capsys, "plan", "--config", "tiny")
  assert status == 0, err
  status, by_path, err = _cli(capsys, "plan", "--config",
                              os.path.join(ROOT, TINY))
  assert status == 0, err
  assert by_name == by_path and "t_c25" in by_name
  line = _one_line_error(capsys, "train", "--config", "rankin")
  assert line == ("--config: no config file or shipped config named 'rankin'. Did "
                  "you mean \"ranking\"? Fix: pass a path to a .yaml or .json file, or "
                  "a shipped config: criteo, movielens, ranking, tiny.")
  line = _one_line_error(capsys, "train", "--config", "configs/rankin.yaml")
  assert line == ("configs/rankin.yaml: config file not found. Did you mean the "
                  "shipped config 'ranking' (--config ranking)? Fix: check the path, "
                  "or name a shipped config: criteo, movielens, ranking, tiny.")
  assert os.listdir(tmp_path) == []  # No runs/rankin/, no logs/.


def test_a_config_beside_the_missing_one_is_suggested(capsys, tmp_path):
  (tmp_path / "mine.yaml").write_text("tables: {}\n")
  line = _one_line_error(capsys, "plan", "--config", str(tmp_path / "mien.yaml"))
  assert line == (f"{tmp_path}/mien.yaml: config file not found. Did you mean "
                  f"\"{tmp_path}/mine.yaml\"? Fix: check the path, or name a shipped "
                  "config: criteo, movielens, ranking, tiny.")


def _clone_fix(extras):
  """The fix printed from this clone: its pip, by path unless on PATH."""
  return f"Fix: {console.tool('pip', 'pip')} install -e '{ROOT}[{extras}]'"


@pytest.mark.parametrize("command,modules,message", [
    ("plan", ("tensorflow",), "plan needs TensorFlow, which is not installed. "
     + "<FIX cpu>" + " (or [tf], or [tpu] on a Cloud TPU VM)."),
    ("train", ("tensorflow_datasets",), "train needs tensorflow_datasets (the "
     "training data), which is not installed. " + "<FIX data>" + "."),
    ("train", ("matplotlib",), "train needs matplotlib (the learning curve), which "
     "is not installed. " + "<FIX data>" + "."),
    # Every missing one on the first try, not one per try.
    ("train", ("tensorflow", "tensorflow_datasets", "matplotlib"), "train needs "
     "TensorFlow, tensorflow_datasets (the training data) and matplotlib (the "
     "learning curve), which are not installed. " + "<FIX cpu,data>"
     + " (or [tf], or [tpu] on a Cloud TPU VM)."),
    ("export", ("tensorflow_datasets",), "export needs tensorflow_datasets (the "
     "training data), which is not installed. " + "<FIX data>" + "."),
], ids=["plan_tf", "train_tfds", "train_matplotlib", "train_all", "export_tfds"])
def test_a_missing_extra_is_named_before_anything_is_made(capsys, monkeypatch,
                                                          tmp_path, command, modules,
                                                          message):
  import importlib.util
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name in modules else find_spec(name, *a))
  monkeypatch.chdir(tmp_path)
  # The fix names the venv's pip by a path from where the command runs (the
  # test's directory), so it is spelled after the chdir, not at collection.
  message = re.sub(r"<FIX ([a-z,]+)>", lambda m: _clone_fix(m.group(1)), message)
  assert _usage_error(capsys, command, "--config", "tiny") == message
  assert os.listdir(tmp_path) == []


def test_a_module_missing_while_running_names_the_extra(capsys, monkeypatch):
  from tpu_embed_ext.cli import main as cli

  def run(*_):
    raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
  monkeypatch.setattr(cli.COMMANDS["plan"], "_run", run)
  monkeypatch.chdir(ROOT)  # From the clone's root: '.[data]'.
  assert _one_line_error(capsys, "plan", "--config", "tiny") == (
      "plan needs matplotlib (the learning curve), which is not installed. Fix: "
      f"{console.tool('pip', 'pip')} install -e '.[data]'.")


def test_the_printed_command_runs_as_printed(monkeypatch, tmp_path):
  """``console.program``: tpu-embed when PATH finds this installation's, else
  its script by path (relative below the working directory)."""
  bin_dir = os.path.dirname(sys.executable)
  script = os.path.join(bin_dir, "tpu-embed")
  monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ["PATH"])
  assert console.program() == "tpu-embed"
  monkeypatch.setenv("PATH", "/usr/bin:/bin")
  monkeypatch.chdir(tmp_path)
  assert console.program() == script  # Not below tmp_path: absolute.
  monkeypatch.chdir(os.path.dirname(os.path.dirname(bin_dir)))
  assert console.program() == os.path.relpath(script)
  assert os.sep in console.program()  # A path, not a PATH lookup.


# --- first-hour polish (issue 36) ------------------------------------------------

def test_version(capsys):
  import tpu_embed_ext
  status, out, err = _cli(capsys, "--version")
  package = os.path.dirname(os.path.abspath(tpu_embed_ext.__file__))
  assert (status, out, err) == (0, f"tpu_embed_ext 0.1.0 ({package})\n", "")


def test_each_command_help_tells_of_that_command_only(capsys):
  for command, other in (("export", "convert-checkpoint"), ("plan", "convert-checkpoint"),
                         ("train", "convert-checkpoint"), ("plan", "export:")):
    status, out, _ = _cli(capsys, command, "--help")
    flags_part = out[out.index("flags:"):out.index("examples:")]
    assert status == 0 and other not in flags_part, (command, flags_part)
  status, out, _ = _cli(capsys, "export", "--help")
  assert "  --out\n      Where to write the SavedModel (default: <model_dir>/serving).\n" in out


def test_plan_shows_sparsecore_notes_only_when_asked(capsys, monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)
  status, out, _ = _cli(capsys, "plan", "--config", "tiny")
  assert status == 0 and "SparseCore" not in out, out
  for flags in (("--engine", "v2"), ("--topology", "v5p:4")):
    status, out, err = _cli(capsys, "plan", "--config", "tiny", *flags)
    assert status == 0, err
    assert ("SparseCore (TPUEmbeddingV2) notes:\n  table 't_c13': clip_weight_min=-2.0 "
            "is ignored by TPUEmbeddingV2 (SparseCore): no weight clipping.") in out


def test_a_failed_train_leaves_nothing_it_created(capsys, monkeypatch, tmp_path,
                                                 data_dir):
  """A run refused after its model_dir was made (a TPU that cannot be
  reached): no empty runs/<name>/, no .lock; a model_dir that was there stays."""
  config = _config(tmp_path, data_dir, name="bad.yaml")
  work = tmp_path / "work"
  work.mkdir()
  monkeypatch.chdir(work)
  for extra in ((), ("--model_dir", str(work / "a" / "b"))):
    line = _one_line_error(capsys, "train", "--config", config, "--tpu",
                           "no-such-tpu-name", *extra)
    assert line.startswith("--tpu: TPU 'no-such-tpu-name' cannot be reached: ")
    assert os.listdir(work) == []  # No runs/, runs/bad/, a/b/ or .lock.
  (work / "mine").mkdir()
  _one_line_error(capsys, "train", "--config", config, "--tpu", "no-such-tpu-name",
                  "--model_dir", str(work / "mine"))
  assert os.listdir(work) == ["mine"] and os.listdir(work / "mine") == []


def test_the_lock_file_goes_with_the_run_that_held_it(tmp_path):
  with model_dir_lib.lock(str(tmp_path)):
    assert (tmp_path / ".lock").read_text() == str(os.getpid())
    with pytest.raises(model_dir_lib.ModelDirError, match="is in use by another run"):
      with model_dir_lib.lock(str(tmp_path)):
        pass
  assert os.listdir(tmp_path) == []
  with model_dir_lib.lock(str(tmp_path)):  # Taken again after it went.
    pass
  assert os.listdir(tmp_path) == []


def test_the_python_api_resolves_shipped_config_names_as_the_cli(monkeypatch, tmp_path):
  import tpu_embed_ext as tee
  monkeypatch.chdir(tmp_path)  # No configs/ here.
  by_name = tee.EmbeddingSpec.from_file("ranking")
  with open(os.path.join(ROOT, "configs", "ranking.yaml")) as f:
    assert by_name == tee.EmbeddingSpec.from_dict(yaml.safe_load(f))
  assert [t.name for t in tee.plan("criteo").tables] == [
      t.name for t in tee.EmbeddingSpec.from_file(
          os.path.join(ROOT, "configs", "criteo.yaml")).tables]
  embedding = tee.CPUEmbedding("tiny")
  assert len(embedding.embedding_tables) == 26
  # A path that exists wins over the shipped name.
  (tmp_path / "tiny").write_text(yaml.safe_dump(
      {"tables": {"t": {"vocabulary_size": 3, "dim": 2}},
       "features": {"f": {"table": "t"}}, "optimizer": {"type": "sgd",
                                                       "learning_rate": 0.1}}))
  assert [t.name for t in tee.EmbeddingSpec.from_file("tiny").tables] == ["t"]
  with pytest.raises(tee.ConfigError) as info:
    tee.EmbeddingSpec.from_file("rankin")
  assert str(info.value) == (
      "no config file or shipped config named 'rankin'. Did you mean \"ranking\"? "
      "Fix: pass a path to a .yaml or .json file, or a shipped config: criteo, "
      "movielens, ranking, tiny.")


def test_a_finished_train_decides_nothing_to_do_before_any_work(
    capsys, monkeypatch, tmp_path, data_dir):
  """No dataset, model, strategy or emulated TPU for a finished run, and one
  device line, true: where the run trained (not the --tpu of this call)."""
  config = _config(tmp_path, data_dir)
  model_dir = str(tmp_path / "run")
  status, out, err = _cli(capsys, "train", "--config", config, "--steps", "5",
                          "--tpu", "none", "--model_dir", model_dir)
  assert status == 0, err
  # One device line, then the AUC without a second one.
  assert [l for l in out.splitlines() if "CPU emulation" in l] == [
      "Training on CPU emulation (CPUEmbedding)."]
  assert re.search(r"^held-out AUC \S+ \(planted model: \S+\) at step 5, [\d,]+ "
                   r"examples/s\.$", out, re.M), out
  from tpu_embed_ext.job import loop

  def refused(*_, **__):
    raise AssertionError("work done for a finished run")
  for name in ("input_datasets", "resolve_strategy", "emulation", "build_model",
               "load"):
    monkeypatch.setattr(loop, name, refused)
  for tpu in ("none", "emulate:2", "auto"):
    status, out, err = _cli(capsys, "train", "--config", config, "--steps", "5",
                            "--tpu", tpu, "--model_dir", model_dir)
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0] == ("Already trained to step 5 (asked for 5): nothing to do; "
                        "metrics.json left as it was.")
    held_out = [l for l in lines if l.startswith("held-out AUC")]
    assert len(held_out) == 1 and held_out[0].endswith(
        " at step 5 (already trained, on CPU emulation (CPUEmbedding): nothing to "
        "do)."), held_out
    assert not [l for l in lines if "Training on" in l or "emulated TPU" in l]


def test_no_tpu_attached_is_information_not_an_error():
  from tpu_embed_ext.job import strategy
  assert strategy.resolve_strategy("auto") == (
      None, "CPU emulation (CPUEmbedding), as no TPU is attached")
