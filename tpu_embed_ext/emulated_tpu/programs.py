"""The program ``emulate`` runs, as ``python`` runs it (``runner.py``).

``find`` makes the program's ``__main__`` as ``python SCRIPT`` or ``python -m
MODULE`` does: an absolute ``__file__``, the loader, a module's spec.
``run_kept`` runs it in a process it owns: ``__main__``, ``sys.argv`` and
``sys.path[0]`` stay until the interpreter exits (its ``atexit`` handlers and
non-daemon threads see them, issue 42), ``__file__`` goes when ``python``
deletes it, and an uncaught exception leaves for Python's top level, which
reports it with the program's ``sys.excepthook`` (given the program's frames)
and ends the process as ``python`` would (1, or SIGINT after a
``KeyboardInterrupt``). ``run_restoring`` runs it inside a caller's process
and puts everything back before it returns the status.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib.machinery
import importlib.util
import io
import os
import sys
import traceback
import types
from typing import List, Optional

from tpu_embed_ext.emulated_tpu import session

__all__ = ["Program", "find", "run_kept", "run_restoring"]


def _script_frames(tb, filename: str):
  """The traceback from the program's first frame on, as ``python`` shows."""
  start = tb
  while start is not None and start.tb_frame.f_code.co_filename != filename:
    start = start.tb_next
  return start or tb


def _exit_code(e: SystemExit) -> int:
  """What Python's own exit makes of ``sys.exit(e.code)``."""
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code
  print(e.code, file=sys.stderr)
  return 1


@dataclasses.dataclass
class Program:
  """The program's ``__main__`` module and code, and its ``sys`` settings."""
  module: types.ModuleType
  code: types.CodeType
  argv: List[str]
  path0: str


def find(script: Optional[str], module: Optional[str], args) -> Optional[Program]:
  """``__main__`` as ``python SCRIPT`` / ``python -m MODULE`` makes it: an
  absolute ``__file__``, the loader, and for a module its spec. None: no
  such module."""
  main = types.ModuleType("__main__")
  main.__dict__["__builtins__"] = builtins
  if module is None:
    filename = os.path.abspath(script)
    with io.open_code(filename) as f:
      code = compile(f.read(), filename, "exec", dont_inherit=True)
    main.__dict__.update(__file__=filename, __cached__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader(
                             "__main__", filename))
    return Program(main, code, [script] + list(args), os.path.dirname(filename))
  saved = sys.path[0]
  sys.path[0] = os.getcwd()
  try:
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations is not None:
      spec = importlib.util.find_spec(f"{module}.__main__")  # A package.
  except (ImportError, ValueError):
    spec = None
  finally:
    sys.path[0] = saved
  code = spec.loader.get_code(spec.name) if spec and spec.loader else None
  if spec is None or spec.origin is None or code is None:
    return None
  main.__dict__.update(__file__=spec.origin, __cached__=spec.cached,
                       __package__=spec.parent, __loader__=spec.loader,
                       __spec__=spec)
  return Program(main, code, [spec.origin] + list(args), os.getcwd())


_DEVICES_FIXED = "Virtual devices cannot be modified after being initialized"


def _explain(e: BaseException) -> None:
  """Adds the runner's fix to TensorFlow's refusal of the program's own
  logical devices (the emulation made them before the program ran)."""
  active = session.current()
  if isinstance(e, RuntimeError) and _DEVICES_FIXED in str(e) and active:
    e.add_note(
        f"emulate: the emulated TPU made {active.replicas} logical CPU devices "
        "(one per replica) before the program ran, and TensorFlow fixes them "
        "then. Fix: give emulate --replicas the number of CPU devices the "
        "program sets (TensorFlow accepts the same configuration again), or "
        "skip its device set-up when tpu_embed_ext.emulated_tpu.is_active().")


def _enter(program: Program) -> None:
  sys.argv, sys.path[0] = program.argv, program.path0
  sys.modules["__main__"] = program.module


def run_kept(program: Program) -> int:
  """Runs the program in a process it owns: its ``__main__``, ``sys.argv``,
  ``sys.path[0]`` (and the emulation) stay until the interpreter exits, for its
  ``atexit`` handlers and threads; an exception (``SystemExit``,
  ``KeyboardInterrupt`` too) ends the process as Python's top level does."""
  _enter(program)
  try:
    exec(program.code, program.module.__dict__)  # pylint: disable=exec-used
  except SystemExit:
    raise  # Python exits from there on: __file__ stays (_script_ended).
  except BaseException as e:
    _explain(e)
    # The interpreter calls sys.excepthook as the exception leaves the
    # process: the script's own hook, given the program's frames only.
    hook = sys.excepthook
    def report(kind, value, tb):
      sys.excepthook = hook
      tb = _script_frames(tb, program.code.co_filename)
      if isinstance(value, BaseException):  # The default hook prints its own.
        value.__traceback__ = tb
      sys.last_traceback = tb
      try:
        hook(kind, value, tb)
      finally:
        _script_ended(program)
    sys.excepthook = report
    raise
  _script_ended(program)
  return 0


def _script_ended(program: Program) -> None:
  """``python SCRIPT`` deletes ``__file__`` and ``__cached__`` from
  ``__main__`` once the script's code has returned or its exception was
  reported, not after ``sys.exit`` (pythonrun.c); ``python -m`` keeps them."""
  if program.module.__dict__.get("__spec__") is None:
    program.module.__dict__.pop("__file__", None)
    program.module.__dict__.pop("__cached__", None)


def run_restoring(program: Program) -> int:
  """Runs the program inside a caller's process, then puts ``__main__``,
  ``sys.argv`` and ``sys.path[0]`` back; the status as Python would exit."""
  saved = sys.argv, sys.path[0], sys.modules.get("__main__")
  _enter(program)
  try:
    exec(program.code, program.module.__dict__)  # pylint: disable=exec-used
  except SystemExit as e:
    return _exit_code(e)
  except BaseException as e:  # pylint: disable=broad-except
    _explain(e)
    # As the interpreter does for an uncaught exception: the script's own
    # sys.excepthook (the default prints the traceback) and status 1.
    e.__traceback__ = _script_frames(e.__traceback__, program.code.co_filename)
    sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
    try:
      sys.excepthook(type(e), e, sys.last_traceback)
    except Exception:  # pylint: disable=broad-except  # A hook that fails.
      traceback.print_exc()
    return 130 if isinstance(e, KeyboardInterrupt) else 1
  finally:
    sys.argv, sys.path[0] = saved[:2]
    if saved[2] is not None:
      sys.modules["__main__"] = saved[2]
  return 0
