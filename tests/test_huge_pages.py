"""Large tables on huge pages (emulation/native/huge_pages.cc).

The native path asks Linux to back every table and slot of 8 MiB or more
with 2 MiB pages. These tests check that it happens where the machine
allows it (the process's AnonHugePages grows by the table's size when the
engine builds), that the switch turns it off, and that values stay what
they are: a large table trained on the native path over several steps is
bit-identical to the TF-op path and to a numpy Adagrad written here, and a
rejected step (its undo log streamed past the caches) leaves it unchanged.
"""

import mmap
import os
import platform

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.emulation import native
from tests import references

api = tf.tpu.experimental.embedding

pytestmark = pytest.mark.skipif(
    native.load() is None, reason="native kernels unavailable")

VOCAB, DIM = 16384, 256  # 16 MiB a variable
MIB = 2**20
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode():
  """"always", "madvise" or "never" (None: not Linux, or no THP)."""
  try:
    with open(THP) as f:
      return f.read().split("[")[1].split("]")[0]
  except (OSError, IndexError):
    return None


def _anon_huge_mib():
  with open("/proc/self/smaps_rollup") as f:
    for line in f:
      if line.startswith("AnonHugePages:"):
        return int(line.split()[1]) / 1024
  return 0.0


def _machine_can_collapse():
  """Whether this machine, now, moves 8 MiB of pages in use onto huge pages
  (it needs free 2 MiB blocks): the tests below assert what the engine gets
  only where the kernel demonstrably grants it. Before Linux 6.1 there is no
  MADV_COLLAPSE: the probe's madvise fails."""
  if _thp_mode() in (None, "never"):
    return False
  region = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  try:
    region.write(b"\1" * (8 * MIB))
    before = _anon_huge_mib()
    region.madvise(mmap.MADV_HUGEPAGE)
    region.madvise(25)  # MADV_COLLAPSE
    return _anon_huge_mib() - before >= 2
  except (OSError, AttributeError, ValueError):
    return False
  finally:
    region.close()


needs_thp = pytest.mark.skipif(
    not _machine_can_collapse(),
    reason=f"transparent huge pages are {_thp_mode()} here, the kernel "
    f"({platform.release()}) has no MADV_COLLAPSE, or no 2 MiB page is free")


def _big_table_engine(kernels, seed=0):
  # TensorFlow makes the initial values: numpy asks for huge pages for its
  # own large arrays, which would count here.
  init = lambda shape, dtype=tf.float32: tf.random.stateless_uniform(
      shape, [seed, 0], -1.0, 1.0, dtype)
  table = api.TableConfig(VOCAB, DIM, name="big", combiner="sum", initializer=init)
  return tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")},
                          api.Adagrad(0.1, initial_accumulator_value=0.1),
                          kernels=kernels)


@needs_thp
def test_a_large_table_and_its_slot_land_on_huge_pages():
  emb = _big_table_engine("native")
  before = _anon_huge_mib()
  emb.build()
  grown = _anon_huge_mib() - before
  # Two 16 MiB variables; up to 2 MiB at each end of a buffer is not on a
  # 2 MiB boundary.
  assert grown >= 2 * (16 - 4), f"AnonHugePages grew by {grown} MiB"


@needs_thp
def test_huge_pages_off_by_the_environment_and_on_the_tf_path(monkeypatch):
  if _thp_mode() == "always":
    pytest.skip("with THP 'always' every large buffer may get huge pages")
  engines = [_big_table_engine("tf"), _big_table_engine("native", seed=1)]
  before = _anon_huge_mib()
  engines[0].build()
  monkeypatch.setenv(native.HUGE_PAGES_ENV, "0")
  emb = engines[1]
  emb.build()
  emb.enqueue({"f": tf.constant([1, 2, 3], tf.int64)})
  emb.apply_gradients({"f": tf.ones([3, DIM])})
  assert _anon_huge_mib() - before < 4, "huge pages were used though turned off"


def test_a_large_table_trains_bit_identically_and_rejects_unchanged():
  rng = np.random.RandomState(7)
  engines = {k: _big_table_engine(k) for k in ("native", "tf")}
  w = engines["native"].variables["big"]["parameters"].numpy()
  slots = references.initial_slots("adagrad", w.shape)
  for _ in range(5):
    ids = rng.randint(0, VOCAB, 64).astype(np.int64)
    ids[:8] = ids[8:16]  # repeated ids: per-id sums
    grads = rng.normal(size=(64, DIM)).astype(np.float32)
    for emb in engines.values():
      emb.enqueue({"f": tf.constant(ids)})
      emb.dequeue()
      emb.apply_gradients({"f": tf.constant(grads)})
    references.train_step("adagrad", w, slots, ids, grads, 0.1)
  native_vars = engines["native"].variables["big"]
  tf_vars = engines["tf"].variables["big"]
  for name in ("parameters", "accumulators"):
    np.testing.assert_array_equal(native_vars[name].numpy(), tf_vars[name].numpy())
  np.testing.assert_allclose(native_vars["parameters"].numpy(), w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(native_vars["accumulators"].numpy(),
                             slots["accumulators"], rtol=1e-5)

  # A step whose last update overflows is rejected: every row it had
  # already written in place comes back from the undo log.
  emb = engines["native"]
  before = {k: v.numpy() for k, v in native_vars.items()}
  ids = np.arange(0, 64 * 8, 8, dtype=np.int64)
  grads = np.ones((ids.size, DIM), np.float32)
  grads[-1] = 3e38  # finite, but acc + g*g overflows
  emb.enqueue({"f": tf.constant(ids)})
  emb.dequeue()
  with pytest.raises(errors.InputError, match="big"):
    emb.apply_gradients({"f": tf.constant(grads)})
  for k, v in native_vars.items():
    np.testing.assert_array_equal(v.numpy(), before[k])
  assert os.environ.get(native.HUGE_PAGES_ENV) is None
