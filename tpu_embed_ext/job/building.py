"""The model of a config: built, its variables created, a checkpoint restored."""

from __future__ import annotations

import keras

from tpu_embed_ext import errors
from tpu_embed_ext import model_dir as model_dir_lib
from tpu_embed_ext.job.config import TrainConfig, keras_config
from tpu_embed_ext.job.outputs import StepLoss
from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["build_model", "build_variables", "restore"]


def build_model(spec: EmbeddingSpec, cfg: TrainConfig, *, engine=None):
  from tpu_embed_ext.model import RankingModel
  keras.utils.set_random_seed(cfg.seed)
  model = RankingModel(spec, engine=engine, **dict(cfg.model))
  loss = keras.losses.BinaryCrossentropy(from_logits=True)
  model.compile(
      optimizer=keras.optimizers.get(keras_config(cfg.dense_optimizer)),
      loss=loss, metrics=[keras.metrics.AUC(from_logits=True, name="auc"),
                          StepLoss(loss)])
  return model


def build_variables(model, batch):
  """Creates every variable (model and dense optimizer) before a restore."""
  features, _ = batch
  model(features, training=False)
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
