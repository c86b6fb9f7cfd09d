"""The model of a config: built, its variables created, a checkpoint restored."""

from __future__ import annotations

import keras

from tpu_embed_ext import errors
from tpu_embed_ext.host import model_dir as model_dir_lib
from tpu_embed_ext.job.config import TrainConfig, keras_config
from tpu_embed_ext.job.data import feature_columns
from tpu_embed_ext.job.outputs import StepLoss
from tpu_embed_ext.job.replicated import call_model, rows
from tpu_embed_ext.keras.model import RankingModel
from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["build_model", "build_variables", "restore"]


def build_model(spec: EmbeddingSpec, cfg: TrainConfig, *, engine=None):
  keras.utils.set_random_seed(cfg.seed)
  multi_hot = [name for name, (_, layout) in feature_columns(spec, cfg).items()
               if layout != "dense"]
  model = RankingModel(spec, engine=engine, multi_hot=multi_hot, **dict(cfg.model))
  loss = keras.losses.BinaryCrossentropy(from_logits=True)
  model.compile(
      optimizer=keras.optimizers.get(keras_config(cfg.dense_optimizer)),
      loss=loss, metrics=[keras.metrics.AUC(from_logits=True, name="auc"),
                          StepLoss(loss)])
  return model


def build_variables(model, batch, batch_size=None):
  """Creates every variable (model and dense optimizer) before a restore.

  Under a strategy the model is called in ``strategy.run``, one slice of the
  batch (padded to ``batch_size``) per replica, as a TPU needs.
  """
  features, _ = batch
  call_model(model, features, batch_size or rows(features))
  model.optimizer.build(model.trainable_variables)


def restore(model, checkpoint, path: str) -> None:
  """Checks ``path`` against the model (tables first), then restores it.

  A refused checkpoint raises before any variable is written.
  """
  embedding = model.embedding.embedding
  if hasattr(embedding, "check_checkpoint"):
    try:
      embedding.check_checkpoint(path, prefix="model/embedding/embedding")
    except errors.ConfigError as e:
      raise model_dir_lib.CheckpointError(
          f"{e} Or pass another --model_dir.") from None
  model_dir_lib.check_checkpoint(checkpoint, path, what="the model of this config")
  checkpoint.restore(path).assert_existing_objects_matched()
