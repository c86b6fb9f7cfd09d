"""``TPUEmbeddingV2``'s private members over the engine's per-table variables.

TensorFlow's ``TPUEmbeddingV2`` (``tpu_embedding_v3.py``, TF 2.21) keeps
``_variables``: ``{stacked table name: {"parameters": v, <slot>: v}}``, each
``v`` a ``TPUEmbeddingShardedVariable`` whose ``values`` are one shard per
chip; and it fills them, when no restore provides a value, from
``_batch_initialize_tables()``, called once, without arguments, from the
first variable's initializer in ``build``: ``{stack: {slot: [shard per
chip]}}``. Tests and libraries read both (TensorFlow's own
``tpu_embedding_v3_checkpoint_test.py`` replaces the hook to prove a restore
before ``build`` initialises nothing).

The emulation keeps its variables per table (the engine's ``_table_vars``).
The emulated ``TPUEmbeddingV2._variables`` answers with ``stacked_views``:
``StackedTable``s, views of the stacked layout that are instances of
TensorFlow's real ``TPUEmbeddingShardedVariable``. ``initialize_stacked``
calls ``_batch_initialize_tables`` when and as TensorFlow does, and writes
what a replaced hook returns into the tables (the default returns the values
the tables were initialised with).
"""

from __future__ import annotations

from typing import Dict, Set, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.tpu import tpu_embedding_v3
from tensorflow.python.trackable import base as trackable_base

from tpu_embed_ext import errors

__all__ = ["StackedTable", "stacked_views",
           "uninitialized", "initialize_stacked", "default_initial_values"]

_WRITES = ("assign", "assign_add", "assign_sub", "scatter_sub", "scatter_add",
           "scatter_mul", "scatter_div", "scatter_min", "scatter_max",
           "scatter_update", "scatter_nd_sub", "scatter_nd_add",
           "scatter_nd_update", "batch_scatter_update")


class StackedTable(tpu_embedding_v3.TPUEmbeddingShardedVariable):
  """A read-only view of one stacked variable, as ``TPUEmbeddingShardedVariable``.

  ``values`` holds one shard per replica (the stacked rows split evenly, as
  the TPU keeps them on its chips), read when asked; ``read_value()`` /
  ``numpy()`` the whole stacked variable, padding included (on a TPU, reading
  it on the host raises NotImplementedError). Converted to a tensor it is the
  first shard, as TensorFlow's. Writes raise: the tables are kept per table.
  In a checkpoint of its own it is the stacked variable, and restoring it
  writes the tables (the embedding's own checkpoint does not go through it).
  The base ``__init__`` is not run: it wants one variable per shard, which
  would be copies.
  """

  def __init__(self, name: str, source, num_shards: int):  # pylint: disable=super-init-not-called
    self._view_name = name
    self._source = source  # the engine's stacked checkpoint object
    self._num_shards = num_shards
    self._distribute_strategy = tf.distribute.get_strategy()
    self._aggregation = tf.VariableAggregation.NONE
    self._packed_var = None
    self._common_name = name

  # DistributedValues reads its shards from ``_values``.
  @property
  def _values(self):
    return tuple(tf.split(self.read_value(), self._num_shards, axis=0))

  @property
  def _primary(self):
    return self._values[0]

  def _get(self):
    return self._values[0]

  @property
  def name(self) -> str:
    return self._view_name

  @property
  def dtype(self):
    return tf.float32

  @property
  def shape(self) -> tf.TensorShape:
    return tf.TensorShape(self._source._shape)  # pylint: disable=protected-access

  @property
  def trainable(self) -> bool:
    return False  # as upstream's (created with trainable=False)

  def read_value(self) -> tf.Tensor:
    return self._source._serialize_to_tensors()[trackable_base.VARIABLE_VALUE_KEY]  # pylint: disable=protected-access

  def value(self) -> tf.Tensor:
    return self.read_value()

  def numpy(self) -> np.ndarray:
    return self.read_value().numpy()

  def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
    del dtype, name, as_ref
    return self._values[0]  # upstream's host conversion: the first shard

  # Saved in a checkpoint of its own, a view is the stacked variable; restored,
  # it writes the tables (never a silent no-op).
  def _gather_saveables_for_checkpoint(self):
    return trackable_base.Trackable._gather_saveables_for_checkpoint(self)  # pylint: disable=protected-access

  def _serialize_to_tensors(self):
    return self._source._serialize_to_tensors()  # pylint: disable=protected-access

  def _restore_from_tensors(self, restored_tensors):
    return self._source._restore_from_tensors(restored_tensors)  # pylint: disable=protected-access

  def __repr__(self) -> str:
    return (f"<StackedTable '{self._view_name}' shape={self.shape.as_list()} "
            f"shards={self._num_shards}>")

  def _refuse_write(self, *args, **kwargs):
    del args, kwargs
    raise errors.ConfigError(
        f"stacked table '{self._view_name}' is a read-only view in the emulated "
        "TPUEmbeddingV2 (its tables are kept per table). Fix: restore a "
        "checkpoint (tf.train.Checkpoint(embedding=...).restore) to change "
        "the tables.")


for _write in _WRITES:
  setattr(StackedTable, _write, StackedTable._refuse_write)  # pylint: disable=protected-access


def stacked_views(owner) -> Dict[str, Dict[str, StackedTable]]:
  """``{stack: {"parameters": view, <slot>: view}}`` of a built ``owner``."""
  tracked = owner._unconditional_dependency_names  # pylint: disable=protected-access
  out = {}
  for stack in owner._stacks:  # pylint: disable=protected-access
    out[stack] = {}
    for slot in ("parameters", *owner._slot_names(stack)):  # pylint: disable=protected-access
      name = stack if slot == "parameters" else f"{stack}/{slot}"
      out[stack][slot] = StackedTable(name, tracked[name],
                                      owner._topology.chips)  # pylint: disable=protected-access
  return out




def uninitialized(owner) -> Set[Tuple[str, str]]:
  """``(stack, slot)`` pairs of an unbuilt ``owner`` that no waiting restore
  fills: those ``build`` initialises (computed before it builds)."""
  sc = owner._sparsecore  # pylint: disable=protected-access
  owner._maybe_initialize_trackable()  # pylint: disable=protected-access
  deferred = owner._deferred_dependencies  # pylint: disable=protected-access
  restored = sc.router.waiting(name for name, p in deferred.items() if p)
  out = set()
  for stack in owner._stacks:  # pylint: disable=protected-access
    members = [l.table for l in sc.layouts if l.stack == stack]
    for slot in sc.padding[members[0]]:
      if any((t, slot) not in restored for t in members):
        out.add((stack, slot))
  return out


def default_initial_values(owner) -> Dict[str, Dict[str, list]]:
  """What the default ``_batch_initialize_tables`` returns: every stacked
  variable as built, one shard per chip."""
  return {stack: {slot: list(view.values) for slot, view in slots.items()}
          for stack, slots in stacked_views(owner).items()}


def initialize_stacked(owner, pending: Set[Tuple[str, str]], default) -> None:
  """Calls ``owner._batch_initialize_tables()`` (once, if ``pending``) and
  writes its shards of each pending ``(stack, slot)`` into the tables.

  ``default``: the class's own hook. Its values are what the tables were
  initialised with, so it is not called (only a replaced hook can observe
  the call, and a replaced one's values are written).
  """
  hook = owner._batch_initialize_tables  # pylint: disable=protected-access
  if not pending or getattr(hook, "__func__", None) is default:
    return  # the default's values are the tables' already: not computed
  tensors = hook()
  tracked = owner._unconditional_dependency_names  # pylint: disable=protected-access
  chips = owner._topology.chips  # pylint: disable=protected-access
  checked = {}
  for stack, slot in sorted(pending):
    name = stack if slot == "parameters" else f"{stack}/{slot}"
    target = tracked[name]
    try:
      shards = tensors[stack][slot]
    except (KeyError, TypeError) as e:
      raise errors.ConfigError(
          f"_batch_initialize_tables() returned no shards for stacked table "
          f"'{stack}', slot '{slot}' ({e!r}). Fix: return {{stacked table name: "
          f"{{slot: [one tensor per chip]}}}} for every stacked table.") from None
    value = tf.concat([tf.convert_to_tensor(s, tf.float32) for s in shards], 0)
    if len(shards) != chips or tuple(value.shape) != tuple(target._shape):  # pylint: disable=protected-access
      raise errors.ConfigError(
          f"_batch_initialize_tables() returned {len(shards)} shard(s) of "
          f"total shape {tuple(value.shape)} for stacked table '{stack}', slot "
          f"'{slot}'; it needs {chips} shards (one per chip) of shape "
          f"{(target._shape[0] // chips, target._shape[1])}. Fix: return one "  # pylint: disable=protected-access
          "shard per chip of the stacked layout.")
    checked[name] = (target, value)
  for target, value in checked.values():
    target._restore_from_tensors({trackable_base.VARIABLE_VALUE_KEY: value})  # pylint: disable=protected-access
