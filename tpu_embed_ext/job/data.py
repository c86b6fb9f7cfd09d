"""The job's input: tfds dataset -> (train, held-out) batches of features."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from typing import Any, Dict

import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.data import pipeline, synthetic_clicks
from tpu_embed_ext.job.config import TrainConfig
from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["feature_columns", "input_datasets", "first_batch", "example_batch"]


def _single_hot_columns(dataset: str):
  if not dataset.startswith("synthetic_clicks"):
    return None
  return set(synthetic_clicks.vocabulary_sizes(
      dataset.partition("/")[2] or "default")) - set(synthetic_clicks.MULTI_HOT)


def feature_columns(spec: EmbeddingSpec, cfg: TrainConfig) -> Dict[str, tuple]:
  """``{feature: (column, format)}`` for the input pipeline."""
  single_hot = _single_hot_columns(cfg.dataset) or set()
  out = {}
  for f in spec.features:
    given = dict(cfg.features.get(f.name, {}))
    column = given.get("column", f.name)
    default = ("dense" if column in single_hot and not f.max_sequence_length
               else "ragged")
    out[f.name] = (column, given.get("format", default))
  return out


def input_datasets(spec: EmbeddingSpec, cfg: TrainConfig, *, skip_batches=0):
  """(train, eval) ``tf.data`` datasets of ``(features, label)`` batches.

  The train dataset repeats forever in an order fixed by ``cfg.seed`` and
  starts after ``skip_batches`` batches, so a resumed run sees exactly the
  batches an uninterrupted run would have seen from that step on.
  """
  columns = feature_columns(spec, cfg)
  builder = _builder(cfg)
  if not builder.is_prepared():
    print(f"Building the {cfg.dataset} dataset in {builder.data_dir} (once: later "
          "runs read it from there)...", flush=True)
    # Our progress lines (synthetic_clicks reports as it generates) go to
    # stdout; tfds prints its own lines there too: they go to the log
    # (host/library_log.py).
    stdout = sys.stdout
    if hasattr(builder, "progress"):
      builder.progress = lambda line: print(line, file=stdout, flush=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      builder.download_and_prepare()
    for line in printed.getvalue().splitlines():
      logging.getLogger("tensorflow_datasets").info(line)
    print(f"Built {cfg.dataset}.", flush=True)
  # TensorFlow combines the shuffle's seed with the global seed, so the order
  # would depend on what the caller seeded before (plan --data measured other
  # batches than train trained on). Fix the global seed to the config's.
  tf.random.set_seed(cfg.seed)
  common = dict(features=columns, batch_size=cfg.batch_size,
                dense_column=cfg.dense_column, label_column=cfg.label,
                preprocess=pipeline.preprocessor(cfg.dataset))
  train = pipeline.make_dataset(
      **_split(builder, cfg.train_split, "train_split"), shuffle_seed=cfg.seed,
      repeat=True, **common).skip(skip_batches)
  evaluation = pipeline.make_dataset(
      **_split(builder, cfg.eval_split, "eval_split"), num_batches=cfg.eval_batches,
      drop_remainder=False, **common)
  return train, evaluation


def _builder(cfg: TrainConfig):
  """The tfds builder of ``cfg.dataset`` (nothing is downloaded or built)."""
  import tensorflow_datasets as tfds
  try:
    return tfds.builder(cfg.dataset, data_dir=cfg.data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise errors.ConfigError(
        f"unknown tfds dataset {cfg.dataset!r}: "
        f"{str(e).strip().splitlines()[0]} Fix: use synthetic_clicks/default, "
        "synthetic_clicks/tiny or a name from tfds.list_builders().",
        path="train.dataset") from None


def example_batch(spec: EmbeddingSpec, cfg: TrainConfig):
  """A batch of zeros with the structure, dtypes and shapes of the pipeline's.

  Computed from the spec, the config and the dataset's declared features
  (``builder.info``, through the dataset's preprocessing traced on specs):
  no record is read and no dataset is built, so ``export`` works without the
  training data. Building the model on it creates the same variables as a
  real batch does.
  """
  builder = _builder(cfg)
  element = builder.info.features.get_tensor_spec()
  preprocess = pipeline.preprocessor(cfg.dataset)
  if preprocess is not None:
    element = tf.function(preprocess).get_concrete_function(
        element).structured_outputs
  if cfg.dense_column not in element:
    raise errors.ConfigError(
        f"{cfg.dataset} has no column {cfg.dense_column!r}; its columns are "
        f"{sorted(element)}. Fix: name one as dense_column.",
        path="train.dense_column")
  rows = cfg.batch_size
  dense = tf.zeros([rows, element[cfg.dense_column].shape[-1]], tf.float32)
  ids = tf.zeros([rows], tf.int64)
  categorical = {}
  for name, (_, layout) in feature_columns(spec, cfg).items():
    if layout == "dense":
      categorical[name] = ids
    elif layout == "ragged":
      categorical[name] = tf.RaggedTensor.from_row_lengths(
          ids, tf.ones([rows], tf.int64))
    else:
      categorical[name] = tf.SparseTensor(
          tf.stack([tf.range(rows, dtype=tf.int64), ids], 1), ids, [rows, 1])
  return {"dense": dense, "categorical": categorical}, tf.zeros([rows], tf.int64)


def _split(builder, split: str, field: str) -> Dict[str, Any]:
  """``make_dataset``'s source: batch-parsed records where we can, else tfds's."""
  try:
    if builder.name == "synthetic_clicks":
      records = synthetic_clicks.serialized_split(builder, split)
      if records is not None:
        return {"ds": records, "parse_batch": builder.info.features.decode_batch}
    return {"ds": builder.as_dataset(split=split, shuffle_files=False)}
  except (ValueError, KeyError, AssertionError) as e:
    raise errors.ConfigError(
        f"the split {split!r} of {builder.info.full_name} cannot be read: "
        f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}. "
        f"Fix: name a non-empty split of {sorted(builder.info.splits)}, e.g. "
        "test or train[90%:].", path=f"train.{field}") from None


def first_batch(eval_ds, cfg: TrainConfig):
  """The first held-out batch (it builds the model); an empty split is an error."""
  batch = next(iter(eval_ds), None)
  if batch is None:
    raise errors.ConfigError(
        f"the held-out split {cfg.eval_split!r} of {cfg.dataset} has no examples. "
        "Fix: name a non-empty split, e.g. test or train[90%:].",
        path="train.eval_split")
  return batch
