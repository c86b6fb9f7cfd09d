"""What a run leaves in model_dir besides checkpoints: history.csv, the
learning-rate series for TensorBoard, learning_curve.png."""

from __future__ import annotations

import csv
import functools
import os
from typing import Dict, Mapping

import keras
import tensorflow as tf

from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["HISTORY", "learning_rate_series", "append_history", "read_history",
           "trim_history", "plot_learning_curve"]


HISTORY = ("step", "loss", "auc", "eval_loss", "eval_auc")


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


def append_history(model_dir: str, row: Mapping[str, float]) -> None:
  path = os.path.join(model_dir, "history.csv")
  new = not os.path.exists(path)
  with open(path, "a", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=HISTORY)
    if new:
      writer.writeheader()
    writer.writerow(row)


def read_history(model_dir: str):
  path = os.path.join(model_dir, "history.csv")
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    reader = csv.DictReader(f)
    if tuple(reader.fieldnames or ()) != HISTORY:
      return []
    return [{k: float(v) for k, v in r.items()} for r in reader]


def trim_history(model_dir: str, step: int) -> None:
  """Drops rows after ``step``: a resumed run redoes them (no duplicates).

  A history of another format (an older version's) is kept as history.csv.old.
  """
  path = os.path.join(model_dir, "history.csv")
  if not os.path.exists(path):
    return
  with open(path, newline="") as f:
    header = tuple(next(csv.reader(f), ()))
  if header != HISTORY:
    os.replace(path, path + ".old")
    return
  rows = [r for r in read_history(model_dir) if r["step"] <= step]
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", newline="") as f:  # Whole or not at all.
    writer = csv.DictWriter(f, fieldnames=HISTORY)
    writer.writeheader()
    writer.writerows({**r, "step": int(r["step"])} for r in rows)
  os.replace(tmp, path)


def plot_learning_curve(model_dir: str):
  """learning_curve.png: loss and AUC, training (per block) beside held-out."""
  rows = read_history(model_dir)
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
