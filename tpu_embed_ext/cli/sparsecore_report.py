"""The SparseCore part of ``plan``: stacks, padding, memory per chip."""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Dict, List, Optional, Sequence

import numpy as np

from tpu_embed_ext.cli import text_table
from tpu_embed_ext.host.memory import human_bytes
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore import limits
from tpu_embed_ext.sparsecore.topology import Topology

__all__ = ["DataReport", "StackingPlan", "feature_ids", "measure",
           "stacking_plan"]

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
    header = ("stack", "table", "rows x dim", "padded", "offset", "rotation",
              "table/chip", "slots/chip")
    rows = []
    for stack, tables in self.stacks.items():
      memory = self.stack_bytes_per_chip(stack)
      for i, l in enumerate(tables):
        rows.append((stack if i == 0 else "", l.table, f"{l.rows:,} x {l.dim}",
                     f"{l.padded_rows:,} x {l.padded_dim}", l.row_offset, l.rotation,
                     human_bytes(memory["parameters"]) if i == 0 else "",
                     human_bytes(memory["slots"]) if i == 0 else ""))
    rows.append((f"{len(self.stacks)} stacks", f"{len(self.layouts)} tables", "", "",
                 "", "", "", human_bytes(self.bytes_per_chip) + " per chip"))
    return "\n".join([f"SparseCore (TPUEmbeddingV2) layout on {self.topology}, "
                      f"{self.topology.num_sparse_cores} SparseCores:"]
                     + text_table.lines(header, rows))


def stacking_plan(feature_config, topology: Topology, slots: Dict[str, Sequence[str]],
                  optimizer=None, batch_size: int = 0) -> StackingPlan:
  """The stacking of ``feature_config`` on ``topology``, as TPUEmbeddingV2 does it."""
  layouts = sc_layout.compute_layouts(
      sc_layout.stacking_inputs(feature_config, optimizer, batch_size), topology)
  return StackingPlan(topology, layouts, {k: tuple(v) for k, v in slots.items()})


def feature_ids(feature_config, features) -> List[limits.FeatureIds]:
  """One step's ``FeatureIds`` in flat feature order (weights do not count).

  Samples as TPUEmbeddingV2 numbers them: the row of a ragged or sparse
  feature, every id its own sample for a dense one.
  """
  from tensorflow.python.util import nest  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = []
  for config, x in zip(nest.flatten(feature_config),
                       nest.flatten(features, expand_composites=False)):
    if isinstance(x, tf.RaggedTensor):
      samples, ids, count = x.value_rowids(), x.values, x.nrows()
    elif isinstance(x, tf.SparseTensor):
      samples, ids, count = x.indices[:, 0], x.values, x.dense_shape[0]
    else:
      ids = tf.reshape(x, [-1])
      samples, count = tf.range(tf.size(ids, out_type=tf.int64)), tf.size(ids)
    if config.output_shape:
      count = functools.reduce(operator.mul, config.output_shape)
    out.append(limits.FeatureIds(config.table.name, np.asarray(samples, np.int64),
                                 np.asarray(ids, np.int64), int(count)))
  return out


@dataclasses.dataclass
class DataReport:
  """Per stack, the most ids one step sent, against the configured limits."""
  topology: Topology
  steps: int
  limits: limits.Limits
  max_ids: Dict[str, int] = dataclasses.field(default_factory=dict)
  max_unique_ids: Dict[str, int] = dataclasses.field(default_factory=dict)
  max_chip_slots: Dict[str, int] = dataclasses.field(default_factory=dict)
  samples_per_chip: Dict[str, int] = dataclasses.field(default_factory=dict)
  source: str = ""
  """What was measured (``training_data.measure_training_data`` fills it in)."""

  def add(self, counts: Sequence[limits.StackCounts]) -> None:
    self.steps += 1
    for c in counts:
      self.max_ids[c.stack] = max(self.max_ids.get(c.stack, 0), int(c.ids.max()))
      self.max_unique_ids[c.stack] = max(self.max_unique_ids.get(c.stack, 0),
                                         int(c.unique_ids.max()))
      self.max_chip_slots[c.stack] = max(self.max_chip_slots.get(c.stack, 0),
                                         int(c.chip_slots.max()))
      self.samples_per_chip[c.stack] = c.samples_per_chip

  def suggested_ids_per_chip_per_sample(self) -> int:
    """The smallest ``max_ids_per_chip_per_sample`` that fits every measured step.

    Its id slots (x samples per chip) must be a multiple of 8 (the TPU checks).
    """
    need = 1
    for stack, slots in self.max_chip_slots.items():
      samples = self.samples_per_chip[stack]
      k = max(1, -(-slots // samples))
      while (k * samples) % 8:
        k += 1
      need = max(need, k)
    return need

  def __str__(self) -> str:
    header = ("stack", "max ids/SparseCore", "limit", "max unique", "limit",
              "max slots/chip", "capacity")
    rows = []
    for stack in self.max_ids:
      capacity = self.limits.max_ids_per_chip_per_sample * self.samples_per_chip[stack]
      flag = lambda v, lim: f"{v}" + (" OVER" if v > lim else "")
      rows.append((stack, flag(self.max_ids[stack], self.limits.max_ids(stack)),
                   self.limits.max_ids(stack),
                   flag(self.max_unique_ids[stack], self.limits.max_unique_ids(stack)),
                   self.limits.max_unique_ids(stack),
                   flag(self.max_chip_slots[stack], capacity), capacity))
    rows.append((f"{self.steps} steps", "", "", "", "", "", ""))
    ids = {s: _round8(v) for s, v in self.max_ids.items()}
    uniques = {s: _round8(v) for s, v in self.max_unique_ids.items()}
    return "\n".join(
        [f"SparseCore input per step on {self.topology} (source -> destination "
         "SparseCore, after deduplication):"]
        + ([f"measured on {self.source}."] if self.source else [])
        + text_table.lines(header, rows) +
        ["", "suggested SparseCoreEmbeddingConfig (measured maxima, rounded up to 8; "
         "add headroom for batches not sampled):",
         f"  max_ids_per_chip_per_sample={self.suggested_ids_per_chip_per_sample()},",
         f"  max_ids_per_table={ids},", f"  max_unique_ids_per_table={uniques}"])


def _round8(n: int) -> int:
  return max(8, -(-n // 8) * 8)


def measure(feature_config, batches, topology: Topology,
            limits_: Optional[limits.Limits] = None, batch_size: int = 0) -> DataReport:
  """Counts what each batch of ``batches`` sends to each SparseCore, as ``plan --data``.

  Limits are not enforced here: over-limit maxima are marked OVER.
  """
  limits_ = limits_ or limits.Limits()
  layouts = sc_layout.compute_layouts(
      sc_layout.stacking_inputs(feature_config, batch_size=batch_size), topology)
  report = DataReport(topology, 0, limits_)
  for features in batches:
    report.add(limits.count_ids(feature_ids(feature_config, features), layouts,
                                topology, limits_))
  return report
