"""The pytest plugin as a CI tool: misuse is a usage error, and
the ``emulated_tpu`` fixture does not depend on test order.

Each case runs ``python -m pytest`` on a small test file in its own
directory (the plugin is loaded through its ``pytest11`` entry point).
"""

import os
import subprocess
import sys

import pytest

LIMIT = 300  # seconds per pytest process; they take seconds.


def _pytest(tmp_path, source, *flags):
  (tmp_path / "test_user.py").write_text(source)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *flags,
       "test_user.py"], cwd=str(tmp_path), env=env, capture_output=True,
      text=True, timeout=LIMIT, check=False)


@pytest.mark.parametrize("flags, message", [
    (["--emulate-tpu-sparsecore"],
     "ERROR: --emulate-tpu-sparsecore needs --emulate-tpu=N (the session's "
     "emulated TPU of N replicas); without it --emulate-tpu-sparsecore would do "
     "nothing. Fix: add --emulate-tpu=N, or drop the flag."),
    (["--emulate-tpu-topology=v5p:8"],
     "ERROR: --emulate-tpu-topology needs --emulate-tpu=N (the session's "
     "emulated TPU of N replicas); without it --emulate-tpu-topology would do "
     "nothing. Fix: add --emulate-tpu=N, or drop the flag."),
    (["--emulate-tpu=3", "--emulate-tpu-topology=v5p:3"],
     "ERROR: --emulate-tpu-topology: topology 'v5p:3' is not a v5p slice: v5p "
     "slices have a multiple of 4 chips (2x2x1 = 4, 2x2x2 = 8, ...). Fix: e.g. "
     "v5p:4, or 3x4 for 3 chips of 4 SparseCores."),
    (["--emulate-tpu-no-xla"],
     "ERROR: --emulate-tpu-no-xla needs --emulate-tpu=N (the session's "
     "emulated TPU of N replicas); without it --emulate-tpu-no-xla would do "
     "nothing. Fix: add --emulate-tpu=N, or drop the flag."),
    (["--emulate-tpu-hosts=2"],
     "ERROR: --emulate-tpu-hosts needs --emulate-tpu=N (the session's "
     "emulated TPU of N replicas); without it --emulate-tpu-hosts would do "
     "nothing. Fix: add --emulate-tpu=N, or drop the flag."),
    (["--emulate-tpu=8", "--emulate-tpu-hosts=3"],
     "ERROR: --emulate-tpu-hosts=3: 8 replicas (--emulate-tpu counts every host's "
     "cores) do not split over 3 hosts, each feeding as many. Fix: --emulate-tpu a "
     "multiple of 3, e.g. --emulate-tpu=6 --emulate-tpu-hosts=3."),
    (["--emulate-tpu=8", "--emulate-tpu-topology=v5p:8", "--emulate-tpu-hosts=1"],
     "ERROR: --emulate-tpu-hosts=1 with --emulate-tpu-topology=v5p:8: that slice "
     "has 2 hosts (4 replicas each, as Cloud TPU's VMs hold them). Fix: leave "
     "--emulate-tpu-hosts out (the topology implies 2), or give --emulate-tpu=8 "
     "--emulate-tpu-hosts=1 --emulate-tpu-sparsecore without "
     "--emulate-tpu-topology."),
], ids=["sparsecore_without_emulate_tpu", "topology_without_emulate_tpu",
        "v5p_slice_of_3_chips", "no_xla_without_emulate_tpu",
        "hosts_without_emulate_tpu", "hosts_not_dividing", "hosts_other_than_the_topologys"])
def test_plugin_misuse_is_a_usage_error(flags, message, tmp_path):
  done = _pytest(tmp_path, "def test_nothing():\n  pass\n", *flags)
  assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error.
  assert done.stderr.strip() == message


_ORDER = """
import tensorflow as tf

def test_a_plain_test_initialises_tensorflow_first():
  assert int(tf.constant(2) + 1) == 3

def test_b_the_fixture_still_gets_its_replicas(emulated_tpu):
  assert emulated_tpu.replicas == 8
  assert tf.distribute.TPUStrategy().num_replicas_in_sync == 8
"""


def test_fixture_does_not_depend_on_test_order(tmp_path):
  done = _pytest(tmp_path, _ORDER)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "2 passed" in done.stdout


_EARLY = """
import tensorflow as tf

ONE = int(tf.constant(1))  # A TensorFlow op while pytest collects this module.

def test_wants_eight(emulated_tpu):
  pass
"""


def test_tensorflow_initialised_at_collection_is_named(tmp_path):
  done = _pytest(tmp_path, _EARLY)
  assert done.returncode == 1, done.stdout[-3000:]
  assert ("TensorFlow was initialised while pytest collected test_user.py (a "
          "TensorFlow op at import time), before the emulated_tpu fixture "
          "could set up its devices. Fix: move that op into a test or "
          "fixture, or run pytest --emulate-tpu=N.") in done.stdout


_XLA_SWITCH = """
import tpu_embed_ext as tee

def test_the_session_emulation_has_the_xla_switch():
  assert tee.emulated_tpu.current().xla is {expected}
"""


@pytest.mark.parametrize("flags, expected", [
    (["--emulate-tpu=2"], True), (["--emulate-tpu=2", "--emulate-tpu-no-xla"], False)],
    ids=["xla_on_by_default", "no_xla"])
def test_no_xla_reaches_the_session_emulation(flags, expected, tmp_path):
  done = _pytest(tmp_path, _XLA_SWITCH.format(expected=expected), *flags)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "1 passed" in done.stdout


_CYCLES = '''
import gc
import weakref


class InACycle:
  def __init__(self):
    self.me = self


def test_cycles_made_by_a_test_are_collected():
  # The session froze TensorFlow's start-up objects (start_up_objects.py)...
  assert gc.get_freeze_count() > 0
  # ...and a test's own reference cycles are still freed, as without the plugin.
  cycle = InACycle()
  alive = weakref.ref(cycle)
  del cycle
  gc.collect()
  assert alive() is None
'''


def test_a_tests_reference_cycles_are_still_collected(tmp_path):
  done = _pytest(tmp_path, _CYCLES, "--emulate-tpu=2")
  assert done.returncode == 0, done.stdout + done.stderr
  assert "1 passed" in done.stdout


_MARKER_XLA = """
import pytest
import tensorflow as tf
import tpu_embed_ext as tee
from tpu_embed_ext import emulated_tpu

@pytest.mark.emulate_tpu(replicas=2, xla=False)
def test_a_marker_switches_the_check_off(emulated_tpu):
  assert emulated_tpu.xla is False and tee.emulated_tpu.current().xla is False
  strategy = tf.distribute.TPUStrategy()
  assert strategy.extended._emulation.xla is False

def test_the_session_keeps_its_own(emulated_tpu):
  assert emulated_tpu.xla is True

def test_a_tests_own_emulate_tpu_of_the_sessions_shape_joins_it():
  with tee.emulate_tpu(replicas=2) as emulation:
    assert emulation is emulated_tpu.current()

def test_another_shape_names_the_fix():
  with pytest.raises(emulated_tpu.EmulationError) as refused:
    with tee.emulate_tpu(replicas=4):
      pass
  print("MESSAGE", refused.value)
"""


def test_a_markers_xla_and_a_tests_own_emulate_tpu_under_emulate_tpu(tmp_path):
  done = _pytest(tmp_path, _MARKER_XLA, "--emulate-tpu=2", "-s")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "4 passed" in done.stdout
  assert (
      "MESSAGE emulate_tpu(replicas=4) entered inside `pytest --emulate-tpu=2`, whose "
      "emulated TPU has 2 replicas: one emulation per process, and the program's own "
      "emulate_tpu joins it only with the same shape. Fix: use the emulated_tpu "
      "fixture with @pytest.mark.emulate_tpu(replicas=4) (skipped unless the session "
      "matches), or run the test with pytest --emulate-tpu=4, or without "
      "--emulate-tpu, where its emulate_tpu makes its own.\n") in done.stdout


_POD = """
import pytest
import tensorflow as tf
import tpu_embed_ext as tee

def test_the_session_is_a_pod(emulated_tpu):
  assert (emulated_tpu.replicas, emulated_tpu.hosts) == (4, 2)
  assert tf.distribute.TPUStrategy().extended.num_hosts == 2

@pytest.mark.emulate_tpu(replicas=4, hosts=2)
def test_a_marker_of_the_sessions_hosts(emulated_tpu):
  with tee.emulate_tpu(replicas=4) as joined:  # No hosts named: the session's.
    assert joined.hosts == 2

@pytest.mark.emulate_tpu(replicas=4, hosts=1)
def test_a_marker_of_other_hosts(emulated_tpu):
  pass
"""


def test_emulate_tpu_hosts_makes_the_session_a_pod(tmp_path):
  done = _pytest(tmp_path, _POD, "--emulate-tpu=4", "--emulate-tpu-hosts=2", "-rs")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "2 passed, 1 skipped" in done.stdout
  assert ("needs emulate_tpu(hosts=1); the session runs on `pytest --emulate-tpu=4 "
          "--emulate-tpu-hosts=2` (2 hosts)") in done.stdout
