"""The package outside the clone: a wheel built from the repository, installed
into a separate virtualenv, works from an empty directory.

What is real: the wheel is built from a copy of the sources (``pip wheel
--no-deps``; without build isolation, so no download), installed with pip
into a new virtualenv that does not see this one (no
``--system-site-packages``), and its ``tpu-embed`` script is run from an
empty directory, far from the clone. What is borrowed: the wheel's
dependencies. Installing TensorFlow from PyPI takes minutes (the README's
figure was measured by hand), so the new environment sees the distributions
already installed here through a ``.pth`` file naming a directory of symlinks
to them, this package's own entries excluded (the clone's editable install
must not leak in). Leaving some out makes a machine without TensorFlow
(``pip install .``) or without the ``data`` extra.
"""

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tests import wheel_build

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pip(*args):
  wheel_build.pip(*args, timeout=600)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """A virtualenv with the wheel installed (and nothing else of its own)."""
  root = tmp_path_factory.mktemp("wheel")
  wheel = wheel_build.build_wheel(root)
  # With pip: the fixes it prints name it (test_a_missing_extra_...).
  subprocess.run([sys.executable, "-m", "venv", str(root / "env")],
                 check=True, timeout=600)
  python = root / "env" / "bin" / "python"
  _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
  return root / "env"


_borrow = wheel_build.borrow


def _run_in_venv(env, work, command, active=True):
  """``command`` in ``work``; ``active``: the env's bin on PATH, else not
  (a leading ``tpu-embed`` is then the env's script by its path)."""
  path = f"{env / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin" if active else (
      f"/usr/bin{os.pathsep}/bin")
  environ = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0", "PATH": path}
  environ.pop("PYTHONPATH", None)
  argv = shlex.split(command)
  if not active and argv[0] == "tpu-embed":
    argv[0] = str(env / "bin" / "tpu-embed")
  return subprocess.run(argv, cwd=work, env=environ,
                        capture_output=True, text=True, timeout=900)


def test_the_installed_wheel_works_from_an_empty_directory(env, tmp_path):
  _borrow(env)
  where = _run_in_venv(env, tmp_path, "python -c 'import tpu_embed_ext; "
                              "print(tpu_embed_ext.__file__)'")
  assert where.stdout.startswith(str(env)), where.stdout + where.stderr
  out = _run_in_venv(env, tmp_path, "tpu-embed plan --config tiny")
  assert (out.returncode, out.stderr) == (0, ""), out.stdout + out.stderr
  assert "t_c25" in out.stdout
  out = _run_in_venv(env, tmp_path, "tpu-embed train --config tiny --steps 10 --tpu none")
  assert (out.returncode, out.stderr) == (0, ""), out.stdout + out.stderr
  assert (tmp_path / "runs" / "tiny" / "checkpoints" / "ckpt-10.index").exists()
  assert (tmp_path / "runs" / "tiny" / "logs" / "libraries.log").exists()
  lines = out.stdout.splitlines()
  export = lines[lines.index("Next, export for serving:") + 1].strip()
  # The env's own script, found on PATH (test_cli runs the printed command).
  assert export == ("tpu-embed export --config tiny --model_dir runs/tiny --out "
                    "runs/tiny/serving")
  assert sorted(os.listdir(tmp_path)) == ["runs"]


@pytest.mark.parametrize("without,command,message", [
    ("tensorflow", "plan --config tiny", "plan needs TensorFlow, which is not "
     "installed. Fix: {pip} install tensorflow-cpu 'protobuf<7' (or tensorflow, or tensorflow-tpu "
     "on a Cloud TPU VM, in place of tensorflow-cpu)."),
    ("tensorflow_datasets", "train --config tiny --steps 10", "train needs "
     "tensorflow_datasets (the training data), which is not installed. Fix: {pip} "
     "install tensorflow-datasets importlib-resources matplotlib tensorboard."),
], ids=["no_tensorflow", "cpu_without_data"])
def test_a_missing_extra_is_named_and_nothing_is_made(env, tmp_path, without, command,
                                                      message):
  """``pip install .`` (no TensorFlow), or ``[cpu]`` without ``[data]``: the
  fix names the extra's real requirements (the package may be on no index)
  and this environment's pip by its path (the virtualenv is not active)."""
  _borrow(env, without=(without,))
  out = _run_in_venv(env, tmp_path, f"tpu-embed {command}", active=False)
  message = message.format(pip=env / "bin" / "pip")
  assert (out.returncode, out.stdout, out.stderr) == (2, "", f"error: {message}\n")
  assert os.listdir(tmp_path) == []


# --- every command the CLI prints runs as printed --------------------------------

def _printed(stdout):
  """The commands a finished ``train`` prints: export, and TensorBoard's."""
  lines = stdout.splitlines()
  export = lines[lines.index("Next, export for serving:") + 1].strip()
  board, = [re.search(r"\((.* --logdir \S+)\)$", l).group(1) for l in lines
            if l.startswith("  TensorBoard logs")]
  return export, board


def _as_printed(command, work, environ, then=()):
  """Runs ``command`` as printed (``then``: arguments added after it, where
  it would otherwise not end: TensorBoard's ``--inspect``, pip's ``--dry-run``)."""
  return subprocess.run([*shlex.split(command), *then], cwd=work, env=environ,
                        capture_output=True, text=True, timeout=900)


def _check_train_and_its_commands(run, work, environ):
  out = run("train --config tiny --steps 10 --tpu none")
  assert (out.returncode, out.stderr) == (0, ""), out.stdout + out.stderr
  export, board = _printed(out.stdout)
  done = _as_printed(export, work, environ)
  assert done.returncode == 0, done.stdout + done.stderr
  assert (work / "runs" / "tiny" / "serving" / "saved_model.pb").exists()
  done = _as_printed(board, work, environ, then=("--inspect",))
  assert done.returncode == 0 and "held_out/auc" in done.stdout, (
      board, done.stdout[-2000:], done.stderr[-2000:])
  return export, board


def test_every_printed_command_runs_as_printed_from_the_wheel(env, tmp_path):
  """The virtualenv not active: a missing extra's fix, then train's export and
  TensorBoard commands, each run as printed."""
  _borrow(env, without=("tensorflow_datasets",))
  work = tmp_path / "work"
  work.mkdir()
  environ = {**os.environ, "PATH": f"/usr/bin{os.pathsep}/bin"}
  environ.pop("PYTHONPATH", None)
  script = str(env / "bin" / "tpu-embed")

  def run(args):
    return _as_printed(f"{script} {args}", work, environ)
  out = run("train --config tiny --steps 10 --tpu none")
  assert out.returncode == 2, out.stderr
  fix = out.stderr.split("Fix: ", 1)[1].rsplit(".", 1)[0]
  assert fix.startswith(f"{env}/bin/pip install tensorflow-datasets"), fix
  try:
    done = _as_printed(fix, work, environ)  # Installs tfds into the env.
    assert done.returncode == 0, done.stdout + done.stderr
    export, board = _check_train_and_its_commands(run, work, environ)
    assert export.startswith(f"{script} export --config tiny "), export
    assert board.startswith(f"{env}/bin/python -m tensorboard.main --logdir "), board
  finally:
    wheel_build.pip("uninstall", "-y", "tensorflow-datasets", python=env / "bin" / "python")


def test_every_printed_command_runs_as_printed_from_a_clone(tmp_path):
  """This clone's Python (its .venv not active): train's commands, and the
  fix for a missing extra (pip's --dry-run: the shared venv is not changed)."""
  work = tmp_path / "work"
  work.mkdir()
  hidden = tmp_path / "hidden"  # find_spec("matplotlib") is None there.
  hidden.mkdir()
  (hidden / "sitecustomize.py").write_text(
      "import sys\nsys.modules['matplotlib'] = None\n")
  environ = {**os.environ, "PATH": f"/usr/bin{os.pathsep}/bin",
             "PYTHONPATH": str(ROOT)}
  python = sys.executable

  def run(args, extra_env=None):
    return _as_printed(f"{python} -m tpu_embed_ext {args}", work,
                       {**environ, **(extra_env or {})})
  out = run("train --config tiny --steps 10 --tpu none",
            {"PYTHONPATH": f"{hidden}{os.pathsep}{ROOT}"})
  assert out.returncode == 2, out.stderr
  fix = out.stderr.split("Fix: ", 1)[1].rsplit(".", 1)[0]
  bin_dir = os.path.dirname(python)
  assert fix == f"{bin_dir}/pip install -e '{ROOT}[data]'", fix
  installed = set(ROOT.glob("*.egg-info"))  # `make install`'s, if it ran
  done = _as_printed(fix, work, environ, then=("--dry-run",))
  assert done.returncode == 0, done.stdout + done.stderr
  assert set(ROOT.glob("*.egg-info")) == installed  # Nothing left in the clone.
  export, board = _check_train_and_its_commands(run, work, environ)
  assert export.startswith(f"{bin_dir}/tpu-embed export --config tiny "), export
  assert board.startswith(f"{bin_dir}/tensorboard --logdir "), board
