"""``TPUEmbeddingV2.compute_sparse_core_stats`` under the emulated TPU.

TensorFlow 2.21 (``tpu_embedding_v3.py``) profiles one chip's batch on the
host: it stacks the tables for ``num_tpu_chips`` chips of ``num_sc_per_chip``
SparseCores, converts the features to SparseCore COO tensors and runs
``GetStatsFromListOfSparseCoreCooTensors`` once per SparseCore of the chip
(the *source*). Each call returns, over the destination SparseCores, the most
ids and the most distinct ids one source sends to one destination; the result
is the maximum over sources, per stacked table: ``({stack: max ids},
{stack: max unique ids})``, as scalar int32 tensors. Those are the quantities
``SparseCoreEmbeddingConfig.max_ids_per_table`` /
``max_unique_ids_per_table`` bound.

Here the counting is ``sparsecore/limits.py``'s (the same counts the emulated
``enqueue`` checks against those limits): the batch is placed as chip 0's,
the other chips empty, and the maximum is taken over chip 0's (source,
destination) pairs. Passing the stats back as limits therefore never fails
the emulated checks for that batch, as on a TPU.
"""

from __future__ import annotations

import copy
import functools
import operator
from typing import Any, Dict, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.util import nest

from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore import limits as sc_limits
from tpu_embed_ext.sparsecore import topology as sc_topology

__all__ = ["compute_sparse_core_stats"]


def _clone(feature_config):
  """A copy with copied tables, so naming the unnamed ones changes nothing of
  the user's (TensorFlow clones them too: ``_clone_feature_config``)."""
  tables = {}
  out = []
  for feature in nest.flatten(feature_config):
    feature = copy.copy(feature)
    if id(feature.table) not in tables:
      tables[id(feature.table)] = copy.copy(feature.table)
    feature.table = tables[id(feature.table)]
    out.append(feature)
  for i, table in enumerate({id(f.table): f.table for f in out}.values()):
    if table.name is None:
      table.name = f"table_{i}"
  return nest.pack_sequence_as(feature_config, out)


def _samples_and_ids(where: str, x) -> Tuple[np.ndarray, np.ndarray, int]:
  """(sample of each id, ids, batch) of one feature's eager input."""
  if isinstance(x, tf.SparseTensor):
    if x.indices.shape.rank != 2 or x.shape.rank != 2:
      raise errors.InputError(
          f"compute_sparse_core_stats: {where} is a SparseTensor of rank "
          f"{x.shape.rank}; the emulation profiles rank 2 ([batch, ids]). Fix: "
          "reshape it to [batch, ids].")
    return (x.indices[:, 0].numpy(), x.values.numpy(), int(x.dense_shape[0]))
  if isinstance(x, tf.RaggedTensor):
    return (x.value_rowids().numpy(), x.flat_values.numpy(), int(x.nrows()))
  if isinstance(x, tf.Tensor):
    ids = tf.reshape(x, [-1]).numpy()
    return np.arange(len(ids)), ids, len(ids)
  # TensorFlow's own phrase (_convert_input_feature_to_list_of_coo_tensors).
  raise errors.InputError(
      f"Input of unknown type {type(x)}. Please only pass Tensor, SparseTensor "
      f"or RaggedTensor as input to embedding lookup. ({where}: "
      "compute_sparse_core_stats profiles one chip's batch. Fix: pass one "
      "replica's values, e.g. strategy.experimental_local_results(x)[0].)")


def compute_sparse_core_stats(features: Any, feature_config, num_tpu_chips: int,
                              num_sc_per_chip: int = 4, optimizer=None,
                              sparse_core_embedding_config=None
                              ) -> Tuple[Dict[str, tf.Tensor], Dict[str, tf.Tensor]]:
  """``({stack: max ids}, {stack: max unique ids})`` of one chip's batch (module doc)."""
  if not tf.executing_eagerly():
    raise errors.InputError(
        "compute_sparse_core_stats profiles a batch eagerly (TensorFlow runs it "
        "on the host before the TPUEmbeddingV2 is made). Fix: call it outside "
        "tf.function.")
  config = _clone(feature_config)
  flat_features = nest.flatten_with_joined_string_paths(config)
  flat_inputs = nest.flatten(features)
  if len(flat_inputs) != len(flat_features):
    raise errors.InputError(
        f"compute_sparse_core_stats got {len(flat_inputs)} inputs for "
        f"{len(flat_features)} features. Fix: pass features with the structure "
        "of feature_config.")
  topology = sc_topology.Topology(int(num_tpu_chips), int(num_sc_per_chip),
                                  name=f"{num_tpu_chips}x{num_sc_per_chip}")
  stacking = not getattr(sparse_core_embedding_config, "disable_table_stacking", False)
  layouts = sc_layout.compute_layouts(
      sc_layout.stacking_inputs(config, optimizer), topology, stacking=stacking)
  ids_per_feature = []
  for (path, feature), x in zip(flat_features, flat_inputs):
    samples, ids, batch = _samples_and_ids(f"feature '{path}'", x)
    per_chip = functools.reduce(operator.mul, feature.output_shape or [batch])
    # One chip's batch, placed as chip 0 of num_tpu_chips.
    ids_per_feature.append(sc_limits.FeatureIds(
        feature.table.name, np.asarray(samples, np.int64), np.asarray(ids, np.int64),
        per_chip * topology.chips, path))
  counts = sc_limits.count_ids(ids_per_feature, layouts, topology)
  max_ids = {c.stack: tf.constant(int(c.ids[0].max()), tf.int32) for c in counts}
  max_unique = {c.stack: tf.constant(int(c.unique_ids[0].max()), tf.int32)
                for c in counts}
  for layout in layouts:  # stacks no feature reached: 0, as TensorFlow's
    max_ids.setdefault(layout.stack, tf.constant(0, tf.int32))
    max_unique.setdefault(layout.stack, tf.constant(0, tf.int32))
  return max_ids, max_unique
