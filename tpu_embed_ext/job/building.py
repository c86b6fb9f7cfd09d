"""The model of a config: built, its variables created, a checkpoint restored."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import keras
import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import dispatch
from tpu_embed_ext.sparsecore import convert
from tpu_embed_ext.host import model_dir as model_dir_lib
from tpu_embed_ext.job.config import TrainConfig, keras_config
from tpu_embed_ext.job.outputs import StepLoss
from tpu_embed_ext.job.replicated import call_model, per_replica_batch, rows
from tpu_embed_ext.keras.model import RankingModel
from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["build_model", "build_variables", "restore"]


def build_model(spec: EmbeddingSpec, cfg: TrainConfig, *, engine=None):
  keras.utils.set_random_seed(cfg.seed)
  model = RankingModel(with_output_shapes(spec, cfg), engine=engine, **dict(cfg.model))
  loss = keras.losses.BinaryCrossentropy(from_logits=True)
  model.compile(
      optimizer=keras.optimizers.get(keras_config(cfg.dense_optimizer)),
      loss=loss, metrics=[keras.metrics.AUC(from_logits=True, name="auc"),
                          StepLoss(loss)])
  return model


def with_output_shapes(spec: EmbeddingSpec, cfg: TrainConfig) -> EmbeddingSpec:
  """``spec`` as the engine of the strategy in scope takes it.

  ``TPUEmbeddingV2`` (SparseCore) needs every feature's ``output_shape``
  (``tpu_embedding_v3.py`` builds its stacked buffers from it): the
  per-replica batch (and a sequence feature's length), as TensorFlow's own
  SparseCore tests set it. Other engines take the spec as it is.
  """
  strategy = tf.distribute.get_strategy()
  if not dispatch.uses_sparsecore(strategy):
    return spec
  per_replica = per_replica_batch(cfg.batch_size, strategy)
  features = tuple(
      f if f.output_shape else dataclasses.replace(
          f, output_shape=(per_replica,) + ((f.max_sequence_length,)
                                            if f.max_sequence_length else ()))
      for f in spec.features)
  return dataclasses.replace(spec, features=features)


def build_variables(model, batch, batch_size=None):
  """Creates every variable (model and dense optimizer) before a restore.

  Under a strategy the model is called in ``strategy.run``, one slice of the
  batch (padded to ``batch_size``) per replica, as a TPU needs.
  """
  features, _ = batch
  call_model(model, features, batch_size or rows(features))
  model.optimizer.build(model.trainable_variables)


def restore(model, checkpoint, path: str, spec: EmbeddingSpec) -> None:
  """Checks ``path`` against the model (tables first), then restores it.

  A refused checkpoint raises before any variable is written. A SparseCore
  run's checkpoint (``TPUEmbeddingV2``'s stacked tables) restored into the
  CPU engine (``export``, ``--tpu none``) is first converted to per-table
  keys (``sparsecore.convert``: values copied, padding dropped) in a
  temporary directory; ``TPUEmbeddingV2`` reads either layout itself.
  """
  embedding = model.embedding.embedding
  if hasattr(embedding, "check_checkpoint"):
    if convert.checkpoint_layouts(path, prefix=_EMBEDDING) is not None:
      with tempfile.TemporaryDirectory(prefix="per-table-") as staging:
        per_table = os.path.join(staging, os.path.basename(path))
        convert.convert_checkpoint(path, per_table, spec, prefix=_EMBEDDING,
                                   log=lambda _: None)
        return restore(model, checkpoint, per_table, spec)
    try:
      embedding.check_checkpoint(path, prefix=_EMBEDDING)
    except errors.ConfigError as e:
      raise model_dir_lib.CheckpointError(
          f"{e} Or pass another --model_dir.") from None
  model_dir_lib.check_checkpoint(checkpoint, path, what="the model of this config")
  checkpoint.restore(path).assert_existing_objects_matched()
  return None


_EMBEDDING = "model/embedding/embedding"  # The engine's path in the job's checkpoints.
