"""The training loop: resume, fit in blocks (checkpoint, held-out evaluation,
history, TensorBoard, log line per block), then metrics.json and the plot.

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
import functools
import json
import os
import sys
import time
from typing import Any, Dict, Mapping, Optional

import keras
import tensorflow as tf

from tpu_embed_ext.host import atomic
from tpu_embed_ext import errors
from tpu_embed_ext.host import checkpoint_scan
from tpu_embed_ext.host import model_dir as model_dir_lib
from tpu_embed_ext.job.building import build_model, build_variables, restore
from tpu_embed_ext.job.config import TrainConfig, check_steps, in_file, load
from tpu_embed_ext.job.data import first_batch, input_datasets
from tpu_embed_ext.job.evaluation import evaluate, planted_auc
from tpu_embed_ext.host.memory import check_memory
from tpu_embed_ext.job.outputs import (STEP_LOSS, append_history,
                                       check_output_paths, learning_rate_series,
                                       plot_learning_curve, purge_summaries,
                                       trim_history)
from tpu_embed_ext.job import replicated
from tpu_embed_ext.job.strategy import emulation, resolve_strategy
from tpu_embed_ext.spec import files

__all__ = ["train"]


class _Blocks(keras.callbacks.Callback):
  """Writes every step's loss to TensorBoard; ends a block of steps:
  checkpoint, held-out evaluation, history, logs.

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
    with self.writer.as_default():
      tf.summary.scalar(STEP_LOSS, logs["step_loss"], step=step)
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
    append_history(self.model_dir, row)
    self._summaries(row)
    try:
      self.manager.save(checkpoint_number=step)
    except (OSError, tf.errors.OpError) as e:
      raise atomic.io_error(
          e, "checkpoint", f"{self.manager.directory}/ckpt-{step}",
          note=_RESUME_NOTE) from None
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
  with model_dir_lib.made_here(model_dir):
    done = _already_done(config_path, model_dir, steps, overrides, log)
    if done is not None:
      return done
    # The emulated TPU first: its logical devices exist only if made before
    # TensorFlow initialises (loading the config may run ops).
    with emulation(tpu), in_file(config_path):
      return _checked_train(config_path, model_dir, steps, tpu, overrides,
                            verbose, log)


def _already_done(config_path, model_dir, steps, overrides, log):
  """The metrics of a finished run asked for no more steps, or None; decided
  from metrics.json, the config's steps and the newest checkpoint (read back
  whole), before any dataset, model or strategy is built, and without
  starting TensorFlow (an emulated TPU could still be made after this)."""
  metrics = _finished(os.path.join(model_dir, "metrics.json"))
  if not isinstance(metrics, dict) or not isinstance(metrics.get("steps"), int):
    return None
  if not os.path.exists(os.path.join(model_dir, "learning_curve.png")):
    return None  # The full path completes the outputs.
  with in_file(config_path):
    data = files.load(files.resolve(config_path, flag=None))
    train_section = {**((data or {}).get("train") or {}), **(overrides or {})}
    total = check_steps(steps, train_section.get("steps", TrainConfig.steps))
  if not isinstance(total, int) or metrics["steps"] < total:
    return None
  newest = model_dir_lib.checkpoint_steps(os.path.join(model_dir, "checkpoints"))
  if not newest or newest[0] != metrics["steps"]:
    return None
  with model_dir_lib.lock(model_dir):  # Not while another run writes it.
    prefix = os.path.join(model_dir, "checkpoints", f"ckpt-{newest[0]}")
    if checkpoint_scan.scan(prefix).error is not None:
      return None  # The full path falls back to an older checkpoint.
    log(f"Already trained to step {metrics['steps']} (asked for {total}): nothing "
        "to do; metrics.json left as it was.")
    return metrics


def _checked_train(config_path, model_dir, steps, tpu, overrides, verbose, log):
  spec, cfg = load(config_path, overrides)
  total = check_steps(steps, cfg.steps)
  model_dir_lib.check_writable(model_dir)
  check_output_paths(model_dir)
  with model_dir_lib.lock(model_dir), _io_errors(model_dir):
      # A checkpoints directory that cannot be written (a read-only mount)
      # is found before anything is trained. (An absent one is created by
      # the first save, in the model_dir found writable above.)
    if os.path.isdir(os.path.join(model_dir, "checkpoints")):
      model_dir_lib.check_writable(os.path.join(model_dir, "checkpoints"),
                                   what="the checkpoints directory")
    return _train(spec, cfg, model_dir, total, tpu, verbose, log)


_RESUME_NOTE = ("The checkpoints before it are intact; run the same command again "
                "to resume from the newest one.")


def _io_errors(model_dir: str):
  """A write refused by the disk (full, read-only) as one ModelDirError line."""
  @contextlib.contextmanager
  def scope():
    try:
      yield
    except errors.Error:
      raise
    except (OSError, tf.errors.OpError) as e:
      if not atomic.is_write_error(e):
        raise
      raise atomic.io_error(e, "to model_dir", model_dir, note=_RESUME_NOTE) from None
  return scope()


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


def _finished(metrics_path: str) -> Optional[Dict[str, Any]]:
  """metrics.json of a finished run, or None (absent, or not whole JSON)."""
  try:
    with open(metrics_path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _train(spec, cfg, model_dir, total, tpu, verbose, log):
  strategy, where = resolve_strategy(tpu)
  if strategy is None:
    check_memory(spec)
  log(f"Training on {where}.")
  tf.config.experimental.enable_op_determinism()
  checkpoints = os.path.join(model_dir, "checkpoints")
  for name in ("metrics.json", "history.csv", "learning_curve.png", "run.json"):
    atomic.clean(os.path.join(model_dir, name))  # leftovers of killed writes
  # The state file is repaired once the restore is checked (repair_state):
  # a refused checkpoint leaves the model_dir as it was.
  resume, named = model_dir_lib.resume_point(checkpoints, log=log, repair=False)
  scope = strategy.scope() if strategy else contextlib.nullcontext()
  with scope:
    model = build_model(spec, cfg)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    _, eval_ds = input_datasets(spec, cfg)
    build_variables(model, first_batch(eval_ds, cfg), cfg.batch_size)
    done = 0
    if resume:
      restore(model, checkpoint, resume, spec)
      done = int(model.embedding.step.numpy())
      log(f"Resumed from {resume} (step {done}).")
      if done != named:
        log(f"{resume} holds table step {done}; continuing from step {done}.")
    model_dir_lib.repair_state(checkpoints, resume)

    settings = {k: getattr(cfg, k) for k in
                ("batch_size", "steps_per_checkpoint", "seed", "dataset")}
    runs = model_dir_lib.read_run_record(model_dir)
    note = _run_changes(runs[-1], settings) if (runs and done) else ""
    if note:
      log(note)
    metrics_path = os.path.join(model_dir, "metrics.json")
    metrics = _finished(metrics_path) if done >= total else None
    if metrics is not None:
      log(f"Already trained to step {done} (asked for {total}): nothing to do; "
          f"metrics.json left as it was.")
      if not os.path.exists(os.path.join(model_dir, "learning_curve.png")):
        # Killed after metrics.json, before the plot: complete the outputs.
        plot_learning_curve(model_dir)
        log("learning_curve.png was missing: drawn from history.csv.")
      return metrics
    model_dir_lib.write_run_record(
        model_dir, runs + [{**settings, "from_step": done, "to_step": total}])
    trim_history(model_dir, done)
    # Points after the resumed step are from a run killed mid-block; this
    # run writes them again.
    purge_summaries(os.path.join(model_dir, "logs"), done)

    evaluate_fn = functools.partial(evaluate, model, eval_ds, cfg.batch_size)
    blocks = _Blocks(
        manager=tf.train.CheckpointManager(checkpoint, checkpoints, max_to_keep=3),
        block=cfg.steps_per_checkpoint, start=done, total=total,
        evaluate_fn=evaluate_fn, model_dir=model_dir,
        rates=learning_rate_series(spec, model.optimizer), log=log)
    start = time.perf_counter()
    if done < total:
      if strategy is None:
        train_ds, _ = input_datasets(spec, cfg, skip_batches=done)
      else:
        train_ds = replicated.fit_dataset(
            lambda: input_datasets(spec, cfg, skip_batches=done)[0])
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
  metrics.update(planted_auc(cfg))
  model_dir_lib.write_json(metrics_path, metrics)
  plot_learning_curve(model_dir)
  return metrics
