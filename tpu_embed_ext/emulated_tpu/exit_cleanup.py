"""At exit: the tf.data iterators still alive are kept from their destructors.

``python -m tpu_embed_ext emulate`` ends the process as Python does (the
script's ``atexit`` handlers, threads, finalizers, ``sys.excepthook``). Of
Python's finalization, one part is slow at 8 replicas and observable by
nobody: TensorFlow's C++ destructors of the ``tf.data`` iterators still
alive (each stops its prefetch threads; a distributed iterator has one per
replica and one on the host). ``keep_iterators`` runs last among the
``atexit`` handlers (the runner registers it before the script runs) and
gives every live ``OwnedIterator`` / ``OwnedMultiDeviceIterator`` one extra
reference, so the interpreter's final collection passes them by; the process
then ends with the memory they hold, as ``os._exit`` would, while every
other object is finalized as usual. ``--finalize`` turns this off.
"""

from __future__ import annotations

import ctypes
import gc
import sys

__all__ = ["keep_iterators"]

_KEPT: list = []


def keep_iterators() -> int:
  """Keeps the live tf.data iterators from their destructors; returns how many."""
  if "tensorflow" not in sys.modules:
    return 0
  from tensorflow.python.data.ops import iterator_ops, multi_device_iterator_ops  # pylint: disable=g-import-not-at-top
  kinds = (iterator_ops.OwnedIterator,
           multi_device_iterator_ops.OwnedMultiDeviceIterator)
  found = [obj for obj in gc.get_objects() if isinstance(obj, kinds)]
  _KEPT.extend(found)
  # A reference no module owns: the final collection and the clearing of
  # module dictionaries leave the list (and what it holds) alive.
  ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))
  return len(found)
