"""Leaves files open and ends with an uncaught exception.

Run as ``python leaves_files_open.py OUT`` and under ``emulate --replicas 8``:
both must leave the same files (Python's own exit does not finish every one
of them: what it leaves, the runner must leave too). It builds a TPUStrategy and a distributed
iterator (alive at exit), then leaves open a gzip file, a zip archive, an
HDF5 file and a NamedTemporaryFile, sets sys.excepthook and raises. Its
reference cycles are collected and finalized as under ``python``: one
dropped and collected during the run, one alive at exit (the runner keeps
only TensorFlow's start-up objects out of collections: start_up_objects.py).
"""

import gc
import gzip
import os
import sys
import tempfile
import weakref
import zipfile

import h5py
import numpy as np
import tensorflow as tf

out = sys.argv[1]
if os.environ.get("ON_EMULATED_TPU"):  # Under emulate: the TPU's entry points.
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
  tf.tpu.experimental.initialize_tpu_system(resolver)
  strategy = tf.distribute.TPUStrategy(resolver)
else:
  strategy = tf.distribute.get_strategy()
data = tf.data.Dataset.range(64).batch(16, drop_remainder=True).repeat()
iterator = iter(strategy.experimental_distribute_dataset(data))
first = strategy.experimental_local_results(next(iterator))

text_gz = gzip.open(os.path.join(out, "text.gz"), "wt")
text_gz.write("gzip text, never closed\n" * 100)
binary_gz = gzip.open(os.path.join(out, "binary.gz"), "wb")
binary_gz.write(b"gzip bytes, never closed\n" * 100)
archive = zipfile.ZipFile(os.path.join(out, "data.zip"), "w")
archive.writestr("inside.txt", "zip member, archive never closed\n")
h5 = h5py.File(os.path.join(out, "data.h5"), "w")
h5["table"] = np.arange(12.0).reshape(3, 4)
temporary = tempfile.NamedTemporaryFile(dir=out, prefix="temporary-",
                                        suffix=".txt", delete=True)
temporary.write(b"deleted at exit")
temporary.flush()


class InACycle:
  """Refers to itself: only the cyclic collector frees it."""

  def __init__(self, name):
    # Its own reference to open: at exit, module globals may be gone.
    self.me, self.path, self.open = self, os.path.join(out, name), open

  def __del__(self):
    with self.open(self.path, "w") as f:
      f.write("finalized\n")


dropped = InACycle("cycle-collected-during-the-run.txt")
alive = weakref.ref(dropped)
del dropped
gc.collect()
if alive() is None:
  open(os.path.join(out, "cycle-freed-by-gc.collect.txt"), "w").close()
at_exit = InACycle("cycle-finalized-at-exit.txt")


def hook(kind, value, traceback):
  with open(os.path.join(out, "excepthook.txt"), "w") as f:
    f.write(f"{kind.__name__}: {value}\n")


sys.excepthook = hook
raise RuntimeError(f"the end, {sum(len(x) for x in first)} examples in the first batch")
