"""``export``: the newest checkpoint as a serving SavedModel."""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

import tensorflow as tf

from tpu_embed_ext.host import atomic
from tpu_embed_ext.host import model_dir as model_dir_lib
from tpu_embed_ext.job.building import build_model, build_variables, restore
from tpu_embed_ext.job.config import in_file, load
from tpu_embed_ext.job.data import example_batch
from tpu_embed_ext.host.memory import check_memory
from tpu_embed_ext.keras import serving

__all__ = ["export", "serving_inputs"]


def export(config_path: str, *, model_dir: str, out: str,
           overrides: Optional[Mapping[str, Any]] = None, log=print) -> str:
  """Restores the newest readable checkpoint and writes a serving SavedModel.

  The signature (``keras/serving.py``) takes ``dense`` float32 [batch, 13] and, per
  categorical feature, int64 ids: [batch] or [batch, 1] for single-hot
  features, [batch, n] padded with -1 for multi-hot ones; it returns
  ``outputs``, the click logit [batch, 1]. Every input is checked inside the
  call (``serving.checked_inputs``): a wrong shape, batch size, a NaN or Inf
  float or an id outside the feature's vocabulary fails it, naming the input.

  ``out`` is replaced only once the new SavedModel is complete; an ``out``
  that overlaps the checkpoints or the config, is a file, or cannot be
  written is refused before anything is built. ``log`` says which
  checkpoint (table step) was exported.
  """
  # Everything that can be checked is checked before the model is built:
  # the config, where the SavedModel goes, and a checkpoint to restore.
  checkpoints = os.path.join(model_dir, "checkpoints")
  with in_file(config_path):
    spec, cfg = load(config_path, overrides)
    check_memory(spec)
    batch = example_batch(spec, cfg)  # From the spec: no dataset is built.
  atomic.check_no_overlap("--out", out, [("the checkpoints of --model_dir",
                                          checkpoints),
                                         ("the config", config_path)])
  atomic.check_writable("--out", out, directory=True)
  path, _ = model_dir_lib.resume_point(checkpoints, log=log, repair=False)
  if path is None:
    raise model_dir_lib.CheckpointError(
        f"no checkpoint in {model_dir}/checkpoints. Fix: run `train` with "
        f"--model_dir={model_dir} first.")
  model = build_model(spec, cfg)
  build_variables(model, batch)
  checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
  restore(model, checkpoint, path, spec)
  log(f"Exporting {path} (table step {int(model.embedding.step.numpy())}).")
  features, _ = batch
  vocabulary = {f.name: spec.table(f.table).vocabulary_size for f in spec.features}
  single = {name: vocabulary[name] for name, ids in features["categorical"].items()
            if isinstance(ids, tf.Tensor) and ids.shape.rank == 1}
  multi = {name: vocabulary[name] for name in features["categorical"]
           if name not in single}
  floats = {"dense": features["dense"].shape[1]}
  signature = serving.serving_signature(single, multi, floats)

  def preprocess(inputs):
    checked = serving.checked_inputs(inputs, single_hot=single, multi_hot=multi,
                                     floats=floats)
    categorical = {}
    for name, ids in features["categorical"].items():
      x = checked[name]
      categorical[name] = tf.cast(
          x if name in single else serving.ragged_from_padded(x), ids.dtype)
    return {"dense": checked["dense"], "categorical": categorical}

  serving.export_for_serving(model, out, signature, preprocess=preprocess)
  return out


def serving_inputs(features) -> Dict[str, tf.Tensor]:
  """A batch of the model's features in the exported signature's format.

  ``dense`` as is; a single-hot feature as int64 [batch, 1]; a multi-hot
  (ragged) one as int64 [batch, longest row] padded with ``serving.PAD_ID``.
  """
  inputs = {"dense": features["dense"]}
  for name, ids in features["categorical"].items():
    if isinstance(ids, tf.RaggedTensor):
      inputs[name] = tf.cast(ids.to_tensor(default_value=serving.PAD_ID), tf.int64)
    else:
      inputs[name] = tf.cast(ids[:, None], tf.int64)
  return inputs
