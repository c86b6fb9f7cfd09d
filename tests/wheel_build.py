"""The package as a user who has no clone gets it: a wheel built from a copy of
the sources (``pip wheel --no-deps``, no build isolation, no download), as
``make dist`` builds it. Used by test_wheel.py, test_notebooks.py and
test_printed_commands.py."""

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pip(*args, python=sys.executable, timeout=900):
  """``python -m pip ARGS`` quietly; its output on failure. Another
  environment's pip runs outside the clone, without PYTHONPATH: it must not
  see the clone's package (or an egg-info left there) as installed."""
  import os  # pylint: disable=g-import-not-at-top
  environ = dict(os.environ)
  cwd = None
  if str(python) != sys.executable:
    environ.pop("PYTHONPATH", None)
    cwd = os.path.dirname(os.path.dirname(str(python)))
  done = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check",
                         "-q", *args], capture_output=True, text=True, env=environ,
                        cwd=cwd, timeout=timeout, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
  return done


def build_wheel(root: pathlib.Path) -> pathlib.Path:
  """Builds the wheel under ``root`` (from a copy of the sources: no build
  files land in the clone); returns its path."""
  source = root / "source"
  source.mkdir()
  shutil.copy(ROOT / "setup.py", source)
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
  for name in ("tpu_embed_ext", "configs"):
    shutil.copytree(ROOT / name, source / name, ignore=ignore)
  pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
      str(root / "dist"), str(source))
  wheel, = (root / "dist").glob("tpu_embed_ext-*.whl")
  return wheel


def clean_env(env_dir: pathlib.Path, home: pathlib.Path, **extra) -> dict:
  """The environment of a user of ``env_dir`` with an empty HOME: that
  virtualenv's bin first on PATH (or none, ``env_dir=None``: not active),
  no PYTHONPATH, no cache or data directory of this test session."""
  import os  # pylint: disable=g-import-not-at-top
  drop = ("PYTHONPATH", "VIRTUAL_ENV", "TFDS_DATA_DIR", "KERAS_HOME",
          "MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
          "TPU_EMBED_EXT_CACHE_DIR", "JUPYTER_PATH", "JUPYTER_DATA_DIR")
  environ = {k: v for k, v in os.environ.items() if k not in drop}
  path = "/usr/local/bin:/usr/bin:/bin"
  environ.update(HOME=str(home), PATH=(f"{env_dir / 'bin'}:{path}" if env_dir
                                       else path))
  environ.update(extra)
  return environ


_OURS = ("tpu_embed_ext", "__editable__", "_tpu_embed_ext")


def borrow(env, *, without=()):
  """Lets the virtualenv ``env`` see this environment's distributions, less
  this package's and ``without``: a ``.pth`` naming a directory of symlinks
  (installing TensorFlow from the index takes minutes; test_wheel.py)."""
  import sysconfig  # pylint: disable=g-import-not-at-top
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
