"""Run by tests/test_emulated_tpu_programs.py as ``pytest --emulate-tpu=N THIS_FILE``.

Not collected by the suite (its name is not ``test_*.py``): it needs the
session to run under the plugin's emulation. ``TPU_PROGRAM_OUT`` is where the
program's checkpoint goes.
"""

import os
import runpy

import tensorflow as tf

from tpu_embed_ext import emulated_tpu as lib
from tpu_embed_ext.emulated_tpu import strategy

PROGRAM = runpy.run_path(os.path.join(os.path.dirname(__file__), "mid_level.py"),
                         run_name="mid_level")


def test_the_session_is_emulated():
  assert lib.is_active()
  assert tf.distribute.TPUStrategy is strategy.EmulatedTPUStrategy


def test_the_fixture_gives_the_sessions_tpu(emulated_tpu):
  assert emulated_tpu is lib.current()


def test_mid_level_program_trains():
  path = PROGRAM["train"](os.environ["TPU_PROGRAM_OUT"], 4)
  assert tf.train.latest_checkpoint(os.environ["TPU_PROGRAM_OUT"]) == path
