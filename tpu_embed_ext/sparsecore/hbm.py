"""HBM per device: what a TPU places on each device for its embedding tables,
against the device's capacity (``chips.py``).

Counted, per device (a replica: a TensorCore on v2 and v3, a chip elsewhere):

- ``TPUEmbedding`` (V1): every table is divided over every device of the slice
  (``TPUEmbeddingConfiguration.num_tensor_cores``); a device holds at most
  ``ceil(rows / devices)`` rows of each table, under either sharding strategy
  (``DIV_DEFAULT``, ``MOD``). Each row holds the parameters, the optimizer's
  slots and, with ``use_gradient_accumulation`` (TensorFlow's default), one
  more float per element: the ``gradient_accumulators`` state variable that
  ``GetOptimizationAlgorithmStateVariables``
  (``tensorflow/core/tpu/tpu_embedding_optimization_parameters_utils.cc``)
  appends after the slots ("otherwise-hidden gradient accumulation buffers",
  which only the ``*GradAccumDebug`` load and retrieve ops expose).
- ``TPUEmbeddingV2`` (SparseCore): the stacked tables as ``layout.py`` lays
  them out (TensorFlow's ``SparseCoreLayoutStacker``): each chip holds
  ``sparsecores_per_chip`` shards of ``rows_per_shard`` rows of the padded
  width, parameters and each slot.
- Both: the step's activations and their gradients, float32, at the
  per-device batch: ``prod(output_shape) x dim`` per feature.

The count is a **lower bound**: not counted are the dense model's variables
and activations, the program's code and XLA's temporary buffers (OpenXLA
error E1000 lists them). The **upper bound** adds what is uncertain in the
embedding's own share: for V1, each table's width padded to a multiple of 8
floats (SparseCore pads so, OpenXLA's SparseCore deep dive §10; whether
TensorCore-based engines do is not published). ``check`` refuses when the
lower bound does not fit and warns when the upper bound passes 90%.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from tpu_embed_ext.host.memory import human_bytes
from tpu_embed_ext.sparsecore import chips as chips_lib
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.topology import MAX_CHIPS, Topology
from tpu_embed_ext.spec import numeric_traps
from tpu_embed_ext.tf import optimizers as tf_optimizers

__all__ = ["TableMemory", "DeviceMemory", "HBMExhaustedError", "HBMNearlyFullWarning",
           "for_tpu_embedding", "for_tpu_embedding_v2", "for_engine", "check", "xla_size",
           "WARN_FRACTION"]

_FLOAT = 4
WARN_FRACTION = 0.9


class HBMExhaustedError(tf.errors.ResourceExhaustedError):
  """A device's HBM cannot hold the embedding: XLA's words first, then ours."""

  def __init__(self, message: str):
    super().__init__(None, None, message)


class HBMNearlyFullWarning(UserWarning):
  """The embedding's upper bound takes more than 90% of a device's HBM."""


@dataclasses.dataclass(frozen=True)
class TableMemory:
  """One table (V1) or stacked table (V2) on one device."""
  name: str
  rows: int
  """Rows on the device (its largest share)."""
  dim: int
  states: Tuple[str, ...]
  """``parameters``, the slots, ``gradient_accumulators``: one float each."""
  padded_dim: int

  @property
  def lower(self) -> int:
    return self.rows * self.dim * len(self.states) * _FLOAT

  @property
  def upper(self) -> int:
    return self.rows * self.padded_dim * len(self.states) * _FLOAT

  def describe(self) -> str:
    return (f"'{self.name}' {self.rows:,} rows x {self.dim} x "
            f"{len(self.states)} ({', '.join(self.states)}): {human_bytes(self.lower)}")


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """The embedding's HBM on one device of ``slice``."""
  slice: chips_lib.Slice
  engine: str
  tables: Tuple[TableMemory, ...]
  buffers: int
  """Activations and their gradients, bytes."""
  uncounted: Tuple[str, ...] = ()
  """Features whose output shape is unknown: their buffers count 0."""

  @property
  def capacity(self) -> int:
    return self.slice.generation.capacity_bytes

  @property
  def lower(self) -> int:
    return sum(t.lower for t in self.tables) + self.buffers

  @property
  def upper(self) -> int:
    return sum(t.upper for t in self.tables) + self.buffers

  @property
  def fits(self) -> bool:
    return self.lower <= self.capacity

  @property
  def nearly_full(self) -> bool:
    return self.upper > WARN_FRACTION * self.capacity

  def summary(self) -> str:
    """One line: bounds against the capacity."""
    uncertain = (f" (up to {human_bytes(self.upper)} with widths padded to 8)"
                 if self.upper != self.lower else "")
    return (f"{human_bytes(self.lower)}{uncertain} of {human_bytes(self.capacity)} "
            f"per device on {self.slice} ({_devices(self.slice)}): tables "
            f"and optimizer state {human_bytes(self.lower - self.buffers)}, "
            f"activations and gradients {human_bytes(self.buffers)}, headroom "
            f"{human_bytes(max(self.capacity - self.lower, 0))}")

  def largest(self, n: int = 3) -> List[TableMemory]:
    return sorted(self.tables, key=lambda t: -t.lower)[:n]

  def chips_needed(self) -> Optional[int]:
    """The smallest slice of this generation where the lower bound fits."""
    generation = self.slice.generation
    devices_now = self.slice.replicas
    for chips in range(self.slice.chips + 1, MAX_CHIPS + 1):
      if not generation.slice_exists(chips):
        continue
      devices = chips * generation.replicas_per_chip
      tables = sum(math.ceil(t.rows * devices_now / devices) * t.dim
                   * len(t.states) * _FLOAT for t in self.tables)
      if tables + self.buffers <= self.capacity:
        return chips
      if tables <= self.buffers:  # More chips no longer help.
        return None
    return None


def _devices(slice_: chips_lib.Slice) -> str:
  n = slice_.replicas
  return f"{n} device" + ("s" if n != 1 else "")


def xla_size(n: int) -> str:
  """Bytes as XLA prints them in its HBM messages: ``12.34G``, ``558.95M``."""
  if n >= chips_lib.GIB:
    return f"{n / chips_lib.GIB:.2f}G"
  return f"{n / (1 << 20):.2f}M"


def _states(optimizer) -> Tuple[Tuple[str, ...], bool]:
  """(slot names, gradient accumulation) of a TensorFlow TPU optimizer."""
  if optimizer is None:
    return (), False
  with numeric_traps.skip_checks():  # Sizes only: TensorFlow takes the object.
    spec = tf_optimizers.as_spec(optimizer)
  return tuple(spec.slot_names), bool(spec.use_gradient_accumulation)


def _features(feature_config) -> list:
  return tf.nest.flatten(feature_config)


def _buffers(features, output_shapes) -> Tuple[int, Tuple[str, ...]]:
  total, uncounted = 0, []
  shapes = list(output_shapes or [])
  for i, feature in enumerate(features):
    shape = tf.TensorShape(shapes[i]) if i < len(shapes) and shapes[i] is not None else None
    if shape is None or not shape.is_fully_defined() or shape.rank == 0:
      uncounted.append(feature.name or feature.table.name)
      continue
    total += 2 * shape.num_elements() * feature.table.dim * _FLOAT
  return total, tuple(uncounted)


def _unique_tables(features) -> list:
  tables = []
  for f in features:
    if all(f.table is not t for t in tables):
      tables.append(f.table)
  return tables


def for_tpu_embedding(feature_config, optimizer, output_shapes,
                      slice_: chips_lib.Slice) -> DeviceMemory:
  """``TPUEmbedding``'s HBM per device on ``slice_`` (see the module doc)."""
  features = _features(feature_config)
  devices = slice_.replicas
  tables = []
  for table in _unique_tables(features):
    slots, accumulate = _states(table.optimizer if table.optimizer is not None
                                else optimizer)
    states = ("parameters", *slots) + (("gradient_accumulators",) if accumulate else ())
    tables.append(TableMemory(table.name, math.ceil(table.vocabulary_size / devices),
                              table.dim, states, -(-table.dim // 8) * 8))
  buffers, uncounted = _buffers(features, output_shapes)
  return DeviceMemory(slice_, "TPUEmbedding", tuple(tables), buffers, uncounted)


def for_tpu_embedding_v2(feature_config, optimizer, output_shapes,
                         slice_: chips_lib.Slice) -> DeviceMemory:
  """``TPUEmbeddingV2``'s HBM per chip on ``slice_`` (see the module doc)."""
  features = _features(feature_config)
  topology = Topology(slice_.chips, slice_.generation.sparsecores_per_chip,
                      name=slice_.name)
  layouts = sc_layout.compute_layouts(
      sc_layout.stacking_inputs(feature_config, optimizer), topology)
  by_name = {t.name: t for t in _unique_tables(features)}
  tables = []
  for stack, members in sc_layout.layouts_by_stack(layouts).items():
    first = members[0]
    table = by_name[first.table]
    slots, _ = _states(table.optimizer if table.optimizer is not None else optimizer)
    rows = first.rows_per_shard * topology.sparsecores_per_chip
    tables.append(TableMemory(stack, rows, first.padded_dim, ("parameters", *slots),
                              first.padded_dim))
  buffers, uncounted = _buffers(features, output_shapes)
  return DeviceMemory(slice_, "TPUEmbeddingV2", tuple(tables), buffers, uncounted)


def for_engine(v2: bool, feature_config, optimizer, output_shapes,
               slice_: chips_lib.Slice) -> DeviceMemory:
  """``for_tpu_embedding_v2`` with ``v2`` (SparseCore), else ``for_tpu_embedding``."""
  count = for_tpu_embedding_v2 if v2 else for_tpu_embedding
  return count(feature_config, optimizer, output_shapes, slice_)


def refusal(memory: DeviceMemory, what: str) -> str:
  """XLA's words, then which tables, bytes per device and the fix."""
  over = memory.lower - memory.capacity
  fixes = []
  chips = memory.chips_needed()
  name = memory.slice.generation.name
  if chips is not None:
    fixes.append(f"a larger slice ({name}:{chips} holds it)")
  else:
    fixes.append("a slice of another generation with more HBM per chip")
  fixes.append("fewer optimizer slots (SGD has none; use_gradient_accumulation="
               "False drops one float per element where the optimizer allows it)")
  fixes.append("a smaller dim or vocabulary_size for the largest tables")
  largest = "; ".join(t.describe() for t in memory.largest())
  return (f"Ran out of memory in memory space hbm. Used {xla_size(memory.lower)} of "
          f"{xla_size(memory.capacity)} hbm. Exceeded hbm capacity by "
          f"{xla_size(over)}. ({what}: the embedding alone needs at least "
          f"{human_bytes(memory.lower)} per device on {memory.slice} "
          f"({_devices(memory.slice)} of {human_bytes(memory.capacity)}): "
          f"tables and optimizer state {human_bytes(memory.lower - memory.buffers)}, "
          f"activations and gradients {human_bytes(memory.buffers)}. Largest: "
          f"{largest}. A TPU refuses this when it compiles. Fix: "
          + "; or ".join(fixes) + ".)")


def check(memory: DeviceMemory, what: str, stacklevel: int = 2) -> None:
  """Raises ``HBMExhaustedError`` if the lower bound does not fit; warns
  ``HBMNearlyFullWarning`` if the upper bound passes 90% of the capacity
  (``stacklevel`` as ``warnings.warn``'s, counted from the caller of this)."""
  if not memory.fits:
    raise HBMExhaustedError(refusal(memory, what))
  if memory.nearly_full:
    warnings.warn(
        f"{what}: the embedding may take {human_bytes(memory.upper)} of "
        f"{human_bytes(memory.capacity)} HBM per device on {memory.slice} "
        f"(over {WARN_FRACTION:.0%}; at least {human_bytes(memory.lower)}), "
        "leaving little for the dense model. Fix: a larger slice, or fewer "
        "slots or smaller tables.", HBMNearlyFullWarning, stacklevel=stacklevel + 1)
