"""What the in-process benchmarks share: round-robin timing and their RESULTS.md section.

Contenders are stepped in turn on the same input (machine noise hits them
alike; every other round in reverse order), after a warm-up on every input of the pool (every shape traced, and
compiled, once).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from tpu_embed_ext.host import atomic

__all__ = ["time_steps", "write_section", "write_json"]


def time_steps(built: Dict[str, Tuple[Callable, Sequence]],
               repeats: int) -> Dict[str, Dict[str, float]]:
  """``{name: {median_ms, p10_ms, p90_ms}}`` of ``step(inputs[r % len])``, in turn."""
  for step, inputs in built.values():
    for x in inputs:  # warm-up
      step(x)
  times: Dict[str, List[float]] = {name: [] for name in built}
  names = list(built)
  for r in range(repeats):
    # Every other round in reverse: no contender always runs first.
    for name in (names if r % 2 == 0 else names[::-1]):
      step, inputs = built[name]
      start = time.perf_counter()
      step(inputs[r % len(inputs)])
      times[name].append((time.perf_counter() - start) * 1e3)
  return {name: {"median_ms": statistics.median(t),
                 "p10_ms": float(np.percentile(t, 10)),
                 "p90_ms": float(np.percentile(t, 90))}
          for name, t in times.items()}


def write_section(path: str, mark: str, table: str) -> None:
  """Replaces the text between the two ``mark`` lines of ``path`` (if it has them)."""
  if not os.path.exists(path):
    return
  text = open(path).read()
  if mark not in text:
    return
  head, _, rest = text.partition(mark)
  _, _, tail = rest.partition(mark)
  atomic.write_text(path, f"{head}{mark}\n{table}\n{mark}{tail}")


def write_json(path: str, **fields) -> None:
  """``fields`` with the machine's description, as JSON at ``path`` (atomically)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  os.makedirs(os.path.dirname(path), exist_ok=True)
  atomic.write_text(path, json.dumps(
      {"machine": platform.processor() or platform.machine(),
       "cpus": os.cpu_count(), "tensorflow": tf.__version__, **fields}, indent=1))
