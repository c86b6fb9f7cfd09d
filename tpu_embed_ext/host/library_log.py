"""The command line owns its stderr: other libraries' output goes to a log file.

TensorFlow's C++ runtime writes to file descriptor 2 directly (on some CPUs
``WARNING: All log messages before absl::InitializeLog() ...`` and the oneDNN
line, whatever ``TF_CPP_MIN_LOG_LEVEL`` says), and Python libraries write to
``sys.stderr`` or to logging handlers bound to it. One mechanism covers them
all: fd 2 is pointed at the log file (``dup2``) before TensorFlow is
imported, ``sys.stderr`` and the logging handlers bound to the old stream
follow it, and the command's own messages go to ``terminal``, the stderr it
was started with. Warnings of this package (``NumericTrapWarning``) are the
command's own messages and go there too.

The log starts as a private file in ``log_dir()`` (``mkstemp``: created
exclusively, mode 0600, so a planted symlink cannot redirect it). It moves
into ``<model_dir>/logs/libraries.log`` once the model_dir is known good
(``move_to``: a run that fails on its config creates no directory);
otherwise ``close`` renames it ``<log_dir>/<command>.log``, the last run's
log of that command (the rename replaces a symlink there, never follows it).

A crash is never lost. In a process (``process=True``): ``faulthandler``
writes the Python stack of a fatal signal (SIGSEGV, SIGABRT, ...) to the
terminal, and a watcher (forked before TensorFlow starts threads) waits for
the process to end; if it ends without ``close`` (a crash in a library, a
kill), the watcher prints the last lines of the log and its path.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import sys
import tempfile
import warnings
from typing import Optional

__all__ = ["LibraryLog", "TAIL_LINES", "log_dir"]

TAIL_LINES = 20
"""Lines of the log the watcher shows when the process ends without a word."""


class LibraryLog:
  """Points fd 2, ``sys.stderr`` and Python's log handlers at a log file.

  ``terminal`` is where the command's own messages go. ``close`` restores
  everything (in a process, fd 2 stays on the log: what TensorFlow prints
  while Python shuts down is not the command's).
  """

  def __init__(self, command: str, *, process: bool = False):
    self._process = process
    self._old_stderr = sys.stderr
    sys.stderr.flush()
    directory = log_dir()
    fd, self.path = tempfile.mkstemp(prefix=f"tpu_embed_ext-{command}-",
                                     suffix=".log", dir=directory)
    self._final = (os.path.join(directory, f"{command}.log") if directory
                   else self.path)
    self._moved, self._start = False, 0
    self._saved_fd = os.dup(2)  # Not inherited by subprocesses (PEP 446).
    if _writes_to_fd2(sys.stderr):
      self.terminal = os.fdopen(os.dup(self._saved_fd), "w", buffering=1,
                                encoding="utf-8", errors="backslashreplace")
    else:  # A test's captured stderr: our messages go where it looks.
      self.terminal = sys.stderr
    self._watcher = _start_watcher(self.terminal, self.path) if process else None
    if process:
      faulthandler.enable(self.terminal, all_threads=True)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8",  # pylint: disable=consider-using-with
                      errors="backslashreplace", closefd=False)
    self._handlers = _retarget_handlers(sys.stderr, (self._old_stderr, sys.__stderr__))
    self._showwarning = warnings.showwarning
    warnings.showwarning = self._show_warning

  def move_to(self, path: str) -> None:
    """Moves the log to ``path`` (appended to it): the model_dir is good.

    A path that cannot be written (``logs`` is a file, a read-only disk)
    keeps the private log: the command reports that itself.
    """
    if self._moved:
      return
    sys.stderr.flush()
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
      return
    self._start = os.fstat(fd).st_size
    with open(self.path, "rb") as src, open(fd, "ab", closefd=False) as dst:
      shutil.copyfileobj(src, dst)
    os.dup2(fd, 2)
    os.close(fd)
    os.unlink(self.path)
    self.path, self._moved = path, True
    self._tell_watcher(f"log {os.path.abspath(path)}\n")

  @property
  def destination(self) -> str:
    """Where the log is once ``close`` has run."""
    return self.path if self._moved else self._final

  def close(self) -> str:
    """Restores stderr; returns the log's path (``destination``)."""
    sys.stderr.flush()
    warnings.showwarning = self._showwarning
    for handler, stream in self._handlers:
      handler.setStream(stream)
    sys.stderr = self._old_stderr
    if not self._process:
      os.dup2(self._saved_fd, 2)
      if self.terminal is not self._old_stderr:
        self.terminal.close()
    os.close(self._saved_fd)
    self._tell_watcher("done\n")
    if self.path != self.destination:  # Replaces a symlink, never follows it.
      os.replace(self.path, self.destination)
      self.path = self.destination
    return self.path

  def _show_warning(self, message, category, filename, lineno, file=None,
                    line=None):
    if category.__module__.startswith("tpu_embed_ext"):
      print(f"warning: {message}", file=self.terminal)
    else:
      self._showwarning(message, category, filename, lineno, file, line)

  def _tell_watcher(self, message: str) -> None:
    if self._watcher is not None:
      os.write(self._watcher, message.encode())


def log_dir() -> Optional[str]:
  """``<cache>/logs``, made private (0700) if absent, or None if it cannot be.

  ``<cache>`` is the kernels' cache root (emulation/native/loader.py, which
  imports TensorFlow: this runs before): ``$TPU_EMBED_EXT_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/tpu_embed_ext``, else ``~/.cache/tpu_embed_ext``.
  """
  root = os.environ.get("TPU_EMBED_EXT_CACHE_DIR") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                       ".cache"), "tpu_embed_ext")
  path = os.path.join(root, "logs")
  try:
    os.makedirs(path, mode=0o700, exist_ok=True)
  except OSError:
    return None
  return path


def _writes_to_fd2(stream) -> bool:
  try:
    return stream.fileno() == 2
  except (AttributeError, OSError, ValueError):
    return False


def _retarget_handlers(stream, old_streams):
  """Points root handlers that write to ``old_streams`` at ``stream``;
  returns ``[(handler, previous stream)]``."""
  moved = []
  for handler in logging.getLogger().handlers:
    target = getattr(handler, "python_handler", handler)  # absl's wraps one.
    if (isinstance(target, logging.StreamHandler)
        and any(target.stream is s for s in old_streams if s is not None)):
      moved.append((target, target.setStream(stream)))
  return moved


def _start_watcher(terminal, log_path: str) -> int:
  """Forks the watcher; returns the pipe to tell it the log's moves and the end."""
  terminal.flush()
  read, write = os.pipe()
  if os.fork():
    os.close(read)
    return write
  try:  # The watcher: no Python object of the parent is used past here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the command.
    os.close(write)
    received = b""
    while True:
      chunk = os.read(read, 4096)
      if not chunk:
        break
      received += chunk
    lines = received.decode(errors="replace").splitlines()
    if "done" not in lines:
      moves = [l[len("log "):] for l in lines if l.startswith("log ")]
      os.write(terminal.fileno(), _crash_report(moves[-1] if moves else log_path))
  finally:
    os._exit(0)  # pylint: disable=protected-access


def _crash_report(log_path: str) -> bytes:
  try:
    with open(log_path, "rb") as f:
      f.seek(max(0, os.path.getsize(log_path) - 64 * 1024))
      tail = f.read().decode(errors="replace").splitlines()[-TAIL_LINES:]
  except OSError:
    tail = []
  text = ("error: the command ended before it finished (killed by a signal, or "
          "a crash inside TensorFlow or another library). The full log is "
          f"{log_path}" + ("; its last lines:" if tail else "."))
  return "\n".join([text] + [f"  {line}" for line in tail] + [""]).encode()
