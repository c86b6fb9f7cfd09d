"""Restoring a checkpoint of another layout into an engine's stacked tables.

``TPUEmbeddingV2`` saves stacked variables (``<stack>``, ``<stack>/<slot>``)
and ``_sparse_core_table_layouts``. TensorFlow 2.21 restores two other kinds
of checkpoint into it through its checkpoint adapter
(``tpu_embedding_v3_checkpoint_adapter.py``, hooked in by
``TPUEmbeddingV2._checkpoint_adapter``): a per-table checkpoint (no layouts:
``TPUEmbedding``, ``TPUEmbeddingForServing``, a CPU model; "unsharded to
sharded") and a stacked one of other layouts ("reshard"). Where a layout
differs it refuses tables that are not the same set (``ValueError: Layouts in
checkpoint and embedding must have the same keys``).

An engine keeps its variables per table (``trackable``), so both kinds come
down to writing each table's value into its own variable. The hook is the
same as TensorFlow's: ``tf.train.Checkpoint.restore`` asks the embedding for
an adapter (``_checkpoint_adapter(path)``) just before it matches the
embedding's children against the checkpoint's. ``Router.adapt`` reads the
checkpoint's layouts there; for a checkpoint of another layout the engine's
``_lookup_dependency`` then answers None for the names the router claims, so
TensorFlow defers those children (``_deferred_dependencies``), and the
router's deferral dict takes each deferred position: it loads the value at
once when the tables exist, or when ``build`` creates them. Each position is
bound to the stacked object it fills, as TensorFlow binds it, so
``assert_consumed`` holds after a stacked restore; after a per-table one it
names only the layouts object, which such a checkpoint does not hold (as
TensorFlow's). Every value is checked (tables, shapes) before the first is
written. Restores pending at ``build`` apply in restore order, TensorFlow's
own deferrals (a checkpoint of this layout) included: the latest wins.

Unlike TensorFlow 2.21 (whose adapter defers a per-table slot under the
stack's parameters name, so slots keep their initial values, and whose
deferral waits for a variable that is already built when restoring after
``build``), every slot is restored, before or after ``build``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base

from tpu_embed_ext.spec import names as derived_names
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.checkpoint import LAYOUTS_NAME

__all__ = ["PLACEMENT_FIELDS", "Router", "differing_field", "layouts_in",
           "unstack"]

_VALUE = trackable_base.VARIABLE_VALUE_KEY
_PARAMETERS = "parameters"

# The fields of a table's layout that decide where its rows are; the rest
# (per_sparse_core_batch_size, num_features) describe inputs, not rows.
PLACEMENT_FIELDS = ("stack", "rows", "dim", "padded_rows", "padded_dim",
                    "row_offset", "rotation", "num_sparse_cores",
                    "num_partitions", "rows_per_shard")


def differing_field(a: sc_layout.TableLayout,
                    b: sc_layout.TableLayout) -> Optional[str]:
  """The first placement field in which two layouts differ, or None."""
  for field in PLACEMENT_FIELDS:
    if getattr(a, field) != getattr(b, field):
      return field
  return None


def layouts_in(path: str) -> Optional[List[sc_layout.TableLayout]]:
  """The SparseCore layouts checkpoint ``path`` holds, or None (per-table).

  As the adapter's ``create_from_checkpoint``: the first key holding
  ``_sparse_core_table_layouts``.
  """
  reader = tf.train.load_checkpoint(path)
  for key in sorted(reader.get_variable_to_dtype_map()):
    if LAYOUTS_NAME in key:
      return sc_layout.layouts_from_proto(reader.get_tensor(key))
  return None


def unstack(value, layout: sc_layout.TableLayout):
  """One table's rows ``[rows, dim]`` out of its stacked variable's value."""
  rows = tf.gather(value, layout.stacked_index(np.arange(layout.rows)))
  return rows[:, :layout.dim]


def _invalid(message: str):
  return tf.errors.InvalidArgumentError(None, None, message)


@dataclasses.dataclass
class _Source:
  """The checkpoint a restore reads: its layouts (None: per table)."""
  path: str
  layouts: Optional[List[sc_layout.TableLayout]]
  same: bool  # its layouts place every row as ours


class Router:
  """Routes a restore's children to an engine's per-table variables.

  Args:
    layouts: the engine's layouts.
  """

  def __init__(self, layouts: Sequence[sc_layout.TableLayout]):
    self._ours = {l.table: l for l in layouts}
    self._source: Optional[_Source] = None
    self._pending: List[Tuple[str, object, _Source]] = []
    self._checked = set()  # restore_uids of the restores already checked
    self._variables = None  # {table: {slot: variable}} once built
    self._tracked: Dict[str, trackable_base.Trackable] = {}

  # --- the hooks the engine calls -------------------------------------------

  def adapt(self, owner, path: str) -> None:
    """``_checkpoint_adapter(path)``: reads the checkpoint's layouts."""
    theirs = layouts_in(path)
    same = False
    if theirs is not None:
      names = {l.table for l in theirs}
      if names != set(self._ours):
        raise ValueError(
            "Layouts in checkpoint and embedding must have the same keys. found "
            f"{sorted(names)} and {sorted(self._ours)} (checkpoint {path}: its "
            "SparseCore tables are not this embedding's). Fix: restore a "
            "checkpoint of the same tables, or one saved per table.")
      same = all(differing_field(l, self._ours[l.table]) is None for l in theirs)
    self._source = _Source(path, theirs, same)
    deferred = owner._deferred_dependencies  # pylint: disable=protected-access
    if not isinstance(deferred, _Deferrals):
      owner._self_unconditional_deferred_dependencies = _Deferrals(self, deferred)  # pylint: disable=protected-access

  def claims(self, name: str) -> bool:
    """Whether the current restore's child ``name`` is the router's to load."""
    source = self._source
    if source is None or source.same:
      return False
    if name == LAYOUTS_NAME:
      return source.layouts is not None
    return self._target(name, source) is not None

  def hold_deferred(self, owner, variables) -> List[Tuple[str, object]]:
    """Takes TensorFlow's deferred restores of the names the stacked objects
    will have (``built`` applies them), so tracking does not apply them first."""
    names = {LAYOUTS_NAME}
    for stack, members in sc_layout.layouts_by_stack(self._ours.values()).items():
      names.update(stack if s == _PARAMETERS else f"{stack}/{s}"
                   for s in variables[members[0].table])
    owner._maybe_initialize_trackable()  # pylint: disable=protected-access
    deferred = owner._deferred_dependencies  # pylint: disable=protected-access
    return [(name, p) for name in sorted(names) for p in deferred.pop(name, ())]

  def built(self, variables: Mapping[str, Mapping[str, tf.Variable]],
            tracked: Mapping[str, trackable_base.Trackable],
            held: Sequence[Tuple[str, object]] = ()) -> None:
    """The engine created (and tracked) its variables: load what waited,
    ``held`` (``hold_deferred``) and the router's own, oldest restore first."""
    self._variables, self._tracked = variables, dict(tracked)
    pending, self._pending = self._pending, []
    waiting = [(p.checkpoint.restore_uid, 0, name, p, None) for name, p in held]
    waiting += [(p.checkpoint.restore_uid, 1, name, p, source)
                for name, p, source in pending]
    for _, routed, name, position, source in sorted(waiting, key=lambda w: w[:2]):
      if routed:
        self._load(name, position, source)
      elif name in self._tracked:
        position.restore(self._tracked[name])

  def waiting(self, deferred_names) -> set:
    """``(table, slot)`` pairs a restore waiting for the build will load: the
    router's own and TensorFlow's deferred ones (``deferred_names``, names of
    this layout's stacked objects)."""
    out = set()
    for name, _, source in self._pending:
      target = self._target(name, source)
      if target is not None:
        out.update((l.table, target[1]) for l in target[0] if l.table in self._ours)
    stacks = sc_layout.layouts_by_stack(self._ours.values())
    for name in deferred_names:
      stack, _, slot = name.rpartition("/") if name not in stacks else (name, "", _PARAMETERS)
      if stack in stacks:
        out.update((l.table, slot) for l in stacks[stack])
    return out

  # --- loading ------------------------------------------------------------

  def _receive(self, name: str, position) -> None:
    source = self._source
    if self._variables is None:
      self._pending.append((name, position, source))
    else:
      self._load(name, position, source)

  def _target(self, name: str, source: _Source):
    """``(tables' layouts in the checkpoint, slot)`` that name ``name`` holds."""
    if source.layouts is None:  # per table: "<table>" or "<table>/<slot>"
      if name in self._ours:
        return [self._ours[name]], _PARAMETERS
      table, _, slot = name.rpartition("/")
      if table in self._ours and slot in derived_names.SLOT_NAMES:
        return [self._ours[table]], slot
      return None
    stacks = sc_layout.layouts_by_stack(source.layouts)
    if name in stacks:
      return stacks[name], _PARAMETERS
    stack, _, slot = name.rpartition("/")
    if stack in stacks and slot in derived_names.SLOT_NAMES:
      return stacks[stack], slot
    return None

  def _load(self, name: str, position, source: _Source) -> None:
    checkpoint = position.checkpoint
    if checkpoint.restore_uid not in self._checked:
      self._check(name, position, source)
      self._checked.add(checkpoint.restore_uid)
    if name == LAYOUTS_NAME:
      self._bind(position, self._tracked.get(LAYOUTS_NAME))
      return
    layouts, slot = self._target(name, source)
    value = position.value_tensors()[_VALUE]
    first = None
    for theirs in layouts:
      variables = self._variables[theirs.table]
      if slot not in variables:
        continue  # a slot this table's optimizer has not: left, as TF does
      table = value if source.layouts is None else unstack(value, theirs)
      variables[slot].assign(table)
      first = first or self._ours[theirs.table]
    if first is not None:
      self._bind(position, self._tracked.get(
          first.stack if slot == _PARAMETERS else f"{first.stack}/{slot}"))

  @staticmethod
  def _bind(position, obj) -> None:
    if obj is not None and position.bind_object(obj):
      obj._update_uid = position.checkpoint.restore_uid  # pylint: disable=protected-access

  def _check(self, name: str, position, source: _Source) -> None:
    """Every value this checkpoint gives the engine, before one is written."""
    checkpoint = position.checkpoint
    proto = checkpoint.object_graph_proto
    # The embedding's node: the one holding this position as child ``name``
    # (TPUEmbeddingForServing also lists its variables in a ``_variables``
    # dict, under other names).
    parent = next(n for n in proto.nodes if any(
        c.node_id == position._proto_id and c.local_name == name  # pylint: disable=protected-access
        for c in n.children))
    children = {c.local_name: proto.nodes[c.node_id] for c in parent.children}

    def shape_of(name):
      node = children[name]
      key = next(a.checkpoint_key for a in node.attributes if a.name == _VALUE)
      return key, list(checkpoint.shape_map[key])

    if source.layouts is None:
      for stack, members in sc_layout.layouts_by_stack(self._ours.values()).items():
        present = [l.table for l in members if l.table in children]
        if present and len(present) != len(members):
          missing = next(l.table for l in members if l.table not in children)
          key = shape_of(present[0])[0].replace(
              f"/{derived_names.escape_local_name(present[0])}/",
              f"/{derived_names.escape_local_name(missing)}/")
          raise tf.errors.NotFoundError(None, None, (
              f"Key {key} not found in checkpoint (checkpoint {source.path} "
              f"holds table '{present[0]}' but not '{missing}' of SparseCore "
              f"stack '{stack}', which is restored as one). Fix: restore a "
              "checkpoint with every table of this embedding."))
        for l in members:
          for name in children:
            target = self._target(name, source)
            if target is None or target[0][0].table != l.table:
              continue
            key, shape = shape_of(name)
            if shape != [l.rows, l.dim]:
              raise _invalid(
                  f"shape in shape_and_slice spec {[l.rows, l.dim]} does not "
                  f"match the shape stored in checkpoint: {shape} (table "
                  f"'{l.table}', key {key} of {source.path}). Fix: restore a "
                  "checkpoint of tables with this vocabulary_size and dim.")
      return
    for stack, members in sc_layout.layouts_by_stack(source.layouts).items():
      for l in members:
        ours = self._ours[l.table]
        if [l.rows, l.dim] != [ours.rows, ours.dim]:
          raise _invalid(
              f"shape in shape_and_slice spec {[ours.rows, ours.dim]} does not "
              f"match the shape stored in checkpoint: {[l.rows, l.dim]} (table "
              f"'{l.table}' in SparseCore stack '{stack}' of {source.path}). "
              "Fix: restore a checkpoint of tables with this vocabulary_size "
              "and dim.")
      for name in children:
        target = self._target(name, source)
        if target is None or target[0][0].stack != stack:
          continue
        key, shape = shape_of(name)
        want = [members[0].stacked_rows, members[0].padded_dim]
        if shape != want:
          raise _invalid(
              f"shape in shape_and_slice spec {want} does not match the shape "
              f"stored in checkpoint: {shape} (stacked table '{name}', key "
              f"{key} of {source.path}: not the shape its own layouts give). "
              "Fix: restore a checkpoint written by TPUEmbeddingV2.")


class _Claimed(list):
  """What the deferral dict hands TensorFlow for a claimed name: appending a
  position gives it to the router instead of leaving it deferred."""

  def __init__(self, router: Router, name: str):
    super().__init__()
    self._router, self._name = router, name

  def append(self, position) -> None:
    self._router._receive(self._name, position)  # pylint: disable=protected-access


class _Deferrals(dict):
  """An engine's ``_deferred_dependencies``: claimed names go to the router."""

  def __init__(self, router: Router, existing):
    super().__init__(existing)
    self._router = router

  def setdefault(self, name, default=None):
    if self._router.claims(name):
      return _Claimed(self._router, name)
    return super().setdefault(name, default)
