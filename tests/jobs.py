"""What the job tests share: the tiny config and its training run, the CLI
in-process, its one-line errors, checkpoints."""

import os

import numpy as np
import tensorflow as tf
import yaml

from tpu_embed_ext.cli import main as cli
from tpu_embed_ext.host import atomic
from tpu_embed_ext import job as train_lib

TINY_CONFIG = "configs/tiny.yaml"


def train_tiny(model_dir, data_dir, steps, config=TINY_CONFIG, verbose=2, **overrides):
  """(metrics, log text) of the job trained in-process to ``steps`` on the
  session's tiny dataset; ``overrides``: the config's train: fields."""
  lines = []
  metrics = train_lib.train(config, model_dir=str(model_dir), steps=steps, tpu="none",
                            verbose=verbose, log=lines.append,
                            overrides={"data_dir": data_dir, **overrides})
  return metrics, "\n".join(lines)


def write_tiny_config(tmp_path, data_dir, edit=None, name="c.yaml", **train):
  """tiny.yaml on ``data_dir``, checkpointing every 5 steps, its train: section
  updated by ``train`` and the whole config by ``edit(config)``; its path."""
  with open(TINY_CONFIG) as f:
    config = yaml.safe_load(f)
  config["train"].update({"data_dir": data_dir, "steps_per_checkpoint": 5, **train})
  if edit:
    edit(config)
  path = tmp_path / name
  path.write_text(yaml.safe_dump(config))
  return str(path)

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
