"""tfds examples -> ``(features, label)`` batches in the layout a spec wants.

``features = {"dense": float32 [B, n], "categorical": {feature: ids}}``; each
categorical feature names its source column and its layout: ``dense``
(single-hot, int64 ``[B]``), ``ragged`` (``tf.RaggedTensor [B, None]``) or
``sparse`` (``tf.SparseTensor [B, max_len]``).
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["make_dataset", "preprocessor", "auc", "FORMATS"]

FORMATS = ("dense", "ragged", "sparse")


def make_dataset(ds: tf.data.Dataset, *, features: Mapping[str, Tuple[str, str]],
                 batch_size: int, dense_column: Optional[str] = "dense",
                 label_column: str = "label", shuffle_seed: Optional[int] = None,
                 shuffle_buffer: int = 10_000, repeat: bool = False,
                 drop_remainder: bool = True,
                 num_batches: Optional[int] = None,
                 preprocess=None) -> tf.data.Dataset:
  """Batches a tfds split (a dataset of example dicts).

  Args:
    features: ``{feature: (column, layout)}``, layout one of FORMATS.
    shuffle_seed: shuffle with this seed (same order on every run, reshuffled
      each epoch); None: keep the stored order.
    repeat: repeat forever (after shuffling, so each epoch is reshuffled).
    num_batches: keep only this many batches.
    preprocess: maps a raw example to its columns (see ``preprocessor``).
  """
  for name, (column, layout) in features.items():
    if layout not in FORMATS:
      raise ValueError(f"feature '{name}': layout must be one of {FORMATS}, got "
                       f"{layout!r}.")
  columns = sorted({c for c, _ in features.values()})
  keep = columns + [label_column] + ([dense_column] if dense_column else [])

  def select(example):
    if preprocess is not None:
      example = preprocess(example)
    elif "ids" in example and "lengths" in example:  # synthetic_clicks packing.
      from tpu_embed_ext.data import synthetic_clicks
      example = synthetic_clicks.columns(example)
    return {k: example[k] for k in keep}

  ds = ds.map(select, num_parallel_calls=tf.data.AUTOTUNE,
              deterministic=True).cache()
  if shuffle_seed is not None:
    ds = ds.shuffle(shuffle_buffer, seed=shuffle_seed, reshuffle_each_iteration=True)
  if repeat:
    ds = ds.repeat()
  ds = ds.ragged_batch(batch_size, drop_remainder=drop_remainder)

  def to_model_inputs(batch):
    categorical = {}
    for name, (column, layout) in features.items():
      ids = batch[column]
      if not isinstance(ids, tf.RaggedTensor):
        ids = tf.RaggedTensor.from_tensor(ids)
      if layout == "dense":
        categorical[name] = ids.to_tensor(shape=[None, 1])[:, 0]
      elif layout == "sparse":
        categorical[name] = ids.to_sparse()
      else:
        categorical[name] = ids
    inputs = {"categorical": categorical}
    if dense_column:
      inputs["dense"] = tf.cast(batch[dense_column], tf.float32)
    return inputs, batch[label_column]

  ds = ds.map(to_model_inputs, num_parallel_calls=tf.data.AUTOTUNE,
              deterministic=True)
  if num_batches is not None:
    ds = ds.take(num_batches)
  return ds.prefetch(tf.data.AUTOTUNE)


def preprocessor(dataset: str):
  """The example -> columns function for a tfds dataset name, or None."""
  if dataset.startswith("movielens"):
    from tpu_embed_ext.data import movielens
    return movielens.columns
  if dataset.startswith("synthetic_clicks"):
    from tpu_embed_ext.data import synthetic_clicks
    return synthetic_clicks.columns
  return None


def auc(labels, scores) -> float:
  """Exact ROC AUC: P(score_pos > score_neg) + P(tie) / 2 (average ranks)."""
  labels = np.asarray(labels).astype(bool).ravel()
  scores = np.asarray(scores, np.float64).ravel()
  positives, negatives = labels.sum(), (~labels).sum()
  if positives == 0 or negatives == 0:
    raise ValueError("AUC needs both positive and negative labels.")
  order = np.argsort(scores, kind="mergesort")
  sorted_scores = scores[order]
  ranks = np.empty(len(scores))
  # Average rank within each group of tied scores (1-based).
  _, start, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
  average = start + (counts + 1) / 2.0
  ranks[order] = np.repeat(average, counts)
  return float((ranks[labels].sum() - positives * (positives + 1) / 2)
               / (positives * negatives))
