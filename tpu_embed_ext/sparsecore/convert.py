"""Lossless checkpoint conversion: per-table <-> SparseCore stacked, with every slot.

Per-table is the layout of ``TPUEmbedding`` and ``CPUEmbedding``
(``<table>``, ``<table>/<slot>``); stacked is ``TPUEmbeddingV2``'s
(``<stack>``, ``<stack>/<slot>``, ``_sparse_core_table_layouts``), for a
topology. Padding rows and columns are dropped on the way out; on the way in
they are zero in the parameters and the slot's initial value in each slot, so
a padded row looks like a row never trained. Values are copied, never
computed, so a round trip is bit-identical.

The output appears under its name only when complete (``atomic.write_prefix``:
staged in a hidden sibling directory, then renamed into place, index last),
so a conversion killed at any moment leaves the previous ``--out`` (or none)
whole. An output that would overwrite the input is refused before anything
is written, and so is an output that cannot be written (a directory, a
read-only disk). A damaged input (truncated or corrupted files, a missing
tensor) is a ``CheckpointError`` naming it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import constants
from tensorflow.python.util import nest

from tpu_embed_ext.host import atomic, memory as host_memory
from tpu_embed_ext.spec import names as derived_names
from tpu_embed_ext import errors
from tpu_embed_ext.tf import optimizers
from tpu_embed_ext.host import model_dir as model_dir_lib
from tpu_embed_ext.sparsecore import from_checkpoint
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.checkpoint import (LAYOUTS_NAME, BundleWriter, ObjectGraph,
                                                 find_embedding, read_rows, slice_spec,
                                                 variable_key)
from tpu_embed_ext.sparsecore.topology import parse_topology
from tpu_embed_ext.host.memory import human_bytes

__all__ = ["convert_checkpoint", "checkpoint_layouts", "resolve_checkpoint"]

_PARAMETERS = "parameters"
_FIX = "Fix: convert with the config the checkpoint was trained with"
_COPY_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class _Table:
  name: str
  rows: int
  dim: int
  slots: Tuple[str, ...]
  initial: Tuple[float, ...]  # each slot's initial value

  @property
  def shape(self) -> List[int]:
    return [self.rows, self.dim]

  def fill(self, slot: str) -> float:
    return 0.0 if slot == _PARAMETERS else self.initial[self.slots.index(slot)]


def _feature_config(config, optimizer):
  """(nested FeatureConfig, [_Table]) of an EmbeddingSpec or a FeatureConfig."""
  if hasattr(config, "feature_config"):
    config = config.feature_config(step=tf.Variable(0, dtype=tf.int64,
                                                    trainable=False))
  tables = []
  for feature in nest.flatten(config):
    t = feature.table
    if any(t is seen for seen, _ in tables):
      continue
    spec = optimizers.as_spec(t.optimizer or optimizer)
    tables.append((t, _Table(t.name, t.vocabulary_size, t.dim, tuple(spec.slot_names),
                             tuple(spec.slot_initial_values()))))
  return config, [t for _, t in tables]


_local = derived_names.local_name


def checkpoint_layouts(path: str, prefix: str = "embedding") -> Optional[List[
    sc_layout.TableLayout]]:
  """The SparseCore layouts stored in checkpoint ``path``, or None if it is per-table."""
  key = variable_key(prefix, LAYOUTS_NAME)
  reader = tf.train.load_checkpoint(path)
  if not reader.has_tensor(key):
    return None
  return sc_layout.layouts_from_proto(reader.get_tensor(key))


def _slots_under(children, name: str, others=()) -> List[str]:
  """Slot names tracked as ``<name>/<slot>`` on the embedding object: exact
  local names, never the variable of another table in ``others``."""
  return [s for s in derived_names.SLOT_NAMES
          if _local(name, s) in children and _local(name, s) not in others]


class _PerTableSource:
  def __init__(self, path, prefix, tables, shapes, children):
    self.path, self.prefix = path, prefix
    self._reader = tf.train.load_checkpoint(path)
    for t in tables:
      if variable_key(prefix, t.name) not in shapes:
        raise errors.ConfigError(
            f"table '{t.name}' is not in checkpoint {path} (no key "
            f"{variable_key(prefix, t.name)}). {_FIX}, or pass its --prefix.")
      _check_slots(t, _slots_under(children, t.name, {x.name for x in tables}), path)
      for slot in (_PARAMETERS,) + t.slots:
        _check_shape(t, slot, _stored_shape(shapes, prefix, t.name, slot, path), path)

  def names(self, tables):
    return [_local(t.name, s) for t in tables for s in (_PARAMETERS,) + t.slots]

  def read(self, table: _Table, slot: str) -> np.ndarray:
    return self._reader.get_tensor(variable_key(self.prefix, _local(table.name, slot)))


class _StackedSource:
  def __init__(self, path, prefix, tables, shapes, children):
    self.path, self.prefix = path, prefix
    self._children = children
    self.layouts = {l.table: l for l in checkpoint_layouts(path, prefix)}
    extra = sorted(set(self.layouts) - {t.name for t in tables})
    if extra:
      raise errors.ConfigError(
          f"checkpoint {path} holds SparseCore tables {extra} that the config does "
          f"not have; converting would drop them. {_FIX}.")
    self._stacks = sc_layout.layouts_by_stack(self.layouts.values())
    for t in tables:
      if t.name not in self.layouts:
        raise errors.ConfigError(
            f"table '{t.name}' is not in the SparseCore layouts of checkpoint {path}."
            f" {_FIX}.")
      l = self.layouts[t.name]
      if [l.rows, l.dim] != t.shape:
        raise errors.ConfigError(
            f"table '{t.name}': checkpoint {path} holds shape {[l.rows, l.dim]} (in "
            f"stack '{l.stack}'), the config has {t.shape}. {_FIX}.")
      _check_slots(t, _slots_under(children, l.stack), path)
      for slot in (_PARAMETERS,) + t.slots:
        stored = _stored_shape(shapes, prefix, l.stack, slot, path)
        if stored != [l.stacked_rows, l.padded_dim]:
          raise errors.ConfigError(
              f"stack '{l.stack}' ({_PARAMETERS if slot == _PARAMETERS else slot}): "
              f"checkpoint {path} holds shape {stored}, its layout needs "
              f"{[l.stacked_rows, l.padded_dim]}. Fix: the checkpoint is damaged or "
              "its layouts key belongs to another checkpoint.")

  def names(self, tables):
    del tables
    return [LAYOUTS_NAME] + [_local(stack, s) for stack in self._stacks
                             for s in [_PARAMETERS] + _slots_under(self._children, stack)]

  def read(self, table: _Table, slot: str) -> np.ndarray:
    # One shard at a time: the table plus one shard's block in memory.
    l = self.layouts[table.name]
    key = variable_key(self.prefix, _local(l.stack, slot))
    out = np.empty((l.rows, l.dim), np.float32)
    for k in range(l.num_sparse_cores):
      rows = out[l.shard_block(k)]
      (block,) = read_rows(self.path, key, [l.stacked_rows, l.padded_dim],
                           [(k * l.rows_per_shard + l.row_offset, l.rows_in_shard)])
      out[l.shard_block(k)] = block[:len(rows), :l.dim]
    return out


def _stored_shape(shapes, prefix, name, slot, path) -> List[int]:
  """The stored shape of ``name``'s ``slot``; CheckpointError if the tensor is missing."""
  key = variable_key(prefix, _local(name, slot))
  if key not in shapes:
    what = "parameters" if slot == _PARAMETERS else f"slot '{slot}'"
    raise model_dir_lib.CheckpointError(
        f"checkpoint {path} is damaged: its object graph lists the {what} of "
        f"'{name}' but it holds no tensor {key}. Fix: convert an undamaged "
        "checkpoint (an earlier one, or a copy).")
  return list(shapes[key])


def _check_slots(t: _Table, have, path):
  if sorted(t.slots) != sorted(have):
    raise errors.ConfigError(
        f"table '{t.name}': checkpoint {path} holds optimizer slots {sorted(have)}, "
        f"the config's optimizer has {sorted(t.slots)}. Fix: convert with the "
        "optimizer the checkpoint was trained with.")


def _check_shape(t: _Table, slot, stored, path):
  if stored != t.shape:
    what = "" if slot == _PARAMETERS else f" slot '{slot}'"
    raise errors.ConfigError(
        f"table '{t.name}'{what}: checkpoint {path} holds shape {stored}, the config "
        f"has {t.shape}. {_FIX}.")


def _write_per_table(writer: BundleWriter, prefix, table: _Table, slot, value):
  writer.write([variable_key(prefix, _local(table.name, slot))], [""], [value])


def _write_stacked(writer: BundleWriter, prefix, table: _Table, layout, slot, value):
  """One slice per shard: the table's rows of that shard, padded."""
  key = variable_key(prefix, _local(layout.stack, slot))
  blocks, specs = [], []
  for k in range(layout.num_sparse_cores):
    rows = value[layout.shard_block(k)]
    block = np.full((layout.rows_in_shard, layout.padded_dim), table.fill(slot),
                    np.float32)
    block[:len(rows), :table.dim] = rows
    blocks.append(block)
    specs.append(slice_spec([layout.stacked_rows, layout.padded_dim],
                            k * layout.rows_per_shard + layout.row_offset,
                            layout.rows_in_shard))
  writer.write([key] * len(blocks), specs, blocks)


def _copy_others(writer: BundleWriter, path: str, skip) -> None:
  reader = tf.train.load_checkpoint(path)
  dtypes = reader.get_variable_to_dtype_map()
  chunk, size = [], 0
  for key in sorted(dtypes):
    if key in skip or key == constants.OBJECT_GRAPH_PROTO_KEY:
      continue
    value = reader.get_tensor(key)
    chunk.append((key, value))
    size += getattr(value, "nbytes", 0)
    if size >= _COPY_CHUNK_BYTES:
      writer.write([k for k, _ in chunk], [""] * len(chunk), [v for _, v in chunk])
      chunk, size = [], 0
  if chunk:
    writer.write([k for k, _ in chunk], [""] * len(chunk), [v for _, v in chunk])


def resolve_checkpoint(path: str, log=print) -> str:
  """The checkpoint prefix ``path`` names, checked before anything is read.

  A directory (a ``checkpoints`` directory, or a model_dir holding one)
  means its newest readable checkpoint, falling back past damaged ones as
  ``train`` does. A prefix must have its ``.index`` file.
  """
  if os.path.isdir(path):
    directory = path
    if not model_dir_lib.checkpoint_steps(path) and os.path.isdir(
        os.path.join(path, "checkpoints")):
      directory = os.path.join(path, "checkpoints")
    prefix, step = model_dir_lib.resume_point(directory, log=log, repair=False)
    if prefix is None:
      raise model_dir_lib.CheckpointError(
          f"--checkpoint {path} is a directory without checkpoints (no "
          "ckpt-<step>.index in it). Fix: pass a checkpoint prefix, e.g. "
          "<model_dir>/checkpoints/ckpt-60, or its directory.")
    log(f"Converting {prefix} (step {step}), the newest readable checkpoint in "
        f"{directory}.")
    return prefix
  atomic.recover(path)
  if not os.path.exists(path + ".index"):
    raise model_dir_lib.CheckpointError(
        f"--checkpoint {path}: no such checkpoint ({path}.index does not exist). "
        "Fix: pass a checkpoint prefix (the path without .index), e.g. "
        "<model_dir>/checkpoints/ckpt-60, or a checkpoints directory.")
  return path


_available_memory = host_memory.available_memory  # tests replace it


def _check_memory(tables, layouts) -> None:
  """ConfigError before anything is allocated if one table (read whole) and
  its padded stacked form (written whole) do not fit into memory."""
  def need(t):
    padded = 0
    if layouts is not None:
      l = layouts[t.name]
      padded = l.padded_rows * l.padded_dim
    return 4 * (t.rows * t.dim + padded)
  if not tables:
    return
  big = max(tables, key=need)
  available = _available_memory()
  if need(big) > available:
    raise errors.ConfigError(
        f"table '{big.name}' needs {human_bytes(need(big))} in memory to "
        f"convert ({big.rows:,} x {big.dim}"
        + (", padded for the topology" if layouts is not None else "")
        + f"), this machine has {human_bytes(available)} available. Fix: "
        "convert on a machine with more memory, or check the topology's chip "
        "count.")


def convert_checkpoint(src: str, dst: str, config, topology=None, *,
                       optimizer=None, prefix: Optional[str] = None, log=print,
                       ) -> Optional[List[sc_layout.TableLayout]]:
  """Converts checkpoint ``src`` into ``dst``, table by table.

  Args:
    src: a checkpoint prefix, per-table or SparseCore-stacked (detected from
      its ``_sparse_core_table_layouts`` key), or a directory (its newest
      readable checkpoint).
    dst: the prefix to write; it must not overlap ``src``. It is replaced
      whole when the conversion is complete, never partly.
    config: the tables it was trained with: an ``EmbeddingSpec`` or a nested
      ``FeatureConfig`` (with ``optimizer`` for tables that have none). It
      gives the shapes to check, the slots' initial values for padding and,
      for a stacked output, the optimizer groups that decide the stacking.
      None: the checkpoint's own tables, slots and shapes
      (``from_checkpoint``): tables with the same slots stack, padding holds
      TensorFlow's default initial values.
    topology: None writes per-table keys; a ``Topology`` (or "v5p:4") writes
      ``TPUEmbeddingV2``'s stacked layout for it.
    prefix: the embedding's path in the checkpoint's object graph; None finds
      it (the one object holding the config's tables, ``embedding_paths``),
      and an error lists the candidates when there are several.
    log: prints which checkpoint a directory resolved to.

  Returns:
    The layouts written, or None for a per-table output.
  """
  src = resolve_checkpoint(src, log=log)
  atomic.check_no_overlap("--out", dst, [("the input checkpoint", src)], prefix=True)
  atomic.check_writable("--out", dst)
  try:
    with atomic.write_prefix(dst) as staging:
      return _convert(src, staging, config, topology, optimizer, prefix)
  except (tf.errors.OpError, IndexError) as e:
    if isinstance(e, (tf.errors.ResourceExhaustedError,
                      tf.errors.PermissionDeniedError)) or atomic.is_write_error(e):
      raise atomic.io_error(e, "--out", dst) from None
    why = (getattr(e, "message", None) or str(e)).strip().splitlines()[0]
    raise model_dir_lib.CheckpointError(
        f"checkpoint {src} cannot be read: {why}. Nothing was written to {dst}. "
        "Fix: convert an undamaged checkpoint (an earlier one, or a copy).") from None
  except OSError as e:
    if isinstance(e, errors.Error):
      raise
    raise atomic.io_error(e, "--out", dst) from None


def _from_checkpoint(src, prefix):
  """(prefix, [_Table], stacking inputs) from the checkpoint alone (no config)."""
  prefix, stored = from_checkpoint.stored_tables(src, prefix)
  tables = [_Table(t.name, t.rows, t.dim, t.slots, tuple(
      from_checkpoint.DEFAULT_SLOT_INITIAL.get(s, 0.0) for s in t.slots))
            for t in stored]
  return prefix, tables, from_checkpoint.stacking_inputs(stored)


def _convert(src, dst, config, topology, optimizer, prefix):
  if config is None:
    prefix, tables, stacking = _from_checkpoint(src, prefix)
  else:
    feature_config, tables = _feature_config(config, optimizer)
    stacking = None
  if prefix is None:
    prefix = find_embedding(src, [t.name for t in tables])
  graph = ObjectGraph(src, prefix)
  children = graph.children()
  shapes = tf.train.load_checkpoint(src).get_variable_to_shape_map()
  source_cls = _StackedSource if LAYOUTS_NAME in children else _PerTableSource
  source = source_cls(src, prefix, tables, shapes, children)
  layouts = None
  if topology is not None:
    topology = parse_topology(topology)
    if stacking is None:
      stacking = sc_layout.stacking_inputs(feature_config, optimizer)
    layouts = {l.table: l for l in sc_layout.compute_layouts(stacking, topology)}
    by_name = {t.name: t for t in tables}
    added = [LAYOUTS_NAME] + [
        _local(stack, s) for stack, ls in sc_layout.layouts_by_stack(
            layouts.values()).items()
        for s in (_PARAMETERS,) + by_name[ls[0].table].slots]
  else:
    added = [_local(t.name, s) for t in tables for s in (_PARAMETERS,) + t.slots]
  _check_memory(tables, layouts)
  dropped = graph.replace(source.names(tables), added)
  writer = BundleWriter(dst)
  _copy_others(writer, src, set(dropped))
  for t in tables:  # one table and slot in memory at a time
    for slot in (_PARAMETERS,) + t.slots:
      value = source.read(t, slot)
      if layouts is None:
        _write_per_table(writer, prefix, t, slot, value)
      else:
        _write_stacked(writer, prefix, t, layouts[t.name], slot, value)
      del value
  extra_names = [constants.OBJECT_GRAPH_PROTO_KEY]
  extra = [tf.constant(graph.proto.SerializeToString())]
  if layouts is not None:
    extra_names.append(variable_key(prefix, LAYOUTS_NAME))
    extra.append(tf.constant(sc_layout.layouts_to_proto(
        list(layouts.values())).SerializeToString()))
  writer.write(extra_names, [""] * len(extra), extra)
  writer.close()
  return None if layouts is None else list(layouts.values())
