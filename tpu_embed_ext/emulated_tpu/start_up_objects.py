"""Keeps Python's full garbage collections off TensorFlow's import-time objects.

Why (issue 34): once TensorFlow is imported and the emulation is set up, the
process holds about 320,000 objects that tracks the cyclic garbage collector
(TensorFlow's modules, op registries, dispatch tables; ours). Every full
(generation 2) collection walks all of them, and the interpreter's exit runs
several: in ``benchmarks/replica_suite.py`` at 8 replicas, the exit took
1.6-3.0 s after the script's last line, almost all of it those collections,
and the longest collection during the tests 0.33-0.72 s.

``freeze_start_up`` collects once, then moves every object that exists at
that point into the collector's permanent generation (``gc.freeze``):
collections and the exit skip them. What it does not change: a frozen
object is still freed when its reference count drops to zero, and
everything made afterwards (the user's script or tests, their files, their
cycles) is collected and finalized as under plain ``python``. What a frozen
object loses is only being collected as part of a reference cycle; the
collection just before the freeze leaves no cyclic garbage behind, and after
the benchmark's tests ``gc.unfreeze(); gc.collect()`` found none (0 objects),
so nothing of the set-up's is kept that plain Python would free.
Measured back to back at 8 replicas (load 3.4): exit 1.61-1.68 s -> 0.26 s,
longest collection 0.33-0.37 s -> 0.17-0.21 s. The cost: one collection
at start-up (0.2 s for 323,543 objects at 8 replicas, load 2).
"""

from __future__ import annotations

import gc

__all__ = ["freeze_start_up"]


def freeze_start_up() -> int:
  """Collects, then freezes every object alive now; returns how many."""
  gc.collect()
  gc.freeze()
  return gc.get_freeze_count()
