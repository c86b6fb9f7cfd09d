"""What the job tests share: the tiny config and its training run, the CLI
in-process, its one-line errors, checkpoints."""

import os

import numpy as np
import tensorflow as tf
import yaml

from tpu_embed_ext.cli import main as cli
from tpu_embed_ext.host import atomic
from tpu_embed_ext import job as train_lib
from tests.builders import checkpoint_values

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


# --- shipped configs on the session's tiny dataset (the emulated-TPU job tests) ---

def scaled_config(tmp_path, data_dir, name, **train):
  """Shipped config ``name`` scaled down to the session's ``synthetic_clicks/tiny``.

  Each table's vocabulary becomes that of the column its feature reads in the
  tiny dataset (every id stays in range); optimizers, overrides, schedules
  and the model are as shipped. ``movielens`` keeps its own dataset (the
  caller mocks tfds). ``train`` updates the config's train: section.
  """
  from tpu_embed_ext.data import synthetic_clicks
  with open(f"configs/{name}.yaml") as f:
    config = yaml.safe_load(f)
  section = config.setdefault("train", {})
  if name != "movielens":
    vocabulary = synthetic_clicks.vocabulary_sizes("tiny")
    columns = section.get("features", {})
    for feature, entry in config["features"].items():
      column = columns.get(feature, {}).get("column", feature)
      config["tables"][entry["table"]]["vocabulary_size"] = vocabulary[column]
    section.update(dataset="synthetic_clicks/tiny", data_dir=data_dir)
  section.update(train)
  path = tmp_path / f"{name}.yaml"
  path.write_text(yaml.safe_dump(config))
  return str(path)


def train_in_process(config, model_dir, tpu, steps, **overrides):
  """(metrics, log lines) of ``train`` run in this process (``--tpu`` ``tpu``)."""
  lines = []
  metrics = train_lib.train(config, model_dir=str(model_dir), steps=steps, tpu=tpu,
                            verbose=0, log=lines.append, overrides=overrides)
  return metrics, lines


def assert_same_checkpoints(got_prefix, want_prefix):
  """Every variable of two checkpoints equal, floats to float32 reordering
  (replicas sum their gradients in another order than one device); returns
  the worst relative difference of the float values."""
  got, want = checkpoint_values(got_prefix), checkpoint_values(want_prefix)
  assert sorted(got) == sorted(want)
  worst = 0.0
  for key, value in want.items():
    if np.asarray(value).dtype.kind == "f":
      np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
      if np.size(value):
        worst = max(worst, float(np.max(np.abs(got[key] - value) /
                                        np.maximum(np.abs(value), 1e-3))))
    else:
      np.testing.assert_array_equal(got[key], value, err_msg=key)
  return worst



def assert_exports_serve_alike(config, data_dir, tpu_dir, cpu_dir):
  """``export`` of two runs' newest checkpoints serves the same predictions on
  one held-out batch (multi-hot ids padded with -1, as the signature takes them)."""
  from tpu_embed_ext.spec import EmbeddingSpec
  served = []
  for model_dir in (tpu_dir, cpu_dir):
    out = train_lib.export(config, model_dir=str(model_dir), out=str(model_dir / "serving"))
    served.append(tf.saved_model.load(out).signatures["serving_default"])
  spec = EmbeddingSpec.from_file(config)
  cfg = train_lib.TrainConfig.from_dict({**spec.train, "data_dir": data_dir})
  features, _ = next(iter(train_lib.input_datasets(spec, cfg)[1]))
  inputs = {"dense": features["dense"]}
  for name, ids in features["categorical"].items():
    inputs[name] = (ids[:, None] if isinstance(ids, tf.Tensor)
                    else ids.to_tensor(default_value=-1))
  got, want = (serve(**inputs)["outputs"].numpy() for serve in served)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
