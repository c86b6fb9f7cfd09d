"""The main job: train, evaluate and export a ranking model from one config.

``python -m tpu_embed_ext train --config configs/ranking.yaml`` reads the
embedding spec and the ``train:`` section of the same file, builds the
``synthetic_clicks`` tfds dataset offline (or another tfds dataset), trains a
DLRM-style model with ``model.fit`` (tables updated by their own TPU
optimizers, dense weights by a Keras optimizer), checkpoints every
``steps_per_checkpoint`` steps and resumes from the last checkpoint in
``--model_dir``, then evaluates on the held-out split and writes
``metrics.json`` and ``learning_curve.png`` there.

Determinism (what makes a killed-and-resumed run equal an uninterrupted one):
the input order is a pure function of the seed and the step (the resumed run
skips the batches already trained on), weights are initialised from the seed,
and TensorFlow's op determinism is enabled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Dict, Mapping, Optional

import keras
import numpy as np
import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["TrainConfig", "train", "export", "build_model", "input_datasets"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """The ``train:`` section of a config file."""

  dataset: str = "synthetic_clicks/default"
  """tfds name (``name/config``); ``synthetic_clicks`` builds offline."""
  data_dir: Optional[str] = None
  """tfds data_dir; None: tfds's default (~/tensorflow_datasets)."""
  batch_size: int = 512
  steps: int = 2000
  steps_per_checkpoint: int = 200
  """Also the interval of logs, TensorBoard points and the learning curve."""
  eval_batches: Optional[int] = None
  """Batches of the held-out split to evaluate on; None: all of it."""
  seed: int = 0
  dense_optimizer: Any = dataclasses.field(
      default_factory=lambda: {"class_name": "Adam",
                               "config": {"learning_rate": 0.001}})
  """A Keras optimizer for the dense weights (``keras.optimizers.get`` form)."""
  model: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  """RankingModel arguments: bottom, top, interaction."""
  features: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  """``{feature: {column: c0, format: dense|ragged|sparse}}``; default: the
  column named like the feature, dense for single-hot, ragged otherwise."""
  label: str = "label"
  dense_column: str = "dense"
  train_split: str = "train"
  eval_split: str = "test"
  """tfds split strings, e.g. ``train[:90%]`` / ``train[90%:]``."""

  @classmethod
  def from_dict(cls, config: Optional[Mapping[str, Any]]) -> "TrainConfig":
    config = dict(config or {})
    names = [f.name for f in dataclasses.fields(cls)]
    for key in config:
      if key not in names:
        raise errors.ConfigError(
            f'unknown field "{key}".{errors.did_you_mean(key, names)} Valid: '
            f"{errors.one_of(names)}.", path=f"train.{key}")
    for key in ("batch_size", "steps", "steps_per_checkpoint"):
      value = config.get(key, 1)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise errors.ConfigError(
            f"{key} must be a positive integer, got {key}={value!r}. Fix: "
            "write e.g. 512.", path=f"train.{key}")
    return cls(**config)


def _single_hot_columns(dataset: str):
  try:
    from tpu_embed_ext.data import synthetic_clicks
  except ImportError:
    return None
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
  import tensorflow_datasets as tfds
  from tpu_embed_ext.data import pipeline  # Registers synthetic_clicks.

  columns = feature_columns(spec, cfg)
  builder = tfds.builder(cfg.dataset, data_dir=cfg.data_dir)
  builder.download_and_prepare()
  common = dict(features=columns, batch_size=cfg.batch_size,
                dense_column=cfg.dense_column, label_column=cfg.label,
                preprocess=pipeline.preprocessor(cfg.dataset))
  train = pipeline.make_dataset(
      **_split(builder, cfg.train_split), shuffle_seed=cfg.seed, repeat=True,
      **common).skip(skip_batches)
  evaluation = pipeline.make_dataset(
      **_split(builder, cfg.eval_split), num_batches=cfg.eval_batches,
      drop_remainder=False, **common)
  return train, evaluation


def _split(builder, split: str) -> Dict[str, Any]:
  """``make_dataset``'s source: batch-parsed records where we can, else tfds's."""
  if builder.name == "synthetic_clicks":
    from tpu_embed_ext.data import synthetic_clicks
    records = synthetic_clicks.serialized_split(builder, split)
    if records is not None:
      return {"ds": records, "parse_batch": builder.info.features.decode_batch}
  return {"ds": builder.as_dataset(split=split, shuffle_files=False)}


def build_model(spec: EmbeddingSpec, cfg: TrainConfig, *, engine=None):
  from tpu_embed_ext.model import RankingModel
  keras.utils.set_random_seed(cfg.seed)
  model = RankingModel(spec, engine=engine, **dict(cfg.model))
  model.compile(
      optimizer=keras.optimizers.get(_keras_config(cfg.dense_optimizer)),
      loss=keras.losses.BinaryCrossentropy(from_logits=True),
      metrics=[keras.metrics.AUC(from_logits=True, name="auc")])
  return model


def _keras_config(optimizer):
  if isinstance(optimizer, Mapping) and "class" in optimizer:
    config = dict(optimizer)
    return {"class_name": config.pop("class"), "config": config}
  return optimizer


def _build(model, batch):
  """Creates every variable (model and dense optimizer) before a restore."""
  features, _ = batch
  model(features, training=False)
  model.optimizer.build(model.trainable_variables)


class _Checkpointer(keras.callbacks.Callback):
  """Saves a checkpoint at the end of every fit 'epoch' (a block of steps)."""

  def __init__(self, manager: tf.train.CheckpointManager, steps_per_block: int):
    super().__init__()
    self.manager = manager
    self.steps_per_block = steps_per_block

  def on_epoch_end(self, epoch, logs=None):
    self.manager.save(checkpoint_number=(epoch + 1) * self.steps_per_block)


def _resolve_strategy(tpu: str):
  """Returns (strategy or None, description of where training runs)."""
  if tpu == "none":
    return None, "CPU emulation (CPUEmbedding)"
  try:
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
        tpu="" if tpu == "auto" else tpu)
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return (tf.distribute.TPUStrategy(resolver),
            f"TPU ({resolver.master()}) via TPUEmbedding")
  except (ValueError, RuntimeError, tf.errors.OpError) as e:
    if tpu != "auto":
      raise
    return None, f"CPU emulation (CPUEmbedding): no TPU found ({type(e).__name__})"


def train(config_path: str, *, model_dir: str, steps: Optional[int] = None,
          tpu: str = "auto", overrides: Optional[Mapping[str, Any]] = None,
          verbose: Optional[int] = None) -> Dict[str, Any]:
  """Trains (or resumes) and evaluates; returns the metrics it writes."""
  spec = EmbeddingSpec.from_file(config_path)
  cfg = TrainConfig.from_dict({**(spec.train or {}), **(overrides or {})})
  import sys
  if verbose is None:  # A live progress bar on a terminal, a line per block in logs.
    verbose = 1 if sys.stdout.isatty() else 2
  total_steps = steps or cfg.steps
  block = min(cfg.steps_per_checkpoint, total_steps)
  if total_steps % block:
    raise errors.ConfigError(
        f"steps={total_steps} must be a multiple of steps_per_checkpoint="
        f"{block}. Fix: change one of them.", path="train.steps")
  tf.config.experimental.enable_op_determinism()
  strategy, where = _resolve_strategy(tpu)
  print(f"Training on {where}.", flush=True)
  os.makedirs(model_dir, exist_ok=True)

  scope = strategy.scope() if strategy else _null_scope()
  with scope:
    model = build_model(spec, cfg)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(
        checkpoint, os.path.join(model_dir, "checkpoints"), max_to_keep=3)
    first_batch = next(iter(input_datasets(spec, cfg)[1]))
    _build(model, first_batch)
    done = 0
    if manager.latest_checkpoint:
      if hasattr(model.embedding.embedding, "check_checkpoint"):
        model.embedding.embedding.check_checkpoint(
            manager.latest_checkpoint, prefix="model/embedding/embedding")
      checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
      done = int(manager.latest_checkpoint.rsplit("-", 1)[1])
      print(f"Resumed from {manager.latest_checkpoint} (step {done}).", flush=True)
    train_ds, eval_ds = input_datasets(spec, cfg, skip_batches=done)

    start = time.perf_counter()
    if done < total_steps:
      model.fit(
          train_ds, epochs=total_steps // block, initial_epoch=done // block,
          steps_per_epoch=block, verbose=verbose,
          callbacks=[
              _Checkpointer(manager, block),
              keras.callbacks.CSVLogger(
                  os.path.join(model_dir, "history.csv"), append=True),
              keras.callbacks.TensorBoard(os.path.join(model_dir, "logs")),
          ])
    seconds = time.perf_counter() - start
    metrics = evaluate(model, eval_ds)

  metrics.update(
      steps=total_steps, resumed_from_step=done, where=where,
      examples_per_second=(
          (total_steps - done) * cfg.batch_size / seconds if seconds else None),
      table_step=int(model.embedding.step.numpy()))
  metrics.update(_planted_auc(cfg))
  with open(os.path.join(model_dir, "metrics.json"), "w") as f:
    json.dump(metrics, f, indent=2)
  _plot_learning_curve(model_dir)
  return metrics


class _null_scope:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


def evaluate(model, eval_ds) -> Dict[str, float]:
  """Loss and exact AUC over the held-out batches."""
  from tpu_embed_ext.data.pipeline import auc
  labels, scores, losses = [], [], []
  bce = keras.losses.BinaryCrossentropy(from_logits=True, reduction="sum")
  count = 0
  for features, label in eval_ds:
    logits = model(features, training=False)
    label = tf.reshape(tf.cast(label, tf.float32), [-1, 1])
    losses.append(float(bce(label, logits)))
    count += int(label.shape[0])
    labels.append(label.numpy().ravel())
    scores.append(logits.numpy().ravel())
  labels, scores = np.concatenate(labels), np.concatenate(scores)
  return {"eval_loss": sum(losses) / count, "eval_auc": float(auc(labels, scores)),
          "eval_examples": count}


def _planted_auc(cfg: TrainConfig) -> Dict[str, float]:
  if not cfg.dataset.startswith("synthetic_clicks"):
    return {}
  from tpu_embed_ext.data import synthetic_clicks
  return {"planted_auc": float(synthetic_clicks.planted_auc(
      cfg.dataset, split="test", data_dir=cfg.data_dir,
      num_examples=None if cfg.eval_batches is None
      else cfg.eval_batches * cfg.batch_size))}


def _plot_learning_curve(model_dir: str):
  path = os.path.join(model_dir, "history.csv")
  if not os.path.exists(path):
    return
  import csv
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  with open(path) as f:
    rows = [r for r in csv.DictReader(f) if r.get("epoch", "").isdigit()]
  if not rows:
    return
  epochs = [int(r["epoch"]) + 1 for r in rows]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for key in ("loss", "auc"):
    ax.plot(epochs, [float(r[key]) for r in rows], marker="o", label=f"train {key}")
  ax.set_xlabel("checkpoint block")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(model_dir, "learning_curve.png"), dpi=100)
  plt.close(fig)


def export(config_path: str, *, model_dir: str, out: str,
           overrides: Optional[Mapping[str, Any]] = None) -> str:
  """Restores the latest checkpoint and writes a serving SavedModel.

  The signature takes ``dense`` [batch, 13] and, per categorical feature, an
  int64 id matrix: [batch, 1] for single-hot features, [batch, n] padded with
  -1 for multi-hot ones.
  """
  from tpu_embed_ext import serving
  spec = EmbeddingSpec.from_file(config_path)
  cfg = TrainConfig.from_dict({**(spec.train or {}), **(overrides or {})})
  model = build_model(spec, cfg)
  _, eval_ds = input_datasets(spec, cfg)
  batch = next(iter(eval_ds))
  _build(model, batch)
  manager = tf.train.CheckpointManager(
      tf.train.Checkpoint(model=model, optimizer=model.optimizer),
      os.path.join(model_dir, "checkpoints"), max_to_keep=3)
  if not manager.latest_checkpoint:
    raise FileNotFoundError(
        f"no checkpoint in {model_dir}/checkpoints. Fix: run `train` with "
        f"--model_dir={model_dir} first.")
  manager.checkpoint.restore(manager.latest_checkpoint).expect_partial()
  features, _ = batch
  signature = {"dense": tf.TensorSpec([None, features["dense"].shape[1]],
                                      tf.float32, name="dense")}
  for name, ids in features["categorical"].items():
    width = 1 if isinstance(ids, tf.Tensor) and ids.shape.rank == 1 else None
    signature[name] = tf.TensorSpec([None, width], tf.int64, name=name)

  def preprocess(inputs):
    categorical = {}
    for name, ids in features["categorical"].items():
      x = inputs[name]
      if isinstance(ids, tf.Tensor) and ids.shape.rank == 1:
        categorical[name] = tf.cast(x[:, 0], ids.dtype)
      else:
        categorical[name] = tf.cast(serving.ragged_from_padded(x), ids.dtype)
    return {"dense": inputs["dense"], "categorical": categorical}

  serving.export_for_serving(model, out, signature, preprocess=preprocess)
  return out
