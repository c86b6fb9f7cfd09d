"""pytest plugin (``pytest11`` entry point ``tpu_embed_ext``): tests on the emulated TPU.

* ``pytest --emulate-tpu=N`` (with ``--emulate-tpu-sparsecore``,
  ``--emulate-tpu-topology=T``, ``--emulate-tpu-hosts=H``,
  ``--emulate-tpu-no-xla``) runs the whole session inside
  ``emulate_tpu(N, ...)``; N counts every host's cores. The logical CPU
  devices are configured before any ``conftest.py`` is loaded (a conftest
  that configures at least as many keeps its own), and the emulation is
  entered once they are loaded.
* The ``emulated_tpu`` fixture gives a test its own emulated TPU, shaped by
  ``@pytest.mark.emulate_tpu(replicas=2, sparsecore=False, topology=None,
  xla=True, hosts=None)`` (default 8 replicas; hosts: the topology's, else
  1). In a session already under ``--emulate-tpu`` it yields the session's,
  and skips a test whose marker asks for other replicas, SparseCore, slice
  or hosts (a marker without ``hosts`` takes the session's); a marker's
  ``xla`` is honoured (the session's emulation with the test's XLA check,
  ``session.xla_switched``).

Under the runner (``python -m tpu_embed_ext emulate -m pytest``) the fixture
gives the runner's emulation as it gives the session's, and a test's own
``emulate_tpu`` of the same shape joins either (``session.hosted_by``).

Order-independent: without ``--emulate-tpu``, the logical CPU devices the
collected ``emulated_tpu`` tests need (the most any marker asks for) are set
up once collection ends, before any test runs, so a fixture's result does
not depend on whether an earlier test already initialised TensorFlow. If
TensorFlow was initialised before that (a test module or conftest running an
op at import), the fixture's error names the module and the fix.

``--emulate-tpu-sparsecore``, ``--emulate-tpu-topology`` and
``--emulate-tpu-hosts`` without ``--emulate-tpu`` are usage errors (pytest's
``ERROR:`` line, status 4), as are hosts that do not divide the replicas or
differ from the topology's (``runner.check_hosts``);
``--emulate-tpu-topology`` must name a real slice (``v5p:3`` is refused), as
for the runner; a SparseCore generation's (v5p, v6e, tpu7x, ``CxS``) implies
``--emulate-tpu-sparsecore``, and one without SparseCore (v2, v3, v4, v5e)
refuses it.

Inert unless asked: without ``--emulate-tpu`` and without ``emulated_tpu``
tests nothing is imported beyond this module and the emulated TPU's
TensorFlow-free modules (no TensorFlow), and nothing is patched.
"""

from __future__ import annotations

import contextlib
import sys

import pytest

from tpu_embed_ext import emulated_tpu as lib, errors
from tpu_embed_ext.emulated_tpu import runner, session as session_lib, start_up_objects

_STACK = pytest.StashKey[contextlib.ExitStack]()
# Where TensorFlow was first seen initialised (a collected module's node id).
_EARLY_TF = pytest.StashKey[str]()


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
                  help="With --emulate-tpu: the TPU slice, GENERATION:CHIPS "
                  "(v5e:4, v4:4, v3:4 with 8 replicas: TPUEmbedding; v5p:8, "
                  "v6e:8, tpu7x:8 or 8x4: SparseCore), whose HBM build() "
                  "checks the tables against.")
  group.addoption("--emulate-tpu-hosts", metavar="H", type=int, default=None,
                  dest="emulate_tpu_hosts",
                  help="With --emulate-tpu: a pod slice of H hosts (TPU VMs), "
                  "each feeding N/H of the N cores from its own input pipeline "
                  "(default: the --emulate-tpu-topology's hosts, else 1).")
  group.addoption("--emulate-tpu-no-xla", action="store_true", default=False,
                  dest="emulate_tpu_no_xla",
                  help="With --emulate-tpu: do not check that each replica's "
                  "step compiles with XLA, as a TPU's must (faster).")


def _session_shape(config, options=None):
  """(replicas, sparsecore, topology, xla, hosts) of --emulate-tpu, or None;
  UsageError.

  ``options``: the parsed options (``config.option`` once configured; the
  early namespace before conftests load)."""
  options = options or config.option
  replicas = getattr(options, "emulate_tpu", None)
  sparsecore = getattr(options, "emulate_tpu_sparsecore", False)
  topology = getattr(options, "emulate_tpu_topology", None)
  no_xla = getattr(options, "emulate_tpu_no_xla", False)
  hosts = getattr(options, "emulate_tpu_hosts", None)
  if replicas is None:
    for flag, given in (("--emulate-tpu-sparsecore", sparsecore),
                        ("--emulate-tpu-topology", topology is not None),
                        ("--emulate-tpu-hosts", hosts is not None),
                        ("--emulate-tpu-no-xla", no_xla)):
      if given:
        raise pytest.UsageError(
            f"{flag} needs --emulate-tpu=N (the session's emulated TPU of N "
            f"replicas); without it {flag} would do nothing. Fix: add "
            "--emulate-tpu=N, or drop the flag.")
    return None
  slice_ = None
  if topology is not None:
    try:
      slice_ = runner.check_slice(topology)  # Without loading TensorFlow.
    except errors.Error as e:
      raise pytest.UsageError(f"--emulate-tpu-topology: {e}") from None
    if sparsecore and not slice_.sparsecore:
      raise pytest.UsageError(session_lib.no_sparsecore(
          "", "--emulate-tpu-sparsecore", slice_))
    sparsecore = slice_.sparsecore  # A SparseCore generation implies it.
  try:
    runner.check_hosts(hosts, replicas, slice_, _FLAGS, sep="=")
  except runner.UsageError as e:
    raise pytest.UsageError(str(e)) from None
  return replicas, sparsecore, topology, not no_xla, hosts


# check_hosts's names of hosts, replicas, topology and SparseCore here.
_FLAGS = ("--emulate-tpu-hosts", "--emulate-tpu", "--emulate-tpu-topology",
          "--emulate-tpu-sparsecore")


def _tensorflow_initialised() -> bool:
  context = sys.modules.get("tensorflow.python.eager.context")
  return bool(context and context.context()._initialized)  # pylint: disable=protected-access


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
  yield
  config = collector.config
  if _EARLY_TF not in config.stash and _tensorflow_initialised():
    config.stash[_EARLY_TF] = collector.nodeid or "conftest.py"


def pytest_collection_modifyitems(session, config, items):
  """Sets up the devices of the collected emulated_tpu tests, before any runs."""
  del session
  if config.getoption("emulate_tpu") is not None:
    return
  wanted = [_marker_kwargs(item).get("replicas", 8) for item in items
            if "emulated_tpu" in getattr(item, "fixturenames", ())]
  if wanted and not _tensorflow_initialised():
    _configure_devices(max(r for r in wanted if isinstance(r, int) and r > 0) or 8)


def _configure_devices(replicas: int) -> None:
  # Lazy: keeps TensorFlow off the plugin's import (every pytest run loads it).
  from tpu_embed_ext.emulated_tpu import devices  # pylint: disable=g-import-not-at-top
  devices.configure_logical_devices(replicas)


def _marker_kwargs(item) -> dict:
  marker = item.get_closest_marker("emulate_tpu")
  return dict(marker.kwargs) if marker else {}


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
  """Configures the session's logical devices before conftests import TF."""
  del parser, args
  known = early_config.known_args_namespace
  replicas = getattr(known, "emulate_tpu", None)
  if replicas and (getattr(known, "emulate_tpu_topology", None) is not None or
                   getattr(known, "emulate_tpu_hosts", None) is not None):
    _session_shape(early_config, known)  # A bad slice or hosts: before TF loads.
  if replicas:
    _configure_devices(replicas)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "emulate_tpu(replicas=8, sparsecore=False, topology=None, xla=True, "
      "hosts=None): "
      "the shape of the TPU the emulated_tpu fixture gives the test.")
  shape = _session_shape(config)
  if shape is None:
    return
  stack = contextlib.ExitStack()
  try:
    stack.enter_context(lib.emulate_tpu(*shape))
  except errors.Error as e:
    raise pytest.UsageError(f"--emulate-tpu={shape[0]}: {e}") from None
  config.stash[_STACK] = stack
  session_lib.hosted_by(
      f"`pytest --emulate-tpu={shape[0]}"
      + (f" --emulate-tpu-topology={shape[2]}" if shape[2] else
         (f" --emulate-tpu-hosts={shape[4]}" if (shape[4] or 1) > 1 else "")
         + (" --emulate-tpu-sparsecore" if shape[1] else "")) + "`",
      "use the emulated_tpu fixture with @pytest.mark.emulate_tpu(replicas="
      "{replicas}) (skipped unless the session matches), or run the test with "
      "pytest --emulate-tpu={replicas}, or without --emulate-tpu, where its "
      "emulate_tpu makes its own.")
  # TensorFlow's and the set-up's objects out of every full collection and of
  # the exit's (start_up_objects.py); the tests' own objects are untouched.
  start_up_objects.freeze_start_up()


def pytest_unconfigure(config):
  stack = config.stash.get(_STACK, None)
  if stack is not None:
    del config.stash[_STACK]
    stack.close()


def _same_slice(asked, active) -> bool:
  return active is None or (asked.generation.name, asked.chips) == (
      active.generation.name, active.chips)


@pytest.fixture
def emulated_tpu(request):
  """The test's emulated TPU (an ``Emulation``): see the module docstring."""
  wanted = _marker_kwargs(request.node)
  session = _session_shape(request.config)
  active = lib.current()
  # The session's emulation, or the runner's (`emulate -m pytest`): shared.
  if session is not None or (active is not None and session_lib.host()):
    asked = (wanted.get("replicas", active.replicas),
             wanted.get("sparsecore", active.sparsecore))
    if asked != (active.replicas, active.sparsecore):
      pytest.skip(f"needs emulate_tpu(replicas={asked[0]}, sparsecore={asked[1]}); "
                  f"the session runs on {session_lib.host()}")
    if wanted.get("topology") is not None and not _same_slice(
        runner.check_slice(wanted["topology"]), active.slice):
      pytest.skip(f"needs emulate_tpu(topology={wanted['topology']!r}); the "
                  f"session runs on {session_lib.host()} ({active.slice})")
    if wanted.get("hosts", None) not in (None, active.hosts):
      pytest.skip(f"needs emulate_tpu(hosts={wanted['hosts']}); the session "
                  f"runs on {session_lib.host()} ({active.hosts} "
                  f"host{'s' if active.hosts != 1 else ''})")
    if wanted.get("xla", active.xla) == active.xla:
      yield active
      return
    # The marker's XLA check, not the session's, for this test.
    with session_lib.xla_switched(wanted["xla"]) as switched:
      yield switched
    return
  try:
    context = lib.emulate_tpu(**wanted)
    emulation = context.__enter__()
  except lib.EmulationError as e:
    early = request.config.stash.get(_EARLY_TF, None)
    if early is None or "logical CPU devices" not in str(e):
      raise
    raise lib.EmulationError(
        f"{e} TensorFlow was initialised while pytest collected {early} (a "
        "TensorFlow op at import time), before the emulated_tpu fixture could "
        "set up its devices. Fix: move that op into a test or fixture, or run "
        "pytest --emulate-tpu=N.") from None
  try:
    yield emulation
  finally:
    context.__exit__(*sys.exc_info())
