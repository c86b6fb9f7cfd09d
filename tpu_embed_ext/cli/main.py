"""Command line: ``tpu-embed COMMAND [flags]`` (also ``python -m tpu_embed_ext``).

  plan    --config C [--proto] [--topology T] [--engine v2 [--data N]]
  train   --config C [--steps N] [--model_dir DIR] [--tpu auto|none|emulate[:N|:TOPOLOGY][,hosts=H]|NAME]
  export  --config C --model_dir DIR [--out DIR]
  convert-checkpoint --checkpoint PREFIX --out PREFIX --topology T|none [--config C]
  emulate [--replicas N] [--hosts H] [--sparsecore] [--topology T] [--no-xla] (SCRIPT | -m MODULE) [ARGS...]

``--config`` is a file or the name of a shipped config (``tiny``,
``ranking``...: ``files.resolve``). ``--help`` lists the commands,
``COMMAND --help`` shows one command's flags (``console``).

``COMMANDS`` maps a name to a plain ``main(argv) -> int`` of the arguments
after the name. The absl commands define their flags in a ``FlagValues`` of
their own when they run, never in absl's global ``FLAGS``: ``emulate`` runs a
script that defines its own ``--tpu`` or ``--model_dir``.
Their work is in ``commands.py`` (plan, convert-checkpoint) and
``job_commands.py`` (train, export), imported when the command runs: TensorFlow
loads after the extras are checked and the library log is set up.

A user error (a bad config, flag or command, a model_dir in use or not
writable, a damaged checkpoint, tables larger than memory, a missing extra)
prints one line, ``error:`` with what is wrong, where and the fix, and exits
with status 2; ``--verbose`` shows the traceback instead. Other libraries'
output goes to a log file (``host.library_log.LibraryLog``) unless ``--verbose``.
"""

import importlib.util
import os
import re
import sys
import traceback
from typing import Callable, Dict, List, Optional, Sequence

import tpu_embed_ext
from tpu_embed_ext import errors
from tpu_embed_ext.cli import console, install_fixes
from tpu_embed_ext.cli.install_fixes import EXTRAS as _EXTRAS
from tpu_embed_ext.host import library_log
from tpu_embed_ext.spec import files

# name -> (DEFINE function, default, help, keyword arguments).
_FLAGS = {
    "config": ("string", "ranking", "The config: a .yaml/.json file, or the name of "
               "a shipped config (tiny, ranking, criteo, movielens); "
               "convert-checkpoint without it reads the tables, slots and "
               "shapes from the checkpoint.", {}),
    "proto": ("bool", False, "Also print the TPUEmbeddingConfiguration proto.", {}),
    "steps": ("integer", None, "The table step to train to (default: the config's "
              "train.steps; a resumed run counts the steps before it).", {}),
    "model_dir": ("string", None, "Checkpoints, logs, metrics (default: runs/<config "
                  "name without extension>).", {}),
    "tpu": ("string", "auto", "'auto' (use a TPU if one is attached), 'none' (CPU "
            "emulation), 'emulate' or 'emulate:N' (the job's TPU path on an "
            "emulated TPU of N replicas, default 8, on CPU: TPUEmbedding), "
            "'emulate:TOPOLOGY' (an emulated TPU slice: emulate:v5e:4, "
            "emulate:v3:4: TPUEmbedding; emulate:v5p:4, emulate:v6e:8: SparseCore, "
            "TPUEmbeddingV2), each with ',hosts=H' for a pod slice of H hosts "
            "(emulate:8,hosts=2: 8 replicas on 2 hosts; a named slice implies "
            "its hosts: emulate:v5p:8 is 2), or a TPU name/address.",
            {}),
    "out": ("string", None, "export: where to write the SavedModel (default: "
            "<model_dir>/serving); convert-checkpoint: the prefix of the converted "
            "checkpoint (required).", {}),
    "verbose": ("bool", False, "Show TensorFlow's and other libraries' log lines "
                "and progress bars (default: a log file), and on an error the "
                "traceback.", {}),
    # SparseCore (TPUEmbeddingV2): tpu_embed_ext/sparsecore/, docs/sparsecore.md.
    "engine": ("enum", "v1", "v2 adds TPUEmbeddingV2's (SparseCore) stacked layout "
               "on --topology.", {"enum_values": ["v1", "v2"]}),
    "topology": ("string", "v5p:4", "GENERATION:CHIPS (v5p:4, v6e:8, tpu7x:4) or "
                 "CHIPSxSPARSECORES; convert-checkpoint: none for per-table keys "
                 "(required there).", {}),
    "data": ("integer", 0, "With --engine v2: measure the ids each stack sends to "
             "each SparseCore over this many training batches (drawn from the spec "
             "when the config names no dataset).", {}),
    "hotness": ("string", "", "--data drawn from the spec: ids per example, N for "
                "every feature or FEATURE=N,... (default: a sequence feature's "
                "max_sequence_length, else 1).", {}),
    "ids": ("enum", "zipf", "--data drawn from the spec: how ids are drawn over each "
            "table's vocabulary.", {"enum_values": ["zipf", "uniform"]}),
    "checkpoint": ("string", None, "The checkpoint to convert (per-table or "
                   "SparseCore-stacked): a prefix, or a directory for its newest "
                   "checkpoint (required).", {}),
    "prefix": ("string", None, "The embedding's path in the checkpoint (default: "
               "found in its object graph; needed only when several objects hold "
               "the tables).", {}),
    "batch_size": ("integer", 0, "Per-device batch of features without "
                   "output_shape: the stacker's output samples (--engine v2) "
                   "and the memory of the activation buffers (--topology; "
                   "default: the config's train.batch_size over the devices).", {}),
}

_NEEDS = {"plan": ("tensorflow",),
          "train": ("tensorflow", "tensorflow_datasets", "importlib_resources",
                    "matplotlib"),
          "export": ("tensorflow", "tensorflow_datasets", "importlib_resources"),
          "convert-checkpoint": ("tensorflow",)}

_HELP = ("--help", "-h", "--helpshort", "--helpfull", "-?", "help")
_owns_process = False  # run(): this process is the command (log watcher, faulthandler).


# A flag's help where the shared text above would talk about another command
# (``export --help`` tells of export's --out only).
_CONFIG_HELP = ("The config: a .yaml/.json file, or the name of a shipped config "
                "(tiny, ranking, criteo, movielens).")
_COMMAND_HELP = {
    **{(command, "config"): _CONFIG_HELP for command in ("plan", "train", "export")},
    ("export", "out"): "Where to write the SavedModel (default: <model_dir>/serving).",
    ("plan", "topology"): "The TPU slice, GENERATION:CHIPS (v5e:1, v3:4, v4:8, "
                          "v5p:8, v6e:8, tpu7x:4) or CHIPSxSPARSECORES: adds "
                          "the embedding's memory per device against the "
                          "chip's HBM; a generation with SparseCore (v5p, "
                          "v6e, tpu7x) implies --engine v2.",
    ("convert-checkpoint", "config"): (
        "The config: a .yaml/.json file, or the name of a shipped config (tiny, "
        "ranking, criteo, movielens). Without it, the tables, slots and shapes "
        "are read from the checkpoint."),
    ("convert-checkpoint", "out"): "The prefix of the converted checkpoint (required).",
    ("convert-checkpoint", "topology"): (
        "The SparseCore layout to write: GENERATION:CHIPS, a Cloud TPU slice "
        "(v5p:4, v6e:8, tpu7x:4), or CHIPSxSPARSECORES (2x4); none for "
        "per-table keys (required)."),
}
# A flag's default where the shared one would contradict the command's help:
# convert-checkpoint's --config is optional (the checkpoint's own tables) and
# its --topology required.
_COMMAND_DEFAULTS = {("convert-checkpoint", "config"): None,
                     ("convert-checkpoint", "topology"): None}


def _flag_values(command: str):
  """A FlagValues holding the flags of ``command`` and ``--verbose``."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  values = flags.FlagValues()
  for name in (*console.COMMAND_FLAGS[command], "verbose"):
    kind, default, text, kwargs = _FLAGS[name]
    text = _COMMAND_HELP.get((command, name), text)
    default = _COMMAND_DEFAULTS.get((command, name), default)
    getattr(flags, f"DEFINE_{kind}")(name=name, default=default, help=text,
                                     flag_values=values, **kwargs)
  return values


def _missing_extra(command: str, modules) -> str:
  return install_fixes.missing_line(command, modules)


def _one_line(e: BaseException, command: str) -> Optional[str]:
  """The line a user sees for an error they can fix, or None for a bug."""
  if isinstance(e, errors.Error):
    return " ".join(str(e).split())
  if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in _EXTRAS:
    return _missing_extra(command, [e.name.split(".")[0]])
  if isinstance(e, KeyboardInterrupt):
    return ("interrupted. Run the same command again to resume from the newest "
            "checkpoint.")
  return None


def _usage_error(message: str) -> int:
  """A mistake on the command line itself: one line, exit 2."""
  print(f"error: {message}", file=sys.stderr)
  return 2


def _implementation(command: str) -> Callable:
  """``run(flags, config, progress)`` of an absl command. Its module loads
  TensorFlow, so it is imported once the extras are checked and other
  libraries' output goes to the library log."""
  if command in ("train", "export"):
    # Lazy: keeps TensorFlow and tensorflow_datasets (the job) off the CLI's start.
    from tpu_embed_ext.cli import job_commands  # pylint: disable=g-import-not-at-top
    return job_commands.COMMANDS[command]
  # Lazy: keeps TensorFlow off the CLI's start (--help, a usage error).
  from tpu_embed_ext.cli import commands  # pylint: disable=g-import-not-at-top
  return commands.COMMANDS[command]


class _AbslCommand:
  """A command whose flags absl parses: ``main(argv) -> int``."""

  def __init__(self, name: str):
    self.name = name

  def _run(self, f, config: str, progress) -> None:
    _implementation(self.name)(f, config, progress)

  def __call__(self, argv: Sequence[str]) -> int:
    if any(a in _HELP for a in argv):
      print(console.command_help(self.name, _flag_values(self.name)))
      return 0
    from absl import flags  # pylint: disable=g-import-not-at-top
    f = _flag_values(self.name)
    try:
      rest = f([f"tpu-embed {self.name}", *argv])[1:]
    except flags.Error as e:
      return _usage_error(self._flag_error(e))
    if rest:
      return _usage_error(
          f"unexpected argument {rest[0]!r} after {self.name}. Fix: give values "
          f"with their flags (tpu-embed {self.name} --help).")
    # Every missing extra at once: a second try should not find another.
    missing = [m for m in _NEEDS[self.name] if importlib.util.find_spec(m) is None]
    if missing:
      return _usage_error(_missing_extra(self.name, missing))
    return self._guarded(f)

  def _flag_error(self, e: Exception) -> str:
    name = getattr(e, "flagname", None)
    if name is None:  # A bad value: absl says "flag --steps=abc: <why>".
      bad = re.match(r"flag --(\w+)=(.*?): (.*)", " ".join(str(e).split()))
      if not bad:
        return f"{' '.join(str(e).split())}. Fix: see tpu-embed {self.name} --help."
      flag, value, why = bad.groups()
      return (f"--{flag}: {value!r} is not a valid value ({why}). Fix: see "
              f"tpu-embed {self.name} --help.")
    ours = [f"--{n}" for n in (*console.COMMAND_FLAGS[self.name], "verbose")]
    elsewhere = [c for c, names in console.COMMAND_FLAGS.items() if name in names]
    where = (f" (a flag of {' and '.join(elsewhere)})." if elsewhere
             else "." + errors.did_you_mean(f"--{name}", ours))
    return (f"unknown flag --{name} for {self.name}{where} {self.name} takes "
            f"{', '.join(ours)} (tpu-embed {self.name} --help).")

  def _guarded(self, f) -> int:
    """Runs the command with other libraries' output in a log file: the
    command's stderr carries its own messages only."""
    log = (None if f.verbose else
           library_log.LibraryLog(self.name, process=_owns_process))
    terminal = log.terminal if log else sys.stderr

    def progress(model_dir):
      def line(text):  # The model_dir is good once the job reports progress.
        if log:
          log.move_to(os.path.join(model_dir, "logs", "libraries.log"))
        print(text, flush=True)
      return line

    status = 2
    try:
      if self.name == "train" or (self.name == "plan" and f.data > 0):
        _quiet_datasets()
      self._run(f, None if f.config is None else files.resolve(f.config), progress)
      status = 0
    except (Exception, KeyboardInterrupt) as e:  # pylint: disable=broad-except
      line = _one_line(e, self.name)
      if f.verbose:
        raise
      if line is None:  # A bug: its traceback reaches the terminal.
        status = 1
        report = traceback.format_exc()
        print(report, file=sys.stderr)  # The log, after what led to it.
        print(report + "(the log of TensorFlow and other libraries: "
              f"{log.destination})", file=terminal)
      else:
        print(f"error: {line} (--verbose shows the traceback)", file=terminal)
    finally:
      if log:
        log.close()
    return status


def _quiet_datasets():
  if importlib.util.find_spec("tensorflow_datasets") is not None:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    tfds.disable_progress_bar()


def _emulate(argv: List[str]) -> int:
  """``emulate``: tpu_embed_ext/emulated_tpu/runner.py parses its own arguments."""
  try:
    # Lazy: the emulation's TensorFlow-free runner, imported only for emulate, so
    # that the other commands run in an installation without emulated_tpu/.
    from tpu_embed_ext.emulated_tpu import runner  # pylint: disable=g-import-not-at-top
  except ModuleNotFoundError as e:
    if not (e.name or "").startswith("tpu_embed_ext.emulated_tpu"):
      raise
    return _usage_error("emulate is not available in this installation of "
                        "tpu_embed_ext. Fix: install a version that has it.")
  # Returning ends the process as Python does (runner.py: the exit).
  return runner.main(argv, owns_process=_owns_process)


COMMANDS: Dict[str, Callable[[List[str]], int]] = {
    "plan": _AbslCommand("plan"),
    "train": _AbslCommand("train"),
    "export": _AbslCommand("export"),
    "convert-checkpoint": _AbslCommand("convert-checkpoint"),
    "emulate": _emulate,
}


def main(argv: Sequence[str]) -> int:
  """``tpu-embed`` with ``argv`` (``argv[0]`` the program); the exit status."""
  args = list(argv[1:])
  if not args or args[0] in _HELP:
    print(console.overview(list(COMMANDS), list(files.shipped_configs())))
    return 0 if args else 2
  command = args[0]
  if command in ("--version", "-V", "version"):
    print(f"tpu_embed_ext {tpu_embed_ext.__version__} "
          f"({os.path.dirname(os.path.abspath(tpu_embed_ext.__file__))})")
    return 0
  if command not in COMMANDS:
    if command.startswith("-"):
      return _usage_error(
          f"the command comes first: tpu-embed COMMAND [flags], got {command!r}. "
          f"Commands: {', '.join(COMMANDS)} (tpu-embed --help).")
    return _usage_error(
        f"unknown command {command!r}.{errors.did_you_mean(command, COMMANDS)} "
        f"Commands: {', '.join(COMMANDS)} (tpu-embed --help).")
  return COMMANDS[command](args[1:])


def run(argv: Optional[Sequence[str]] = None) -> None:
  """The entry point of ``tpu-embed`` and ``python -m tpu_embed_ext``."""
  global _owns_process
  argv = list(sys.argv if argv is None else argv)
  _owns_process = True
  console.quiet_cpp(argv)
  sys.exit(main(argv))


if __name__ == "__main__":
  run()
