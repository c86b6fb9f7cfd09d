"""SparseCore's compile-time limits: the scratchpad (E3001) and the HBM stack (E3000).

What a TPU's compiler refuses for a ``TPUEmbeddingV2`` before its first step,
per stacked table, from the stacked tables (``layout.py``), the feature width
(the padded dim), the samples per SparseCore (the batch), the compiled limits
``max_ids_per_table`` / ``max_unique_ids_per_table`` (``limits.Limits``, by
stacked table name, 256 by default) and the topology. Pure Python.

Sources (published):

- OpenXLA error E3001 (openxla.org/xla/errors/error_3001): "No viable logical
  replica count for the embedding table with metadata: max_nz_per_row =
  141352, max_unique_nz_per_row = 8, feature_width = 8, sample_count = 204800
  (last tried split factor for vector splitting = 1, last tried split factor
  for sample dimension splitting = 1, fixed_size_allocation_bytes = 410880,
  row_dependent_size_allocation_bytes = 1696224, total_spmem_size_bytes =
  524288)": a stacked table's buffers must fit SparseCore's scratchpad
  (TileSpmem). ``max_nz_per_row`` is ``max_ids_per_table``,
  ``max_unique_nz_per_row`` ``max_unique_ids_per_table``, ``feature_width``
  the embedding dim, ``sample_count`` the lookups per SparseCore.
- OpenXLA error E3000 (openxla.org/xla/errors/error_3000; TensorFlow 2.21
  ships it under third_party/xla/docs/errors/): allocation failure in a memory
  space (0 Smem, 201 TileSpmem, 202 Spmem, 203 HBM, 204 sync flags); its
  sample allocates beyond 131,071 words of space 201: 131,072 words x 4 B =
  524,288 B, E3001's ``total_spmem_size_bytes``.
- OpenXLA's SparseCore deep dive (openxla.org/xla/sparsecore): SPMEM buffers
  are sized statically so that all data for a partition's ids up to max_ids /
  max_unique_ids fits (§7); an id travels as a COO triple, row id, column id
  and value (gain) (§3); the HBM stack per table is about
  ``(2 * feature_width + 1) * max_unique_nz_per_row * logical_replica_count *
  4`` B forward and ``3 * feature_width * max_unique_nz_per_row *
  logical_replica_count * 4`` B backward (§9).

Inferred, not published: in E3001's sample the row-dependent bytes are
exactly 12 B per id (141,352 x 12 = 1,696,224), one 4-byte row id, column id
and gain each. Since splitting the sample dimension cannot bound the ids one
partition receives (``max_nz_per_row`` is a per-partition bound already),
``12 x max_ids`` is needed at any split: a **lower bound**, and E3001 is
refused when it alone exceeds ``total_spmem_size_bytes``.

Estimated, not published: the compiler's formula for
``fixed_size_allocation_bytes``, and how it picks split factors. One sample
does not determine it (410,880 = 2 x 204,800 + 1,280); ``2 B x sample_count +
1,280 B``, scaled from that sample, is used only to **warn**, never to refuse.

E3000 in HBM (memory space 203): the forward and backward stack of every
stacked table at ``logical_replica_count = 1`` (its least) must fit in the
chip's HBM left after the stacked tables and their slots. The deep dive gives
the formula as approximate, so the check is the least the stack can take.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore import chips as chips_lib
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.topology import Topology

__all__ = ["StackScratchpad", "HBMStack", "scratchpad", "samples_per_sparsecore",
           "hbm_stack", "tables_and_slots_bytes", "generation_of", "largest_max_ids",
           "TOTAL_SPMEM_BYTES", "BYTES_PER_ID", "FITS", "WARNED", "REFUSED"]

TOTAL_SPMEM_BYTES = 524_288
"""E3001's ``total_spmem_size_bytes`` (= E3000's 131,072 words of TileSpmem)."""
BYTES_PER_ID = 12
"""Row-dependent bytes per id: inferred from E3001's sample (module doc)."""
FIXED_BYTES_PER_SAMPLE = 2
FIXED_BYTES = 1_280
"""The estimate of ``fixed_size_allocation_bytes``: ``2 x sample_count +
1,280``, scaled from E3001's sample (not published; warns only)."""
_FLOAT = 4
_WORD = 4
HBM_SPACE = 203

FITS, WARNED, REFUSED = "fits", "may not fit (warned)", "refused (E3001)"

_PUBLISHED = ("XLA:TPU compile permanent error. Compilation failure: No viable logical "
              "replica count for the embedding table with metadata: ")


def largest_max_ids(total: int = TOTAL_SPMEM_BYTES) -> int:
  """The largest ``max_ids_per_table`` whose ids alone fit the scratchpad."""
  return total // BYTES_PER_ID


@dataclasses.dataclass(frozen=True)
class StackScratchpad:
  """E3001's quantities for one stacked table."""
  stack: str
  tables: Tuple[str, ...]
  feature_width: int
  sample_count: int
  """Samples (lookups) per SparseCore of the stack, over its features."""
  max_ids: int
  max_unique_ids: int
  topology: str = ""
  total: int = TOTAL_SPMEM_BYTES

  @property
  def row_dependent_bytes(self) -> int:
    """``12 x max_nz_per_row`` (inferred, exact on OpenXLA's sample)."""
    return BYTES_PER_ID * self.max_ids

  @property
  def fixed_estimate_bytes(self) -> int:
    """Our estimate of ``fixed_size_allocation_bytes`` (not published)."""
    return FIXED_BYTES_PER_SAMPLE * self.sample_count + FIXED_BYTES

  @property
  def verdict(self) -> str:
    if self.row_dependent_bytes > self.total:
      return REFUSED
    if self.row_dependent_bytes + self.fixed_estimate_bytes > self.total:
      return WARNED
    return FITS

  @property
  def refused(self) -> bool:
    return self.verdict == REFUSED

  @property
  def largest_max_ids(self) -> int:
    """The most ``max_ids_per_table`` the published rule accepts."""
    return largest_max_ids(self.total)

  @property
  def max_ids_without_warning(self) -> int:
    """The most ``max_ids_per_table`` that fits with the estimated fixed part."""
    return max(0, (self.total - self.fixed_estimate_bytes) // BYTES_PER_ID)

  def _metadata(self) -> str:
    return (f"max_nz_per_row = {self.max_ids}, max_unique_nz_per_row = "
            f"{self.max_unique_ids}, feature_width = {self.feature_width}, "
            f"sample_count = {self.sample_count} (last tried split factor for vector "
            "splitting = 1, last tried split factor for sample dimension splitting = "
            f"1, fixed_size_allocation_bytes = {self.fixed_estimate_bytes}, "
            f"row_dependent_size_allocation_bytes = {self.row_dependent_bytes}, "
            f"total_spmem_size_bytes = {self.total})")

  def _where(self) -> str:
    tables = ", ".join(f"'{t}'" for t in self.tables)
    on = f" on {self.topology}" if self.topology else ""
    return f"stacked table '{self.stack}' (tables {tables}){on}"

  def _fix(self, most: int) -> str:
    return (f"Fix: lower max_ids_per_table['{self.stack}'] (the stacked table's "
            f"name) to at most {most:,}; if a batch sends more ids than that to "
            "one SparseCore, use a smaller batch per chip or more chips.")

  def message(self) -> str:
    """E3001 in XLA's words first, then ours (for a refusal or a warning)."""
    head = f"E3001: {_PUBLISHED}{self._metadata()}. "
    rows = (f"max_ids_per_table['{self.stack}'] = {self.max_ids:,} needs "
            f"row_dependent_size_allocation_bytes = {BYTES_PER_ID} B x "
            f"{self.max_ids:,} = {self.row_dependent_bytes:,} B")
    fixed = (f"fixed_size_allocation_bytes = {self.fixed_estimate_bytes:,} B is our "
             f"estimate ({FIXED_BYTES_PER_SAMPLE} B x sample_count + {FIXED_BYTES:,} "
             "B, scaled from OpenXLA's E3001 sample; the compiler's formula is not "
             "published)")
    if self.refused:
      return head + (
          f"(emulated TPUEmbeddingV2: {self._where()}: {rows} of SparseCore's "
          f"scratchpad (TileSpmem) for its ids alone, over total_spmem_size_bytes = "
          f"{self.total:,} at any split factor (12 B per id, a row id, column id "
          "and gain, is exact on OpenXLA's E3001 sample; splitting the sample "
          f"dimension does not bound the ids one SparseCore receives); {fixed}. "
          f"A TPU refuses this when it compiles the step. {self._fix(self.largest_max_ids)})")
    return head + (
        f"(emulated TPUEmbeddingV2, a warning, not a refusal: {self._where()}: "
        f"{rows}, plus {fixed}, is {self.row_dependent_bytes + self.fixed_estimate_bytes:,}"
        f" B, over total_spmem_size_bytes = {self.total:,}. The compiler may still "
        f"find a split that fits. {self._fix(self.max_ids_without_warning)})")


def samples_per_sparsecore(layouts: Sequence[sc_layout.TableLayout],
                           feature_samples: Sequence[Tuple[str, int]],
                           topology: Topology) -> Dict[str, int]:
  """``{stack: samples per SparseCore}`` from ``(table, global sample count)``
  per feature: as ``limits.py`` counts them, a stack's samples per chip are
  the sum over its features of ``samples / chips``, split evenly over the
  chip's SparseCores. Stacks no feature reaches: 0."""
  stack_of = {l.table: l.stack for l in layouts}
  out = {l.stack: 0 for l in layouts}
  for table, count in feature_samples:
    out[stack_of[table]] += int(count)
  per = topology.chips * topology.sparsecores_per_chip
  return {stack: n // per for stack, n in out.items()}


def scratchpad(layouts: Sequence[sc_layout.TableLayout], samples: Mapping[str, int],
               limits, topology: Optional[Topology] = None) -> List[StackScratchpad]:
  """E3001's quantities per stacked table, stacks in name order.

  ``samples``: ``{stack: samples per SparseCore}`` (``samples_per_sparsecore``);
  ``limits``: a ``limits.Limits`` (``max_ids`` / ``max_unique_ids`` by stack).
  """
  out = []
  for stack, members in sc_layout.layouts_by_stack(layouts).items():
    out.append(StackScratchpad(
        stack, tuple(l.table for l in members), members[0].padded_dim,
        int(samples.get(stack, 0)), int(limits.max_ids(stack)),
        int(limits.max_unique_ids(stack)), str(topology or "")))
  return out


def tables_and_slots_bytes(layouts: Sequence[sc_layout.TableLayout],
                           states: Mapping[str, int], topology: Topology) -> int:
  """Bytes of the stacked tables and their slots on one chip.

  ``states``: ``{table: 1 + slots}`` (a stack has one copy of each state of its
  first table's optimizer); a chip holds ``sparsecores_per_chip`` shards of
  ``rows_per_shard`` rows of the padded width (``hbm.for_tpu_embedding_v2``).
  """
  total = 0
  for members in sc_layout.layouts_by_stack(layouts).values():
    first = members[0]
    total += first.bytes_per_chip(topology.sparsecores_per_chip,
                                  int(states[first.table]))
  return total


def generation_of(topology: Topology) -> chips_lib.Generation:
  """The generation named by the topology ("v5p:4"), else the SparseCore
  generation with its SparseCores per chip and the most HBM (no false refusal)."""
  try:
    return chips_lib.parse_slice(topology.name, check=False).generation
  except errors.ConfigError:  # No name, or not a slice's.
    return chips_lib.sparsecore_generation(topology.sparsecores_per_chip)


@dataclasses.dataclass(frozen=True)
class HBMStack:
  """E3000 in HBM (memory space 203): SparseCore's stack against what the
  tables and slots leave of a chip's HBM."""
  stacks: Tuple[StackScratchpad, ...]
  used: int
  """Tables and slots per chip, bytes."""
  capacity: int
  generation: str = ""

  @staticmethod
  def forward(s: StackScratchpad) -> int:
    return (2 * s.feature_width + 1) * s.max_unique_ids * _FLOAT

  @staticmethod
  def backward(s: StackScratchpad) -> int:
    return 3 * s.feature_width * s.max_unique_ids * _FLOAT

  @property
  def need(self) -> int:
    """Forward + backward stack of every stacked table, logical_replica_count = 1."""
    return sum(self.forward(s) + self.backward(s) for s in self.stacks)

  @property
  def left(self) -> int:
    return self.capacity - self.used

  @property
  def refused(self) -> bool:
    return self.need > self.left

  def message(self) -> str:
    biggest = max(self.stacks, key=lambda s: self.forward(s) + self.backward(s))
    others = self.need - self.forward(biggest) - self.backward(biggest)
    per_id = (5 * biggest.feature_width + 1) * _FLOAT
    most = max(0, (self.left - others) // per_id)
    return (
        f"E3000: 'memref.alloca' op current allocation offset upper bound "
        f"({(self.used + self.need) // _WORD} words) exceeds the legitimate user "
        f"allocatable offset upper bound ({self.capacity // _WORD - 1} words) in "
        f"memory space {HBM_SPACE} when allocating {self.need // _WORD} words. "
        f"(emulated TPUEmbeddingV2: SparseCore's HBM stack at logical_replica_count "
        f"= 1, its least, is (2 x feature_width + 1) x max_unique_nz_per_row x 4 B "
        "forward + 3 x feature_width x max_unique_nz_per_row x 4 B backward per "
        f"stacked table (OpenXLA's SparseCore deep dive): {self.need:,} B; the "
        f"chip's {self.capacity:,} B of HBM ({self.generation}) less "
        f"{self.used:,} B of stacked tables and slots leaves {max(self.left, 0):,}"
        f" B. Largest: stacked table '{biggest.stack}' (tables "
        f"{', '.join(repr(t) for t in biggest.tables)}), "
        f"max_unique_ids_per_table['{biggest.stack}'] = {biggest.max_unique_ids:,},"
        f" feature_width = {biggest.feature_width}. Fix: lower "
        f"max_unique_ids_per_table['{biggest.stack}'] to at most {most:,}, or more "
        "chips (smaller table shards per chip).)")


def hbm_stack(stacks: Sequence[StackScratchpad], used: int, capacity: int,
              generation: str = "") -> HBMStack:
  """The HBM-stack check given the bytes already used on the chip."""
  return HBMStack(tuple(stacks), int(used), int(capacity), generation)
