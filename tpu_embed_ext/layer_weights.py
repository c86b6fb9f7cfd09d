"""``EmbeddingLayer`` in a Keras weights file (``model.save``, ``save_weights``).

Keys: ``<table>`` a table, ``<table>.<slot>`` one of its optimizer slots,
``.step`` the table step, ``.gradient_sink`` the sink. Loading checks every
table, slot and shape before the first variable is written.
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import tensorflow as tf

from tpu_embed_ext import errors

__all__ = ["keyed_variables", "save", "load", "STEP_KEY", "SINK_KEY"]

# A leading dot keeps them apart from table names.
STEP_KEY = ".step"
SINK_KEY = ".gradient_sink"


def keyed_variables(layer) -> Dict[str, tf.Variable]:
  """Every saved variable by its key in a Keras weights file.

  ``<table>`` is a table, ``<table>.<slot>`` one of its optimizer slots
  (HDF5 reads "/" as a group, so TensorFlow's ``<table>/<slot>`` is not
  usable), ``.step`` the table step, ``.gradient_sink`` the sink.
  """
  if layer._kind != "cpu":
    raise errors.ConfigError(
        f"EmbeddingLayer '{layer.name}': Keras weight files of a TPU engine "
        "are not supported (not run on a TPU). Fix: save with "
        "tf.train.Checkpoint, whose keys equal TPUEmbedding's.")
  state = {}
  for table, variables in layer.embedding.variables.items():
    state[table] = variables["parameters"]
    state.update({f"{table}.{slot}": variable
                  for slot, variable in variables.items()
                  if slot != "parameters"})
  state[STEP_KEY] = layer.embedding.step
  state[SINK_KEY] = layer.gradient_sink
  return state


def save(layer, store) -> None:
  """Writes tables, slots, the table step and the sink (see ``keyed_variables``)."""
  for key, variable in keyed_variables(layer).items():
    store[key] = np.asarray(variable.numpy())


def load(layer, store) -> None:
  """Restores what ``save_own_variables`` wrote, or changes nothing.

  Every table, slot and shape is checked before the first variable is
  written; a mismatch names the table.
  """
  state = keyed_variables(layer)
  stored = set(store.keys())
  # Keys of the other tables, which may start with "<table>." too.
  owner = {STEP_KEY: None, SINK_KEY: None}
  for table, variables in layer.embedding.variables.items():
    owner.update({table if s == "parameters" else f"{table}.{s}": table
                  for s in variables})
  others = {t: {k for k, o in owner.items() if o != t}
            for t in layer.embedding.variables}
  for table, variables in layer.embedding.variables.items():
    if table not in stored:
      raise errors.ConfigError(
          f"EmbeddingLayer '{layer.name}': table '{table}' is not in the "
          f"saved weights (they hold {sorted(stored)}). Fix: load weights "
          "saved from a layer with the same spec, or rename the table back.")
    slots = sorted(s for s in variables if s != "parameters")
    saved = sorted(k[len(table) + 1:] for k in stored - others[table]
                   if k.startswith(f"{table}."))
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
      what = f"table '{owner[key]}'" if owner[key] else f"'{key}'"
      where = f" (slot '{key}')" if owner[key] and key != owner[key] else ""
      raise errors.ConfigError(
          f"EmbeddingLayer '{layer.name}': {what} is saved with shape "
          f"{have}{where}, this layer has {want}. Fix: load into a spec with "
          "the same vocabulary_size and dim.")
  for key, variable in state.items():
    variable.assign(values[key].astype(tf.as_dtype(variable.dtype).as_numpy_dtype))
