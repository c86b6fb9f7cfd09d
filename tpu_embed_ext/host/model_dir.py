"""What the main job keeps in a model_dir, and the rules that keep it whole.

A model_dir holds ``checkpoints/ckpt-<table step>.{index,data-*}`` (and
TensorFlow's ``checkpoints/checkpoint`` state file), ``history.csv``,
``metrics.json``, ``run.json`` (the settings of each run) and TensorBoard
logs. The rules, each because a run once lost work without them:

- One run at a time: ``lock`` holds an ``fcntl`` lock on ``.lock`` for the
  life of the process. The kernel drops it when the process dies (even by
  SIGKILL), so a stale lock file never blocks a later run. A run that ends
  removes its ``.lock``, and a failed run removes the model_dir it made if it
  is still empty (``made_here``): nothing is left that was not there.
- The state file is a hint, never the truth: ``resume_point`` scans the
  ``ckpt-*.index`` files, newest first, and returns the newest checkpoint
  whose every tensor reads back (TensorFlow checks each tensor's CRC; a
  truncated ``.data`` file counts as damaged too), then rewrites the state
  file to list only readable checkpoints, with their timestamps, so that
  ``CheckpointManager`` keeps ``max_to_keep`` of them across resumes. A checkpoint
  that cannot be read is reported by file and left on disk; it is replaced
  only when training writes a good checkpoint of the same step.
- A restore is checked first (``check_checkpoint``): every variable the model
  would restore must be in the checkpoint with the same shape, so a changed
  config is refused, naming the first mismatch, before anything is written;
  and finite (``checkpoint_scan``: counted in the same read as the CRCs).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import keras
import tensorflow as tf

from tpu_embed_ext.host import atomic, checkpoint_scan
from tpu_embed_ext import errors
from tpu_embed_ext.host.checkpoint_scan import CheckpointError

__all__ = ["CheckpointError", "ModelDirError", "lock", "made_here", "check_writable",
           "checkpoint_steps", "resume_point", "repair_state", "check_checkpoint",
           "read_run_record", "write_run_record", "write_json"]

_CKPT = re.compile(r"^ckpt-(\d+)\.index$")


class ModelDirError(errors.Error, OSError):
  """A model_dir that cannot be used: not writable, or in use by a run."""


class lock:
  """``with lock(model_dir):`` holds the model_dir for this process."""

  def __init__(self, model_dir: str):
    self.path = os.path.join(model_dir, ".lock")
    self._file = None

  def __enter__(self):
    self._file = open(self.path, "a+")
    try:
      fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self._file.seek(0)
      owner = self._file.read().strip() or "unknown"
      self._file.close()
      raise ModelDirError(
          f"model_dir {os.path.dirname(self.path)} is in use by another run "
          f"(pid {owner}). Fix: wait for it to finish, or pass another "
          "--model_dir.") from None
    try:  # Removed by its last holder (__exit__) after we opened it: retry.
      same = os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino
    except FileNotFoundError:
      same = False
    if not same:
      self._file.close()
      return self.__enter__()
    self._file.seek(0)
    self._file.truncate()
    self._file.write(str(os.getpid()))
    self._file.flush()
    return self

  def __exit__(self, *exc):
    # Removed while held, so nothing is left behind; a run that opened the
    # old file meanwhile sees it gone (__enter__) and takes a new one.
    try:
      os.remove(self.path)
    except OSError:
      pass
    fcntl.flock(self._file, fcntl.LOCK_UN)
    self._file.close()
    return False


def made_here(model_dir: str):
  """A context that, if what it wraps raises, removes ``model_dir`` and the
  parents it creates (``runs/`` of ``runs/tiny``) when they were absent before
  and are still empty: a failed command leaves nothing behind it created."""
  absent = []
  path = os.path.abspath(model_dir)
  while path and not os.path.exists(path):
    absent.append(path)
    path = os.path.dirname(path)

  @contextlib.contextmanager
  def scope():
    try:
      yield
    except BaseException:
      for directory in absent:  # Innermost first.
        try:
          os.rmdir(directory)
        except OSError:
          break  # Not empty (or gone): what the run wrote stays.
      raise
  return scope()


def check_writable(model_dir: str, what: str = "model_dir") -> None:
  """ModelDirError unless files can be created in ``model_dir`` (made if absent)."""
  try:
    atomic.probe_write(os.path.join(model_dir, f".write_probe_{os.getpid()}"))
  except OSError as e:
    raise ModelDirError(
        f"cannot write to {what} {model_dir}: {e.strerror or e}. Fix: pass a "
        "writable --model_dir.") from None


def checkpoint_steps(directory: str) -> List[int]:
  """Steps of the ``ckpt-<step>.index`` files in ``directory``, newest first."""
  if not os.path.isdir(directory):
    return []
  steps = [int(m.group(1)) for m in map(_CKPT.match, os.listdir(directory)) if m]
  return sorted(steps, reverse=True)


def resume_point(directory: str, log=print, *, repair: bool = True
                 ) -> Tuple[Optional[str], int]:
  """(prefix of the newest readable checkpoint or None, its step).

  ``repair``: rewrite the state file to list the readable checkpoints (a
  run about to save; a reader such as ``export`` leaves it alone). Raises
  CheckpointError if checkpoints exist and none reads back: starting from
  step 0 would overwrite them.
  """
  steps = checkpoint_steps(directory)
  bad = []
  for i, step in enumerate(steps):
    prefix = os.path.join(directory, f"ckpt-{step}")
    why = checkpoint_scan.scan(prefix).error
    if why is None:
      if bad:
        log(f"Falling back to {prefix} (step {step}): the newer checkpoint"
            f"{'s' if len(bad) > 1 else ''} {', '.join(bad)} could not be read.")
      if repair:
        repair_state(directory, prefix)
      return prefix, step
    log(f"Checkpoint {prefix}.index is damaged and cannot be restored: {why}")
    bad.append(f"{prefix}.index")
  if bad:
    raise CheckpointError(
        f"no checkpoint in {directory} can be read ({', '.join(bad)}). Fix: move "
        "them away to train from step 0, or restore a copy; nothing was "
        "overwritten.")
  return None, 0


def repair_state(directory: str, prefix: Optional[str]) -> None:
  """Deletes leftovers of killed saves and rewrites the state file to list
  ``prefix`` (the checkpoint resumed from) and the older checkpoints.

  ``train`` calls it once the restore was checked, so that a refused
  checkpoint leaves the model_dir exactly as it was.
  """
  _clean_leftovers(directory)
  if prefix is None:
    return
  step = int(prefix.rsplit("-", 1)[1])
  _write_state(directory, prefix, [os.path.join(directory, f"ckpt-{s}") for s in
                                   reversed(checkpoint_steps(directory)) if s <= step])


def _clean_leftovers(directory: str) -> None:
  """Deletes what a killed save leaves: TensorFlow's ``ckpt-N_temp`` shard
  directories and data files without their index (the ``.index`` is written
  last, so those never were a checkpoint). Runs under the model_dir lock."""
  if not os.path.isdir(directory):
    return
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    data = re.match(r"^(ckpt-\d+)\.data-\d{5}-of-\d{5}$", name)
    if re.match(r"^ckpt-\d+_temp$", name) and os.path.isdir(path):
      shutil.rmtree(path, ignore_errors=True)
    elif data and not os.path.exists(os.path.join(directory, data.group(1) + ".index")):
      os.remove(path)
  atomic.clean(os.path.join(directory, "checkpoint"))


def _write_state(directory: str, newest: str, paths: List[str]) -> None:
  """The state file TensorFlow's CheckpointManager trusts: readable ones only.

  With their timestamps (the ``.index`` files' mtimes) and a last-preserved
  time before them all: without timestamps, ``CheckpointManager`` takes
  every listed checkpoint as preserved (kept forever, outside
  ``max_to_keep``), so each resume left its checkpoints behind for good.
  """
  stamps = [os.path.getmtime(p + ".index") for p in paths]
  tf.compat.v1.train.update_checkpoint_state(
      directory, newest, all_model_checkpoint_paths=paths,
      all_model_checkpoint_timestamps=stamps,
      last_preserved_timestamp=min(stamps) - 1.0)


def _variable_paths(root) -> Dict[int, Tuple[Any, str]]:
  """``{id(variable): (variable, shortest object path from root)}``."""
  from tensorflow.python.checkpoint import graph_view
  from tensorflow.python.trackable import trackable_utils
  _, paths = graph_view.ObjectGraphView(root).breadth_first_traversal()
  return {id(obj): (obj, trackable_utils.object_path_to_string(path))
          for obj, path in paths.items()
          if isinstance(obj, (tf.Variable, keras.Variable))}


def _expected_variables(root) -> Dict[str, Tuple[str, List[int]]]:
  """``{checkpoint key: (variable name, shape)}`` of every variable under ``root``.

  The key is TensorFlow's (the shortest path, which for a dense weight runs
  through the optimizer); the name is its path through the layers
  (``model/top/layers/0/kernel``): root's children in order, breadth first,
  not descending into an optimizer below them.
  """
  from tensorflow.python.checkpoint import trackable_view
  children = trackable_view.TrackableView.children
  names: Dict[int, str] = {}
  seen = set()
  for top, obj in children(root).items():
    queue = collections.deque([(obj, top)])
    while queue:
      obj, path = queue.popleft()
      if id(obj) in seen:
        continue
      seen.add(id(obj))
      if isinstance(obj, (tf.Variable, keras.Variable)):
        names[id(obj)] = path
        continue
      for name, child in children(obj).items():
        if not isinstance(child, keras.optimizers.Optimizer):
          queue.append((child, f"{path}/{name}"))
  return {f"{path}/.ATTRIBUTES/VARIABLE_VALUE": (names.get(key, path), list(var.shape))
          for key, (var, path) in _variable_paths(root).items()}


def check_checkpoint(root, path: str, *, what: str = "this model") -> None:
  """CheckpointError unless ``path`` holds every variable of ``root``, same
  shapes, all finite.

  ``root`` is what would restore it (a ``tf.train.Checkpoint``, a model...).
  Nothing is read into variables, so a refused restore changes nothing. The
  first mismatch in checkpoint-key order is named. Each tensor is read once
  per checkpoint (``checkpoint_scan``), also across calls.
  """
  stored = dict(tf.train.list_variables(path))
  expected = _expected_variables(root)
  for key, (name, shape) in sorted(expected.items()):
    if key not in stored:
      raise CheckpointError(
          f"checkpoint {path} has no variable {name} (shape {shape}), which "
          f"{what} needs. Fix: restore a checkpoint written with the same "
          "config, or use another --model_dir.")
    if list(stored[key]) != shape:
      raise CheckpointError(
          f"variable {name}: checkpoint {path} holds shape {list(stored[key])}, "
          f"{what} has {shape}. Fix: restore a checkpoint written with the same "
          "config, or use another --model_dir.")
  checkpoint_scan.check_finite(
      path, {key: f"variable {name}" for key, (name, _) in expected.items()})


def read_run_record(model_dir: str) -> List[Dict[str, Any]]:
  path = os.path.join(model_dir, "run.json")
  if not os.path.exists(path):
    return []
  try:
    with open(path) as f:
      return list(json.load(f))
  except (ValueError, TypeError):
    return []  # A damaged record only loses the "what changed" note.


def write_run_record(model_dir: str, runs: List[Dict[str, Any]]) -> None:
  write_json(os.path.join(model_dir, "run.json"), runs)


def write_json(path: str, value) -> None:
  """Writes whole or not at all (``atomic.write_file``)."""
  with atomic.write_file(path) as f:
    json.dump(value, f, indent=2)
