"""``export``: the newest checkpoint as a serving SavedModel."""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

import tensorflow as tf

from tpu_embed_ext import model_dir as model_dir_lib
from tpu_embed_ext.job.building import build_model, build_variables, restore
from tpu_embed_ext.job.config import in_file, load
from tpu_embed_ext.job.data import example_batch
from tpu_embed_ext.job.memory import check_memory

__all__ = ["export", "serving_inputs"]


def export(config_path: str, *, model_dir: str, out: str,
           overrides: Optional[Mapping[str, Any]] = None) -> str:
  """Restores the newest readable checkpoint and writes a serving SavedModel.

  The signature (``serving.py``) takes ``dense`` float32 [batch, 13] and, per
  categorical feature, an int64 id matrix: [batch, 1] for single-hot
  features, [batch, n] padded with -1 for multi-hot ones; it returns
  ``outputs``, the click logit [batch, 1]. An id outside a feature's
  vocabulary fails the call with an error naming the feature.
  """
  from tpu_embed_ext import serving
  # Everything that can be checked is checked before the model is built:
  # the config, where the SavedModel goes, and a checkpoint to restore.
  with in_file(config_path):
    spec, cfg = load(config_path, overrides)
    check_memory(spec)
    batch = example_batch(spec, cfg)  # From the spec: no dataset is built.
  _check_out(out)
  path, _ = model_dir_lib.resume_point(os.path.join(model_dir, "checkpoints"),
                                       repair=False)
  if path is None:
    raise model_dir_lib.CheckpointError(
        f"no checkpoint in {model_dir}/checkpoints. Fix: run `train` with "
        f"--model_dir={model_dir} first.")
  model = build_model(spec, cfg)
  build_variables(model, batch)
  checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
  restore(model, checkpoint, path)
  features, _ = batch
  signature = {"dense": tf.TensorSpec([None, features["dense"].shape[1]],
                                      tf.float32, name="dense")}
  for name, ids in features["categorical"].items():
    width = 1 if isinstance(ids, tf.Tensor) and ids.shape.rank == 1 else None
    signature[name] = tf.TensorSpec([None, width], tf.int64, name=name)
  vocabulary = {f.name: spec.table(f.table).vocabulary_size for f in spec.features}

  def preprocess(inputs):
    categorical = {}
    for name, ids in features["categorical"].items():
      single = isinstance(ids, tf.Tensor) and ids.shape.rank == 1
      x = serving.check_ids(name, inputs[name], vocabulary[name], padded=not single)
      if single:
        categorical[name] = tf.cast(x[:, 0], ids.dtype)
      else:
        categorical[name] = tf.cast(serving.ragged_from_padded(x), ids.dtype)
    return {"dense": inputs["dense"], "categorical": categorical}

  serving.export_for_serving(model, out, signature, preprocess=preprocess)
  return out


def _check_out(out: str) -> None:
  """ModelDirError unless the SavedModel can be written at ``out``."""
  parent = os.path.dirname(os.path.abspath(out))
  try:
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(out) and not os.path.isdir(out):
      raise NotADirectoryError(f"{out} is a file")
    if not os.access(out if os.path.isdir(out) else parent, os.W_OK):
      raise PermissionError("permission denied")
  except OSError as e:
    raise model_dir_lib.ModelDirError(
        f"cannot write the SavedModel to {out}: {e.strerror or e}. Fix: pass a "
        "writable --out.") from None


def serving_inputs(features) -> Dict[str, tf.Tensor]:
  """A batch of the model's features in the exported signature's format.

  ``dense`` as is; a single-hot feature as int64 [batch, 1]; a multi-hot
  (ragged) one as int64 [batch, longest row] padded with ``serving.PAD_ID``.
  """
  from tpu_embed_ext import serving
  inputs = {"dense": features["dense"]}
  for name, ids in features["categorical"].items():
    if isinstance(ids, tf.RaggedTensor):
      inputs[name] = tf.cast(ids.to_tensor(default_value=serving.PAD_ID), tf.int64)
    else:
      inputs[name] = tf.cast(ids[:, None], tf.int64)
  return inputs
