"""Builds the native kernels against the installed TensorFlow, and loads them.

TensorFlow has no stable C++ ABI across versions, so the library is compiled
here, on first use, against the TensorFlow that will load it (pip's build
isolation would compile against another one), and cached per TensorFlow
version and source hash:

  ``$TPU_EMBED_EXT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tpu_embed_ext``, or
  ``~/.cache/tpu_embed_ext``) ``/kernels/tf-<version>-<hash>/``

holding ``libtpu_embed_ext_ops.so``, ``manifest.json`` (the TensorFlow
version it was built for, read back before loading: a library built for
another version is refused) and ``build.log``. A build writes into a
temporary directory renamed into place, under a file lock, so concurrent
processes build once and never load half a file.

Every ``*.cc`` beside this module goes into the one library. Compiler: ``$CXX``,
else ``$CC``, else ``g++`` or ``c++`` on the PATH. No compiler, a failed
build or a refused library: ``load()`` returns None, ``why_not()`` says why,
and one log line (with the build log's path) tells the user that the
TensorFlow-op path runs instead, which gives the same results.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional

import tensorflow as tf

__all__ = ["load", "why_not", "build", "cache_root", "library_dir",
           "compiler", "LIBRARY", "COMPILING", "compiled", "announce"]

LIBRARY = "libtpu_embed_ext_ops.so"
_MANIFEST = "manifest.json"
_HERE = os.path.dirname(os.path.abspath(__file__))
_LOG = logging.getLogger("tpu_embed_ext")
# Why each flag: -fno-math-errno and __restrict let GCC vectorise the sqrt /
# divide loops (measured 2.7x on the apply phase); -ffp-contract=off keeps
# a*b+c two roundings on every target, as TensorFlow's own ops compute it
# (bit-identical results); no -march: the library must run on any x86-64 /
# aarch64 the wheel runs on (-march=native also breaks Eigen with g++ 12).
_FLAGS = ["-std=c++17", "-shared", "-fPIC", "-O3", "-fno-math-errno",
          "-ffp-contract=off", "-DEIGEN_USE_THREADS",
          "-Wno-deprecated-declarations", "-Wno-sign-compare"]

_lock = threading.Lock()
_state = {"done": False, "module": None, "why": None}


def cache_root() -> str:
  """The directory the kernels are cached under (see module doc)."""
  root = os.environ.get("TPU_EMBED_EXT_CACHE_DIR")
  if not root:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache")
    root = os.path.join(xdg, "tpu_embed_ext")
  return os.path.join(root, "kernels")


def _sources() -> List[str]:
  return sorted(glob.glob(os.path.join(_HERE, "*.cc")))


def compiler() -> Optional[List[str]]:
  """The C++ compiler's command (``$CXX`` may be e.g. "ccache g++"), or None."""
  for name in ("CXX", "CC"):
    value = os.environ.get(name)
    if value:
      command = shlex.split(value)
      path = shutil.which(command[0]) if command else None
      return [path, *command[1:]] if path else None
  path = shutil.which("g++") or shutil.which("c++")
  return [path] if path else None


def _command(cxx: List[str], sources: List[str], output: str) -> List[str]:
  return ([*cxx, *_FLAGS, *tf.sysconfig.get_compile_flags(), *sources, "-o",
           output, *tf.sysconfig.get_link_flags()])


def _digest(cxx: List[str]) -> str:
  """Hash of what the library depends on: sources, flags, compiler."""
  h = hashlib.sha256()
  for path in _sources():
    h.update(os.path.basename(path).encode() + b"\0")
    with open(path, "rb") as f:
      h.update(f.read())
  h.update(" ".join(_command(cxx, [], "")).encode())
  h.update(tf.sysconfig.get_lib().encode())
  return h.hexdigest()[:16]


def library_dir(cxx: Optional[List[str]] = None) -> str:
  """The cache directory of the library for this TensorFlow and these sources."""
  cxx = cxx or compiler() or ["none"]
  return os.path.join(cache_root(), f"tf-{tf.__version__}-{_digest(cxx)}")


@contextlib.contextmanager
def _file_lock(path: str):
  import fcntl  # pylint: disable=g-import-not-at-top  (POSIX only)
  with open(path, "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


COMPILING = ("tpu_embed_ext: compiling the native kernels (first run after an "
             "install or a TensorFlow upgrade, about 40 s on 2 cores)...")


def compiled(seconds: float, ok: bool = True) -> str:
  """The end of the ``COMPILING`` line: `` done in 41 s.``"""
  return f" {'done' if ok else 'failed'} in {seconds:.0f} s."


def _stdout_announcer(text: str) -> None:
  """Writes ``COMPILING`` and its end as one line on this process's stdout
  (a terminal, a notebook cell): the command's own progress, as the CLI's
  other progress lines, not a library's log line (the CLI sends stderr to
  its library log)."""
  try:
    sys.stdout.write(text if text == COMPILING else text + "\n")
    sys.stdout.flush()
  except (OSError, ValueError, AttributeError):
    pass  # No stdout (closed, None): the build goes on without the line.


# Where the one-line announcement of a compile goes: a callable given
# COMPILING, then compiled(...). Said once, in build(), for every caller (the
# CLI, `emulate`, a notebook, `make install`); None keeps it quiet.
announce = _stdout_announcer


def _announce(text: str) -> None:
  if announce is not None:
    announce(text)


class BuildError(RuntimeError):
  """The library could not be built (the message says why and where the log is)."""


def build(force: bool = False) -> str:
  """Builds the library into the cache if needed; returns its directory.

  Raises BuildError when there is no compiler or the compiler fails.
  """
  cxx = compiler()
  if cxx is None:
    wanted = os.environ.get("CXX") or os.environ.get("CC") or "g++"
    raise BuildError(f"no C++ compiler ({wanted!r} not found)")
  final = library_dir(cxx)
  root = os.path.dirname(final)
  os.makedirs(root, exist_ok=True)
  with _file_lock(final + ".lock"):
    if os.path.exists(os.path.join(final, _MANIFEST)) and not force:
      return final
    tmp = tempfile.mkdtemp(prefix=".build-", dir=root)
    log = os.path.join(tmp, "build.log")
    command = _command(cxx, _sources(), os.path.join(tmp, LIBRARY))
    started = time.monotonic()
    _announce(COMPILING)
    with open(log, "w") as f:
      f.write(" ".join(command) + "\n\n")
      f.flush()
      result = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT,
                              check=False)
    _announce(compiled(time.monotonic() - started, result.returncode == 0))
    if result.returncode != 0:
      kept = final + ".failed.log"
      os.replace(log, kept)
      shutil.rmtree(tmp, ignore_errors=True)
      raise BuildError(f"the C++ build failed (exit {result.returncode}); "
                       f"build log: {kept}")
    with open(os.path.join(tmp, _MANIFEST), "w") as f:
      json.dump({"tensorflow": tf.__version__, "compiler": " ".join(cxx),
                 "sources": [os.path.basename(s) for s in _sources()]}, f)
    if os.path.exists(final):  # A forced rebuild replaces the old one.
      shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def _load_from(directory: str):
  """The op module of the library in ``directory``, refusing another TF's."""
  with open(os.path.join(directory, _MANIFEST)) as f:
    built_for = json.load(f).get("tensorflow")
  if built_for != tf.__version__:
    raise BuildError(
        f"the library in {directory} was built for TensorFlow {built_for}, "
        f"this is TensorFlow {tf.__version__}")
  return tf.load_op_library(os.path.join(directory, LIBRARY))


def load():
  """The loaded op module, or None (``why_not()`` says why); builds if needed.

  Runs once per process; the first failure logs one line.
  """
  with _lock:
    if not _state["done"]:
      _state["done"] = True
      try:
        _state["module"] = _load_from(build())
      except Exception as e:  # pylint: disable=broad-except
        # Anything (no compiler, compile error, refused or broken library)
        # leaves the TF-op path, which computes the same results.
        _state["why"] = f"{type(e).__name__}: {e}" if not isinstance(
            e, BuildError) else str(e)
        _LOG.warning("tpu_embed_ext: native kernels unavailable (%s); using "
                     "the TensorFlow-op path (same results, slower).",
                     _state["why"])
    return _state["module"]


def why_not() -> Optional[str]:
  """Why ``load()`` returned None (None if it has not failed)."""
  return _state["why"]


def _reset_for_tests():
  _state.update(done=False, module=None, why=None)


if __name__ == "__main__":  # pragma: no cover
  sys.exit("run: python -m tpu_embed_ext.emulation.native build")
