"""Whether the tables and slots fit into host memory for CPU emulation."""

from __future__ import annotations

from typing import Optional

from tpu_embed_ext.host_memory import MemoryLimitError, available_memory, gib as _gib
from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["MemoryLimitError", "available_memory", "memory_shortfall", "check_memory"]


def memory_shortfall(spec: EmbeddingSpec, available: Optional[int] = None
                     ) -> Optional[str]:
  """Why the tables do not fit into host memory for CPU emulation, or None."""
  # Through the package: importing the submodule `tpu_embed_ext.plan` first
  # would shadow the package's `plan` function with the module.
  import tpu_embed_ext
  available = available_memory() if available is None else available
  tables = tpu_embed_ext.plan(spec).tables
  total = sum(t.total_bytes for t in tables)
  if total <= available:
    return None
  big = max(tables, key=lambda t: t.total_bytes)
  return (f"the tables and optimizer slots need {_gib(total)} (float32) "
          f"but this machine has {_gib(available)} available; the "
          f"largest is table '{big.name}' ({big.rows:,} x {big.dim}, "
          f"{len(big.optimizer.slot_names)} slot(s): "
          f"{_gib(big.total_bytes)}). Fix: lower its vocabulary_size "
          "for CPU emulation, or train on a TPU (--tpu).")


def check_memory(spec: EmbeddingSpec, available: Optional[int] = None) -> None:
  """MemoryLimitError, naming the largest table, before anything is allocated."""
  why = memory_shortfall(spec, available)
  if why:
    raise MemoryLimitError(why)
