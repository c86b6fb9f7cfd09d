"""Whether tables fit into this machine's memory, asked before allocating.

Below the spec, the engine and the job, so that each of them checks before
it allocates: a table of 2^40 rows otherwise fails deep inside TensorFlow
(``ResourceExhaustedError`` from ``build()``), naming no table.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

from tpu_embed_ext import errors

__all__ = ["MemoryLimitError", "available_memory", "gib", "check_tables",
           "memory_shortfall", "check_memory", "human_bytes"]


class MemoryLimitError(errors.Error, MemoryError):
  """The tables and slots would not fit into this machine's memory."""


def available_memory() -> int:
  """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gib(n: int) -> str:
  return f"{n / 2**30:,.1f} GiB"


def check_tables(tables: Sequence[Tuple[str, int, int, int]],
                 available: Optional[int] = None) -> None:
  """MemoryLimitError unless ``(name, rows, dim, slots)`` tables fit, in float32.

  Each table is its parameters and one variable of its shape per slot.
  """
  if not tables:
    return
  need = {name: 4 * rows * dim * (1 + slots) for name, rows, dim, slots in tables}
  total = sum(need.values())
  available = available_memory() if available is None else available
  if total <= available:
    return
  name, rows, dim, slots = max(tables, key=lambda t: need[t[0]])
  raise MemoryLimitError(
      f"table '{name}' ({rows:,} x {dim}, {slots} slot(s)) needs {gib(need[name])} "
      f"(float32), and all tables and slots {gib(total)}, but this machine has "
      f"{gib(available)} available; nothing was allocated. Fix: lower its "
      "vocabulary_size for CPU emulation, or run on a TPU.")


def memory_shortfall(spec, available: Optional[int] = None) -> Optional[str]:
  """Why an ``EmbeddingSpec``'s tables do not fit into host memory for CPU
  emulation, or None."""
  available = available_memory() if available is None else available
  # A table's parameters and each of its optimizer's slots: float32 rows x dim.
  sizes = {t.name: t.vocabulary_size * t.dim * 4
           * (1 + len(spec.optimizer_for(t.name).slot_names)) for t in spec.tables}
  total = sum(sizes.values())
  if total <= available:
    return None
  big = max(spec.tables, key=lambda t: sizes[t.name])
  return (f"the tables and optimizer slots need {gib(total)} (float32) "
          f"but this machine has {gib(available)} available; the "
          f"largest is table '{big.name}' ({big.vocabulary_size:,} x {big.dim}, "
          f"{len(spec.optimizer_for(big.name).slot_names)} slot(s): "
          f"{gib(sizes[big.name])}). Fix: lower its vocabulary_size "
          "for CPU emulation, or train on a TPU (--tpu).")


def check_memory(spec, available: Optional[int] = None) -> None:
  """MemoryLimitError, naming the largest table, before anything is allocated."""
  why = memory_shortfall(spec, available)
  if why:
    raise MemoryLimitError(why)


def human_bytes(n: int) -> str:
  """``n`` bytes as people read them: ``1.5 GiB``."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
    n /= 1024
