"""Checkpoint plumbing for conversions: keys, the object graph, streamed slices.

A TF2 checkpoint is a tensor bundle plus an object graph
(``_CHECKPOINTABLE_OBJECT_GRAPH``) that ``tf.train.Checkpoint.restore`` walks
from the root. Converting the embedding's tables therefore rewrites the
embedding object's children in that graph and writes their tensors; every
other object and tensor is copied unchanged.

Tensors are written one table at a time, each into its own temporary bundle
(a stacked variable as one slice per SparseCore shard), then merged with
``MergeV2Checkpoints``, which joins the slices of a key across bundles; they
are read back with ``RestoreV2`` slice specs. No step holds more than one
table's tensors, so a checkpoint larger than memory converts.
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2
from tensorflow.python.trackable import constants

from tpu_embed_ext import errors
from tpu_embed_ext.spec.names import LAYOUTS_NAME, variable_key

__all__ = ["LAYOUTS_NAME", "BundleWriter", "ObjectGraph", "embedding_paths", "find_objects",
           "find_embedding", "read_rows", "slice_spec", "variable_key"]

_VALUE = "VARIABLE_VALUE"


def slice_spec(shape: Sequence[int], start: int, length: int) -> str:
  """A ``SaveV2``/``RestoreV2`` spec for rows ``[start, start + length)``."""
  return (" ".join(str(d) for d in shape) + f" {start},{length}"
          + ":-" * (len(shape) - 1))


def read_rows(path: str, key: str, shape: Sequence[int],
              blocks: Iterable[Tuple[int, int]]) -> List[np.ndarray]:
  """Rows ``[start, start + length)`` of ``key`` for each ``(start, length)``."""
  blocks = list(blocks)
  out = tf.raw_ops.RestoreV2(
      prefix=path, tensor_names=[key] * len(blocks),
      shape_and_slices=[slice_spec(shape, s, n) for s, n in blocks],
      dtypes=[tf.float32] * len(blocks))
  return [t.numpy() for t in out]


def _graph(path: str) -> trackable_object_graph_pb2.TrackableObjectGraph:
  reader = tf.train.load_checkpoint(path)
  if not reader.has_tensor(constants.OBJECT_GRAPH_PROTO_KEY):
    raise errors.ConfigError(
        f"{path} is not an object-based (TF2) checkpoint: it has no "
        f"{constants.OBJECT_GRAPH_PROTO_KEY}. Fix: convert a checkpoint "
        "written by tf.train.Checkpoint.")
  return trackable_object_graph_pb2.TrackableObjectGraph.FromString(
      reader.get_tensor(constants.OBJECT_GRAPH_PROTO_KEY))


def embedding_paths(path: str, table_names: Iterable[str]) -> List[str]:
  """Paths of the objects in checkpoint ``path`` that hold an embedding's tables.

  An object qualifies when it has a child per table (per-table keys, as
  ``TPUEmbedding`` and ``CPUEmbedding`` save them) or the SparseCore layouts
  (a stacked ``TPUEmbeddingV2``). Each object is named once, by its shortest
  path from the root (``train``'s checkpoints: ``model/embedding/embedding``;
  ``tf.train.Checkpoint(embedding=e)``: ``embedding``).
  """
  tables = set(table_names)
  return find_objects(_graph(path), lambda node, names: (
      LAYOUTS_NAME in names or bool(tables and tables <= names)))


def find_objects(proto, holds) -> List[str]:
  """Paths of the objects of an object graph for which ``holds(node, names
  of its children)``, each by its shortest path from the root; the search
  does not go below an object that holds."""
  seen, found, queue = {0}, [], [(0, "")]
  while queue:  # Breadth first: the first path to reach a node is a shortest.
    node, where = queue.pop(0)
    if where and holds(node, {c.local_name for c in proto.nodes[node].children}):
      found.append(where)
      continue
    for c in proto.nodes[node].children:
      if c.node_id not in seen:
        seen.add(c.node_id)
        queue.append((c.node_id, f"{where}/{c.local_name}" if where else c.local_name))
  return found


def find_embedding(path: str, table_names: Iterable[str]) -> str:
  """The one embedding object's path in the checkpoint, or an error listing them."""
  table_names = sorted(table_names)
  found = embedding_paths(path, table_names)
  if len(found) == 1:
    return found[0]
  if not found:
    raise errors.ConfigError(
        f"checkpoint {path} has no object holding the tables "
        f"{', '.join(table_names)} (per-table) or SparseCore layouts. Fix: "
        "convert a checkpoint trained with this config, or pass --prefix with "
        "the embedding's path in the checkpoint.")
  raise errors.ConfigError(
      f"checkpoint {path} holds {len(found)} embeddings with these tables: "
      f"{', '.join(sorted(found))}. Fix: pass --prefix with one of them.")


class ObjectGraph:
  """The checkpoint's object graph, with the embedding object's variables swapped."""

  def __init__(self, path: str, prefix: str):
    self.proto = _graph(path)
    self.prefix = prefix
    node = 0
    for part in prefix.split("/"):
      children = {c.local_name: c.node_id for c in self.proto.nodes[node].children}
      if part not in children:
        raise errors.ConfigError(
            f'checkpoint {path} has no object "{prefix}" (no child "{part}").'
            f"{errors.did_you_mean(part, children)} Fix: leave --prefix out "
            "to find the embedding, or pass its path in the checkpoint "
            '(tf.train.Checkpoint(embedding=...): "embedding"; train\'s '
            'checkpoints: "model/embedding/embedding").')
      node = children[part]
    self.node = node

  def children(self) -> Dict[str, int]:
    return {c.local_name: c.node_id for c in self.proto.nodes[self.node].children}

  def replace(self, remove: Iterable[str], add: Iterable[str]) -> List[str]:
    """Drops the embedding's children ``remove``, adds variables ``add``.

    Returns the bundle keys the dropped children held. Nodes are renumbered
    so the graph holds no unreachable node.
    """
    remove = set(remove)
    children = self.children()
    dropped = {children[name] for name in remove}
    keys = [a.checkpoint_key for i in dropped for a in self.proto.nodes[i].attributes]
    old = self.proto
    keep = [i for i in range(len(old.nodes)) if i not in dropped]
    new_id = {i: n for n, i in enumerate(keep)}
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    for i in keep:
      node = graph.nodes.add()
      node.CopyFrom(old.nodes[i])
      del node.children[:]
      for c in old.nodes[i].children:
        if c.node_id in new_id:
          node.children.add(node_id=new_id[c.node_id], local_name=c.local_name)
      for s in node.slot_variables:
        s.original_variable_node_id = new_id[s.original_variable_node_id]
        s.slot_variable_node_id = new_id[s.slot_variable_node_id]
    self.node = new_id[self.node]
    for name in add:
      graph.nodes[self.node].children.add(node_id=len(graph.nodes), local_name=name)
      node = graph.nodes.add()
      node.attributes.add(name=_VALUE, full_name=name,
                          checkpoint_key=variable_key(self.prefix, name))
      node.has_checkpoint_values.value = True
    self.proto = graph
    return keys


class BundleWriter:
  """Writes a checkpoint as temporary bundles, merged into one by ``close``."""

  def __init__(self, path: str):
    self.path = path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self._dir = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(
        os.path.abspath(path)))
    self._parts: List[str] = []

  def write(self, names: Sequence[str], specs: Sequence[str], tensors: Sequence) -> None:
    """One bundle: ``tensors[i]`` as ``names[i]`` (slice ``specs[i]``, "" = whole)."""
    part = os.path.join(self._dir, f"part{len(self._parts)}")
    tf.raw_ops.SaveV2(prefix=part, tensor_names=list(names),
                      shape_and_slices=list(specs), tensors=list(tensors))
    self._parts.append(part)

  def close(self) -> None:
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=self._parts,
                                  destination_prefix=self.path, delete_old_dirs=True)
    if os.path.isdir(self._dir):
      os.rmdir(self._dir)
