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
from tpu_embed_ext.sparsecore import scratchpad as sc_scratchpad
from tpu_embed_ext.sparsecore.topology import Topology

__all__ = ["DataReport", "StackingPlan", "feature_ids", "measure",
           "stacking_plan"]


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
    table = first.bytes_per_chip(self.topology.sparsecores_per_chip)
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
  layouts: List[sc_layout.TableLayout] = dataclasses.field(default_factory=list)
  """The stacked tables measured (``measure`` fills it in): widths for E3001."""

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

  def proposed_limits(self) -> limits.Limits:
    """The measured maxima rounded up to 8, ``max_ids_per_table`` capped at the
    most the published E3001 rule accepts (``scratchpad.largest_max_ids``)."""
    cap = sc_scratchpad.largest_max_ids()
    return dataclasses.replace(
        self.limits,
        max_ids_per_table={s: min(_round8(v), cap) for s, v in self.max_ids.items()},
        max_unique_ids_per_table={s: _round8(v) for s, v in self.max_unique_ids.items()})

  def compile_verdicts(self, limits_: limits.Limits):
    """E3001's quantities per measured stack at ``limits_`` (``scratchpad.py``)."""
    nsc = self.topology.sparsecores_per_chip
    measured = [l for l in self.layouts if l.stack in self.max_ids]
    return sc_scratchpad.scratchpad(
        measured, {s: n // nsc for s, n in self.samples_per_chip.items()}, limits_,
        self.topology)

  def compile_lines(self) -> List[str]:
    """Whether the configured and the proposed limits compile (E3001)."""
    if not self.layouts:
      return []
    proposed = self.proposed_limits()
    header = ("stack", "width", "samples/SparseCore", "max_ids_per_table",
              "compiles?", "proposed", "compiles?")
    rows, notes = [], []
    for now, new in zip(self.compile_verdicts(self.limits),
                        self.compile_verdicts(proposed)):
      rows.append((now.stack, now.feature_width,
                   now.sample_count, now.max_ids, now.verdict, new.max_ids, new.verdict))
      if self.max_ids[now.stack] > now.largest_max_ids:
        notes.append(
            f"  {now.stack}: {self.max_ids[now.stack]:,} ids reached one SparseCore, "
            f"more than any max_ids_per_table that compiles (at most "
            f"{now.largest_max_ids:,}): use a smaller batch per chip or more chips.")
      if now.refused or new.verdict != sc_scratchpad.FITS:
        notes.append("  " + (now if now.refused else new).message())
    rows.append((f"{len(rows)} stacks", "", "", "",
                 f"{sum(r[4] == sc_scratchpad.REFUSED for r in rows)} refused", "",
                 f"{sum(r[6] == sc_scratchpad.REFUSED for r in rows)} refused"))
    return (["", f"compile-time limits (OpenXLA E3001: {sc_scratchpad.BYTES_PER_ID} B "
             f"per id of max_ids_per_table must fit SparseCore's "
             f"{sc_scratchpad.TOTAL_SPMEM_BYTES:,} B scratchpad; the fixed part is "
             "an estimate and only warns):"]
            + text_table.lines(header, rows) + notes)

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
    proposed = self.proposed_limits()
    ids, uniques = proposed.max_ids_per_table, proposed.max_unique_ids_per_table
    return "\n".join(
        [f"SparseCore input per step on {self.topology} (source -> destination "
         "SparseCore, after deduplication):"]
        + ([f"measured on {self.source}."] if self.source else [])
        + text_table.lines(header, rows) + self.compile_lines() +
        ["", "suggested SparseCoreEmbeddingConfig (measured maxima, rounded up to 8, "
         "max_ids_per_table at most "
         f"{sc_scratchpad.largest_max_ids():,} (E3001); add headroom for batches "
         "not sampled):",
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
  report = DataReport(topology, 0, limits_, layouts=layouts)
  for features in batches:
    report.add(limits.count_ids(feature_ids(feature_config, features), layouts,
                                topology, limits_))
  return report
