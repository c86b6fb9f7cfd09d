"""``EmbeddingLayer`` in a Keras weights file (``model.save``, ``save_weights``).

Keys (``spec.names.weights_key``): ``<table>`` a table, ``<table>.<slot>``
one of its optimizer slots (``%``, ``/`` and a name ``.`` percent-encoded:
HDF5 reads ``/`` as a group), ``.step`` the table step, ``.gradient_sink``
the sink. No two tables share a key (refused when the spec is made).
Loading checks every table, slot and shape before the first variable is
written.
"""

from __future__ import annotations

import weakref
from typing import Dict

import numpy as np
import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.spec.names import SINK_KEY, SLOT_NAMES, STEP_KEY, weights_key

__all__ = ["keyed_variables", "save", "load", "STEP_KEY", "SINK_KEY"]


def keyed_variables(layer) -> Dict[str, tf.Variable]:
  """Every saved variable by its key in a Keras weights file.

  ``<table>`` is a table, ``<table>.<slot>`` one of its optimizer slots
  (``spec.names.weights_key``), ``.step`` the table step,
  ``.gradient_sink`` the sink.
  """
  if not layer._adapter.keras_weights:
    raise errors.ConfigError(
        f"EmbeddingLayer '{layer.name}': Keras weight files of a TPU engine "
        "are not supported (not run on a TPU). Fix: save with "
        "tf.train.Checkpoint, whose keys equal TPUEmbedding's.")
  state = {}
  for table, variables in layer.embedding.variables.items():
    state[weights_key(table)] = variables["parameters"]
    state.update({weights_key(table, slot): variable
                  for slot, variable in variables.items()
                  if slot != "parameters"})
  state[STEP_KEY] = layer.embedding.step
  state[SINK_KEY] = layer.gradient_sink
  return state


def save(layer, store) -> None:
  """Writes tables, slots, the table step and the sink (see ``keyed_variables``)."""
  for key, variable in keyed_variables(layer).items():
    store[key] = np.asarray(variable.numpy())


# {layer: (the store it failed to load from, the error)}. Keras visits a
# layer again under its other paths after it failed to load (saving_lib's
# _load_state marks only loaded layers visited): in a subclassed model the
# second path ("layers/<name>") holds nothing, and Keras reports the last
# error. Keras hands every path the same store object (H5IOStore.get returns
# itself), so an empty visit of that store repeats the first error.
_failures: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def load(layer, store) -> None:
  """Restores what ``save_own_variables`` wrote, or changes nothing.

  Every table, slot and shape is checked before the first variable is
  written; a mismatch names the table.
  """
  failed = _failures.pop(layer, None)
  if failed is not None and failed[0]() is store and not list(store.keys()):
    raise failed[1]
  try:
    _load(layer, store)
  except errors.ConfigError as e:
    try:
      _failures[layer] = (weakref.ref(store), e)
    except TypeError:
      pass  # a store without weak references (a dict): visited once
    raise


def _load(layer, store) -> None:
  state = keyed_variables(layer)
  stored = set(store.keys())
  owner = {STEP_KEY: None, SINK_KEY: None}
  for table, variables in layer.embedding.variables.items():
    owner.update({weights_key(table, s): (table, s) for s in variables})
  for table, variables in layer.embedding.variables.items():
    if weights_key(table) not in stored:
      raise errors.ConfigError(
          f"EmbeddingLayer '{layer.name}': table '{table}' is not in the "
          f"saved weights (they hold {sorted(stored)}). Fix: load weights "
          "saved from a layer with the same spec, or rename the table back.")
    # Exact keys: another table's key (a table named "<table>.<slot>") is
    # never taken for one of this table's slots.
    slots = sorted(s for s in variables if s != "parameters")
    saved = sorted(s for s in SLOT_NAMES if weights_key(table, s) in stored
                   and owner.get(weights_key(table, s), (table,))[0] == table)
    if saved != slots:
      raise errors.ConfigError(
          f"EmbeddingLayer '{layer.name}': table '{table}' is saved with "
          f"optimizer slots {saved}, its optimizer needs {slots}. Fix: load "
          "with the table optimizer the weights were trained with.")
  unknown = sorted(stored - set(state))
  if unknown:
    raise errors.ConfigError(
        f"EmbeddingLayer '{layer.name}': the saved weights hold {unknown}, "
        "which this spec does not have. Fix: load into a layer with the same "
        "spec.")
  missing = sorted({STEP_KEY, SINK_KEY} - stored)
  if missing:
    raise errors.ConfigError(
        f"EmbeddingLayer '{layer.name}': the saved weights lack {missing}. "
        "Fix: load weights saved by EmbeddingLayer.save_own_variables.")
  values = {key: np.asarray(store[key]) for key in state}
  for key, variable in state.items():
    want, have = list(variable.shape), list(values[key].shape)
    if have != want:
      table, slot = owner[key] or (None, None)
      what = f"table '{table}'" if table is not None else f"'{key}'"
      where = f" (slot '{slot}')" if slot not in (None, "parameters") else ""
      raise errors.ConfigError(
          f"EmbeddingLayer '{layer.name}': {what} is saved with shape "
          f"{have}{where}, this layer has {want}. Fix: load into a spec with "
          "the same vocabulary_size and dim.")
  for key, variable in state.items():
    variable.assign(values[key].astype(tf.as_dtype(variable.dtype).as_numpy_dtype))
