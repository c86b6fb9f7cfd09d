"""An embedding's tables, slots and shapes, read from a checkpoint alone.

``convert-checkpoint`` without ``--config`` (a checkpoint written by a
TensorFlow program, which has no YAML spec of ours): the embedding object is
found in the checkpoint's object graph and its children name the tables
(``<table>``, ``<table>/<slot>``, as ``TPUEmbedding``, ``CPUEmbedding`` and
``TPUEmbeddingForServing`` track them) or the stacks and their layouts
(``TPUEmbeddingV2``). What a checkpoint does not hold is an optimizer's
settings, so stacking groups tables by their slots (``TPUEmbeddingV2``
groups them by optimizer settings) and padding holds each slot's TensorFlow
default initial value.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from tpu_embed_ext.spec import names as derived_names
from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.checkpoint import (LAYOUTS_NAME, ObjectGraph,
                                                 _graph, find_objects)

__all__ = ["StoredTable", "DEFAULT_SLOT_INITIAL", "find_embedding_object",
           "stored_tables"]

_VALUE = "VARIABLE_VALUE"
# TensorFlow's defaults (tpu_embedding_v2_utils): Adagrad's, AdagradMomentum's
# and FTRL's initial_accumulator_value; every other slot starts at 0.
DEFAULT_SLOT_INITIAL = {"accumulators": 0.1}


@dataclasses.dataclass(frozen=True)
class StoredTable:
  name: str
  rows: int
  dim: int
  slots: Tuple[str, ...]


def _leaf_shapes(proto, node, shapes) -> Optional[Dict[str, List[int]]]:
  """``{child: shape}`` of the children of ``node`` that are variables, or None
  if a child holds a value otherwise. Children without a value of their own
  are passed over (``TPUEmbeddingForServing``'s ``_feature_config``, and its
  ``_variables`` dict, which holds the same variables again)."""
  out = {}
  for c in proto.nodes[node].children:
    child = proto.nodes[c.node_id]
    if not child.attributes:
      continue
    keys = [a.checkpoint_key for a in child.attributes if a.name == _VALUE]
    if child.children or len(keys) != 1 or keys[0] not in shapes:
      return None
    out[c.local_name] = list(shapes[keys[0]])
  return out


def _looks_per_table(children: Dict[str, List[int]]) -> bool:
  tables = {n for n in children if "/" not in n}
  if not tables or any(len(children[n]) != 2 for n in children):
    return False
  slotted = [n for n in children if "/" in n]
  return bool(slotted) and all(
      n.rpartition("/")[0] in tables and n.rpartition("/")[2] in derived_names.SLOT_NAMES
      for n in slotted)


def find_embedding_object(path: str) -> str:
  """The path of the one embedding object in checkpoint ``path``.

  An embedding: an object with ``_sparse_core_table_layouts`` (stacked), or
  one whose children are all 2-D variables, some of them optimizer slots
  ``<table>/<slot>`` of a sibling table (per table).
  """
  proto = _graph(path)
  shapes = tf.train.load_checkpoint(path).get_variable_to_shape_map()

  def holds(node, names):
    if LAYOUTS_NAME in names:
      return True
    leaves = _leaf_shapes(proto, node, shapes)
    return leaves is not None and _looks_per_table(leaves)
  found = find_objects(proto, holds)
  if len(found) == 1:
    return found[0]
  if not found:
    raise errors.ConfigError(
        f"checkpoint {path} has no object that holds embedding tables (per table: "
        "2-D variables with optimizer slots '<table>/<slot>'; stacked: "
        f"{LAYOUTS_NAME}). Fix: pass --prefix with the embedding's path in the "
        "checkpoint, or --config with its tables (tables trained with SGD have "
        "no slot to recognise them by).")
  raise errors.ConfigError(
      f"checkpoint {path} holds {len(found)} objects that look like embeddings: "
      f"{', '.join(sorted(found))}. Fix: pass --prefix with one of them.")


def stored_tables(path: str, prefix: Optional[str] = None
                  ) -> Tuple[str, List[StoredTable]]:
  """``(prefix, tables)`` of the embedding at ``prefix`` (None: found)."""
  prefix = prefix or find_embedding_object(path)
  graph = ObjectGraph(path, prefix)
  children = graph.children()
  shapes = tf.train.load_checkpoint(path).get_variable_to_shape_map()
  def slots_of(name):
    return tuple(s for s in derived_names.SLOT_NAMES
                 if derived_names.local_name(name, s) in children)
  if LAYOUTS_NAME in children:
    layouts = sc_layout.layouts_from_proto(tf.train.load_checkpoint(path).get_tensor(
        derived_names.variable_key(prefix, LAYOUTS_NAME)))
    return prefix, [StoredTable(l.table, l.rows, l.dim, slots_of(l.stack))
                    for l in sorted(layouts, key=lambda l: l.table)]
  proto = _graph(path)
  valued = {n for n, i in children.items() if proto.nodes[i].attributes}
  tables = []
  for name in sorted(n for n in valued if "/" not in n):
    key = derived_names.variable_key(prefix, name)
    shape = list(shapes.get(key, []))
    if len(shape) != 2:
      raise errors.ConfigError(
          f"'{name}' in the embedding object '{prefix}' of checkpoint {path} is "
          f"not a table (shape {shape}, not [rows, dim]). Fix: pass --config with "
          "the tables, or --prefix with the embedding's path.")
    tables.append(StoredTable(name, shape[0], shape[1], slots_of(name)))
  return prefix, tables


def stacking_inputs(tables: List[StoredTable]) -> List[sc_layout.StackingInput]:
  """The stacker's inputs: name order, grouped by optimizer slots."""
  return [sc_layout.StackingInput(t.name, t.rows, t.dim, group="slots:" + ",".join(t.slots))
          for t in sorted(tables, key=lambda t: t.name)]
