"""The SparseCore part of ``plan``: stacks, padding, memory per chip."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.topology import Topology

__all__ = ["StackingPlan", "stacking_plan"]

_BYTES_PER_FLOAT = 4


@dataclasses.dataclass(frozen=True)
class StackingPlan:
  """The stacked variables ``TPUEmbeddingV2`` creates on ``topology``.

  ``slots`` gives each table's optimizer slot names: a stack has one copy of
  each slot of its first table's optimizer (tables stack only when their
  optimizers are equal).
  """
  topology: Topology
  layouts: List[sc_layout.TableLayout]
  slots: Dict[str, tuple]

  @property
  def stacks(self) -> Dict[str, List[sc_layout.TableLayout]]:
    return sc_layout.layouts_by_stack(self.layouts)

  def stack_bytes_per_chip(self, stack: str) -> Dict[str, int]:
    """``{"parameters": bytes, "slots": bytes}`` of ``stack`` on one chip."""
    first = self.stacks[stack][0]
    table = (first.rows_per_shard * self.topology.sparsecores_per_chip
             * first.padded_dim * _BYTES_PER_FLOAT)
    return {"parameters": table, "slots": table * len(self.slots[first.table])}

  @property
  def bytes_per_chip(self) -> int:
    return sum(sum(self.stack_bytes_per_chip(s).values()) for s in self.stacks)

  def __str__(self) -> str:
    from tpu_embed_ext.plan import _human, _table_lines  # pylint: disable=g-import-not-at-top
    header = ("stack", "table", "rows x dim", "padded", "offset", "rotation",
              "table/chip", "slots/chip")
    rows = []
    for stack, tables in self.stacks.items():
      memory = self.stack_bytes_per_chip(stack)
      for i, l in enumerate(tables):
        rows.append((stack if i == 0 else "", l.table, f"{l.rows:,} x {l.dim}",
                     f"{l.padded_rows:,} x {l.padded_dim}", l.row_offset, l.rotation,
                     _human(memory["parameters"]) if i == 0 else "",
                     _human(memory["slots"]) if i == 0 else ""))
    rows.append((f"{len(self.stacks)} stacks", f"{len(self.layouts)} tables", "", "",
                 "", "", "", _human(self.bytes_per_chip) + " per chip"))
    return "\n".join([f"SparseCore (TPUEmbeddingV2) layout on {self.topology}, "
                      f"{self.topology.num_sparse_cores} SparseCores:"]
                     + _table_lines(header, rows))


def stacking_plan(feature_config, topology: Topology, slots: Dict[str, Sequence[str]],
                  optimizer=None, batch_size: int = 0) -> StackingPlan:
  """The stacking of ``feature_config`` on ``topology``, as TPUEmbeddingV2 does it."""
  layouts = sc_layout.compute_layouts(
      sc_layout.stacking_inputs(feature_config, optimizer, batch_size), topology)
  return StackingPlan(topology, layouts, {k: tuple(v) for k, v in slots.items()})
