"""A checkpoint read once: does every tensor read back, which hold NaN or Inf.

``model_dir.resume_point`` reads every tensor of a checkpoint before trusting
it (TensorFlow checks each tensor's CRC as it reads), so the non-finite
values of each floating tensor are counted in that same pass, one tensor in
memory at a time. The result is remembered per checkpoint (its files'
inode, size and modification time), so the checks before a restore
(``check_finite``, called by the engines' and ``model_dir``'s
``check_checkpoint``) read nothing again. A NaN or Inf in a table or slot
means training diverged before the save: restoring it would train on
garbage or, behind a ReLU, serve finite garbage.
"""

from __future__ import annotations

import glob
import os
from typing import Dict, Mapping, NamedTuple, Optional, Tuple

import numpy as np
import tensorflow as tf

from tpu_embed_ext import errors

__all__ = ["CheckpointError", "Scan", "scan", "check_finite"]

_CHUNK = 1 << 24  # elements counted at a time: bounds the mask's memory
_MEMO_SIZE = 8


class CheckpointError(errors.Error, ValueError):
  """A checkpoint that cannot be read, or does not fit the model."""


class Scan(NamedTuple):
  error: Optional[str]
  """None if every tensor reads back, else why not (first line)."""
  nonfinite: Mapping[str, Tuple[int, int]]
  """``{key: (non-finite values, values)}`` of each floating tensor with any."""


_memo: Dict[str, Tuple[tuple, Scan]] = {}


def _identity(prefix: str) -> tuple:
  files = sorted([prefix + ".index"] + glob.glob(glob.escape(prefix) + ".data-*"))
  out = []
  for name in files:
    try:
      s = os.stat(name)
    except OSError:
      continue
    out.append((name, s.st_ino, s.st_size, s.st_mtime_ns))
  return tuple(out)


def _count_nonfinite(value: np.ndarray) -> int:
  flat = value.reshape(-1)
  if flat.dtype.kind != "f":
    flat = flat.astype(np.float32)  # bfloat16 (ml_dtypes) has kind "V"
  return sum(int(np.count_nonzero(~np.isfinite(flat[i:i + _CHUNK])))
             for i in range(0, flat.size, _CHUNK))


def scan(prefix: str) -> Scan:
  """Reads every tensor of checkpoint ``prefix`` once (or recalls the result)."""
  identity = _identity(prefix)
  known = _memo.get(prefix)
  if known is not None and known[0] == identity:
    return known[1]
  nonfinite: Dict[str, Tuple[int, int]] = {}
  try:
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    for name in sorted(reader.get_variable_to_shape_map()):
      value = reader.get_tensor(name)
      if dtypes[name].is_floating:
        value = np.asarray(value)
        bad = _count_nonfinite(value)
        if bad:
          nonfinite[name] = (bad, int(value.size))
      del value
    result = Scan(None, nonfinite)
  except (tf.errors.OpError, ValueError, IndexError) as e:
    # IndexError: a truncated .data file ("Read less bytes than requested").
    result = Scan((getattr(e, "message", None) or str(e) or type(e).__name__
                   ).strip().splitlines()[0], {})
  if len(_memo) >= _MEMO_SIZE:
    _memo.pop(next(iter(_memo)))
  _memo[prefix] = (identity, result)
  return result


def check_finite(path: str, described: Mapping[str, str]) -> None:
  """CheckpointError if a tensor of ``described`` (``{key: what it is}``, e.g.
  "table 'users' (slot 'accumulators')") holds NaN or Inf in checkpoint
  ``path``; names the first one in key order and how many others."""
  nonfinite = scan(path).nonfinite
  found = sorted(k for k in described if k in nonfinite)
  if not found:
    return
  count, size = nonfinite[found[0]]
  others = (f" (and {len(found) - 1} more variable{'s' if len(found) > 2 else ''})"
            if len(found) > 1 else "")
  raise CheckpointError(
      f"{described[found[0]]}: checkpoint {path} holds {count:,} non-finite "
      f"values (NaN or Inf) of {size:,}{others}; training diverged before it "
      "was saved, and restoring it would train or serve garbage. Nothing was "
      f"restored. Fix: resume from an older checkpoint (move {path}.index and "
      f"{os.path.basename(path)}.data-* away), and lower the learning rate.")
