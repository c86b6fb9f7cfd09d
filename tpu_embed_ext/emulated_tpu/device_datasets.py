"""Distributed datasets of the emulated TPU, without tf.data autotuning threads.

``strategy.experimental_distribute_dataset`` and
``distribute_datasets_from_function`` (``MirroredStrategy``'s, which the
emulated ``TPUStrategy`` is) feed the replicas through a
``MultiDeviceIterator``: one host iterator deals the elements round-robin to
one small dataset per replica (``multi_device_iterator_ops.
_create_device_dataset``: a generator reading the host buffer, then a
``prefetch`` of one element). Each of those is iterated by its own tf.data
``RootDataset`` iterator, and by default each starts an autotuning thread
(``Model::OptimizeLoop``) that has nothing to tune there (a fixed buffer of
one).

Why it matters (issue 34): freeing such an iterator joins that thread in
``RootDataset::Iterator::~Iterator``. Under ``emulate --replicas 8`` (9 such
iterators per distributed iterator), TensorFlow's own test file
``tpu_embedding_v2_valid_input_test.py`` hung there in 2 runs of 2: the main
thread, tracing the next test and holding the GIL, freed an old iterator and
waited in ``UnboundedThreadPool::LogicalThreadWrapper::~LogicalThreadWrapper``
at 0% CPU (minutes; killed after 12 min in one run), while every
``OptimizeLoop`` thread slept in its condition variable (gdb: all 59
threads). The same file with autotuning off on these per-replica datasets
ran through (9 tests, 70 s). With autotuning off on the per-replica datasets
only, the wait moved to the host side: the last per-replica iterator freed
the ``MultiDeviceIterator``, whose host ``RootDataset`` iterator waited for
its own autotuning thread (a 17.6 s collection, then a hang). So both ends
run without it:

* ``create_device_dataset``: TensorFlow's per-replica dataset with
  ``options.autotune.enabled = False`` (patched in by ``patching.PATCHES``
  while the emulation is active);
* ``without_autotuning``: the host dataset the emulated strategy distributes
  (``strategy.EmulatedTPUExtended``), the same elements in the same order;
  only the speed of ``AUTOTUNE`` parallelism and buffers can change, which a
  CPU run does not predict anyway.

Which element goes to which replica stays TensorFlow's own round-robin
(``tests/test_emulated_tpu.py`` compares with a plain ``MirroredStrategy``).
"""

from __future__ import annotations

import tensorflow as tf

from tpu_embed_ext.emulated_tpu import patching

__all__ = ["create_device_dataset", "without_autotuning"]

_MODULE = "tensorflow.python.data.ops.multi_device_iterator_ops"


def without_autotuning(dataset):
  """``dataset`` with ``options.autotune.enabled = False`` (see above)."""
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.with_options(options)


def create_device_dataset(*args, **kwargs):
  """TensorFlow's per-replica dataset, with autotuning off (see above)."""
  return without_autotuning(
      patching.original(_MODULE, "_create_device_dataset")(*args, **kwargs))
