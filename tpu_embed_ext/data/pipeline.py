"""tfds examples -> ``(features, label)`` batches in the layout a spec wants.

``features = {"dense": float32 [B, n], "categorical": {feature: ids}}``; each
categorical feature names its source column and its layout: ``dense``
(single-hot, int64 ``[B]``), ``ragged`` (``tf.RaggedTensor [B, None]``) or
``sparse`` (``tf.SparseTensor [B, longest row in the batch]``). A spec's
feature names need not be the dataset's column names (feature ``user`` may read
column ``c0``), and several features may read one column.

Also ``auc``: the exact ROC AUC every evaluation in the package uses.
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.data import movielens

__all__ = ["make_dataset", "preprocessor", "auc", "FORMATS"]

FORMATS = ("dense", "ragged", "sparse")


def make_dataset(ds: tf.data.Dataset, *, features: Mapping[str, Tuple[str, str]],
                 batch_size: int, dense_column: Optional[str] = "dense",
                 label_column: str = "label", shuffle_seed: Optional[int] = None,
                 shuffle_buffer: int = 10_000, repeat: bool = False,
                 drop_remainder: bool = True,
                 num_batches: Optional[int] = None,
                 preprocess=None, parse_batch=None) -> tf.data.Dataset:
  """Batches a tfds split (a dataset of example dicts).

  Args:
    features: ``{feature: (column, layout)}``, layout one of FORMATS.
    shuffle_seed: shuffle with this seed: the same order on every run (a
      resumed run can skip the batches it has seen), reshuffled each epoch;
      None: keep the stored order (read ``ds`` with ``shuffle_files=False``).
    repeat: repeat forever (after shuffling, so each epoch is reshuffled).
    num_batches: keep only this many batches.
    preprocess: maps a raw example to its columns (see ``preprocessor``).
    parse_batch: if given, ``ds`` holds serialized examples and this maps a
      batch of them to batched columns (``synthetic_clicks``' features'
      ``decode_batch``):
      the same batches, parsed a batch at a time instead of one by one.

  Raises:
    ValueError: a layout not in FORMATS.
    tf.errors.InvalidArgumentError: (when a batch is read) a ``dense``
      feature's row does not hold exactly one id.
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
    _check_columns(example, features, label_column, dense_column)
    return {k: example[k] for k in keep}

  if parse_batch is None:
    ds = ds.map(select, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  # Cached after the first pass: decoded examples, or the serialized ones.
  ds = ds.cache()
  if shuffle_seed is not None:
    ds = ds.shuffle(shuffle_buffer, seed=shuffle_seed, reshuffle_each_iteration=True)
  if repeat:
    ds = ds.repeat()
  if parse_batch is None:
    ds = ds.ragged_batch(batch_size, drop_remainder=drop_remainder)
  else:
    ds = ds.batch(batch_size, drop_remainder=drop_remainder).map(
        lambda serialized: select(parse_batch(serialized)),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

  def to_model_inputs(batch):
    categorical = {}
    for name, (column, layout) in features.items():
      ids = batch[column]
      if not isinstance(ids, tf.RaggedTensor):  # Fixed-shape column: [B] or [B, n].
        ids = tf.RaggedTensor.from_tensor(tf.reshape(ids, [tf.shape(ids)[0], -1]))
      if layout == "dense":
        # Padding or truncating would feed a wrong id silently.
        check = tf.debugging.assert_equal(
            ids.row_lengths(), tf.constant(1, ids.row_splits.dtype),
            message=f"feature '{name}' (column '{column}') has layout 'dense' "
                    "but a row without exactly one id; use 'ragged' or 'sparse'.")
        with tf.control_dependencies([check]):
          categorical[name] = ids.to_tensor(shape=[None, 1])[:, 0]
      elif layout == "sparse":
        categorical[name] = ids.to_sparse()
      else:
        categorical[name] = ids
    if drop_remainder:
      # Every batch has batch_size rows; say so statically: TPUEmbedding
      # (and CPUEmbedding.enqueue) compile fully defined shapes only.
      categorical = {k: _with_batch(v, batch_size) for k, v in categorical.items()}
    inputs = {"categorical": categorical}
    if dense_column:
      inputs["dense"] = tf.cast(batch[dense_column], tf.float32)
    return inputs, batch[label_column]

  ds = ds.map(to_model_inputs, num_parallel_calls=tf.data.AUTOTUNE,
              deterministic=True)
  if num_batches is not None:
    ds = ds.take(num_batches)
  return ds.prefetch(tf.data.AUTOTUNE)


def _check_columns(example, features, label_column, dense_column) -> None:
  """ConfigError naming the feature (or field) whose column the data lacks."""
  have = sorted(example)
  wanted = [(f"train.features.{name}.column", f"feature '{name}' reads column "
             f"'{column}'", column) for name, (column, _) in features.items()]
  wanted += [("train.label", f"label column '{label_column}'", label_column)]
  if dense_column:
    wanted += [("train.dense_column", f"dense column '{dense_column}'", dense_column)]
  for path, what, column in wanted:
    if column not in example:
      raise errors.ConfigError(
          f"{what}, which the dataset does not have.{errors.did_you_mean(column, have)}"
          f" Its columns: {', '.join(have)}. Fix: map the feature to a column "
          f"(train.features: {{<feature>: {{column: <column>}}}}), or correct "
          "the name.", path=path)


def _with_batch(ids, batch_size: int):
  """``ids`` with its static batch dimension set to ``batch_size``."""
  if isinstance(ids, tf.RaggedTensor):
    return tf.RaggedTensor.from_row_splits(
        ids.values, tf.ensure_shape(ids.row_splits, [batch_size + 1]),
        validate=False)
  if isinstance(ids, tf.SparseTensor):
    ids.set_shape([batch_size] + [None] * (ids.shape.rank - 1))
    return ids
  return tf.ensure_shape(ids, [batch_size] + ids.shape.as_list()[1:])


def preprocessor(dataset: str):
  """The example -> columns function for a tfds dataset name, or None.

  None means the examples already are columns (``synthetic_clicks``).
  """
  if dataset.startswith("movielens"):
    return movielens.columns
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
