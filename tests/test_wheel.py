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
import shlex
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tests import wheel_build

ROOT = pathlib.Path(__file__).resolve().parent.parent
_OURS = ("tpu_embed_ext", "__editable__", "_tpu_embed_ext")


def _pip(*args):
  wheel_build.pip(*args, timeout=600)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """A virtualenv with the wheel installed (and nothing else of its own)."""
  root = tmp_path_factory.mktemp("wheel")
  wheel = wheel_build.build_wheel(root)
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")],
                 check=True, timeout=600)
  python = root / "env" / "bin" / "python"
  _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
  return root / "env"


def _borrow(env, *, without=()):
  """Points the env's .pth at this environment's distributions, less ``without``."""
  site = subprocess.run(
      [str(env / "bin" / "python"), "-c", "import sysconfig; "
       "print(sysconfig.get_paths()['purelib'])"],
      check=True, capture_output=True, text=True).stdout.strip()
  deps = env / "borrowed"
  shutil.rmtree(deps, ignore_errors=True)
  deps.mkdir()
  here = pathlib.Path(sysconfig.get_paths()["purelib"])
  for entry in here.iterdir():
    name = entry.name.lower()
    if name.startswith(_OURS) or name.endswith(".pth") or name.startswith(without):
      continue
    (deps / entry.name).symlink_to(entry)
  pathlib.Path(site, "borrowed.pth").write_text(f"{deps}\n")


def _run(env, work, command):
  environ = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0",
             "PATH": f"{env / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"}
  environ.pop("PYTHONPATH", None)
  return subprocess.run(shlex.split(command), cwd=work, env=environ,
                        capture_output=True, text=True, timeout=900)


def test_the_installed_wheel_works_from_an_empty_directory(env, tmp_path):
  _borrow(env)
  where = _run(env, tmp_path, "python -c 'import tpu_embed_ext; "
                              "print(tpu_embed_ext.__file__)'")
  assert where.stdout.startswith(str(env)), where.stdout + where.stderr
  out = _run(env, tmp_path, "tpu-embed plan --config tiny")
  assert (out.returncode, out.stderr) == (0, ""), out.stdout + out.stderr
  assert "t_c25" in out.stdout
  out = _run(env, tmp_path, "tpu-embed train --config tiny --steps 10 --tpu none")
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
     "installed. Fix: pip install 'tpu_embed_ext[cpu]' (or [tf], or [tpu] on a Cloud "
     "TPU VM)."),
    ("tensorflow_datasets", "train --config tiny --steps 10", "train needs "
     "tensorflow_datasets (the training data), which is not installed. Fix: pip "
     "install 'tpu_embed_ext[data]'."),
], ids=["no_tensorflow", "cpu_without_data"])
def test_a_missing_extra_is_named_and_nothing_is_made(env, tmp_path, without, command,
                                                      message):
  """``pip install .`` (no TensorFlow), or ``[cpu]`` without ``[data]``."""
  _borrow(env, without=(without,))
  out = _run(env, tmp_path, f"tpu-embed {command}")
  assert (out.returncode, out.stdout, out.stderr) == (2, "", f"error: {message}\n")
  assert os.listdir(tmp_path) == []
