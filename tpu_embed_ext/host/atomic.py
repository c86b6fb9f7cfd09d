"""Outputs that appear whole or not at all, and outputs that never overwrite inputs.

Every file or directory the package writes goes through here:

- ``write_file(path)``: a context manager yielding a file object that writes
  a hidden sibling (``.<name>.tmp-<pid>-<n>``). On success it is flushed,
  ``fsync``ed and renamed over ``path`` (``os.replace`` is atomic), and the
  directory is ``fsync``ed. On an error the sibling is removed and ``path``
  is as it was.
- ``write_dir(path)``: the same for a directory (a SavedModel): the caller
  fills a hidden sibling directory, which then takes ``path``'s place. On
  Linux the swap is one ``renameat2(RENAME_EXCHANGE)``, so a reader sees the
  old tree or the new one at every instant; elsewhere the old tree is moved
  aside first and ``recover`` puts it back if the process dies in between.
- ``write_prefix(prefix)``: for a TensorFlow checkpoint (``<prefix>.index``
  plus ``<prefix>.data-*``, several files no rename can swap together). The
  caller writes a staging prefix in a hidden sibling directory; the old
  files move into a hidden backup directory (index first, so the old pair
  stops being a checkpoint as a whole), then the new data files and, last,
  the new index move into place, then the backup is deleted. Between the
  first and last rename (a few ``rename`` calls) ``<prefix>.index`` is
  absent and the old complete checkpoint is in the backup; ``recover``
  (called before every read or write of that prefix by this package) moves
  it back.

Leftovers of killed runs all start with ``.`` and contain ``.tmp-``,
``.old-`` or ``.bak-``: no output name of the package matches them (``ckpt-N.index``,
``saved_model.pb``...), and ``clean`` deletes those not held by a live
process.

``check_no_overlap`` refuses an output that equals, contains or lies inside
an input before anything is written.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import itertools
import os
import re
import shutil
from typing import IO, Iterator, List, Sequence

from tpu_embed_ext import errors

__all__ = ["OutputError", "temporary_name", "write_file", "write_text", "write_dir", "write_prefix",
           "prefix_files", "recover", "clean", "check_no_overlap", "check_writable",
           "probe_write", "io_error", "is_write_error"]

_counter = itertools.count()
_RENAME_EXCHANGE = 2


class OutputError(errors.Error, OSError):
  """An output that cannot be written: it overlaps an input, or the disk refuses it."""


def is_write_error(e: BaseException) -> bool:
  """Whether an OSError or TensorFlow error is the disk refusing a write."""
  if getattr(e, "errno", None) in (errno.ENOSPC, errno.EROFS, errno.EACCES,
                                   errno.EPERM, errno.EDQUOT):
    return True
  text = str(getattr(e, "message", e))
  return any(s in text for s in ("No space left", "Read-only file system",
                                 "Permission denied", "Disk quota"))


def io_error(e: BaseException, what: str, path: str, *,
             note: str = "Nothing was replaced; the previous output, if any, is "
             "intact.") -> OutputError:
  """The one-line error for an ``OSError`` (or TensorFlow I/O error) writing ``path``."""
  code = getattr(e, "errno", None)
  text = (getattr(e, "strerror", None) or getattr(e, "message", None) or str(e))
  # TensorFlow's: "{{function_node ...}} <file>; No space left on device [Op:SaveV2]"
  text = re.sub(r"\{\{.*?\}\}|\[Op:\w+\]", "", " ".join(str(text).split())).strip()
  if code == errno.ENOSPC or "No space left" in text:
    fix = "free space on that disk, or write elsewhere"
  elif code in (errno.EROFS, errno.EACCES, errno.EPERM) or any(
      s in text for s in ("Read-only", "Permission denied", "not permitted")):
    fix = "make it writable, or write elsewhere"
  else:
    fix = "check the path and the disk"
  return OutputError(f"cannot write {what} {path}: {text}. {note} Fix: {fix}.")


def temporary_name(path: str) -> str:
  """A hidden sibling name for ``path`` that ``clean`` removes once this process dies."""
  return _tmp_name(path)


def _tmp_name(path: str, kind: str = "tmp") -> str:
  head, tail = os.path.split(os.path.abspath(path))
  return os.path.join(head, f".{tail}.{kind}-{os.getpid()}-{next(_counter)}")


def _fsync_dir(directory: str) -> None:
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def _fsync_tree(root: str) -> None:
  for directory, _, files in os.walk(root):
    for name in files:
      fd = os.open(os.path.join(directory, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    _fsync_dir(directory)


@contextlib.contextmanager
def write_file(path: str, mode: str = "w", **kwargs) -> Iterator[IO]:
  """``with write_file(p) as f:`` f writes a sibling that replaces ``p`` when whole."""
  tmp = _tmp_name(path)
  try:
    with open(tmp, mode, **kwargs) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise
  _fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_text(path: str, text: str) -> None:
  with write_file(path) as f:
    f.write(text)


def _exchange(a: str, b: str) -> bool:
  """Swaps two paths in one step (Linux renameat2); False where unsupported."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
  except (OSError, AttributeError):
    return False
  at_fdcwd = -100
  if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b),
               _RENAME_EXCHANGE) == 0:
    return True
  code = ctypes.get_errno()
  if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
    return False
  raise OSError(code, os.strerror(code), b)


@contextlib.contextmanager
def write_dir(path: str) -> Iterator[str]:
  """``with write_dir(p) as tmp:`` fill directory ``tmp``; it becomes ``p`` when whole."""
  path = os.path.abspath(path)
  recover(path)
  tmp = _tmp_name(path)
  os.makedirs(tmp)
  try:
    yield tmp
    _fsync_tree(tmp)
    if os.path.isdir(path) and not os.path.islink(path):
      if _exchange(tmp, path):  # tmp now holds the old tree.
        shutil.rmtree(tmp, ignore_errors=True)
      else:
        old = _tmp_name(path, "old")
        os.rename(path, old)  # recover() moves it back if we die here.
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
      os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  _fsync_dir(os.path.dirname(path))


def prefix_files(prefix: str) -> List[str]:
  """The files of checkpoint ``prefix`` that exist: data files, then the index."""
  data = sorted(glob.glob(glob.escape(prefix) + ".data-?????-of-?????"))
  index = prefix + ".index"
  return data + ([index] if os.path.exists(index) else [])


@contextlib.contextmanager
def write_prefix(prefix: str) -> Iterator[str]:
  """``with write_prefix(p) as staging:`` write a checkpoint at ``staging``.

  When the block ends without an error the staged files replace ``p``'s.
  """
  prefix = os.path.abspath(prefix)
  recover(prefix)
  stage_dir = _tmp_name(prefix)
  os.makedirs(stage_dir)
  staging = os.path.join(stage_dir, os.path.basename(prefix))
  try:
    yield staging
    staged = prefix_files(staging)
    if not staged or not staged[-1].endswith(".index"):
      raise OutputError(f"the checkpoint staged for {prefix} has no .index file.")
    for name in staged:
      with open(name, "rb") as f:
        os.fsync(f.fileno())
    backup = _tmp_name(prefix, "bak")
    old = prefix_files(prefix)
    if old:
      os.makedirs(backup)
      for name in [old[-1]] + old[:-1] if old[-1].endswith(".index") else old:
        os.rename(name, os.path.join(backup, os.path.basename(name)))
      _fsync_dir(os.path.dirname(prefix))
    for name in staged:  # data first, index last
      os.rename(name, os.path.dirname(prefix) + "/" + os.path.basename(prefix)
                + name[len(staging):])
    _fsync_dir(os.path.dirname(prefix))
    shutil.rmtree(backup, ignore_errors=True)
  finally:
    shutil.rmtree(stage_dir, ignore_errors=True)


def _alive(pid: int) -> bool:
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _leftovers(path: str, kind: str) -> List[str]:
  head, tail = os.path.split(os.path.abspath(path))
  found = []
  for name in glob.glob(os.path.join(glob.escape(head),
                                     f".{glob.escape(tail)}.{kind}-*-*")):
    pid = os.path.basename(name)[len(tail) + 2 + len(kind) + 1:].split("-")[0]
    if pid.isdigit() and not _alive(int(pid)):
      found.append(name)
  return found


def recover(path: str) -> None:
  """Puts back an old output moved aside by a killed ``write_dir``/``write_prefix``.

  ``path`` is a directory or a checkpoint prefix. Only acts when ``path`` is
  missing its output (no directory / no ``.index``) and a complete backup of
  a dead process exists; then removes the dead processes' leftovers.
  """
  path = os.path.abspath(path)
  newest = lambda names: sorted(names, key=os.path.getmtime, reverse=True)
  for backup in newest(_leftovers(path, "bak")):  # write_prefix's
    staged = os.path.join(backup, os.path.basename(path))
    if os.path.exists(staged + ".index") and not os.path.exists(path + ".index"):
      # Killed mid-swap: the old data files not yet moved are still in
      # place, the moved ones (and the old index) are in the backup; new
      # data files of the same names are overwritten. Data first, index last.
      for name in prefix_files(staged):
        os.rename(name, path + name[len(staged):])
      break
  for old in newest(_leftovers(path, "old")):  # write_dir's, without renameat2
    if not os.path.exists(path):
      os.rename(old, path)
      break
  clean(path)


def clean(path: str) -> None:
  """Deletes the temporary siblings of ``path`` left by processes that died."""
  for name in (_leftovers(path, "tmp") + _leftovers(path, "old")
               + _leftovers(path, "bak")):
    if os.path.isdir(name):
      shutil.rmtree(name, ignore_errors=True)
    else:
      with contextlib.suppress(OSError):
        os.remove(name)


def _real(path: str) -> str:
  return os.path.realpath(os.path.abspath(path))


def _inside(child: str, parent: str) -> bool:
  return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_no_overlap(flag: str, output: str, inputs: Sequence[tuple],
                     prefix: bool = False) -> None:
  """OutputError if ``output`` equals, contains or lies inside an input.

  ``inputs`` are ``(description, path)``; a path is a file, a directory or
  (``prefix``-style, for checkpoints) a checkpoint prefix, compared by its
  files. Called before anything is written.
  """
  out = _real(output)
  out_paths = [out] + ([out + ".index", out + ".data-"] if prefix else [])
  for what, path in inputs:
    if not path:
      continue
    src = _real(path)
    srcs = [src] + [_real(p) for p in prefix_files(path)]
    clash = any(o == s or _inside(s, o) or (_inside(o, s) and os.path.isdir(s))
                for o in out_paths for s in srcs)
    clash = clash or (prefix and out == src)
    if clash:
      raise OutputError(
          f"{flag} {output} would overwrite {what} {path} (the output equals, "
          f"contains or lies inside it); nothing was written. Fix: pass another "
          f"{flag}, outside the input.")


def check_writable(flag: str, path: str, *, directory: bool = False) -> None:
  """OutputError unless ``path`` (a file/prefix, or a directory) can be written.

  Checks before any work: an existing non-directory where a directory goes
  (and the reverse), and a probe file in the parent, which also catches a
  read-only mount (``os.access`` alone does not: root passes it).
  """
  path = os.path.abspath(path)
  if directory and os.path.exists(path) and not os.path.isdir(path):
    raise OutputError(f"{flag} {path} is a file; the output is a directory. Fix: "
                      f"pass a directory path for {flag}.")
  if not directory and os.path.isdir(path):
    raise OutputError(f"{flag} {path} is a directory; the output is a checkpoint "
                      f"prefix (<dir>/<name>, written as <name>.index and "
                      f"<name>.data-*). Fix: pass e.g. {os.path.join(path, 'ckpt')}.")
  try:
    probe_write(_tmp_name(path, "tmp"))
  except OSError as e:
    raise io_error(e, flag, path) from None


def probe_write(probe: str) -> None:
  """Writes and removes file ``probe``, making its directory; OSError if it cannot.

  A real write, not ``os.access``: root passes ``os.access`` on a read-only
  mount or an immutable directory.
  """
  os.makedirs(os.path.dirname(probe), exist_ok=True)
  with open(probe, "w") as f:
    f.write("ok")
  os.remove(probe)
