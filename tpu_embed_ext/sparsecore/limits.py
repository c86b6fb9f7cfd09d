"""SparseCore's per-step input limits, counted and enforced as its preprocessing does.

Source: tensorflow/core/tpu/kernels/sparse_core_preprocess_ops.cc, the ops
``TPUEmbeddingV2.enqueue`` runs on the host (TF 2.21):

- ``ConvertToListOfSparseCoreCooTensors``, per feature: sample ``s`` of a chip's
  batch goes to that chip's SparseCore ``s // (samples / sparsecores_per_chip)``
  (the *source*); id ``i`` becomes the stacked column ``c = shard + S * position``
  (``layout.TableLayout.shard_and_position``), which lives on SparseCore ``c % S``
  (the *destination*, one of ``S = chips * sparsecores_per_chip``).
- ``SortListOfSparseCoreCooTensors``, per source SparseCore: (sample, column)
  pairs are deduplicated; per destination it counts the pairs (ids) and the
  distinct columns (unique ids), and fails if either exceeds
  ``max_ids_per_table[stack]`` / ``max_unique_ids_per_table[stack]`` (256 by
  default; keyed by the *stacked* table's name). It never drops.
- ``ConvertToSparseCoreCsrWrappedCooTensor``, per chip: the pairs are packed
  source by source, destination by destination (each segment padded to a
  multiple of 8), in table-in-stack order, then column, then input order,
  into ``max_ids_per_chip_per_sample * samples`` slots. What does not fit
  fails, or with ``allow_id_dropping`` is dropped: the tail of the segment
  that overflows and every later segment.

The CPU batch is the global batch: chip ``k`` of ``chips`` gets the ``k``-th
contiguous slice of each feature's samples, as a distributed dataset splits it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.topology import Topology

__all__ = ["FeatureIds", "Limits", "StackCounts", "check_limits", "count_ids",
           "DEFAULT_MAX_IDS", "DEFAULT_MAX_IDS_PER_CHIP_PER_SAMPLE"]

# TPUEmbeddingV2.DEFAULT_MAX_IDS_PER_TABLE / _UNIQUE_IDS_PER_TABLE and
# SparseCoreEmbeddingConfig.max_ids_per_chip_per_sample.
DEFAULT_MAX_IDS = 256
DEFAULT_MAX_IDS_PER_CHIP_PER_SAMPLE = 64
_XLA_PAD = 8


class FeatureIds(NamedTuple):
  """One feature's ids in one step (the global batch)."""
  table: str
  samples: np.ndarray
  """Sample of each id, in ``[0, sample_count)``, non-decreasing."""
  ids: np.ndarray
  sample_count: int
  """Samples of the feature (``prod(output_shape)``: batch, x length for sequences)."""
  name: str = ""
  """The feature's path, for errors."""

  def where(self, i: int) -> str:
    return f"feature '{self.name}' (table '{self.table}')" if self.name else (
        f"feature {i} (table '{self.table}')")


@dataclasses.dataclass(frozen=True)
class Limits:
  """``tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig``'s limits."""
  max_ids_per_chip_per_sample: int = DEFAULT_MAX_IDS_PER_CHIP_PER_SAMPLE
  max_ids_per_table: Optional[Mapping[str, int]] = None
  """By stacked table name, as TPUEmbeddingV2 reads it; 256 for others."""
  max_unique_ids_per_table: Optional[Mapping[str, int]] = None
  allow_id_dropping: bool = False

  @classmethod
  def from_config(cls, config) -> "Limits":
    """From a ``SparseCoreEmbeddingConfig`` (or None: its defaults)."""
    if config is None:
      return cls()
    # Values may be the scalar tensors compute_sparse_core_stats returns.
    def ints(limits):
      return None if limits is None else {k: int(v) for k, v in limits.items()}
    return cls(config.max_ids_per_chip_per_sample, ints(config.max_ids_per_table),
               ints(config.max_unique_ids_per_table), config.allow_id_dropping)

  def max_ids(self, stack: str) -> int:
    return (self.max_ids_per_table or {}).get(stack, DEFAULT_MAX_IDS)

  def max_unique_ids(self, stack: str) -> int:
    return (self.max_unique_ids_per_table or {}).get(stack, DEFAULT_MAX_IDS)


@dataclasses.dataclass
class StackCounts:
  """What one stacked table sends to SparseCores in one step."""
  stack: str
  ids: np.ndarray
  """[chips, source SparseCore of the chip, destination SparseCore]: deduplicated ids."""
  unique_ids: np.ndarray
  """Same shape: distinct rows."""
  chip_slots: np.ndarray
  """[chips]: slots the packed ids take on each chip (segments padded to 8;
  after dropping, at most ``chip_capacity``)."""
  chip_capacity: int
  """``max_ids_per_chip_per_sample`` x the chip's samples of this stack."""
  samples_per_chip: int
  dropped: int = 0


class _Pairs(NamedTuple):
  """Deduplicated (sample, column) pairs of one stack on one chip, in packing order."""
  source: np.ndarray
  destination: np.ndarray
  column: np.ndarray
  spans: List[tuple]
  """Per member feature: (feature, first occurrence on this chip, pair of each)."""


def _stack_members(features, layouts):
  by_table = {l.table: l for l in layouts}
  members: Dict[str, List[int]] = {}
  for i, f in enumerate(features):
    if f.table not in by_table:
      raise errors.InputError(
          f"{f.where(i)}: the table has no SparseCore layout. "
          f"Fix: compute the layouts for every table ({sorted(by_table)}).")
    members.setdefault(by_table[f.table].stack, []).append(i)
  return by_table, members


def _chip_pairs(features, members, by_table, topology, chip) -> _Pairs:
  """The chip's pairs of one stack, deduplicated and in the TPU's packing order."""
  nsc, s = topology.sparsecores_per_chip, topology.num_sparse_cores
  stack_order = [l.table for l in by_table.values()
                 if l.stack == by_table[features[members[0]].table].stack]
  parts, spans = [], []
  for i in members:
    f = features[i]
    per_chip = f.sample_count // topology.chips
    lo, hi = np.searchsorted(f.samples, [chip * per_chip, (chip + 1) * per_chip])
    sample = np.asarray(f.samples[lo:hi], np.int64) - chip * per_chip
    shard, position = by_table[f.table].shard_and_position(f.ids[lo:hi])
    parts.append(np.stack([
        sample // (per_chip // nsc), shard, np.full(hi - lo, stack_order.index(f.table)),
        shard + s * position, np.full(hi - lo, i), np.arange(lo, hi), sample]))
    spans.append((i, lo, hi - lo))
  source, destination, table, column, feature, occurrence, sample = np.concatenate(
      parts, axis=1)
  # Packing order: source, destination, table in stack, column, then input
  # order. Samples are non-decreasing within a feature, so the occurrences of
  # one (feature, sample, column) pair are adjacent: the first one stays.
  order = np.lexsort((occurrence, feature, column, table, destination, source))
  f, c, smp = feature[order], column[order], sample[order]
  new = np.ones(len(order), bool)
  new[1:] = (f[1:] != f[:-1]) | (c[1:] != c[:-1]) | (smp[1:] != smp[:-1])
  pair = np.empty(len(order), np.int64)
  pair[order] = np.cumsum(new) - 1
  first = order[new]
  start, out_spans = 0, []
  for i, lo, n in spans:
    out_spans.append((i, lo, pair[start:start + n]))
    start += n
  return _Pairs(source[first], destination[first], column[first], out_spans)


def validate(features, topology):
  """The checks on the batch's layout (also run at trace time on static counts)."""
  s = topology.num_sparse_cores
  if s & (s - 1):
    raise errors.InputError(
        f"SparseCore preprocessing needs a power-of-two number of SparseCores, the "
        f"topology {topology} has {s} (ConvertToListOfSparseCoreCooTensors: "
        "num_sc_shards is not a power of two). Fix: use 2^k chips.")
  step = topology.chips * topology.sparsecores_per_chip
  for i, f in enumerate(features):
    if len(f.samples) and np.any(np.diff(f.samples) < 0):
      raise errors.InputError(
          f"{f.where(i)}: samples must be non-decreasing, as "
          "SparseCore's preprocessing requires (sorted SparseTensor indices). Fix: "
          "reorder the SparseTensor (tf.sparse.reorder).")
    if f.sample_count % step:
      raise errors.InputError(
          f"{f.where(i)} has {f.sample_count} samples, not a "
          f"multiple of {topology.chips} chips x {topology.sparsecores_per_chip} "
          "SparseCores per chip: the TPU splits each chip's batch evenly over its "
          "SparseCores. Fix: use a batch size divisible by "
          f"{step}.")


def count_ids(features: Sequence[FeatureIds], layouts: Sequence[sc_layout.TableLayout],
              topology: Topology, limits: Limits = Limits()) -> List[StackCounts]:
  """Ids and unique ids per (chip, source, destination SparseCore) of each stack."""
  return [c for c, _ in _count(features, layouts, topology, limits)]


def _count(features, layouts, topology, limits):
  validate(features, topology)
  by_table, members = _stack_members(features, layouts)
  nsc, s = topology.sparsecores_per_chip, topology.num_sparse_cores
  out = []
  for stack, idx in members.items():
    samples = sum(features[i].sample_count for i in idx) // topology.chips
    counts = StackCounts(
        stack, np.zeros((topology.chips, nsc, s), np.int64),
        np.zeros((topology.chips, nsc, s), np.int64), np.zeros(topology.chips, np.int64),
        limits.max_ids_per_chip_per_sample * samples, samples)
    chips = []
    for chip in range(topology.chips):
      pairs = _chip_pairs(features, idx, by_table, topology, chip)
      np.add.at(counts.ids[chip], (pairs.source, pairs.destination), 1)
      distinct = np.unique(np.stack([pairs.source, pairs.column]), axis=1)
      np.add.at(counts.unique_ids[chip], (distinct[0], distinct[1] % s), 1)
      segments = counts.ids[chip].ravel()
      counts.chip_slots[chip] = int((segments + -segments % _XLA_PAD).sum())
      chips.append(pairs)
    out.append((counts, chips))
  return out


def _pack(counts: StackCounts, chip: int, allow_dropping: bool):
  """Pairs kept on ``chip`` (a prefix count per segment) and the slots used."""
  capacity, used, kept = counts.chip_capacity, 0, []
  segments = counts.ids[chip].ravel()  # source-major, destination-minor
  for n in segments:
    if used + n > capacity:
      if not allow_dropping:
        return None, int(used), int(segments.sum() - sum(kept))
      kept.append(max(0, capacity - used))
      used = capacity
      continue
    kept.append(int(n))
    used += n
    used += -used % _XLA_PAD
  return np.array(kept), int(used), 0


def check_limits(features: Sequence[FeatureIds],
                 layouts: Sequence[sc_layout.TableLayout], topology: Topology,
                 limits: Limits = Limits()):
  """Checks one step's ids against SparseCore's limits, as its preprocessing does.

  Returns ``(counts, keep)``: ``counts`` a ``StackCounts`` per stack;
  ``keep[i]`` a boolean mask over feature ``i``'s ids, False for the ids
  SparseCore drops (only with ``allow_id_dropping``; duplicates of a kept
  (sample, id) pair are kept with it). Raises ``InputError`` naming the stack,
  the limit and the observed count where the TPU fails.
  """
  keep = [np.ones(len(f.ids), bool) for f in features]
  out = []
  for counts, chips in _count(features, layouts, topology, limits):
    for chip in range(topology.chips):
      for name, observed, limit in (
          ("ids", counts.ids[chip], limits.max_ids(counts.stack)),
          ("unique ids", counts.unique_ids[chip], limits.max_unique_ids(counts.stack))):
        over = np.argwhere(observed > limit)
        if len(over):
          src, dst = over[0]
          field = "max_ids_per_table" if name == "ids" else "max_unique_ids_per_table"
          raise errors.InputError(
              f"table '{counts.stack}': SparseCore {dst} gets {observed[src, dst]} "
              f"{name} from SparseCore {src} of chip {chip}, over the limit "
              f"{field}['{counts.stack}']={limit}. SparseCore fails this step "
              f"(it never drops for this limit). Fix: raise {field}"
              f"['{counts.stack}'] (the stacked table's name) to at least "
              f"{int(observed.max())}.")
      kept, used, remaining = _pack(counts, chip, limits.allow_id_dropping)
      if kept is None:
        raise errors.InputError(
            f"table '{counts.stack}': chip {chip} needs more than its "
            f"{counts.chip_capacity} id slots (max_ids_per_chip_per_sample="
            f"{limits.max_ids_per_chip_per_sample} x {counts.samples_per_chip} "
            f"samples); {remaining} ids do not fit. Fix: raise "
            "max_ids_per_chip_per_sample, or set allow_id_dropping=True to drop "
            "them as SparseCore does.")
      counts.chip_slots[chip] = used
      pairs = chips[chip]
      segment = pairs.source * topology.num_sparse_cores + pairs.destination
      # Pairs are sorted by segment: the rank of a pair inside its segment.
      rank = np.arange(len(segment)) - np.searchsorted(segment, segment)
      dropped = rank >= kept[segment]
      counts.dropped += int(dropped.sum())
      for feature, lo, pair in pairs.spans:
        keep[feature][lo:lo + len(pair)] &= ~dropped[pair]
    out.append(counts)
  return out, keep

