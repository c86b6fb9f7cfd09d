"""``python -m tpu_embed_ext emulate [options] SCRIPT [ARGS...]``: a program on the emulated TPU.

SCRIPT runs as ``__main__``, as ``python SCRIPT ARGS`` runs it:
``sys.argv`` is ``[SCRIPT, *ARGS]``, ``sys.path[0]`` the script's directory,
and absl's flag registry holds only what the script defines (the
command line dispatches ``emulate`` here before it defines its own flags), so
a script's ``app.run(main)`` parses its own flags. The logical CPU devices
are set up before the script runs, then the whole script runs inside
``emulate_tpu``.

Exit status: the script's own (``sys.exit(code)``; 0 when it returns; 1 with
the traceback printed on an exception); 2 for a bad ``emulate`` command line.

Exit time: once the script has finished (and its ``atexit`` handlers and
non-daemon threads with it, as at a normal exit), open files, ``tf.io.gfile``
files and summary writers are flushed and the process ends without Python's
final garbage collection (``exit_now``; ``--finalize`` keeps it). That
collection runs TensorFlow's C++ destructors of the script's distributed
iterators and multi-device functions. Measured at 8 replicas on the loaded
2-core development machine (issue 29), a script building 5 distributed
iterators and taking 3 steps on each: Python's final collection alone took
1.3-20.5 s with the engine (stalls of about 10 s: 10.3, 10.3, 20.5, 20.5 s
in 4 of 6 runs) and 0.6-1.3 s without it; the whole exit after the script's
last line took 7-22 s with the engine and 5-43 s without it (3 runs each).
What the engine adds is more to collect: 34,000 objects and 264 traced
graphs against 16,000 and 99 (its per-replica and merge functions); the
stalls themselves are inside TensorFlow's C++ destructors (no Python frame
in a profile of the collection). Through this runner the process ended
0.8-1.1 s after the script's last line (3 runs), and 3, 25 and 88 s after
it with ``--finalize``.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import io
import os
import runpy
import sys
import threading
import traceback
from typing import List, Optional

__all__ = ["main"]

USAGE = ("python -m tpu_embed_ext emulate [--replicas N] [--sparsecore] "
         "[--topology T] [--no-xla] [--finalize] SCRIPT [ARGS...]")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m tpu_embed_ext emulate", usage=USAGE,
      description="Run SCRIPT, unmodified, on an emulated TPU of logical CPU "
      "devices: TensorFlow's TPUClusterResolver, TPUStrategy and TPUEmbedding "
      "(TPUEmbeddingV2 with --sparsecore) run on CPU with the TPU's math.")
  parser.add_argument("--replicas", type=int, default=8,
                      help="TPU cores (replicas), one logical CPU device each "
                      "(default 8).")
  parser.add_argument("--sparsecore", action="store_true",
                      help="The TPU has SparseCore: TPUEmbeddingV2 is emulated.")
  parser.add_argument("--topology", default=None,
                      help="SparseCore topology of --replicas chips: v5p:N, "
                      "v6e:N, tpu7x:N or NxSPARSECORES.")
  parser.add_argument("--no-xla", dest="xla", action="store_false",
                      help="Do not check that each replica's step compiles "
                      "with XLA, as a TPU's must (faster; see "
                      "docs/guides/tpu-on-cpu.md).")
  parser.add_argument("--finalize", action="store_true",
                      help="Exit as Python does, with its final garbage "
                      "collection (TensorFlow's destructors; at 8 replicas this "
                      "can take minutes).")
  parser.add_argument("script", metavar="SCRIPT", help="The Python program.")
  parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                      help="SCRIPT's own arguments.")
  return parser


def _exit_code(e: SystemExit) -> int:
  """What Python's own exit makes of ``sys.exit(e.code)``."""
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code
  print(e.code, file=sys.stderr)
  return 1


def _run(script: str, args: List[str], options) -> int:
  from tpu_embed_ext import emulated_tpu  # pylint: disable=g-import-not-at-top
  # Set-up errors (replicas, devices) propagate: main prints them in one line.
  with emulated_tpu.emulate_tpu(options.replicas, options.sparsecore,
                                options.topology, xla=options.xla):
    saved = sys.argv, sys.path[0]
    sys.argv = [script] + list(args)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
      runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
      return _exit_code(e)
    except KeyboardInterrupt:
      traceback.print_exc()
      return 130  # As Python's own exit on SIGINT reads in a shell.
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      return 1
    finally:
      sys.argv, sys.path[0] = saved
  return 0


def main(argv: Optional[List[str]] = None, *, fast_exit: bool = True) -> int:
  """Runs ``emulate``'s command line (the words after ``emulate``).

  Returns the exit status (the script's, or 2 for a bad command line). With
  ``fast_exit`` (the command line's way) a script that ran does not return
  here: the process ends with its status through ``exit_now``. Call it as
  ``sys.exit(main(argv))``.
  """
  parser = _parser()
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    options = parser.parse_args(argv)
  except SystemExit as e:  # argparse printed the usage or --help.
    return 0 if e.code == 0 else 2
  if not os.path.isfile(options.script):
    print(f"error: emulate: no script {options.script!r}. Usage: {USAGE}",
          file=sys.stderr)
    return 2
  try:
    code = _run(options.script, options.args, options)
  except Exception as e:  # pylint: disable=broad-except
    from tpu_embed_ext import errors  # pylint: disable=g-import-not-at-top
    if not isinstance(e, errors.Error):
      raise
    print(f"error: emulate: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  if fast_exit and not options.finalize:
    exit_now(code)
  return code


def exit_now(code: int) -> None:
  """Ends the process as a finished ``python SCRIPT`` would, minus final GC.

  What the script can observe still happens: non-daemon threads are waited
  for, ``atexit`` handlers run, and open files, ``tf.io.gfile`` files and
  ``tf.summary`` writers are flushed (Python's and TensorFlow's destructors
  would flush them). Then ``os._exit(code)``: no final garbage collection,
  which is where TensorFlow's distributed iterators take their time.
  """
  threading._shutdown()  # pylint: disable=protected-access
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  _flush_outputs()
  os._exit(code)  # pylint: disable=protected-access


def _flush_outputs() -> None:
  kinds = [io.IOBase]
  if "tensorflow" in sys.modules:
    from tensorflow.python.lib.io import file_io  # pylint: disable=g-import-not-at-top
    from tensorflow.python.ops import summary_ops_v2  # pylint: disable=g-import-not-at-top
    kinds += [file_io.FileIO, summary_ops_v2.SummaryWriter]
  kinds = tuple(kinds)
  for obj in gc.get_objects():
    if isinstance(obj, kinds) and obj not in (sys.stdout, sys.stderr):
      _flush(obj)
  for stream in (sys.stdout, sys.stderr):
    _flush(stream)


def _flush(obj) -> None:
  try:
    if not getattr(obj, "closed", False):
      obj.flush()
  except Exception:  # pylint: disable=broad-except  # Not writable, or gone.
    pass
