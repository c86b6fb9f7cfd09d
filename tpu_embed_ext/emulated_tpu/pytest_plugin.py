"""pytest plugin (``pytest11`` entry point ``tpu_embed_ext``): tests on the emulated TPU.

* ``pytest --emulate-tpu=N`` (with ``--emulate-tpu-sparsecore``,
  ``--emulate-tpu-topology=T``, ``--emulate-tpu-no-xla``) runs the whole session inside
  ``emulate_tpu(N, ...)``. The logical CPU devices are configured before
  any ``conftest.py`` is loaded (a conftest that configures at least as many
  keeps its own), and the emulation is entered once they are loaded.
* The ``emulated_tpu`` fixture gives a test its own emulated TPU, shaped by
  ``@pytest.mark.emulate_tpu(replicas=2, sparsecore=False, topology=None,
  xla=True)``
  (default 8 replicas). In a session already under ``--emulate-tpu`` it
  yields the session's, and skips a test whose marker asks for another.

Inert unless asked: without ``--emulate-tpu`` nothing is imported beyond this
module (no TensorFlow) and nothing is patched.
"""

from __future__ import annotations

import contextlib

import pytest

_STACK = pytest.StashKey[contextlib.ExitStack]()


def pytest_addoption(parser):
  group = parser.getgroup("tpu_embed_ext", "emulated TPU (tpu_embed_ext)")
  group.addoption("--emulate-tpu", metavar="N", type=int, default=None,
                  dest="emulate_tpu",
                  help="Run the session on an emulated TPU of N replicas "
                  "(logical CPU devices): TensorFlow's TPUStrategy and "
                  "TPUEmbedding run on CPU with the TPU's math.")
  group.addoption("--emulate-tpu-sparsecore", action="store_true",
                  dest="emulate_tpu_sparsecore",
                  help="With --emulate-tpu: the TPU has SparseCore "
                  "(TPUEmbeddingV2).")
  group.addoption("--emulate-tpu-topology", metavar="T", default=None,
                  dest="emulate_tpu_topology",
                  help="With --emulate-tpu: the SparseCore topology (v5p:N...).")
  group.addoption("--emulate-tpu-no-xla", action="store_false", default=True,
                  dest="emulate_tpu_xla",
                  help="With --emulate-tpu: do not check that each replica's "
                  "step compiles with XLA, as a TPU's must (faster).")


def _session_shape(config):
  replicas = config.getoption("emulate_tpu")
  if replicas is None:
    return None
  return (replicas, config.getoption("emulate_tpu_sparsecore"),
          config.getoption("emulate_tpu_topology"),
          config.getoption("emulate_tpu_xla"))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
  """Configures the session's logical devices before conftests import TF."""
  del parser, args
  replicas = getattr(early_config.known_args_namespace, "emulate_tpu", None)
  if replicas:
    from tpu_embed_ext.emulated_tpu import strategy  # pylint: disable=g-import-not-at-top
    strategy.configure_logical_devices(replicas)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "emulate_tpu(replicas=8, sparsecore=False, topology=None, "
      "xla=True): "
      "the shape of the TPU the emulated_tpu fixture gives the test.")
  shape = _session_shape(config)
  if shape is None:
    return
  from tpu_embed_ext import emulated_tpu as lib, errors  # pylint: disable=g-import-not-at-top
  stack = contextlib.ExitStack()
  try:
    stack.enter_context(lib.emulate_tpu(*shape))
  except errors.Error as e:
    raise pytest.UsageError(f"--emulate-tpu={shape[0]}: {e}") from None
  config.stash[_STACK] = stack


def pytest_unconfigure(config):
  stack = config.stash.get(_STACK, None)
  if stack is not None:
    del config.stash[_STACK]
    stack.close()


@pytest.fixture
def emulated_tpu(request):
  """The test's emulated TPU (an ``Emulation``): see the module docstring."""
  from tpu_embed_ext import emulated_tpu as lib  # pylint: disable=g-import-not-at-top
  marker = request.node.get_closest_marker("emulate_tpu")
  wanted = dict(marker.kwargs) if marker else {}
  session = _session_shape(request.config)
  if session is not None:
    active = lib.current()
    asked = (wanted.get("replicas", active.replicas),
             wanted.get("sparsecore", active.sparsecore))
    if asked != (active.replicas, active.sparsecore):
      pytest.skip(f"needs emulate_tpu(replicas={asked[0]}, sparsecore={asked[1]}); "
                  f"the session runs --emulate-tpu={active.replicas}"
                  + (" --emulate-tpu-sparsecore" if active.sparsecore else ""))
    yield active
    return
  with lib.emulate_tpu(**wanted) as emulation:
    yield emulation
