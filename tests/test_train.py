"""The main job on the tiny dataset: train, resume, evaluate, export."""

import csv
import glob
import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf

from tests import jobs
from tpu_embed_ext import job as train_lib
from tpu_embed_ext.data import pipeline
from tpu_embed_ext.spec import EmbeddingSpec

CONFIG = jobs.TINY_CONFIG


def _train(model_dir, data_dir, steps):
  """The job's metrics (quiet: verbose=0)."""
  return jobs.train_tiny(model_dir, data_dir, steps, verbose=0)[0]


def _tables(model_dir, data_dir):
  """Every table and slot of the latest checkpoint, by checkpoint key."""
  latest = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
  return {k: tf.train.load_variable(latest, k) for k, _ in tf.train.list_variables(latest)
          if "/embedding/embedding/" in k}


def _cosine_with_warmup(t, init=0.0, target=0.05, warmup=10, decay=50, alpha=0.1):
  """Keras CosineDecay with warm-up (configs/tiny.yaml's warm_cosine)."""
  if t < warmup:
    return init + (target - init) * t / warmup
  fraction = min(t - warmup, decay) / decay
  return target * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * fraction)) + alpha)


def _scalars(log_dir):
  """``{tag: {step: value}}`` from the TensorBoard event files."""
  out = {}
  for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        out.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
  return out


def test_train_writes_metrics_curve_history_and_tensorboard(tmp_path, data_dir):
  metrics = _train(tmp_path, data_dir, 60)
  saved = json.loads((tmp_path / "metrics.json").read_text())
  assert saved == pytest.approx(metrics)
  assert metrics["steps"] == 60 and metrics["table_step"] == 60
  assert metrics["where"] == "CPU emulation (CPUEmbedding)"
  assert metrics["eval_examples"] == 1000
  assert 0.5 < metrics["planted_auc"] <= 1.0
  assert 0.0 < metrics["eval_auc"] <= 1.0 and metrics["eval_loss"] > 0
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("-60")

  # history.csv: one row per 20-step block, every column filled.
  with open(tmp_path / "history.csv") as f:
    rows = list(csv.DictReader(f))
  assert list(rows[0]) == ["step", "loss", "auc", "eval_loss", "eval_auc"]
  assert [int(r["step"]) for r in rows] == [20, 40, 60]
  assert all(v not in ("", "nan", None) and math.isfinite(float(v))
             for r in rows for v in r.values())
  # The held-out columns are the job's own evaluation (the last one is metrics.json's).
  assert float(rows[-1]["eval_auc"]) == metrics["eval_auc"]
  assert float(rows[-1]["eval_loss"]) == metrics["eval_loss"]

  # learning_curve.png: two panels (loss, AUC), training and held-out in each.
  import matplotlib.image
  image = matplotlib.image.imread(tmp_path / "learning_curve.png")
  assert image.shape[:2] == (350, 1000)

  # TensorBoard: every dynamic learning-rate tag per step, beside the dense rate.
  # Update t applies the rate at table step t - 1.
  scalars = _scalars(str(tmp_path / "logs"))
  steps = list(range(1, 61))
  assert sorted(scalars["learning_rate/tag_0"]) == steps
  np.testing.assert_allclose(
      [scalars["learning_rate/tag_0"][t] for t in steps],
      [_cosine_with_warmup(t - 1) for t in steps], rtol=1e-6, atol=1e-9)
  b1, b2 = 0.9, 0.999  # t_c9: Adam(0.002, bias_correction=True), tag 1.
  np.testing.assert_allclose(
      [scalars["learning_rate/tag_1"][t] for t in steps],
      [0.002 * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) for t in steps], rtol=1e-6)
  assert [scalars["learning_rate/dense"][t] for t in steps] == pytest.approx([0.002] * 60)
  assert sorted(k for k in scalars if k.startswith("learning_rate/")) == [
      "learning_rate/dense", "learning_rate/tag_0", "learning_rate/tag_1"]
  for key in ("train/loss", "train/auc", "held_out/loss", "held_out/auc"):
    assert sorted(scalars[key]) == [20, 40, 60], key
  assert scalars["held_out/auc"][60] == pytest.approx(metrics["eval_auc"])

  # Beside the per-block scalars, every step's own training loss. Its mean
  # over a block is that block's train/loss (Keras's mean over the block).
  per_step = scalars["train/loss_per_step"]
  assert sorted(per_step) == steps
  for end in (20, 40, 60):
    block = [per_step[t] for t in range(end - 19, end + 1)]
    assert np.mean(block) == pytest.approx(scalars["train/loss"][end], rel=1e-5)
    assert np.std(block) > 0  # each step its own value, not the running mean
  # The loss of step 21 (41) is the model of ckpt-20 (ckpt-40) on the 21st
  # (41st) batch of the run: binary cross-entropy from its logits, in numpy.
  spec = EmbeddingSpec.from_file(CONFIG)
  cfg = train_lib.TrainConfig.from_dict({**spec.train, "data_dir": data_dir})
  for done in (20, 40):
    model = train_lib.build_model(spec, cfg)
    features, labels = next(iter(train_lib.input_datasets(spec, cfg, skip_batches=done)[0]))
    model(features)
    tf.train.Checkpoint(model=model).restore(
        str(tmp_path / "checkpoints" / f"ckpt-{done}")).expect_partial()
    x = model(features, training=False).numpy().ravel().astype(np.float64)
    y = labels.numpy().ravel().astype(np.float64)
    bce = np.mean(np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x))))
    assert per_step[done + 1] == pytest.approx(bce, rel=1e-5), done


def test_export_serves_the_trained_model(tmp_path, data_dir):
  _train(tmp_path, data_dir, 20)
  # export reads no data: its signature comes from the spec and the train:
  # section, so an empty data_dir stays empty (no dataset is built).
  no_data = tmp_path / "no_data"
  no_data.mkdir()
  out = train_lib.export(CONFIG, model_dir=str(tmp_path), out=str(tmp_path / "serving"),
                         overrides={"data_dir": str(no_data)})
  assert not list(no_data.iterdir())
  serve = tf.saved_model.load(out).signatures["serving_default"]
  assert set(serve.structured_input_signature[1]) == {
      "dense", *(f"c{i}" for i in range(26))}

  # The trained model, restored independently, on one held-out batch.
  spec = EmbeddingSpec.from_file(CONFIG)
  cfg = train_lib.TrainConfig.from_dict({**spec.train, "data_dir": data_dir})
  model = train_lib.build_model(spec, cfg)
  features, _ = next(iter(train_lib.input_datasets(spec, cfg)[1]))
  model(features)
  tf.train.Checkpoint(model=model).restore(
      tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))).expect_partial()
  want = model.predict(features, verbose=0)

  inputs = {"dense": features["dense"]}
  for name, ids in features["categorical"].items():
    inputs[name] = (ids[:, None] if isinstance(ids, tf.Tensor)
                    else ids.to_tensor(default_value=-1))
  got = serve(**inputs)["outputs"].numpy()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  # Out-of-vocabulary ids are refused, naming the feature (single- and multi-hot).
  for name, vocabulary, padding in (("c5", 24, ""), ("c21", 18, " or -1 (padding)")):
    bad = dict(inputs)
    ids = inputs[name].numpy().copy()
    ids[3, 0] = vocabulary
    bad[name] = tf.constant(ids)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
      serve(**bad)
    assert (f"feature {name}: ids must be in [0, {vocabulary}){padding}; "
            "out-of-vocabulary ids are refused. Fix: map unknown ids to a row of the "
            "vocabulary before serving. First bad ids:") in info.value.message, info.value.message
  single = dict(inputs, c5=tf.fill(tf.shape(inputs["c5"]), tf.constant(-1, tf.int64)))
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature c5: "):
    serve(**single)  # -1 pads multi-hot rows only.


def test_auc_is_exact_against_pairwise_counting():
  rng = np.random.RandomState(0)
  labels = rng.randint(0, 2, 300)
  scores = np.round(rng.normal(size=300), 1)  # Many ties.
  pos, neg = scores[labels == 1], scores[labels == 0]
  pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
  assert pipeline.auc(labels, scores) == pytest.approx(pairs / (len(pos) * len(neg)),
                                                       abs=1e-12)


def _movielens_examples(builder, split, **kwargs):
  """Mock movielens/100k-ratings examples with real-looking ratings 1..5."""
  rng = np.random.RandomState(0)
  n = 400
  genres = [list(rng.randint(0, 21, rng.randint(1, 4))) for _ in range(n)]
  return tf.data.Dataset.from_tensor_slices({
      "user_id": [str(i) for i in rng.randint(1, 944, n)],
      "movie_id": [str(i) for i in rng.randint(1, 1683, n)],
      "movie_genres": tf.ragged.constant(genres, tf.int64),
      "user_occupation_label": rng.randint(0, 22, n),
      "bucketized_user_age": rng.choice([18.0, 25.0, 35.0, 45.0], n).astype(np.float32),
      "user_gender": rng.randint(0, 2, n).astype(bool),
      "user_rating": rng.randint(1, 6, n).astype(np.float32)})


def test_movielens_config_trains_on_mock_data(tmp_path):
  import tensorflow_datasets as tfds
  with tfds.testing.mock_data(as_dataset_fn=_movielens_examples):
    metrics = train_lib.train("configs/movielens.yaml", model_dir=str(tmp_path),
                              steps=20, tpu="none", verbose=0,
                              overrides={"steps_per_checkpoint": 10, "batch_size": 16})
  assert metrics["table_step"] == 20
  assert "planted_auc" not in metrics
  assert metrics["eval_examples"] == 400  # The mock serves the same rows per split.
  assert 0.0 < metrics["eval_auc"] < 1.0


# The job, SIGKILLed by itself right after its first checkpoint is saved: the
# kill lands at the same point however loaded the machine is (an outside
# process polling for the checkpoint could be descheduled past the end of
# the run).
_KILLED_AFTER_FIRST_CHECKPOINT = """
import os, runpy, signal, sys
import tensorflow as tf
save = tf.train.CheckpointManager.save
def save_then_die(self, *args, **kwargs):
  save(self, *args, **kwargs)
  os.kill(os.getpid(), signal.SIGKILL)
tf.train.CheckpointManager.save = save_then_die
sys.argv = ["tpu_embed_ext"] + sys.argv[1:]
runpy.run_module("tpu_embed_ext", run_name="__main__", alter_sys=True)
"""


def test_sigkill_mid_run_then_restart_equals_an_uninterrupted_run(tmp_path):
  import subprocess
  import sys
  # The session's tfds data dir (tests/conftest.py): the tiny dataset is built once.
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}

  def args(model_dir):
    return ["train", "--config", CONFIG, "--steps", "60", "--model_dir", str(model_dir),
            "--tpu", "none"]

  subprocess.run([sys.executable, "-m", "tpu_embed_ext", *args(tmp_path / "straight")],
                 env=env, check=True, capture_output=True, timeout=900)
  killed = tmp_path / "killed"
  proc = subprocess.Popen([sys.executable, "-c", _KILLED_AFTER_FIRST_CHECKPOINT,
                           *args(killed)], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
  _, stderr = proc.communicate(timeout=900)
  assert proc.returncode == -9, stderr[-2000:]
  interrupted_at = int(tf.train.latest_checkpoint(str(killed / "checkpoints")).rsplit("-", 1)[1])
  assert interrupted_at == 20
  # The killed run's lock file is still there, naming a dead process: no obstacle.
  assert (killed / ".lock").read_text() == str(proc.pid)
  out = subprocess.run([sys.executable, "-m", "tpu_embed_ext", *args(killed)], env=env,
                       check=True, capture_output=True, text=True, timeout=900)
  assert f"(step {interrupted_at})" in out.stdout + out.stderr
  assert json.loads((killed / "metrics.json").read_text())["steps"] == 60
  history = (killed / "history.csv").read_text().splitlines()[1:]
  assert [int(r.split(",")[0]) for r in history] == [20, 40, 60]
  straight, resumed = _tables(str(tmp_path / "straight"), None), _tables(str(killed), None)
  assert straight.keys() == resumed.keys() and straight
  for key in straight:
    np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)
