"""What the job tests share: the CLI in-process, its one-line errors, checkpoints."""

import os

import numpy as np
import tensorflow as tf

from tpu_embed_ext.cli import main as cli
from tpu_embed_ext.host import atomic

_SUFFIX = " (--verbose shows the traceback)"


def run_cli(capsys, *args):
  """(exit status, stdout, stderr) of ``python -m tpu_embed_ext args``, in-process."""
  status = cli.main(["tpu_embed_ext", *args])
  out = capsys.readouterr()
  return status, out.out, out.err


def one_line_error(capsys, *args) -> str:
  """The message of the one ``error: ...`` line a failing command prints (exit 2)."""
  status, _, err = run_cli(capsys, *args)
  lines = err.strip().splitlines()
  assert status == 2, err
  assert len(lines) == 1 and lines[0].startswith("error: "), err
  assert lines[0].endswith(_SUFFIX), lines[0]
  return lines[0][len("error: "):-len(_SUFFIX)]


def variables(prefix):
  """Every variable of a checkpoint, by key."""
  return {k: tf.train.load_variable(prefix, k) for k, _ in tf.train.list_variables(prefix)
          if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def checkpoint(model_dir, step):
  return os.path.join(str(model_dir), "checkpoints", f"ckpt-{step}")


def rewrite_checkpoint(prefix, key, fill):
  """Checkpoint ``prefix`` rewritten whole (valid CRCs) with tensor ``key`` filled
  by ``fill`` (e.g. NaN), as a diverged run would have saved it."""
  reader = tf.train.load_checkpoint(prefix)
  names = sorted(reader.get_variable_to_shape_map())
  assert key in names, key
  values = [reader.get_tensor(n) for n in names]
  values[names.index(key)] = np.full_like(values[names.index(key)], fill)
  for name in atomic.prefix_files(prefix):
    os.remove(name)
  tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                    tensors=[tf.constant(v) for v in values])
