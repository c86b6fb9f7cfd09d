"""What a run leaves in model_dir besides checkpoints: history.csv, the
learning-rate series and the per-step loss for TensorBoard, learning_curve.png.

Files are replaced whole (``atomic.write_file``), never appended in place: a
kill leaves the previous complete history.csv or the new one. A torn last
row (a history.csv written by an older version, or cut by a full disk) is
dropped when read, never an error. ``purge_summaries`` drops TensorBoard
points after the resumed step, which the resumed run writes again.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import os
from typing import Dict, Mapping, Optional

import keras
import tensorflow as tf

from tpu_embed_ext.host import atomic
from tpu_embed_ext.host.model_dir import ModelDirError
from tpu_embed_ext.spec import EmbeddingSpec
from tpu_embed_ext.tf import config as tf_config, rates

__all__ = ["HISTORY", "STEP_LOSS", "StepLoss", "OUTPUT_FILES", "OUTPUT_DIRS",
           "check_output_paths", "learning_rate_series", "append_history",
           "read_history", "trim_history", "plot_learning_curve", "purge_summaries"]


HISTORY = ("step", "loss", "auc", "eval_loss", "eval_auc")
STEP_LOSS = "train/loss_per_step"
"""TensorBoard tag of every step's training loss (``train/loss`` is per block)."""


class StepLoss(keras.metrics.Metric):
  """The loss of the last batch alone.

  Keras's ``loss`` in the logs is the mean since the metrics were last reset
  (a block, here); this is the value behind each point of ``STEP_LOSS``.
  Under a strategy it is the mean over the replicas' batches.
  """

  def __init__(self, loss, name: str = "step_loss"):
    super().__init__(name=name)
    self._loss = loss
    self._value = self.add_variable(shape=(), initializer="zeros", name="value",
                                    aggregation="mean")

  def update_state(self, y_true, y_pred, sample_weight=None):
    self._value.assign(self._loss(y_true, y_pred, sample_weight))

  def result(self):
    return self._value

# What a training run writes in its model_dir: files, then directories.
OUTPUT_FILES = (".lock", "run.json", "history.csv", "metrics.json",
                "learning_curve.png")
OUTPUT_DIRS = ("checkpoints", "logs")


def check_output_paths(model_dir: str) -> None:
  """ModelDirError before any work if a path the run writes is of the wrong
  kind: a directory where a file goes (found only when it is written, some
  after all the training), a file where a directory goes (a checkpoints file
  failed every save, and the run said to run it again)."""
  for name in OUTPUT_FILES:
    path = os.path.join(model_dir, name)
    if os.path.isdir(path):
      raise ModelDirError(
          f"{path} is a directory, but a run writes its {name} file there. Fix: "
          "move it away, or pass another --model_dir; nothing was written.")
  for name in OUTPUT_DIRS:
    path = os.path.join(model_dir, name)
    if os.path.lexists(path) and not os.path.isdir(path):
      raise ModelDirError(
          f"{path} is a file, but a run writes its {name} directory there. Fix: "
          "move it away, or pass another --model_dir; nothing was written.")


def learning_rate_series(spec: EmbeddingSpec, dense_optimizer=None
                         ) -> Dict[str, tuple]:
  """``{TensorBoard tag: (step -> rate, description)}``.

  One series per dynamic learning-rate tag of the tables (as the TPU
  numbers them) and one for the dense optimizer.
  """
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
    out.setdefault(name, (functools.partial(rates.value_at, rate),
                          f"tables {', '.join(users)}: "
                          f"{rates.describe(rate)}"))
  if dense_optimizer is not None:
    lr = dense_optimizer._learning_rate  # pylint: disable=protected-access
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
      dense = lambda t: float(lr(t))
    else:
      value = float(keras.ops.convert_to_numpy(lr))
      dense = lambda t: value
    out["learning_rate/dense"] = (dense, f"dense {type(dense_optimizer).__name__}")
  return out


def _write_history(path: str, rows) -> None:
  with atomic.write_file(path, newline="") as f:
    writer = csv.DictWriter(f, fieldnames=HISTORY)
    writer.writeheader()
    writer.writerows({**r, "step": int(r["step"])} for r in rows)


def append_history(model_dir: str, row: Mapping[str, float]) -> None:
  """Adds ``row``: the whole file is rewritten beside and renamed (it is small)."""
  path = os.path.join(model_dir, "history.csv")
  _write_history(path, read_history(model_dir) + [dict(row)])


def _row(r) -> Optional[Dict[str, float]]:
  try:
    values = {k: float(r[k]) for k in HISTORY}
  except (TypeError, ValueError, KeyError):
    return None  # A torn row: missing or cut fields.
  return values if None not in r else None  # None: extra fields


def read_history(model_dir: str):
  """The complete rows of history.csv; a torn row is skipped."""
  path = os.path.join(model_dir, "history.csv")
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    text = f.read()
  if not text.endswith("\n"):  # A torn last row, even one whose cut value parses.
    text = text[:text.rfind("\n") + 1]
  reader = csv.DictReader(io.StringIO(text, newline=""))
  if tuple(reader.fieldnames or ()) != HISTORY:
    return []
  return [row for row in map(_row, reader) if row is not None]


def trim_history(model_dir: str, step: int) -> None:
  """Drops rows after ``step`` (a resumed run redoes them) and torn rows.

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
  _write_history(path, [r for r in read_history(model_dir) if r["step"] <= step])


def purge_summaries(log_dir: str, step: int) -> int:
  """Drops TensorBoard events after ``step`` from every events file in ``log_dir``.

  A run killed mid-block wrote that block's points, and the resumed run
  writes them again: without this TensorBoard would show both. Each file is
  rewritten beside and renamed; a torn last record (a kill mid-write) ends
  the file. Returns the number of events dropped.
  """
  from tensorflow.core.util import event_pb2
  dropped = 0
  if not os.path.isdir(log_dir):
    return 0
  # The temporary file is named without "tfevents" (TensorBoard reads every
  # file whose name has it); a killed purge's leftover is deleted here.
  atomic.clean(os.path.join(log_dir, "purge"))
  for name in sorted(os.listdir(log_dir)):
    if not name.startswith("events.out.tfevents."):
      continue
    path = os.path.join(log_dir, name)
    kept, torn = [], False
    try:
      for record in tf.data.TFRecordDataset(path).as_numpy_iterator():
        kept.append(record)
    except tf.errors.OpError:
      torn = True  # Keep the complete records before the torn one.
    events = [(r, event_pb2.Event.FromString(r)) for r in kept]
    keep = [r for r, e in events if not (e.step > step and e.HasField("summary"))]
    if len(keep) == len(kept) and not torn:
      continue
    dropped += len(kept) - len(keep)
    tmp = atomic.temporary_name(os.path.join(log_dir, "purge"))
    try:
      with tf.io.TFRecordWriter(tmp) as writer:
        for record in keep:
          writer.write(record)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  return dropped


def plot_learning_curve(model_dir: str):
  """learning_curve.png: loss and AUC, training (per block) beside held-out,
  and the AUC of the model that planted the labels (metrics.json's
  ``planted_auc``, synthetic data only), the ceiling the summary quotes."""
  rows = read_history(model_dir)
  if not rows:
    return
  ceiling = None
  try:
    with open(os.path.join(model_dir, "metrics.json")) as f:
      ceiling = float(json.load(f)["planted_auc"])
  except (OSError, ValueError, KeyError, TypeError):
    pass  # No metrics yet, or no planted model: no line.
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [r["step"] for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  for ax, key in zip(axes, ("loss", "auc")):
    ax.plot(steps, [r[key] for r in rows], marker="o", label=f"training {key} (block mean)")
    ax.plot(steps, [r[f"eval_{key}"] for r in rows], marker="s",
            label=f"held-out {key}")
    if key == "auc" and ceiling is not None:
      ax.axhline(ceiling, linestyle="--", color="gray",
                 label=f"planted model {ceiling:.4f} (the ceiling)")
    ax.set_xlabel("table step")
    ax.set_title(key.upper() if key == "auc" else key)
    ax.legend()
    ax.grid(alpha=0.3)
  fig.tight_layout()
  with atomic.write_file(os.path.join(model_dir, "learning_curve.png"), "wb") as f:
    fig.savefig(f, format="png", dpi=100)
  plt.close(fig)
