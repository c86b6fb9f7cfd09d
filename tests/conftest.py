"""Test-session set-up: logical CPU devices for the replica tests.

TensorFlow fixes its devices when it first initialises, so the split of the
one physical CPU into logical devices happens here, before any test runs.
Tests that need no replicas keep using the first device.
"""

import os

import pytest
import tensorflow as tf

# --- native kernels (docs/native_kernels.md) ---------------------------------
# The kernel cache is repo-local (filled by `make install` / `make test`, or
# by the first test that needs it), never the user's ~/.cache.
os.environ.setdefault(
    "TPU_EMBED_EXT_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 ".cache"))
# The engine's test modules run twice: kernels forced native, then forced to
# TensorFlow ops ("[native]" / "[tf]" in test ids). Without the library (no
# compiler) the native runs are skipped, saying why.
KERNEL_PATH_MODULES = {"test_engine", "test_engine_contract", "test_replicas",
                       "test_parity", "test_layer", "test_sparsecore_engine"}


def pytest_generate_tests(metafunc):
  if metafunc.module.__name__.rsplit(".", 1)[-1] in KERNEL_PATH_MODULES:
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
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS)
  except RuntimeError:  # Already initialised (e.g. imported by a plugin).
    pass


_split_cpu()


@pytest.fixture
def no_op_determinism():
  """Keras turns XLA off while op determinism is on (the training job sets it)."""
  from tensorflow.python.framework import config  # pylint: disable=g-import-not-at-top
  was_on = config.is_op_determinism_enabled()
  config.disable_op_determinism()
  yield
  if was_on:
    config.enable_op_determinism()
