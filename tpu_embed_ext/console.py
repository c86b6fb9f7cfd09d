"""What the command line prints: its help, and where other libraries' output goes.

Quiet by default, never silent on long work: our own progress (building the
dataset, training, conversion) goes to stdout; TensorFlow's, tfds' and absl's
log lines, Python warnings and tfds progress bars go to a log file, and a
closing line says how many went there. ``--verbose`` shows them all (and a
traceback on an error).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import textwrap
from typing import Dict, Optional, Sequence

__all__ = ["COMMAND_FLAGS", "EXAMPLES", "help_text", "quiet_cpp", "ThirdPartyLog"]

# Flags each command reads, in the order help shows them (--verbose: all).
COMMAND_FLAGS: Dict[str, Sequence[str]] = {
    "plan": ("config", "proto", "engine", "topology", "batch_size", "data",
             "hotness", "ids"),
    "train": ("config", "steps", "model_dir", "tpu"),
    "export": ("config", "model_dir", "out"),
    "convert-checkpoint": ("config", "checkpoint", "out", "topology", "prefix"),
}

SUMMARIES = {
    "plan": "print the TPU plan of a config: tables, optimizers, learning-rate "
            "tags, memory; with --engine v2 the SparseCore layout, with --data N "
            "the ids each step sends to each SparseCore",
    "train": "train (or resume) the config's ranking model; checkpoints, "
             "history, TensorBoard logs and metrics go to --model_dir",
    "export": "write the newest checkpoint of --model_dir as a serving SavedModel",
    "convert-checkpoint": "convert a checkpoint between per-table keys and "
                          "TPUEmbeddingV2's (SparseCore) stacked layout",
}

EXAMPLES = (
    "python -m tpu_embed_ext train --config configs/ranking.yaml",
    "python -m tpu_embed_ext export --config configs/ranking.yaml --model_dir runs/ranking",
    "python -m tpu_embed_ext plan --config configs/criteo.yaml --engine v2 "
    "--topology v5p:4 --data 20",
    "python -m tpu_embed_ext convert-checkpoint --config configs/ranking.yaml "
    "--checkpoint runs/ranking/checkpoints --out runs/ranking/v5p4/ckpt "
    "--topology v5p:4",
)


def help_text(flags) -> str:
  """The help of ``tpu-embed`` and ``python -m tpu_embed_ext`` (the same text)."""
  lines = ["usage: tpu-embed COMMAND [flags]   (or: python -m tpu_embed_ext "
           "COMMAND [flags])", "", "commands:"]
  for command, names in COMMAND_FLAGS.items():
    lines += [""] + textwrap.wrap(f"{command}: {SUMMARIES[command]}", 80,
                                  initial_indent="  ", subsequent_indent="    ")
    for name in names:
      lines += _flag_lines(flags[name])
  lines += ["", "every command:"] + _flag_lines(flags["verbose"])
  lines += ["", "examples:"] + [f"  {e}" for e in EXAMPLES]
  lines += ["", "A user error prints one line, error: <what, where, the fix>, "
            "and exits with status 2.", "Documentation: README.md, docs/cli.md."]
  return "\n".join(lines)


def _flag_lines(flag) -> list:
  shown = not isinstance(flag.default, bool) and flag.default not in (None, "")
  text = flag.help + (f" Default: {flag.default}." if shown else "")
  return [f"    --{flag.name}"] + textwrap.wrap(
      text, 80, initial_indent=" " * 8, subsequent_indent=" " * 8,
      break_on_hyphens=False)


class ThirdPartyLog:
  """Sends other libraries' log lines, warnings and progress bars to ``path``.

  Python logging (absl, TensorFlow's and tfds' loggers) and ``warnings`` go
  through the root logger; its handlers are pointed at the file. TensorFlow's
  C++ logging is cut at warnings before TensorFlow loads (``TF_CPP_MIN_LOG_LEVEL``,
  set by ``quiet_cpp``). With ``datasets``, tfds' progress bars are switched off.
  """

  def __init__(self, path: Optional[str], *, datasets: bool = False):
    self.path = path or os.path.join(tempfile.gettempdir(),
                                     f"tpu_embed_ext-{os.getuid()}.log")
    try:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      self._file = open(self.path, "a", encoding="utf-8")
    except OSError:  # A read-only model_dir: the command reports it itself.
      self.path = os.path.join(tempfile.gettempdir(),
                               f"tpu_embed_ext-{os.getuid()}.log")
      self._file = open(self.path, "a", encoding="utf-8")
    self._start = self._file.tell()
    self._saved = []
    root = logging.getLogger()
    for handler in root.handlers:
      target = getattr(handler, "python_handler", handler)  # absl's wraps one.
      if (isinstance(target, logging.StreamHandler)
          and target.stream in (sys.stderr, sys.stdout, sys.__stderr__)):
        self._saved.append((target, target.stream))
        target.setStream(self._file)
    if not self._saved:
      handler = logging.StreamHandler(self._file)
      root.addHandler(handler)
      self._saved.append((handler, None))
    logging.captureWarnings(True)
    if datasets and _importable("tensorflow_datasets"):
      import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
      tfds.disable_progress_bar()

  def close(self) -> str:
    """Restores the handlers; returns a closing note if anything was logged."""
    self._file.flush()
    written = self._file.tell() - self._start
    for handler, stream in self._saved:
      if stream is None:
        logging.getLogger().removeHandler(handler)
      else:
        handler.setStream(stream)
    logging.captureWarnings(False)
    self._file.close()
    if not written:
      return ""
    return (f"(TensorFlow's and other libraries' log lines are in {self.path}; "
            "--verbose shows them here.)")


def quiet_cpp(argv: Sequence[str]) -> None:
  """Hides TensorFlow's C++ info and warning lines unless --verbose is given."""
  if not any(a in ("--verbose", "--verbose=true", "--verbose=True") for a in argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _importable(name: str) -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top
  return importlib.util.find_spec(name) is not None
