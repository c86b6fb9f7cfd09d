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

import contextlib
import csv
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any, Dict, Mapping, Optional

import keras
import numpy as np
import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext import model_dir as model_dir_lib
from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["TrainConfig", "MemoryLimitError", "train", "export", "evaluate",
           "build_model", "input_datasets", "check_memory", "memory_shortfall",
           "available_memory", "learning_rate_series", "serving_inputs"]


_MODEL_FIELDS = ("bottom", "top", "interaction")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """The ``train:`` section of a config file."""

  dataset: str = "synthetic_clicks/default"
  """tfds name (``name/config``); ``synthetic_clicks`` builds offline."""
  data_dir: Optional[str] = None
  """tfds data_dir; None: tfds's default (~/tensorflow_datasets)."""
  batch_size: int = 512
  steps: int = 2000
  """Train until the tables have taken this many steps (a resumed run counts
  the steps before it)."""
  steps_per_checkpoint: int = 200
  """Checkpoints at multiples of this table step (and the last step); also
  the interval of held-out evaluations, history rows and log lines."""
  eval_batches: Optional[int] = None
  """Batches of the held-out split to evaluate on; None: all of it."""
  seed: int = 0
  dense_optimizer: Any = dataclasses.field(
      default_factory=lambda: {"class_name": "Adam",
                               "config": {"learning_rate": 0.001}})
  """A Keras optimizer for the dense weights (``keras.optimizers.get`` form,
  or ``{class: Adam, learning_rate: ...}``)."""
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
    """Validates every field; a ConfigError names ``train.<field>``."""
    config = dict(config or {})
    names = [f.name for f in dataclasses.fields(cls)]
    for key in config:
      if key not in names:
        raise errors.ConfigError(
            f'unknown field "{key}".{errors.did_you_mean(key, names)} Valid: '
            f"{errors.one_of(names)}.", path=f"train.{key}")
    for key in ("batch_size", "steps", "steps_per_checkpoint", "eval_batches"):
      if key in config and not (key == "eval_batches" and config[key] is None):
        _positive(config[key], f"train.{key}", key)
    seed = config.get("seed", 0)
    if not _is_int(seed) or seed < 0:
      raise errors.ConfigError(
          f"seed must be an integer >= 0, got seed={seed!r}. Fix: write e.g. 0.",
          path="train.seed")
    for key in ("dataset", "label", "dense_column", "train_split", "eval_split"):
      if key in config:
        errors.require_name(config[key], f"train.{key}", key)
    if config.get("data_dir") is not None:
      errors.require_name(config["data_dir"], "train.data_dir", "data_dir")
    _check_dense_optimizer(config.get("dense_optimizer"))
    _check_model(config.get("model", {}))
    _check_features(config.get("features", {}))
    return cls(**config)


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _positive(value, path: str, name: str) -> None:
  if not _is_int(value) or value <= 0:
    raise errors.ConfigError(
        f"{name} must be a positive integer, got {name}={value!r}. Fix: write "
        "e.g. 512.", path=path)


def _check_dense_optimizer(optimizer) -> None:
  if optimizer is None:
    return
  try:
    keras.optimizers.get(_keras_config(optimizer))
  except (ValueError, TypeError) as e:
    names = sorted(n for n, c in vars(keras.optimizers).items()
                   if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)
                   and c is not keras.optimizers.Optimizer)
    given = (optimizer.get("class") or optimizer.get("class_name")
             if isinstance(optimizer, Mapping) else optimizer)
    hint = errors.did_you_mean(given, names) if isinstance(given, str) else ""
    raise errors.ConfigError(
        f"Keras cannot build the dense optimizer {optimizer!r}: "
        f"{str(e).splitlines()[0]}{hint} Fix: write e.g. {{class: Adam, "
        f"learning_rate: 0.001}}; classes: {', '.join(names)}.",
        path="train.dense_optimizer") from None


def _check_model(model) -> None:
  if not isinstance(model, Mapping):
    raise errors.ConfigTypeError(
        f"model must be a mapping of {', '.join(_MODEL_FIELDS)}, got {model!r}.",
        path="train.model")
  for key, value in model.items():
    path = f"train.model.{key}"
    if key not in _MODEL_FIELDS:
      raise errors.ConfigError(
          f'unknown field "{key}".{errors.did_you_mean(key, _MODEL_FIELDS)} '
          f"Valid: {errors.one_of(_MODEL_FIELDS)}.", path=path)
    if key == "interaction":
      if value not in ("dot", "concat"):
        raise errors.ConfigError(
            f'interaction must be "dot" or "concat", got {value!r}.', path=path)
    elif (not isinstance(value, (list, tuple)) or not value
          or not all(_is_int(u) and u > 0 for u in value)):
      raise errors.ConfigError(
          f"{key} must be a list of layer widths (positive integers), got "
          f"{value!r}. Fix: write e.g. [64, 16].", path=path)


def _check_features(features) -> None:
  from tpu_embed_ext.data.pipeline import FORMATS
  if not isinstance(features, Mapping):
    raise errors.ConfigTypeError(
        f"features must be a mapping of feature -> {{column, format}}, got "
        f"{features!r}.", path="train.features")
  for name, entry in features.items():
    path = f"train.features.{name}"
    if not isinstance(entry, Mapping) or set(entry) - {"column", "format"}:
      raise errors.ConfigError(
          f"each feature takes {{column, format}}, got {entry!r}.", path=path)
    if "format" in entry and entry["format"] not in FORMATS:
      raise errors.unknown_name("format", entry["format"], FORMATS,
                                path=f"{path}.format")


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
  try:
    builder = tfds.builder(cfg.dataset, data_dir=cfg.data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise errors.ConfigError(
        f"unknown tfds dataset {cfg.dataset!r}: "
        f"{str(e).strip().splitlines()[0]} Fix: use synthetic_clicks/default, "
        "synthetic_clicks/tiny or a name from tfds.list_builders().",
        path="train.dataset") from None
  builder.download_and_prepare()
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


def _split(builder, split: str, field: str) -> Dict[str, Any]:
  """``make_dataset``'s source: batch-parsed records where we can, else tfds's."""
  try:
    if builder.name == "synthetic_clicks":
      from tpu_embed_ext.data import synthetic_clicks
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


def _first_batch(eval_ds, cfg: TrainConfig):
  """The first held-out batch (it builds the model); an empty split is an error."""
  batch = next(iter(eval_ds), None)
  if batch is None:
    raise errors.ConfigError(
        f"the held-out split {cfg.eval_split!r} of {cfg.dataset} has no examples. "
        "Fix: name a non-empty split, e.g. test or train[90%:].",
        path="train.eval_split")
  return batch


def _restore(model, checkpoint, path: str) -> None:
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


# --- memory --------------------------------------------------------------------

class MemoryLimitError(errors.Error, MemoryError):
  """The tables and slots would not fit into this machine's memory."""


def available_memory() -> int:
  """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_shortfall(spec: EmbeddingSpec, available: Optional[int] = None
                     ) -> Optional[str]:
  """Why the tables do not fit into host memory for CPU emulation, or None."""
  # Through the package: importing the submodule `tpu_embed_ext.plan` first
  # would shadow the package's `plan` function with the module.
  import tpu_embed_ext
  available = available_memory() if available is None else available
  tables = tpu_embed_ext.plan(spec).tables
  total = sum(t.total_bytes for t in tables)
  if total <= available:
    return None
  big = max(tables, key=lambda t: t.total_bytes)
  return (f"the tables and optimizer slots need {_gib(total)} (float32) "
          f"but this machine has {_gib(available)} available; the "
          f"largest is table '{big.name}' ({big.rows:,} x {big.dim}, "
          f"{len(big.optimizer.slot_names)} slot(s): "
          f"{_gib(big.total_bytes)}). Fix: lower its vocabulary_size "
          "for CPU emulation, or train on a TPU (--tpu).")


def _gib(n: int) -> str:
  return f"{n / 2**30:,.1f} GiB"


def check_memory(spec: EmbeddingSpec, available: Optional[int] = None) -> None:
  """MemoryLimitError, naming the largest table, before anything is allocated."""
  why = memory_shortfall(spec, available)
  if why:
    raise MemoryLimitError(why)


# --- the training loop -----------------------------------------------------------

_HISTORY = ("step", "loss", "auc", "eval_loss", "eval_auc")


class _Blocks(keras.callbacks.Callback):
  """Ends a block of steps: checkpoint, held-out evaluation, history, logs.

  Blocks end at table steps that are multiples of ``block`` and at the last
  step, so checkpoint names, history rows, log lines, TensorBoard steps and
  ``metrics.json`` all count the table step, across any number of resumes.
  Train loss and AUC are over the block (the metrics are reset after it).
  """

  def __init__(self, *, manager, block, start, total, evaluate_fn, model_dir,
               rates, log):
    super().__init__()
    self.manager, self.block, self.total = manager, block, total
    self.start = self.last = start
    self.evaluate_fn, self.model_dir, self.rates, self.log = (
        evaluate_fn, model_dir, rates, log)
    self.writer = tf.summary.create_file_writer(os.path.join(model_dir, "logs"))
    self.seconds = 0.0  # Spent here, not training.
    self.held_out = None  # The last block's evaluation.
    self.block_start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    step = self.start + batch + 1
    if step % self.block and step != self.total:
      return
    began = time.perf_counter()
    train_seconds = began - self.block_start
    table_step = int(self.model.embedding.step.numpy())
    if table_step != step:  # The invariant every name and count relies on.
      raise RuntimeError(f"the tables took {table_step} steps, the loop counted "
                         f"{step}: checkpoint names would lie.")
    held_out = self.held_out = self.evaluate_fn()
    row = {"step": step, "loss": float(logs["loss"]), "auc": float(logs["auc"]),
           "eval_loss": held_out["eval_loss"], "eval_auc": held_out["eval_auc"]}
    # History first: every checkpoint then has its row (a run killed between
    # the two redoes the block, and the resume drops the row after its step).
    _append_history(self.model_dir, row)
    self._summaries(row)
    self.manager.save(checkpoint_number=step)
    self.log(f"step {step}/{self.total}: loss {row['loss']:.4f}, AUC "
             f"{row['auc']:.4f}; held-out loss {row['eval_loss']:.4f}, AUC "
             f"{row['eval_auc']:.4f}; "
             f"{(step - self.last) / max(train_seconds, 1e-9):.1f} steps/s; "
             f"saved {self.manager.latest_checkpoint}")
    self.model.reset_metrics()
    self.last = step
    self.seconds += time.perf_counter() - began
    self.block_start = time.perf_counter()

  def _summaries(self, row):
    with self.writer.as_default():
      for key in ("loss", "auc"):
        tf.summary.scalar(f"train/{key}", row[key], step=row["step"])
        tf.summary.scalar(f"held_out/{key}", row[f"eval_{key}"], step=row["step"])
      # Update t (the step counter going t-1 -> t) applies the rate of step t-1.
      for t in range(self.last + 1, row["step"] + 1):
        for name, (rate, description) in self.rates.items():
          tf.summary.scalar(name, rate(t - 1), step=t, description=description)
    self.writer.flush()


def learning_rate_series(spec: EmbeddingSpec, dense_optimizer=None
                         ) -> Dict[str, tuple]:
  """``{TensorBoard tag: (step -> rate, description)}``.

  One series per dynamic learning-rate tag of the tables (as the TPU
  numbers them) and one for the dense optimizer.
  """
  from tpu_embed_ext import learning_rates, tf_config
  config = spec.feature_config(
      step=tf.Variable(0, dtype=tf.int64, trainable=False, name="series_step"))
  tags = tf_config.tags(config)
  out = {}
  for table in tf_config.table_order(config):
    tag = tags[table.name]
    if tag is None:
      continue
    name = f"learning_rate/tag_{tag}"
    users = [t for t, g in tags.items() if g == tag]
    rate = table.optimizer.learning_rate
    out.setdefault(name, (functools.partial(learning_rates.value_at, rate),
                          f"tables {', '.join(users)}: "
                          f"{learning_rates.describe(rate)}"))
  if dense_optimizer is not None:
    lr = dense_optimizer._learning_rate  # pylint: disable=protected-access
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
      dense = lambda t: float(lr(t))
    else:
      value = float(keras.ops.convert_to_numpy(lr))
      dense = lambda t: value
    out["learning_rate/dense"] = (dense, f"dense {type(dense_optimizer).__name__}")
  return out


def _append_history(model_dir: str, row: Mapping[str, float]) -> None:
  path = os.path.join(model_dir, "history.csv")
  new = not os.path.exists(path)
  with open(path, "a", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=_HISTORY)
    if new:
      writer.writeheader()
    writer.writerow(row)


def _read_history(model_dir: str):
  path = os.path.join(model_dir, "history.csv")
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    reader = csv.DictReader(f)
    if tuple(reader.fieldnames or ()) != _HISTORY:
      return []
    return [{k: float(v) for k, v in r.items()} for r in reader]


def _trim_history(model_dir: str, step: int) -> None:
  """Drops rows after ``step``: a resumed run redoes them (no duplicates).

  A history of another format (an older version's) is kept as history.csv.old.
  """
  path = os.path.join(model_dir, "history.csv")
  if not os.path.exists(path):
    return
  with open(path, newline="") as f:
    header = tuple(next(csv.reader(f), ()))
  if header != _HISTORY:
    os.replace(path, path + ".old")
    return
  rows = [r for r in _read_history(model_dir) if r["step"] <= step]
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", newline="") as f:  # Whole or not at all.
    writer = csv.DictWriter(f, fieldnames=_HISTORY)
    writer.writeheader()
    writer.writerows({**r, "step": int(r["step"])} for r in rows)
  os.replace(tmp, path)


def _check_steps(steps: Optional[int], default: int) -> int:
  if steps is None:
    return default
  if not _is_int(steps) or steps <= 0:
    raise errors.ConfigError(
        f"--steps must be a positive integer (the table step to train to), got "
        f"{steps!r}. Fix: pass e.g. --steps {default}, or leave it out for the "
        "config's train.steps.", path="--steps")
  return steps


def _run_changes(previous: Mapping[str, Any], now: Mapping[str, Any]) -> str:
  changed = [f"{k} {previous[k]} -> {now[k]}" for k in now
             if k in previous and previous[k] != now[k]]
  if not changed:
    return ""
  note = f"This run changed {', '.join(changed)} since the checkpoint."
  if previous.get("batch_size") != now["batch_size"] or previous.get("seed") != now["seed"]:
    note += (" From here the input order differs from an uninterrupted run "
             "(the resumed run skips step x batch_size examples of the new "
             "order).")
  return note


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
  except (ValueError, RuntimeError, OSError, tf.errors.OpError) as e:
    if tpu != "auto":
      raise errors.ConfigError(
          f"TPU {tpu!r} cannot be reached: {type(e).__name__}: "
          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}. Fix: "
          "check the name (gcloud compute tpus list), use --tpu auto on a TPU "
          "VM, or --tpu none for CPU emulation.", path="--tpu") from None
    return None, f"CPU emulation (CPUEmbedding): no TPU found ({type(e).__name__})"


def train(config_path: str, *, model_dir: str, steps: Optional[int] = None,
          tpu: str = "auto", overrides: Optional[Mapping[str, Any]] = None,
          verbose: Optional[int] = None, log=None) -> Dict[str, Any]:
  """Trains (or resumes) to table step ``steps`` and evaluates.

  Returns the metrics written to ``metrics.json``. Re-running a finished job
  trains nothing and returns the metrics already there. ``verbose``: 0
  silent, 1 a progress bar and a line per block, 2 a line per block (default:
  1 on a terminal, else 2). ``log`` prints those lines (default: print).
  """
  if verbose is None:
    verbose = 1 if sys.stdout.isatty() else 2
  if log is None:
    log = (lambda line: print(line, flush=True)) if verbose else (lambda line: None)
  with _in_file(config_path):
    spec, cfg = _load(config_path, overrides)
    total = _check_steps(steps, cfg.steps)
    model_dir_lib.check_writable(model_dir)
    with model_dir_lib.lock(model_dir):
      return _train(spec, cfg, model_dir, total, tpu, verbose, log)


def _load(config_path: str, overrides: Optional[Mapping[str, Any]]):
  spec = EmbeddingSpec.from_file(config_path)
  return spec, TrainConfig.from_dict({**(spec.train or {}), **(overrides or {})})


@contextlib.contextmanager
def _in_file(config_path: str):
  """Locates config errors raised after loading (train: section) in the file."""
  try:
    yield
  except errors.ConfigError as e:
    if e.file or e.path.startswith("--"):
      raise
    raise e.at(file=config_path) from None


def _train(spec, cfg, model_dir, total, tpu, verbose, log):
  strategy, where = _resolve_strategy(tpu)
  if strategy is None:
    check_memory(spec)
  log(f"Training on {where}.")
  tf.config.experimental.enable_op_determinism()
  checkpoints = os.path.join(model_dir, "checkpoints")
  resume, named = model_dir_lib.resume_point(checkpoints, log=log)
  scope = strategy.scope() if strategy else contextlib.nullcontext()
  with scope:
    model = build_model(spec, cfg)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    _, eval_ds = input_datasets(spec, cfg)
    _build(model, _first_batch(eval_ds, cfg))
    done = 0
    if resume:
      _restore(model, checkpoint, resume)
      done = int(model.embedding.step.numpy())
      log(f"Resumed from {resume} (step {done}).")
      if done != named:
        log(f"{resume} holds table step {done}; continuing from step {done}.")

    settings = {k: getattr(cfg, k) for k in
                ("batch_size", "steps_per_checkpoint", "seed", "dataset")}
    runs = model_dir_lib.read_run_record(model_dir)
    note = _run_changes(runs[-1], settings) if (runs and done) else ""
    if note:
      log(note)
    metrics_path = os.path.join(model_dir, "metrics.json")
    if done >= total and os.path.exists(metrics_path):
      log(f"Already trained to step {done} (asked for {total}): nothing to do; "
          f"metrics.json left as it was.")
      with open(metrics_path) as f:
        return json.load(f)
    model_dir_lib.write_run_record(
        model_dir, runs + [{**settings, "from_step": done, "to_step": total}])
    _trim_history(model_dir, done)

    evaluate_fn = functools.partial(evaluate, model, eval_ds)
    blocks = _Blocks(
        manager=tf.train.CheckpointManager(checkpoint, checkpoints, max_to_keep=3),
        block=cfg.steps_per_checkpoint, start=done, total=total,
        evaluate_fn=evaluate_fn, model_dir=model_dir,
        rates=learning_rate_series(spec, model.optimizer), log=log)
    start = time.perf_counter()
    if done < total:
      train_ds, _ = input_datasets(spec, cfg, skip_batches=done)
      model.fit(train_ds, epochs=1, steps_per_epoch=total - done, shuffle=False,
                verbose=1 if verbose == 1 else 0, callbacks=[blocks])
    seconds = time.perf_counter() - start - blocks.seconds
    metrics = dict(blocks.held_out) if blocks.held_out else evaluate_fn()

  trained = max(total - done, 0)
  metrics.update(
      steps=int(model.embedding.step.numpy()), trained_steps=trained,
      resumed_from_step=done, where=where,
      examples_per_second=trained * cfg.batch_size / seconds if trained else None,
      table_step=int(model.embedding.step.numpy()))
  metrics.update(_planted_auc(cfg))
  model_dir_lib.write_json(metrics_path, metrics)
  _plot_learning_curve(model_dir)
  return metrics


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
  """learning_curve.png: loss and AUC, training (per block) beside held-out."""
  rows = _read_history(model_dir)
  if not rows:
    return
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [r["step"] for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  for ax, key in zip(axes, ("loss", "auc")):
    ax.plot(steps, [r[key] for r in rows], marker="o", label=f"training {key} (block mean)")
    ax.plot(steps, [r[f"eval_{key}"] for r in rows], marker="s",
            label=f"held-out {key}")
    ax.set_xlabel("table step")
    ax.set_title(key.upper() if key == "auc" else key)
    ax.legend()
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(model_dir, "learning_curve.png"), dpi=100)
  plt.close(fig)


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
  with _in_file(config_path):
    spec, cfg = _load(config_path, overrides)
    model = build_model(spec, cfg)
    _, eval_ds = input_datasets(spec, cfg)
    batch = _first_batch(eval_ds, cfg)
  _build(model, batch)
  checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
  path, _ = model_dir_lib.resume_point(os.path.join(model_dir, "checkpoints"),
                                       repair=False)
  if path is None:
    raise model_dir_lib.CheckpointError(
        f"no checkpoint in {model_dir}/checkpoints. Fix: run `train` with "
        f"--model_dir={model_dir} first.")
  _restore(model, checkpoint, path)
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
