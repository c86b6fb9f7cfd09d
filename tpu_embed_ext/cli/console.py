"""What the command line says about itself: its help, and how to call it again.

``tpu-embed --help`` lists the commands; ``tpu-embed COMMAND --help`` shows
one command's flags and examples. Where other libraries' output goes is
``host/library_log.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from typing import Dict, Sequence

__all__ = ["COMMAND_FLAGS", "SUMMARIES", "EXAMPLES", "overview", "command_help",
           "program", "tool", "quiet_cpp"]

# Flags each command reads, in the order its help shows them (and --verbose).
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
    "emulate": "run a TPU training script on CPU with emulated TPU devices: "
               "emulate [--replicas N] [--hosts H] [--sparsecore] [--topology T] [--no-xla] (SCRIPT | -m MODULE) [ARGS...]",
}

EXAMPLES = {
    "plan": ("tpu-embed plan --config tiny",
             "tpu-embed plan --config criteo --engine v2 --topology v5p:4 --data 20"),
    "train": ("tpu-embed train --config ranking",
              "tpu-embed train --config tiny --steps 10 --model_dir runs/try --tpu none"),
    "export": ("tpu-embed export --config ranking --model_dir runs/ranking",),
    "convert-checkpoint": (
        "tpu-embed convert-checkpoint --config ranking --checkpoint "
        "runs/ranking/checkpoints --out runs/ranking/v5p4/ckpt --topology v5p:4",
        "tpu-embed convert-checkpoint --checkpoint /tmp/model/ckpt-10 --out "
        "/tmp/model-v5p4/ckpt-10 --topology v5p:4",),
}

_USAGE = "usage: tpu-embed COMMAND [flags]   (or: python -m tpu_embed_ext COMMAND [flags])"


def overview(commands: Sequence[str], config_names: Sequence[str]) -> str:
  """``tpu-embed --help``: every command, one paragraph each."""
  lines = [_USAGE, "", "commands:"]
  for command in commands:
    lines += textwrap.wrap(f"{command}: {SUMMARIES[command]}", 80,
                           initial_indent="  ", subsequent_indent="      ")
  lines += ["", "tpu-embed COMMAND --help shows a command's flags and examples; "
            "tpu-embed --version the version.",
            "--config takes a .yaml/.json file or a shipped config: "
            f"{', '.join(config_names)}."] + _closing()
  return "\n".join(lines)


def command_help(command: str, flag_values) -> str:
  """``tpu-embed COMMAND --help``: the command's flags and examples."""
  lines = [f"usage: tpu-embed {command} [flags]", ""]
  lines += textwrap.wrap(SUMMARIES[command] + ".", 80)
  lines += ["", "flags:"]
  for name in (*COMMAND_FLAGS[command], "verbose"):
    lines += _flag_lines(flag_values[name])
  lines += ["", "examples:"] + [f"  {e}" for e in EXAMPLES[command]]
  return "\n".join(lines + _closing())


def _closing():
  return ["", "A user error prints one line, error: <what, where, the fix>, and "
          "exits with status 2.", "Documentation: README.md, docs/cli.md."]


def _flag_lines(flag) -> list:
  shown = not isinstance(flag.default, bool) and flag.default not in (None, "")
  text = flag.help + (f" Default: {flag.default}." if shown else "")
  return [f"  --{flag.name}"] + textwrap.wrap(
      text, 80, initial_indent=" " * 6, subsequent_indent=" " * 6,
      break_on_hyphens=False)


def program() -> str:
  """How to call this command line again from here, so that a printed
  command runs as printed: ``tpu-embed`` when that is on PATH and is this
  installation, else this installation's script by its path (the virtualenv
  need not be active), else this Python with ``-m tpu_embed_ext``."""
  return tool("tpu-embed", "tpu_embed_ext")


def tool(name: str, module: str) -> str:
  """How to call this installation's script ``name`` so that it runs as
  printed from here (``program``; ``pip``, ``tensorboard``): its bare name
  when PATH finds this installation's, else its path, else ``python -m
  module`` with this Python by its path."""
  bin_dir = os.path.dirname(sys.executable)
  script = os.path.join(bin_dir, name)
  found = shutil.which(name)
  if found and os.path.realpath(found) == os.path.realpath(script):
    return name
  if os.access(script, os.X_OK):
    return _short(script)
  return f"{_short(sys.executable)} -m {module}"


def _short(path: str) -> str:
  relative = os.path.relpath(path)
  if relative.startswith(".."):
    return path
  return relative if os.sep in relative else os.path.join(".", relative)


def quiet_cpp(argv: Sequence[str]) -> None:
  """Cuts TensorFlow's C++ info lines at the source unless --verbose (fewer
  lines in the log; what is still printed goes to the log all the same)."""
  if not any(a in ("--verbose", "--verbose=true", "--verbose=True") for a in argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
