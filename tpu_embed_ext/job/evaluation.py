"""Held-out evaluation: loss, exact AUC, and the dataset's planted AUC."""

from __future__ import annotations

from typing import Dict

import keras
import numpy as np
import tensorflow as tf

from tpu_embed_ext.data import synthetic_clicks
from tpu_embed_ext.data.pipeline import auc
from tpu_embed_ext.job.config import TrainConfig
from tpu_embed_ext.job.replicated import call_model, rows

__all__ = ["evaluate", "planted_auc"]


def evaluate(model, eval_ds, batch_size=None) -> Dict[str, float]:
  """Loss and exact AUC over the held-out batches.

  Under a strategy each batch runs in ``strategy.run``, padded to
  ``batch_size`` and split over the replicas (``replicated.call_model``).
  """
  labels, scores, losses = [], [], []
  bce = keras.losses.BinaryCrossentropy(from_logits=True, reduction="sum")
  count = 0
  for features, label in eval_ds:
    logits = call_model(model, features, batch_size or rows(features))
    label = tf.reshape(tf.cast(label, tf.float32), [-1, 1])
    losses.append(float(bce(label, logits)))
    count += int(label.shape[0])
    labels.append(label.numpy().ravel())
    scores.append(logits.numpy().ravel())
  labels, scores = np.concatenate(labels), np.concatenate(scores)
  return {"eval_loss": sum(losses) / count, "eval_auc": float(auc(labels, scores)),
          "eval_examples": count}


def planted_auc(cfg: TrainConfig) -> Dict[str, float]:
  if not cfg.dataset.startswith("synthetic_clicks"):
    return {}
  return {"planted_auc": float(synthetic_clicks.planted_auc(
      cfg.dataset, split="test", data_dir=cfg.data_dir,
      num_examples=None if cfg.eval_batches is None
      else cfg.eval_batches * cfg.batch_size))}
