"""Test-session set-up: a private HOME, and logical CPU devices for the replica tests.

Hermetic: before TensorFlow, tfds, Keras or matplotlib is imported, HOME and
every cache or data directory they honour point into one temporary directory
of this session (removed at its end). No test reads or writes the user's
``~/tensorflow_datasets``, ``~/.keras``, ``~/.cache`` or ``~/.config``; a test
that needs a dataset builds it there (or in its own tmp_path), so no test
depends on another having run first, or on what a previous session left.
Subprocesses started by tests inherit these variables.

TensorFlow fixes its devices when it first initialises, so the split of the
one physical CPU into logical devices happens here, before any test runs.
Tests that need no replicas keep using the first device.
"""

import os
import shutil
import tempfile

_HOME = tempfile.mkdtemp(prefix="tpu_embed_ext-tests-home-")
HERMETIC_ENV = {
    "HOME": _HOME,
    "TFDS_DATA_DIR": os.path.join(_HOME, "tensorflow_datasets"),  # tfds's data_dir
    "KERAS_HOME": os.path.join(_HOME, ".keras"),                  # Keras's config/cache
    "MPLCONFIGDIR": os.path.join(_HOME, ".config", "matplotlib"),  # matplotlib's cache
    "XDG_CACHE_HOME": os.path.join(_HOME, ".cache"),
    "XDG_CONFIG_HOME": os.path.join(_HOME, ".config"),
}
os.environ.update(HERMETIC_ENV)

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position


def pytest_unconfigure(config):
  del config
  shutil.rmtree(_HOME, ignore_errors=True)

# --- native kernels (docs/native_kernels.md) ---------------------------------
# The kernel cache is repo-local (filled by `make install` / `make test`, or
# by the first test that needs it), never the user's ~/.cache.
os.environ.setdefault(
    "TPU_EMBED_EXT_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 ".cache"))
# The engine's test modules (test_engine_*.py and these) run twice: kernels
# forced native, then forced to TensorFlow ops ("[native]" / "[tf]" in test
# ids). Without the library (no compiler) the native runs are skipped, saying why.
KERNEL_PATH_MODULES = {"test_replicas", "test_layer",
                       "test_sparsecore_engine"}


def _runs_on_both_kernel_paths(module_name):
  name = module_name.rsplit(".", 1)[-1]
  return name.startswith("test_engine_") or name in KERNEL_PATH_MODULES


def pytest_generate_tests(metafunc):
  if _runs_on_both_kernel_paths(metafunc.module.__name__):
    metafunc.fixturenames.append("kernel_path")
    metafunc.parametrize("kernel_path", ["native", "tf"])


@pytest.fixture(autouse=True)
def _force_kernel_path(request, monkeypatch):
  """Sets TPU_EMBED_EXT_KERNELS for the tests parametrized above."""
  callspec = getattr(request.node, "callspec", None)
  path = callspec.params.get("kernel_path") if callspec else None
  if path is None:
    return
  from tpu_embed_ext.emulation import native  # pylint: disable=g-import-not-at-top
  if path == "native" and native.load() is None:
    pytest.skip(f"native kernels unavailable: {native.why_not()}")
  monkeypatch.setenv(native.ENV, path)


# --- end of native kernels ---------------------------------------------------

LOGICAL_CPUS = 8


def _split_cpu():
  cpu = tf.config.list_physical_devices("CPU")[0]
  if len(tf.config.get_logical_device_configuration(cpu) or []) >= LOGICAL_CPUS:
    return  # `pytest --emulate-tpu=N` (N > 8) split it first: keep all N.
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS)
  except RuntimeError:  # Already initialised (e.g. imported by a plugin).
    pass


_split_cpu()


@pytest.fixture(scope="session")
def tiny_data_dir():
  """A tfds data_dir holding ``synthetic_clicks/tiny``, built once per session."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tpu_embed_ext import data  # pylint: disable=g-import-not-at-top  # Registers it.
  del data
  path = HERMETIC_ENV["TFDS_DATA_DIR"]
  tfds.builder("synthetic_clicks/tiny", data_dir=path).download_and_prepare()
  return path


@pytest.fixture(scope="session")
def data_dir(tiny_data_dir):
  """``tiny_data_dir`` under the name the job tests pass on (test_cli.py
  builds its own, to keep tfds's progress bars out of its stderr)."""
  return tiny_data_dir


@pytest.fixture
def no_op_determinism():
  """Keras turns XLA off while op determinism is on (the training job sets it)."""
  from tensorflow.python.framework import config  # pylint: disable=g-import-not-at-top
  was_on = config.is_op_determinism_enabled()
  config.disable_op_determinism()
  yield
  if was_on:
    config.enable_op_determinism()
