"""Whether the tables and slots fit into host memory for CPU emulation."""

from __future__ import annotations

from typing import Optional

from tpu_embed_ext.host.memory import MemoryLimitError, available_memory
from tpu_embed_ext.host.memory import gib as _gib
from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["MemoryLimitError", "available_memory", "memory_shortfall", "check_memory"]


def memory_shortfall(spec: EmbeddingSpec, available: Optional[int] = None
                     ) -> Optional[str]:
  """Why the tables do not fit into host memory for CPU emulation, or None."""
  available = available_memory() if available is None else available
  # A table's parameters and each of its optimizer's slots: float32 rows x dim.
  sizes = {t.name: t.vocabulary_size * t.dim * 4
           * (1 + len(spec.optimizer_for(t.name).slot_names)) for t in spec.tables}
  total = sum(sizes.values())
  if total <= available:
    return None
  big = max(spec.tables, key=lambda t: sizes[t.name])
  return (f"the tables and optimizer slots need {_gib(total)} (float32) "
          f"but this machine has {_gib(available)} available; the "
          f"largest is table '{big.name}' ({big.vocabulary_size:,} x {big.dim}, "
          f"{len(spec.optimizer_for(big.name).slot_names)} slot(s): "
          f"{_gib(sizes[big.name])}). Fix: lower its vocabulary_size "
          "for CPU emulation, or train on a TPU (--tpu).")


def check_memory(spec: EmbeddingSpec, available: Optional[int] = None) -> None:
  """MemoryLimitError, naming the largest table, before anything is allocated."""
  why = memory_shortfall(spec, available)
  if why:
    raise MemoryLimitError(why)
