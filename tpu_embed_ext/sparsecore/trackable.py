"""Per-table variables saved and restored in ``TPUEmbeddingV2``'s stacked layout.

An engine keeps one variable per table and slot, and tracks these objects
instead: each stands for one stacked variable (``<stack>`` or
``<stack>/<slot>``) and builds it from the tables' variables when a checkpoint
is written, and writes the tables' variables back from it when one is
restored (the pattern of ``tpu_embedding_v3_utils.SparseCoreStackedTableTrackable``).
A third object holds ``_sparse_core_table_layouts``. The engine itself is
unchanged: its variables, lookups and updates stay per table.
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base

from tpu_embed_ext.spec import names
from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.host import checkpoint_scan
from tpu_embed_ext.sparsecore import restore
from tpu_embed_ext.sparsecore.checkpoint import LAYOUTS_NAME
from tpu_embed_ext.sparsecore.convert import checkpoint_layouts

__all__ = ["check_checkpoint", "check_layouts", "track_stacked"]

_PARAMETERS = "parameters"


class _StackedVariable(trackable_base.Trackable):
  """One stacked variable of a SparseCore checkpoint, backed by per-table variables."""

  def __init__(self, name: str, parts):
    """``parts``: ``[(layout, variable, padding value)]`` in stack order."""
    self._name = name
    self._parts = parts
    first = parts[0][0]
    self._shape = (first.stacked_rows, first.padded_dim)
    # perm[stacked row] = row of the concatenated padded tables.
    perm = np.empty(first.stacked_rows, np.int64)
    start = 0
    for layout, _, _ in parts:
      perm[layout.stacked_index(np.arange(layout.padded_rows))] = (
          start + np.arange(layout.padded_rows))
      start += layout.padded_rows
    self._perm = perm

  def _serialize_to_tensors(self):
    padded = []
    for layout, var, fill in self._parts:
      value = tf.convert_to_tensor(var)
      padded.append(tf.pad(value, [[0, layout.padded_rows - layout.rows],
                                   [0, layout.padded_dim - layout.dim]],
                           constant_values=fill))
    stacked = tf.gather(tf.concat(padded, axis=0), self._perm)
    return {trackable_base.VARIABLE_VALUE_KEY: stacked}

  def _restore_from_tensors(self, restored_tensors):
    value = restored_tensors[trackable_base.VARIABLE_VALUE_KEY]
    if tuple(value.shape) != self._shape:
      raise errors.ConfigError(
          f"stacked table '{self._name}': the checkpoint holds shape "
          f"{list(value.shape)}, this engine's SparseCore layout needs "
          f"{list(self._shape)}. Fix: convert the checkpoint to this topology "
          "(python -m tpu_embed_ext convert-checkpoint --topology ...).")
    ops = []
    for layout, var, _ in self._parts:
      rows = tf.gather(value, layout.stacked_index(np.arange(layout.rows)))
      ops.append(var.assign(rows[:, :layout.dim]))
    return tf.group(ops)


class _Layouts(trackable_base.Trackable):
  """The ``_sparse_core_table_layouts`` value: must equal the engine's own."""

  def __init__(self, layouts):
    self._layouts = list(layouts)
    self._value = sc_layout.layouts_to_proto(self._layouts).SerializeToString()

  def _serialize_to_tensors(self):
    return {trackable_base.VARIABLE_VALUE_KEY: tf.constant(self._value)}

  def _restore_from_tensors(self, restored_tensors):
    stored = restored_tensors[trackable_base.VARIABLE_VALUE_KEY].numpy()
    check_layouts(sc_layout.layouts_from_proto(stored), self._layouts)
    return tf.no_op()


def _describe(l: sc_layout.TableLayout) -> str:
  return (f"{l.num_sparse_cores} SparseCores on {l.num_partitions} chips, stack "
          f"'{l.stack}', {l.padded_rows} x {l.padded_dim} padded, offset "
          f"{l.row_offset}, rotation {l.rotation}")


def check_layouts(stored: Sequence[sc_layout.TableLayout],
                  ours: Sequence[sc_layout.TableLayout]) -> None:
  """Raises ConfigError unless a checkpoint's layouts place every row as ``ours``.

  Only the fields that place rows count (``restore.PLACEMENT_FIELDS``): the
  batch size and feature count a layout also records do not move a row.
  """
  theirs = {l.table: l for l in stored}
  for l in ours:
    if l.table not in theirs:
      raise errors.ConfigError(
          f"table '{l.table}' is not in the checkpoint's SparseCore layouts. Fix: "
          "restore a checkpoint of the same tables.")
    field = restore.differing_field(theirs[l.table], l)
    if field is not None:
      raise errors.ConfigError(
          f"table '{l.table}': the checkpoint's SparseCore layout has {field} "
          f"{getattr(theirs[l.table], field)}, this engine's has "
          f"{getattr(l, field)} (checkpoint: {_describe(theirs[l.table])}; "
          f"engine: {_describe(l)}). Fix: convert the checkpoint to this "
          "topology (python -m tpu_embed_ext convert-checkpoint --topology ...).")


def check_checkpoint(path: str, layouts: Sequence[sc_layout.TableLayout],
                     prefix: str = "embedding") -> None:
  """``check_layouts`` on checkpoint ``path`` before restoring it, and every
  stacked table and slot finite (``checkpoint_scan``); changes nothing.

  Stricter than ``tf.train.Checkpoint``'s restore (``restore.Router``), which
  also reads a checkpoint saved per table or of another layout: ``train``
  resumes its own checkpoints only."""
  stored = checkpoint_layouts(path, prefix)
  if stored is None:
    raise errors.ConfigError(
        f"checkpoint {path} holds per-table keys, not a SparseCore layout. Fix: "
        "convert it (python -m tpu_embed_ext convert-checkpoint --topology ...).")
  check_layouts(stored, layouts)
  described = {}
  for stack, members in sc_layout.layouts_by_stack(layouts).items():
    tables = ", ".join(f"'{l.table}'" for l in members)
    for slot in (None, *names.SLOT_NAMES):
      what = "" if slot is None else f" (slot '{slot}')"
      described[names.checkpoint_key(prefix, stack, slot)] = (
          f"SparseCore stack '{stack}' of table(s) {tables}{what}")
  checkpoint_scan.check_finite(path, described)


def track_stacked(owner, variables: Mapping[str, Mapping[str, tf.Variable]],
                  layouts: Sequence[sc_layout.TableLayout],
                  padding: Mapping[str, Mapping[str, float]]) -> Dict[str, object]:
  """Tracks the stacked form of ``variables`` on ``owner``; returns what it tracked.

  Args:
    owner: the embedding object (a Trackable); its checkpoint keys become
      ``TPUEmbeddingV2``'s.
    variables: ``{table: {"parameters": var, <slot>: var}}``, not tracked by
      ``owner`` themselves.
    layouts: every table's layout.
    padding: ``{table: {slot: value}}``: what padding rows and columns hold
      (0 for parameters, the slot's initial value).
  """
  tracked = {}
  for stack, members in sc_layout.layouts_by_stack(layouts).items():
    for slot in variables[members[0].table]:
      name = stack if slot == _PARAMETERS else f"{stack}/{slot}"
      tracked[name] = _StackedVariable(name, [
          (l, variables[l.table][slot], padding[l.table][slot]) for l in members])
  tracked[LAYOUTS_NAME] = _Layouts(layouts)
  for name, obj in tracked.items():
    owner._track_trackable(obj, name=name)  # pylint: disable=protected-access
  return tracked
