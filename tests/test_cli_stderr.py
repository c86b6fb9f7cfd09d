"""The command line owns its stderr, from its first line (``library_log.py``).

Real processes (``python -m tpu_embed_ext``, the entry point ``run``): fd-level
output cannot be checked in-process. Every run here has
``TF_CPP_MIN_LOG_LEVEL=0``, where TensorFlow's C++ runtime logs at start-up
on any CPU, and its own cache directory (where the log of a command without
a model_dir ends, ``<cache>/logs/<command>.log``) and ``TMPDIR`` (left
empty). One class of output at a time is made certain
by a command replaced in the process (``_script``): a C++-style line written
to fd 2, Python's stderr, logging, absl, a warning, a child process; then
crashes (segfault, abort, a kill, a bug), each of which must still reach the
terminal with the path of the full log.
"""

import os
import stat
import subprocess
import sys
import textwrap

import pytest

_CRASH = ("error: the command ended before it finished (killed by a signal, or a "
          "crash inside TensorFlow or another library). The full log is ")


def _env(tmp_path):
  tmp = tmp_path / "tmpdir"
  tmp.mkdir(exist_ok=True)
  return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0", "TMPDIR": str(tmp),
          "TPU_EMBED_EXT_CACHE_DIR": str(tmp_path / "cache")}


def _logs(tmp_path):
  return tmp_path / "cache" / "logs"


def _cli_process(tmp_path, *args, script=None, cwd=None):
  """(status, stdout, stderr) of the CLI, or of ``script`` then ``run()``."""
  work = cwd or tmp_path / "work"
  os.makedirs(work, exist_ok=True)
  if script is None:
    argv = [sys.executable, "-m", "tpu_embed_ext", *args]
  else:
    code = (textwrap.dedent(script) + "\nfrom tpu_embed_ext.cli import main as cli\n"
            f"cli.COMMANDS[{args[0]!r}]._run = command\n"
            f"cli.run(['tpu-embed', *{list(args)!r}])\n")
    argv = [sys.executable, "-c", code]
  out = subprocess.run(argv, cwd=work, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=600)
  return out.returncode, out.stdout, out.stderr


def _private_log(path, tmp_path):
  """The text of a log: a private file in the cache's logs/ (mode 0700)."""
  info = os.lstat(path)
  assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, path
  assert os.path.dirname(path) == str(_logs(tmp_path))
  assert stat.S_IMODE(os.stat(_logs(tmp_path)).st_mode) == 0o700
  with open(path) as f:
    return f.read()


def test_plan_writes_nothing_to_stderr_with_tensorflow_logging_on(tmp_path):
  status, out, err = _cli_process(tmp_path, "plan", "--config", "tiny")
  assert (status, err) == (0, "")
  assert "t_c25" in out and "libraries" not in out
  _private_log(_logs(tmp_path) / "plan.log", tmp_path)
  assert os.listdir(_logs(tmp_path)) == ["plan.log"]
  assert os.listdir(tmp_path / "tmpdir") == []


_EVERY_KIND = """
import logging, os, subprocess, sys, warnings

def command(f, config, progress):
  import tensorflow as tf
  from absl import logging as absl_logging
  from tpu_embed_ext.spec import numeric_traps
  os.write(2, b"I0000 00:00:1.0 1 fake.cc:1] a C++ line on fd 2\\n")
  print("a Python line on sys.stderr", file=sys.stderr)
  print("a line on sys.__stderr__", file=sys.__stderr__, flush=True)
  logging.getLogger("tensorflow").warning("a logging line")
  absl_logging.warning("an absl line")
  warnings.warn("a library's warning", DeprecationWarning)
  warnings.warn("momentum=1.0: ours", numeric_traps.NumericTrapWarning)
  subprocess.run(["sh", "-c", "echo a child process line >&2"], check=True)
  tf.constant(1.0)
  print("the command's output")
"""


def test_every_library_line_goes_to_the_log_and_ours_to_stderr(tmp_path):
  status, out, err = _cli_process(tmp_path, "plan", "--config", "tiny", script=_EVERY_KIND)
  assert status == 0, err
  assert err == "warning: momentum=1.0: ours\n"
  assert out == "the command's output\n"
  log = _private_log(_logs(tmp_path) / "plan.log", tmp_path)
  for line in ("a C++ line on fd 2", "a Python line on sys.stderr",
               "a line on sys.__stderr__", "a logging line", "an absl line",
               "a library's warning", "a child process line"):
    assert line in log, line
  assert "ours" not in log


def test_verbose_shows_the_library_lines(tmp_path):
  status, out, err = _cli_process(tmp_path, "plan", "--config", "tiny", "--verbose",
                          script=_EVERY_KIND)
  assert status == 0, err
  assert "a C++ line on fd 2" in err and "an absl line" in err
  assert not (tmp_path / "cache").exists() and os.listdir(tmp_path / "tmpdir") == []


_CRASHES = {
    "segfault": "import ctypes; ctypes.string_at(0)",
    "abort": "os.abort()",
    "kill": "os.kill(os.getpid(), 9)",
}


@pytest.mark.parametrize("kind", sorted(_CRASHES))
def test_a_crash_in_a_library_reaches_the_terminal_with_the_log(tmp_path, kind):
  script = f"""
  import os

  def command(f, config, progress):
    import tensorflow as tf
    tf.constant(1.0)
    os.write(2, b"F0000 fake.cc:1] Check failed: what the library said\\n")
    {_CRASHES[kind]}
  """
  status, _, err = _cli_process(tmp_path, "plan", "--config", "tiny", script=script)
  assert status < 0, (status, err)  # Killed by the signal.
  if kind != "kill":  # faulthandler: the Python stack of the fatal signal.
    assert "Fatal Python error: " in err and "in command" in err, err
  report = err[err.index(_CRASH):].splitlines()
  path = report[0][len(_CRASH):-len("; its last lines:")]
  assert "F0000 fake.cc:1] Check failed: what the library said" in _private_log(
      path, tmp_path)
  assert report[-1] == "  F0000 fake.cc:1] Check failed: what the library said"


def test_a_bug_prints_its_traceback_and_the_log(tmp_path):
  script = """
  def command(f, config, progress):
    import tensorflow as tf
    tf.constant(1.0)
    raise RuntimeError("a bug")
  """
  status, _, err = _cli_process(tmp_path, "plan", "--config", "tiny", script=script)
  assert status == 1
  lines = err.splitlines()
  assert lines[0] == "Traceback (most recent call last):"
  assert "RuntimeError: a bug" in lines
  log = _logs(tmp_path) / "plan.log"
  assert lines[-1] == f"(the log of TensorFlow and other libraries: {log})"
  assert "RuntimeError: a bug" in _private_log(log, tmp_path)  # After what led to it.


def test_a_run_that_fails_on_its_config_leaves_nothing(tmp_path):
  work = tmp_path / "work"
  status, out, err = _cli_process(tmp_path, "train", "--config", "configs/rankin.yaml")
  assert (status, out) == (2, "")
  assert err == (
      "error: configs/rankin.yaml: config file not found. Did you mean the shipped "
      "config 'ranking' (--config ranking)? Fix: check the path, or name a shipped "
      "config: criteo, movielens, ranking, tiny. (--verbose shows the traceback)\n")
  assert os.listdir(work) == [] and os.listdir(tmp_path / "tmpdir") == []
  assert os.listdir(_logs(tmp_path)) == ["train.log"]  # The last train's log.


def test_unknown_command_in_a_real_process(tmp_path):
  status, out, err = _cli_process(tmp_path, "trian")
  assert (status, out) == (2, "")
  assert err == ("error: unknown command 'trian'. Did you mean \"train\"? Commands: "
                 "plan, train, export, convert-checkpoint, emulate (tpu-embed --help)."
                 "\n")


def test_a_planted_symlink_cannot_redirect_the_log(tmp_path):
  """The log of plan and convert-checkpoint was a fixed
  /tmp/tpu_embed_ext-<uid>.log that followed a symlink someone planted. Now
  it is written to a new file made exclusively, renamed over <command>.log:
  a symlink there is replaced, not followed."""
  victim = tmp_path / "victim"
  victim.write_text("precious\n")
  (tmp_path / "tmpdir").mkdir()
  _logs(tmp_path).mkdir(parents=True, mode=0o700)
  os.symlink(victim, tmp_path / "tmpdir" / f"tpu_embed_ext-{os.getuid()}.log")
  os.symlink(victim, _logs(tmp_path) / "plan.log")
  status, _, err = _cli_process(tmp_path, "plan", "--config", "tiny", script=_EVERY_KIND)
  assert status == 0, err
  assert victim.read_text() == "precious\n"
  assert "a C++ line on fd 2" in _private_log(_logs(tmp_path) / "plan.log", tmp_path)


def test_the_private_log_is_created_exclusively(monkeypatch, tmp_path):
  """mkstemp (O_CREAT | O_EXCL): a name taken by a symlink is skipped."""
  import tempfile
  from tpu_embed_ext.host import library_log
  victim = tmp_path / "victim"
  victim.write_text("precious\n")
  monkeypatch.setenv("TPU_EMBED_EXT_CACHE_DIR", str(tmp_path))
  (tmp_path / "logs").mkdir()
  os.symlink(victim, tmp_path / "logs" / "tpu_embed_ext-plan-planted.log")
  monkeypatch.setattr(tempfile, "_get_candidate_names",
                      lambda: iter(["planted", "fresh"]))
  log = library_log.LibraryLog("plan")
  try:
    assert log.path == str(tmp_path / "logs" / "tpu_embed_ext-plan-fresh.log")
    os.write(2, b"a library line\n")
  finally:
    path = log.close()
  assert path == str(tmp_path / "logs" / "plan.log")
  assert victim.read_text() == "precious\n"
  with open(path) as f:
    assert f.read() == "a library line\n"


def test_convert_checkpoint_errors_are_its_only_stderr(tmp_path):
  """The stderr and one-line rules hold for every command; this one
  loads TensorFlow before it finds the missing flags."""
  status, out, err = _cli_process(tmp_path, "convert-checkpoint", "--config", "tiny")
  assert (status, out) == (2, "")
  assert err == ("error: convert-checkpoint needs --checkpoint PREFIX|DIR --out PREFIX "
                 "--topology T (a SparseCore topology, or none for per-table). Fix: "
                 "pass all three. (--verbose shows the traceback)\n")
  assert os.listdir(_logs(tmp_path)) == ["convert-checkpoint.log"]


def test_the_log_moves_into_the_model_dir_and_a_crash_names_it_there(tmp_path):
  """train's log is private until the job reports progress (the model_dir is
  good), then <model_dir>/logs/libraries.log, with what came before."""
  script = """
  import os

  def command(f, config, progress):
    import tensorflow as tf
    os.write(2, b"before the model_dir is known\\n")
    progress(f.model_dir)("Training on the test's command.")
    os.write(2, b"after\\n")
    os.kill(os.getpid(), 9)
  """
  model_dir = tmp_path / "run"
  status, out, err = _cli_process(tmp_path, "train", "--config", "tiny", "--model_dir",
                          str(model_dir), script=script)
  log = model_dir / "logs" / "libraries.log"
  assert status < 0 and out == "Training on the test's command.\n"
  assert err.startswith(f"{_CRASH}{log}; its last lines:\n"), err
  assert err.endswith("  after\n")
  text = log.read_text()
  assert text.index("before the model_dir is known") < text.index("after")
  assert os.listdir(_logs(tmp_path)) == []  # The private log was moved.
