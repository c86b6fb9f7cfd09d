"""Command line: ``tpu-embed COMMAND [flags]`` (also ``python -m tpu_embed_ext``).

  plan    --config C [--proto] [--engine v2 --topology T [--data N]]
  train   --config C [--steps N] [--model_dir DIR] [--tpu auto|none|emulate[:N]|NAME]
  export  --config C --model_dir DIR [--out DIR]
  convert-checkpoint --checkpoint PREFIX --out PREFIX --topology T|none [--config C]
  emulate [--replicas N] [--sparsecore] [--topology T] [--no-xla] (SCRIPT | -m MODULE) [ARGS...]

``--config`` is a file or the name of a shipped config (``tiny``,
``ranking``...: ``files.resolve``). ``--help`` lists the commands,
``COMMAND --help`` shows one command's flags (``console``).

``COMMANDS`` maps a name to a plain ``main(argv) -> int`` of the arguments
after the name. The absl commands define their flags in a ``FlagValues`` of
their own when they run, never in absl's global ``FLAGS``: ``emulate`` runs a
script that defines its own ``--tpu`` or ``--model_dir``.

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

from tpu_embed_ext.cli import console
from tpu_embed_ext import errors
from tpu_embed_ext.cli.install_fixes import EXTRAS as _EXTRAS

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
            "emulated TPU of N replicas, default 8, on CPU), or a TPU name/address.",
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
    "batch_size": ("integer", 0, "With --engine v2: per-chip batch of features "
                   "without output_shape (the stacker's output samples).", {}),
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
    ("plan", "topology"): "With --engine v2: the SparseCore topology, "
                          "GENERATION:CHIPS (v5p:4, v6e:8, tpu7x:4) or "
                          "CHIPSxSPARSECORES.",
}


def _flag_values(command: str):
  """A FlagValues holding the flags of ``command`` and ``--verbose``."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  values = flags.FlagValues()
  for name in (*console.COMMAND_FLAGS[command], "verbose"):
    kind, default, text, kwargs = _FLAGS[name]
    text = _COMMAND_HELP.get((command, name), text)
    getattr(flags, f"DEFINE_{kind}")(name=name, default=default, help=text,
                                     flag_values=values, **kwargs)
  return values


def _model_dir(f, config: str) -> str:
  if f.model_dir:
    return f.model_dir
  return os.path.join("runs", os.path.splitext(os.path.basename(config))[0])


def _plan(f, config: str, progress):
  del progress
  import tpu_embed_ext as tee  # pylint: disable=g-import-not-at-top
  from tpu_embed_ext import job  # pylint: disable=g-import-not-at-top
  spec = tee.EmbeddingSpec.from_file(config)
  hotness = None
  if f.data and f.hotness:  # Checked before the plan is computed.
    from tpu_embed_ext.data import spec_ids  # pylint: disable=g-import-not-at-top
    hotness = spec_ids.parse_hotness(f.hotness, spec)
  plan = tee.plan(spec)
  # SparseCore only when asked about: --engine v2, or a --topology given.
  print(plan.text(sparsecore_notes=f.engine == "v2" or f["topology"].present))
  shortfall = job.memory_shortfall(spec)
  if shortfall:
    print(f"\nCPU emulation (train --tpu none) would not fit: {shortfall}")
  if f.proto:
    print()
    print(plan.config_proto())
  if f.engine == "v2":
    print()
    print(plan.sparsecore(f.topology, batch_size=f.batch_size))
    if f.data:
      from tpu_embed_ext.cli import sparsecore_report as report  # pylint: disable=g-import-not-at-top
      from tpu_embed_ext.sparsecore import topology
      print()
      print(report.measure_training_data(
          plan.spec, topology.parse_topology(f.topology), f.data,
          hotness=hotness, distribution=f.ids, batch_size=f.batch_size))


def _train(f, config: str, progress):
  from tpu_embed_ext import job  # pylint: disable=g-import-not-at-top
  model_dir = _model_dir(f, f.config)
  said = []
  line = progress(model_dir)

  def log(text):
    said.append(text)
    line(text)
  metrics = job.train(config, model_dir=model_dir, steps=f.steps, tpu=f.tpu,
                      log=log)
  finished_before = any(t.startswith("Already trained") for t in said)
  speed = None if finished_before else metrics.get("examples_per_second")
  # One device line: "Training on ..." of this run, or, for a finished run
  # that trained nothing now, where it trained.
  print(f"\nheld-out AUC {metrics['eval_auc']:.4f}"
        + (f" (planted model: {metrics['planted_auc']:.4f})"
           if "planted_auc" in metrics else "")
        + (f" at step {metrics['steps']}, {speed:,.0f} examples/s." if speed else
           f" at step {metrics['steps']} (already trained, on "
           f"{metrics['where']}: nothing to do)."))
  print(where_everything_went(f.config, model_dir))


def where_everything_went(config: str, model_dir: str) -> str:
  """The closing summary of ``train``: every output and the next command,
  spelled so that it runs as printed from here (``console.program``)."""
  from tpu_embed_ext.host import model_dir as model_dir_lib  # pylint: disable=g-import-not-at-top
  checkpoints = os.path.join(model_dir, "checkpoints")
  steps = model_dir_lib.checkpoint_steps(checkpoints)
  newest = f" (newest: ckpt-{steps[0]})" if steps else ""
  rows = [("checkpoints", checkpoints + newest),
          ("metrics", os.path.join(model_dir, "metrics.json")),
          ("learning curve", os.path.join(model_dir, "learning_curve.png")),
          ("history", os.path.join(model_dir, "history.csv")),
          ("TensorBoard logs", os.path.join(model_dir, "logs") +
           f"   ({console.tool('tensorboard', 'tensorboard.main')} --logdir "
           f"{os.path.join(model_dir, 'logs')})")]
  library_log = os.path.join(model_dir, "logs", "libraries.log")
  if os.path.exists(library_log):  # Not with --verbose: they were shown.
    rows.append(("library log", library_log + "   (TensorFlow's and other "
                 "libraries' lines)"))
  lines = [f"Results in {model_dir}:"]
  lines += [f"  {name:<17} {path}" for name, path in rows]
  lines += ["Next, export for serving:",
            f"  {console.program()} export --config {config} --model_dir "
            f"{model_dir} --out {os.path.join(model_dir, 'serving')}"]
  return "\n".join(lines)


def _export(f, config: str, progress):
  from tpu_embed_ext import job  # pylint: disable=g-import-not-at-top
  model_dir = _model_dir(f, f.config)
  out = f.out or os.path.join(model_dir, "serving")
  print("SavedModel written to", job.export(config, model_dir=model_dir, out=out,
                                              log=progress(model_dir)))


def _tables_spec(path: str):
  """The config's spec for converting tables: feature names play no part in
  it, so they are replaced (in their sorted order, which decides the first
  feature the stacker sees) by names every check accepts ('0'..'7' are
  Model Garden's, refused as serving-signature inputs)."""
  import tpu_embed_ext as tee  # pylint: disable=g-import-not-at-top
  from tpu_embed_ext.spec import files  # pylint: disable=g-import-not-at-top
  data = files.load(path)
  features = data.get("features") if isinstance(data, dict) else None
  if isinstance(features, dict):
    data = dict(data, features={f"feature_{i:06d}": value for i, (_, value)
                                in enumerate(sorted(features.items()))})
  try:
    return tee.EmbeddingSpec.from_dict(data, source=path)
  except errors.ConfigError as e:
    raise e.at(file=path) from None


def _convert_checkpoint(f, config: str, progress):
  del progress
  from tpu_embed_ext import sparsecore  # pylint: disable=g-import-not-at-top
  if not (f.checkpoint and f.out and f["topology"].present):
    raise errors.ConfigError(
        "convert-checkpoint needs --checkpoint PREFIX|DIR --out PREFIX --topology T "
        "(a SparseCore topology, or none for per-table). Fix: pass all three.")
  topology = None if f.topology == "none" else f.topology
  # Without --config the checkpoint's own tables, slots and shapes are used.
  spec = _tables_spec(config) if f["config"].present else None
  source = f.checkpoint
  if os.path.isdir(source):  # A checkpoints directory: its newest readable one.
    from tpu_embed_ext.host import model_dir as model_dir_lib  # pylint: disable=g-import-not-at-top
    source, _ = model_dir_lib.resume_point(source, repair=False)
    if source is None:
      raise model_dir_lib.CheckpointError(
          f"no checkpoint (ckpt-<step>.index) in {f.checkpoint}. Fix: pass a "
          "checkpoint prefix, e.g. runs/ranking/checkpoints/ckpt-1500.")
  print(f"Converting {source} table by table...", flush=True)
  layouts = sparsecore.convert_checkpoint(source, f.out, spec, topology,
                                          prefix=f.prefix)
  form = (f"SparseCore layout for {sparsecore.parse_topology(topology)} "
          f"({len({l.stack for l in layouts})} stacks)" if layouts else "per-table")
  print(f"{source} -> {f.out}: {form}.")


def _missing_extra(command: str, modules) -> str:
  from tpu_embed_ext.cli import install_fixes  # pylint: disable=g-import-not-at-top
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


class _AbslCommand:
  """A command whose flags absl parses: ``main(argv) -> int``."""

  def __init__(self, name: str, run: Callable):
    self.name, self._run = name, run

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
    from tpu_embed_ext.spec import files  # pylint: disable=g-import-not-at-top
    from tpu_embed_ext.host import library_log
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
      self._run(f, files.resolve(f.config), progress)
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
    from tpu_embed_ext.emulated_tpu import runner  # pylint: disable=g-import-not-at-top
  except ModuleNotFoundError as e:
    if not (e.name or "").startswith("tpu_embed_ext.emulated_tpu"):
      raise
    return _usage_error("emulate is not available in this installation of "
                        "tpu_embed_ext. Fix: install a version that has it.")
  # Returning ends the process as Python does (runner.py: the exit).
  return runner.main(argv, owns_process=_owns_process)


COMMANDS: Dict[str, Callable[[List[str]], int]] = {
    "plan": _AbslCommand("plan", _plan),
    "train": _AbslCommand("train", _train),
    "export": _AbslCommand("export", _export),
    "convert-checkpoint": _AbslCommand("convert-checkpoint", _convert_checkpoint),
    "emulate": _emulate,
}


def main(argv: Sequence[str]) -> int:
  """``tpu-embed`` with ``argv`` (``argv[0]`` the program); the exit status."""
  args = list(argv[1:])
  if not args or args[0] in _HELP:
    from tpu_embed_ext.spec import files  # pylint: disable=g-import-not-at-top
    print(console.overview(list(COMMANDS), list(files.shipped_configs())))
    return 0 if args else 2
  command = args[0]
  if command in ("--version", "-V", "version"):
    import tpu_embed_ext  # pylint: disable=g-import-not-at-top
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
