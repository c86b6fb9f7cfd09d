"""``python -m tpu_embed_ext emulate [options] SCRIPT [ARGS...]`` (or ``-m MODULE``).

SCRIPT runs as ``__main__``, as ``python SCRIPT ARGS`` runs it:
``sys.argv`` is ``[SCRIPT, *ARGS]``, ``sys.path[0]`` the script's directory,
``__file__`` the script's absolute path (deleted once its code ends, unless
by ``sys.exit``, as ``python`` does), and absl's flag registry holds only
what the script defines (the command line dispatches ``emulate`` here before
it defines its own flags), so a script's ``app.run(main)`` parses its own
flags. ``-m MODULE ARGS`` runs a module as ``python -m MODULE ARGS`` does:
``sys.argv[0]`` is the module's file and ``sys.path[0]`` the current
directory. The logical CPU devices are set up before the script runs, then
the whole script runs inside ``emulate_tpu``.

The script's world lasts until the interpreter exits (issue 42): on the
command line ``__main__`` (so pickles of the script's classes), ``sys.argv``,
``sys.path[0]`` (so imports of modules next to it) and the emulation are
never put back; its ``atexit`` handlers and non-daemon threads see them as
under ``python``. The emulation is left by an ``atexit`` handler registered
before the script runs, so after the script's own. Called as a library
(``main(argv)``), they are put back before ``main`` returns.

The program runs in ``programs.py``.

Exit status: the script's own (``sys.exit(code)``; 0 when it returns; 1
after the script's ``sys.excepthook`` reported an exception; killed by
SIGINT after an uncaught ``KeyboardInterrupt``, as ``python``: on the command
line the exception leaves ``main`` for Python's top level, and the hook is
given the script's frames only); 2 for a bad ``emulate`` command line (one
line, as the other commands).

Exit: Python's own. ``main`` returns the status and the command line ends
with ``sys.exit``: the script's ``atexit`` handlers and non-daemon threads,
then the interpreter's finalization (open files, ``gzip`` / ``zipfile`` /
``h5py`` files and ``NamedTemporaryFile``s end as their finalizers leave
them under ``python SCRIPT``; ``tests/test_emulate_command.py`` compares
each). Until issue 34 the runner ended with ``os._exit`` to skip that
finalization, where TensorFlow's destructors of distributed iterators waited
on tf.data autotuning threads for seconds to minutes at 8 replicas; the
emulated TPU's distributed datasets have neither those threads nor
per-replica iterators (``device_datasets.py``). The rest of the exit's time was the interpreter's
final collections walking TensorFlow's start-up objects (1.1-2.3 s after the
script's last line at 8 replicas); on the command line ``_start`` freezes
them (``start_up_objects.py``) before the script runs, and
``benchmarks/replica_suite.py`` measures 0.1-0.3 s at 1, 2 and 8 replicas.
The script's own objects are collected and finalized as under ``python``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.util
import os
import sys
from typing import List, Optional

from tpu_embed_ext import errors
from tpu_embed_ext.emulated_tpu import programs, session, start_up_objects
from tpu_embed_ext.host import library_log

__all__ = ["main", "parse", "check_slice", "check_hosts", "UsageError", "USAGE",
           "OPTIONS"]

USAGE = ("python -m tpu_embed_ext emulate [--replicas N] [--hosts H] [--sparsecore] "
         "[--topology T] [--no-xla] (SCRIPT | -m MODULE) [ARGS...]")


@dataclasses.dataclass(frozen=True)
class Option:
  """One ``emulate`` option: ``metavar`` None for a switch."""
  metavar: Optional[str]
  help: str
  convert: object = str


def _replicas(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise UsageError(f"--replicas takes a whole number of TPU cores, got "
                     f"{text!r}. Fix: e.g. --replicas 8.") from None


def _hosts(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise UsageError(f"--hosts takes a whole number of hosts (TPU VMs), got "
                     f"{text!r}. Fix: e.g. --hosts 2.") from None


# Options by name; a new option is a new entry (the parser reads this table).
OPTIONS = {
    "--replicas": Option("N", "TPU cores (replicas) of the whole slice, every "
                         "host's (num_replicas_in_sync), one logical CPU device "
                         "each (default: the --topology's replicas, else 8).",
                         _replicas),
    "--hosts": Option("H", "Hosts (TPU VMs) of a pod slice, each feeding N/H "
                      "of the cores from its own input pipeline: TPUStrategy "
                      "calls an input function once per host (default: the "
                      "--topology's hosts, e.g. 2 for v5p:8, else 1).", _hosts),
    "--sparsecore": Option(None, "The TPU has SparseCore: TPUEmbeddingV2 is "
                           "emulated."),
    "--topology": Option("T", "The TPU slice, GENERATION:CHIPS: v5e:4, v4:4, "
                         "v3:4 (8 replicas), v2:4 (TPUEmbedding) or v5p:8, "
                         "v6e:8, tpu7x:8, 8x4 (chips x SparseCores; implies "
                         "--sparsecore). build() refuses tables that do not "
                         "fit its HBM (default: v4, or v5p with --sparsecore)."),
    "--no-xla": Option(None, "Do not check that each replica's step compiles "
                       "with XLA, as a TPU's must (faster; see "
                       "docs/guides/tpu-on-cpu.md)."),
    # Before issue 34 it asked for Python's exit instead of os._exit; the
    # exit is always Python's now. Accepted so existing command lines run.
    "--finalize": Option(None, "No effect (the exit is always Python's own); "
                         "kept for older command lines."),
}
_DEFAULTS = {"--replicas": 8}


class UsageError(Exception):
  """A bad ``emulate`` command line (one line, exit 2)."""


@dataclasses.dataclass
class Command:
  """What the ``emulate`` command line asks for."""
  options: dict
  script: Optional[str]
  module: Optional[str]
  args: List[str]

  def get(self, name: str):
    return self.options.get(name, _DEFAULTS.get(name, False if
                                                 OPTIONS[name].metavar is None
                                                 else None))


def parse(argv: List[str]) -> Command:
  """Reads ``emulate``'s words: options, then SCRIPT or ``-m MODULE``, then
  the program's own ARGS (which may look like options). Raises UsageError."""
  options, i = {}, 0
  while i < len(argv):
    word = argv[i]
    if word == "-m" or (word.startswith("-m") and not word.startswith("--")):
      module = word[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
      if not module:
        raise UsageError("-m needs a MODULE, as python -m does.")
      return Command(options, None, module, argv[i + (1 if word[2:] else 2):])
    if word == "--":
      i += 1
      break
    if not word.startswith("-") or word == "-":
      break
    name, eq, value = word.partition("=")
    option = OPTIONS.get(name)
    if option is None:
      raise UsageError(f"unknown option {name!r}.{errors.did_you_mean(name, OPTIONS)}"
                       " Options come before SCRIPT; the script's own go after it.")
    if option.metavar is None:
      if eq:
        raise UsageError(f"{name} takes no value, got {word!r}.")
      options[name] = True
    else:
      if not eq:
        if i + 1 >= len(argv):
          raise UsageError(f"{name} needs a value ({option.metavar}).")
        i += 1
        value = argv[i]
      options[name] = option.convert(value)
    i += 1
  if i >= len(argv):
    raise UsageError("give the program to run: SCRIPT or -m MODULE.")
  return Command(options, argv[i], None, argv[i + 1:])


def _help() -> str:
  lines = [f"usage: {USAGE}", "",
           "Runs a Python program, unmodified, on an emulated TPU of logical "
           "CPU devices: TensorFlow's TPUClusterResolver, TPUStrategy and "
           "TPUEmbedding (TPUEmbeddingV2 with --sparsecore) run on CPU with "
           "the TPU's math.", ""]
  for name, option in OPTIONS.items():
    head = f"{name} {option.metavar}" if option.metavar else name
    lines.append(f"  {head:<16} {option.help}")
  lines.append(f"  {'-m MODULE':<16} Run a module as python -m does.")
  return "\n".join(lines)


def _shape(command: Command):
  """(replicas, sparsecore, topology, xla, hosts) with the slice and the
  hosts checked (``hosts`` None: the topology's, else 1)."""
  topology, replicas = command.get("--topology"), command.get("--replicas")
  sparsecore, slice_ = command.get("--sparsecore"), None
  if topology is not None:
    try:
      slice_ = check_slice(topology)
    except errors.Error as e:
      raise UsageError(f"--topology: {' '.join(str(e).split())}") from None
    if sparsecore and not slice_.sparsecore:
      raise UsageError(session.no_sparsecore("", "--sparsecore", slice_))
    sparsecore = slice_.sparsecore  # A SparseCore generation implies it.
    if "--replicas" not in command.options:  # v2, v3: two per chip.
      replicas = slice_.replicas
  hosts = command.get("--hosts")
  check_hosts(hosts, replicas, slice_)
  return replicas, sparsecore, topology, not command.get("--no-xla"), hosts


def check_hosts(hosts, replicas: int, slice_=None,
                flags=("--hosts", "--replicas", "--topology", "--sparsecore"),
                sep: str = " ") -> None:
  """UsageError unless ``hosts`` (None: the slice's, else 1) can feed
  ``replicas`` cores of ``slice_`` (a named slice, or None): a positive
  number dividing the replicas, and a named slice's own hosts. ``flags``: the
  command line's names of hosts, replicas, topology and SparseCore, ``sep``
  between a flag and its value, for the message."""
  hosts_flag, replicas_flag, topology_flag, sparsecore_flag = flags
  if hosts is None:
    return
  if hosts < 1:
    raise UsageError(f"{hosts_flag} takes a positive number of hosts (TPU VMs), "
                     f"got {hosts}. Fix: e.g. {hosts_flag}{sep}2, or leave it out "
                     "for one host.")
  if slice_ is not None and hosts != slice_.hosts:
    implied, per_host = slice_.hosts, slice_.replicas // slice_.hosts
    sparsecore = f" {sparsecore_flag}" if slice_.sparsecore else ""
    raise UsageError(
        f"{hosts_flag}{sep}{hosts} with {topology_flag}{sep}{slice_.name}: that "
        f"slice has {implied} host{'s' if implied != 1 else ''} ({per_host} "
        f"replicas each, as Cloud TPU's VMs hold them). Fix: leave {hosts_flag} "
        f"out (the topology implies {implied}), or give {replicas_flag}{sep}"
        f"{replicas} {hosts_flag}{sep}{hosts}{sparsecore} without {topology_flag}.")
  if replicas % hosts:
    raise UsageError(
        f"{hosts_flag}{sep}{hosts}: {replicas} replicas ({replicas_flag} counts "
        f"every host's cores) do not split over {hosts} hosts, each feeding as "
        f"many. Fix: {replicas_flag} a multiple of {hosts}, e.g. {replicas_flag}"
        f"{sep}{hosts * max(1, replicas // hosts)} {hosts_flag}{sep}{hosts}.")


def check_slice(topology):
  """The TPU slice ``topology`` names (``sparsecore.chips.Slice``), checked
  to be one Cloud TPU has (``v5p:3`` is refused), without loading TensorFlow.

  The ``tpu_embed_ext.sparsecore`` package imports TensorFlow (its checkpoint
  conversion); a usage error should not print TensorFlow's start-up lines,
  so ``chips.py`` (which needs only ``errors``) is read on its own.
  """
  chips = _chips()
  slice_ = chips.parse_slice(topology, check=False)
  generation, n = slice_.generation, slice_.chips
  if slice_.named_generation and not generation.slice_exists(n):
    name = generation.name
    nearest = next(c for c in range(n, n + 1024) if generation.slice_exists(c))
    per_chip = generation.sparsecores_per_chip
    other = (f", or {n}x{per_chip} for {n} chips of {per_chip} SparseCores"
             if slice_.sparsecore else "")
    raise errors.ConfigError(
        f"topology {str(topology).strip()!r} is not a {name} slice: {name} "
        f"slices have {generation.slices}. Fix: e.g. {name}:{nearest}{other}.")
  return slice_


def _chips():
  name = "tpu_embed_ext.sparsecore.chips"
  module = sys.modules.get(name) or sys.modules.get(f"{name}_standalone")
  if module is None:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "sparsecore", "chips.py")
    spec = importlib.util.spec_from_file_location(f"{name}_standalone", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up.
    spec.loader.exec_module(module)
  return module


def main(argv: Optional[List[str]] = None, *, owns_process: bool = False) -> int:
  """Runs ``emulate``'s command line (the words after ``emulate``).

  Returns the exit status (the script's, or 2 for a bad command line): call
  it as ``sys.exit(main(argv))``, which ends the process as Python does.
  ``owns_process`` (the command line's way): TensorFlow's start-up lines go
  to the library log, not the terminal, and the script's world (``__main__``,
  ``sys.argv``, ``sys.path[0]``, the emulation) is kept until the interpreter
  exits; an exception leaving the script (``SystemExit`` too) leaves ``main``
  for Python's top level. Without it, they are put back before ``main``
  returns the status.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  if any(a in ("-h", "--help") for a in argv[:_first_program_word(argv)]):
    print(_help())
    return 0
  try:
    command = parse(argv)
    if command.script is not None and not os.path.isfile(command.script):
      raise UsageError(f"no script {command.script!r}.")
    shape = _shape(command)
  except UsageError as e:
    print(f"error: emulate: {e} Usage: {USAGE}", file=sys.stderr)
    return 2
  stack = contextlib.ExitStack()
  try:
    _start(stack, shape, owns_process)
    program = programs.find(command.script, command.module, command.args)
    if program is None:
      raise UsageError(f"no module named {command.module!r} (looked in the "
                       "current directory and sys.path, as python -m does).")
  except (UsageError, errors.Error) as e:  # Set-up (replicas, devices): one line.
    stack.close()
    line = " ".join(str(e).split())
    print(f"error: emulate: {line}" + (f" Usage: {USAGE}" if isinstance(
        e, UsageError) else ""), file=sys.stderr)
    return 2
  except BaseException:
    stack.close()
    raise
  if owns_process:
    # Left by the last atexit handler: after the script's own handlers (run
    # in reverse order of registration) and its non-daemon threads.
    atexit.register(stack.close)
    return programs.run_kept(program)
  with stack:
    return programs.run_restoring(program)


def _start(stack: contextlib.ExitStack, shape, owns_process: bool) -> None:
  """Enters the emulation. On the command line, TensorFlow's start-up lines
  (written to fd 2 while it loads and makes its devices: the oneDNN and CPU
  feature lines) go to the library log, as in the other commands; the
  script's own stderr is the terminal again before it runs."""
  log = None
  if owns_process:
    log = library_log.LibraryLog("emulate")
  try:
    emulation = stack.enter_context(session.emulate_tpu(*shape))
  finally:
    if log is not None:
      log.close()
  topology = (f" --topology {shape[2]}" if shape[2] else
              (f" --hosts {emulation.hosts}" if emulation.hosts > 1 else "")
              + (" --sparsecore" if shape[1] else "")) + ("" if shape[3] else " --no-xla")
  session.hosted_by(
      f"`python -m tpu_embed_ext emulate --replicas {emulation.replicas}{topology}`",
      "run the program with `python -m tpu_embed_ext emulate --replicas "
      "{replicas}{flags} ...` (its emulate_tpu then joins the runner's), or "
      "with plain `python`, where its emulate_tpu makes its own.")
  if owns_process:
    # TensorFlow's and the set-up's objects out of every full collection and
    # of the exit's (start_up_objects.py); the script's own are untouched.
    start_up_objects.freeze_start_up()


def _first_program_word(argv: List[str]) -> int:
  """Where SCRIPT or -m is: the words from there on are the program's."""
  i = 0
  while i < len(argv):
    word = argv[i]
    if word.startswith("-m") and not word.startswith("--"):
      return i
    if word == "--" or not word.startswith("-") or word == "-":
      return i
    name = word.partition("=")[0]
    option = OPTIONS.get(name)
    i += 2 if option and option.metavar and "=" not in word else 1
  return i
