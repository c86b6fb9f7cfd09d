"""``build()``'s HBM check on the emulated TPU: what a TPU places on each
device for the embedding (``sparsecore/hbm.py``) against the active
emulation's slice (``Emulation.slice``), before any table is created.

A TPU refuses a program whose buffers do not fit a device's HBM when it
compiles ("Ran out of memory in memory space hbm. Used X of Y hbm.", OpenXLA
error E1000). The emulated ``TPUEmbedding.build`` (``mid_level.py``) and
``TPUEmbeddingV2.build`` (``sparsecore.py``) call ``check`` after
TensorFlow's own build checks and before the engine creates a variable: a
refused build leaves no table and the TPU's embedding engine unclaimed, so a
corrected object builds after it. Only the lower bound is refused
(``hbm.check``); above 90% of the upper bound it warns.

The shapes counted are those ``build`` fixes: ``per_replica_input_shapes`` /
``per_replica_batch_size`` given, else ``FeatureConfig.output_shape`` and
those fixed so far (the engine's ``_shapes``); a feature whose shape is not
known yet (a build from the first ``enqueue``) counts no activation buffer,
which keeps the count a lower bound.
"""

from __future__ import annotations

import copy
from typing import List, Sequence

import tensorflow as tf
from tensorflow.python.util import nest

from tpu_embed_ext.emulated_tpu import session
from tpu_embed_ext.sparsecore import hbm

__all__ = ["check", "named_feature_config"]


def named_feature_config(feature_config, tables: Sequence, features: Sequence):
  """``feature_config`` with copies of its ``TableConfig``s that carry the
  engine's table names (``table_<i>`` for an unnamed one, as TensorFlow names
  it) and optimizers (the global one where a table has none), so the count's
  messages name every table; the user's objects are never modified.

  ``tables``, ``features``: the engine's (``emulation/tables.py``), in the
  flattened order of ``feature_config``.
  """
  copies = {}
  flat = []
  for config, feature in zip(nest.flatten(feature_config), features):
    if feature.table not in copies:
      table = tables[feature.table]
      copied = copy.copy(table.config)
      copied.name = table.name
      if copied.optimizer is None:
        copied.optimizer = (table.tf_optimizer if table.tf_optimizer is not None
                            else table.optimizer)
      copies[feature.table] = copied
    config = copy.copy(config)
    config.table = copies[feature.table]
    flat.append(config)
  return nest.pack_sequence_as(feature_config, flat)


def check(what: str, sparsecore: bool, feature_config, tables, features,
          shapes: List[tf.TensorShape]) -> None:
  """``hbm.HBMExhaustedError`` (a ``tf.errors.ResourceExhaustedError``, XLA's
  words first) if the embedding cannot fit a device of the active
  emulation's slice; ``hbm.HBMNearlyFullWarning`` above 90%. Nothing outside
  an emulation (no slice)."""
  emulation = session.current()
  slice_ = getattr(emulation, "slice", None)
  if slice_ is None:
    return
  memory = hbm.for_engine(sparsecore, named_feature_config(feature_config, tables, features),
                          None, list(shapes), slice_)
  hbm.check(memory, what, stacklevel=3)  # The user's line that built.
