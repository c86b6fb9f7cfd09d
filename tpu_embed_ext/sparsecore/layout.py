"""Which tables ``TPUEmbeddingV2`` stacks, and where each row of a table lives.

Stacking (``SparseCoreLayoutStacker``, tensorflow/core/tpu/kernels/
sparse_core_layout.cc; driven by ``tpu_embedding_v3.py``
``_stack_tables_with_same_table_dim_and_optimizer``):

- tables are added in name order; a table joins the first stack of its group
  (same optimizer hash and quantization repr) and padded width that stays under
  three limits (activation bytes, variable shard bytes, rows), else opens one;
- rows are padded to a multiple of ``8 * num_sparse_cores``, columns to 8;
- in a stack, a table starts at row ``sparse_core_shard_row_offset`` of every
  SparseCore shard (the padded rows of the tables before it, divided by the
  number of SparseCores) and is rotated by ``(k * sparsecores_per_chip) %
  num_sparse_cores`` shards, ``k`` its position in the stack;
- a stack is named after its tables, joined by ``_``.

Row ``r`` of a (padded) table is then in shard ``(r % S + rotation) % S`` at
position ``row_offset + r // S`` (``S`` SparseCores), i.e. row ``shard *
rows_per_shard + position`` of the stacked variable (``tpu_embedding_v3_utils``
``map_indices_in_shard`` / ``unshuffle_from_sc_to_cpu``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import operator
from typing import Dict, List, Optional, Sequence

import numpy as np

from tpu_embed_ext.spec import names
from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore.topology import Topology

__all__ = ["StackingInput", "TableLayout", "compute_layouts", "layouts_by_stack",
           "stacking_inputs", "layouts_from_proto", "layouts_to_proto",
           "ACTIVATION_BYTES_LIMIT", "SHARD_BYTES_LIMIT", "ROW_LIMIT"]

# The stacker's defaults: XLA flags tf_xla_sparse_core_stacking_mem_limit_bytes
# and ..._table_shard_limit_bytes (sparse_core_xla_flags_defaults.h), and the
# signed 32-bit row limit of sparse_core_layout.h.
ACTIVATION_BYTES_LIMIT = 2_097_152
SHARD_BYTES_LIMIT = 2_147_483_648
ROW_LIMIT = (1 << 31) - 1
_BYTES_PER_FLOAT = 4


@dataclasses.dataclass(frozen=True)
class StackingInput:
  """One table as the stacker sees it (``SparseCoreLayoutStacker.AddTable``)."""
  name: str
  rows: int
  dim: int
  group: str
  """Tables stack only within a group (TPUEmbeddingV2: the optimizer's hash)."""
  output_samples: int = 0
  """Activation rows per step (TPUEmbeddingV2 counts only its first feature)."""
  num_features: int = 0


@dataclasses.dataclass(frozen=True)
class TableLayout:
  """Where one table lives in its stacked variable (``SparseCoreTableLayout``)."""
  table: str
  stack: str
  rows: int
  dim: int
  padded_rows: int
  padded_dim: int
  row_offset: int
  """First row of this table in every SparseCore shard of the stack."""
  rotation: int
  """Shards the table is rotated by."""
  num_sparse_cores: int
  num_partitions: int
  rows_per_shard: int
  """Rows of each SparseCore shard of the whole stack."""
  per_sparse_core_batch_size: int = 0
  num_features: int = 0

  @property
  def rows_in_shard(self) -> int:
    """Rows of this table in each shard."""
    return self.padded_rows // self.num_sparse_cores

  def bytes_per_chip(self, sparsecores_per_chip: int, states: int = 1) -> int:
    """Bytes of this table's whole stack on one chip, ``states`` float32
    copies (parameters and slots): ``sparsecores_per_chip`` shards of
    ``rows_per_shard`` rows of the padded width."""
    return self.rows_per_shard * sparsecores_per_chip * self.padded_dim * 4 * states

  @property
  def stacked_rows(self) -> int:
    return self.rows_per_shard * self.num_sparse_cores

  def shard_and_position(self, rows):
    """(shard, position in shard) of padded-table rows ``rows``."""
    rows = np.asarray(rows, dtype=np.int64)
    s = self.num_sparse_cores
    return (rows % s + self.rotation) % s, self.row_offset + rows // s

  def stacked_index(self, rows) -> np.ndarray:
    """Row of the stacked variable that holds padded-table rows ``rows``."""
    shard, position = self.shard_and_position(rows)
    return shard * self.rows_per_shard + position

  def shard_block(self, shard: int) -> slice:
    """The padded-table rows stored, in order, in ``shard``: ``table[block]``."""
    return slice((shard - self.rotation) % self.num_sparse_cores, None,
                 self.num_sparse_cores)


def _next_multiple(n: int, factor: int) -> int:
  return n if n % factor == 0 else n + factor - n % factor


def _stack_with_formula(tables, topology, stacking, activation_limit, shard_limit,
                        row_limit) -> List[TableLayout]:
  """sparse_core_layout.cc, AddTable + GetLayouts, in Python."""
  s = topology.num_sparse_cores
  stacks_by_group: Dict[tuple, list] = {}
  for t in tables:
    padded_dim = _next_multiple(t.dim, 8)
    padded_rows = _next_multiple(t.rows, s * 8)
    batch = t.output_samples // topology.sparsecores_per_chip
    activation = _BYTES_PER_FLOAT * padded_dim * batch
    shard_bytes = _BYTES_PER_FLOAT * padded_dim * padded_rows // topology.chips
    candidates = stacks_by_group.setdefault((padded_dim, t.group), [])
    stack = None
    for candidate in candidates if stacking else ():
      if activation_limit and candidate["activation"] + activation >= activation_limit:
        continue
      if shard_limit and candidate["shard_bytes"] + shard_bytes >= shard_limit:
        continue
      if row_limit and candidate["height"] + padded_rows >= row_limit:
        continue
      stack = candidate
      break
    if stack is None:
      stack = {"activation": 0, "shard_bytes": 0, "height": 0, "tables": []}
      candidates.append(stack)
    stack["tables"].append(dict(
        table=t.name, rows=t.rows, dim=t.dim, padded_rows=padded_rows,
        padded_dim=padded_dim, row_offset=stack["height"] // s,
        rotation=(len(stack["tables"]) * s // topology.chips) % s,
        per_sparse_core_batch_size=batch, num_features=t.num_features))
    stack["height"] += padded_rows
    stack["shard_bytes"] += shard_bytes
    stack["activation"] += activation
  out = []
  for key in sorted(stacks_by_group):  # the stacker's btree order
    for stack in stacks_by_group[key]:
      name = "_".join(t["table"] for t in stack["tables"])
      out += [TableLayout(stack=name, num_sparse_cores=s,
                          num_partitions=topology.chips,
                          rows_per_shard=stack["height"] // s, **t)
              for t in stack["tables"]]
  return out


def _stack_with_tensorflow(tables, topology, stacking, activation_limit,
                           shard_limit, row_limit) -> Optional[List[TableLayout]]:
  """TensorFlow's own stacker, or None where it is not importable."""
  try:
    from tensorflow.python.tpu import _pywrap_sparse_core_layout  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  stacker = _pywrap_sparse_core_layout.SparseCoreLayoutStacker(
      num_partitions=topology.chips, disable_table_stacking=not stacking,
      sparse_cores_per_partition=topology.sparsecores_per_chip)
  stacker.SetActivationMemoryBytesLimit(activation_limit)
  stacker.SetVariableShardBytesLimit(shard_limit)
  if row_limit != ROW_LIMIT:
    return None  # The binding has no row-limit setter: use the formula.
  for t in tables:
    stacker.AddTable(table_name=t.name, table_height=t.rows, table_width=t.dim,
                     group=t.group, output_samples=t.output_samples,
                     num_features=t.num_features)
  return layouts_from_proto(stacker.GetLayouts())


def compute_layouts(tables: Sequence[StackingInput], topology: Topology, *,
                    stacking: bool = True,
                    activation_limit: int = ACTIVATION_BYTES_LIMIT,
                    shard_limit: int = SHARD_BYTES_LIMIT,
                    row_limit: int = ROW_LIMIT,
                    use_tensorflow: bool = True) -> List[TableLayout]:
  """The layout of every table, in the stacker's order.

  ``tables`` are added in the order given (TPUEmbeddingV2 sorts them by name:
  see ``stacking_inputs``). With ``use_tensorflow`` (default) TensorFlow's own
  ``SparseCoreLayoutStacker`` computes it where it is importable, so the plan
  cannot drift from the TPU's; otherwise the same algorithm in Python (tests
  check that the two agree).
  """
  tables = list(tables)
  for t in tables:  # Sizes before the stacker sees them (it takes int64s).
    padded = _next_multiple(t.rows, topology.num_sparse_cores * 8)
    if padded >= row_limit:
      raise errors.ConfigError(
          f"table '{t.name}' has {t.rows:,} rows, {padded:,} once padded for "
          f"{topology.num_sparse_cores} SparseCores: SparseCore row numbers are "
          f"signed 32-bit, at most {row_limit:,} rows per stack "
          "(sparse_core_layout.h). Fix: lower its vocabulary_size, or split "
          "the table.", path=f"tables.{t.name}.vocabulary_size")
  args = (tables, topology, stacking, activation_limit, shard_limit, row_limit)
  layouts = _stack_with_tensorflow(*args) if use_tensorflow else None
  if layouts is None:
    layouts = _stack_with_formula(*args)
  names.check_stack_names(layouts)
  return layouts


def _group_key(optimizer, quantization_config) -> str:
  # TPUEmbeddingV2's key (_stack_tables_with_same_table_dim_and_optimizer):
  # the optimizer's hash (per process: it hashes strings) and the
  # quantization config's repr.
  key = (hash(optimizer), repr(quantization_config))
  return "_xxtpuv3internal_" + hashlib.sha1(
      repr(key).encode(), usedforsecurity=False).hexdigest()


def stacking_inputs(feature_config, optimizer=None,
                    batch_size: int = 0) -> List[StackingInput]:
  """The stacker's inputs for a nested ``FeatureConfig``, as TPUEmbeddingV2 builds them.

  Tables in name order, grouped by the hash of their optimizer (``optimizer``
  for tables without one) and quantization config. As in TensorFlow 2.21, only
  the first feature's output samples and count reach the stacker: the loop
  over features in ``_stack_tables_with_same_table_dim_and_optimizer`` returns
  during its first iteration. ``batch_size`` stands in for an unset
  ``output_shape`` (TPUEmbeddingV2 itself requires one).
  """
  from tensorflow.python.util import nest  # pylint: disable=g-import-not-at-top
  features = nest.flatten(feature_config)
  tables = []
  for f in features:
    if all(f.table is not t for t in tables):
      tables.append(f.table)
  samples = collections.Counter()
  counts = collections.Counter()
  if features:
    first = features[0]
    samples[first.table.name] = functools.reduce(
        operator.mul, first.output_shape or [batch_size])
    counts[first.table.name] = 1
  out = []
  for table in sorted(tables, key=lambda t: t.name):
    group = _group_key(table.optimizer if table.optimizer is not None
                       else optimizer, table.quantization_config)
    out.append(StackingInput(table.name, table.vocabulary_size, table.dim,
                             group, samples[table.name],
                             counts[table.name]))
  return out


def layouts_by_stack(layouts: Sequence[TableLayout]) -> Dict[str, List[TableLayout]]:
  """``{stack: [layouts in row order]}``, stacks in name order.

  Not the stacker's order, which follows ``hash(optimizer)`` and so differs
  between processes: plans, object graphs and conversions come out the same
  in every run.
  """
  out: Dict[str, List[TableLayout]] = {}
  for layout in sorted(layouts, key=lambda l: (l.stack, l.row_offset)):
    out.setdefault(layout.stack, []).append(layout)
  return out


def layouts_to_proto(layouts: Sequence[TableLayout]):
  """A ``SparseCoreTableLayouts`` proto (the ``_sparse_core_table_layouts`` value).

  Stacks in name order, each stack's tables in row order. The stacker's own
  order of stacks follows ``hash(optimizer)``, which Python seeds per process,
  so without this two processes would write the same layouts as different
  bytes. Readers (ours, ``TPUEmbeddingV2``'s) look tables up by name.
  """
  from tensorflow.core.tpu.kernels import sparse_core_layout_pb2  # pylint: disable=g-import-not-at-top
  proto = sparse_core_layout_pb2.SparseCoreTableLayouts()
  for l in (l for ls in layouts_by_stack(layouts).values() for l in ls):
    proto.tables.add(
        table_name=l.table, stacked_table_name=l.stack,
        num_sparse_cores=l.num_sparse_cores, num_partitions=l.num_partitions,
        total_rows_per_sparse_core_shard=l.rows_per_shard,
        unsharded_shape=[l.rows, l.dim],
        unsharded_padded_shape=[l.padded_rows, l.padded_dim],
        sparse_core_shard_row_offset=l.row_offset,
        sparse_core_shard_rotation=l.rotation,
        per_sparse_core_batch_size=l.per_sparse_core_batch_size,
        num_features=l.num_features)
  return proto


def layouts_from_proto(proto) -> List[TableLayout]:
  """Our layouts from a ``SparseCoreTableLayouts`` proto or its serialized bytes."""
  if isinstance(proto, (bytes, str)):
    from tensorflow.core.tpu.kernels import sparse_core_layout_pb2  # pylint: disable=g-import-not-at-top
    data = proto.encode("latin-1") if isinstance(proto, str) else proto
    proto = sparse_core_layout_pb2.SparseCoreTableLayouts.FromString(data)
  return [TableLayout(
      table=t.table_name, stack=t.stacked_table_name, rows=t.unsharded_shape[0],
      dim=t.unsharded_shape[1], padded_rows=t.unsharded_padded_shape[0],
      padded_dim=t.unsharded_padded_shape[1],
      row_offset=t.sparse_core_shard_row_offset,
      rotation=t.sparse_core_shard_rotation,
      num_sparse_cores=t.num_sparse_cores, num_partitions=t.num_partitions,
      rows_per_shard=t.total_rows_per_sparse_core_shard,
      per_sparse_core_batch_size=t.per_sparse_core_batch_size,
      num_features=t.num_features) for t in proto.tables]
