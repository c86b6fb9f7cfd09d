"""The main job on the tiny dataset: train, resume, evaluate, export."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tpu_embed_ext import train as train_lib
from tpu_embed_ext.data import pipeline

CONFIG = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def _run(model_dir, data_dir, steps):
  return train_lib.train(CONFIG, model_dir=str(model_dir), steps=steps, tpu="none",
                         overrides={"data_dir": data_dir}, verbose=0)


def _tables(model_dir, data_dir):
  """Every table and slot of the latest checkpoint, by checkpoint key."""
  latest = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
  return {k: tf.train.load_variable(latest, k) for k, _ in tf.train.list_variables(latest)
          if "/embedding/embedding/" in k}


def test_train_writes_metrics_curve_and_checkpoints(tmp_path, data_dir):
  metrics = _run(tmp_path, data_dir, 60)
  saved = json.loads((tmp_path / "metrics.json").read_text())
  assert saved == pytest.approx(metrics)
  assert metrics["steps"] == 60 and metrics["table_step"] == 60
  assert metrics["where"] == "CPU emulation (CPUEmbedding)"
  assert metrics["eval_examples"] == 1000
  assert 0.5 < metrics["planted_auc"] <= 1.0
  assert 0.0 < metrics["eval_auc"] <= 1.0 and metrics["eval_loss"] > 0
  assert (tmp_path / "learning_curve.png").stat().st_size > 1000
  rows = (tmp_path / "history.csv").read_text().strip().splitlines()
  assert len(rows) == 1 + 3  # Header + one row per 20-step block.
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("-60")


def test_resumed_run_equals_uninterrupted_run(tmp_path, data_dir):
  _run(tmp_path / "straight", data_dir, 60)
  _run(tmp_path / "resumed", data_dir, 20)      # "Crashes" after 20 steps...
  metrics = _run(tmp_path / "resumed", data_dir, 60)  # ...and is started again.
  assert metrics["resumed_from_step"] == 20
  straight = _tables(str(tmp_path / "straight"), data_dir)
  resumed = _tables(str(tmp_path / "resumed"), data_dir)
  # 26 tables; slots: 12 Adagrad x 1, Adam x 2, 7 SGD x 0, 6 FTRL x 2.
  assert len(straight) == 26 + 12 + 2 + 12
  assert straight.keys() == resumed.keys()
  for key in straight:
    np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)


def test_export_serves_the_trained_model(tmp_path, data_dir):
  _run(tmp_path, data_dir, 20)
  out = train_lib.export(CONFIG, model_dir=str(tmp_path), out=str(tmp_path / "serving"),
                         overrides={"data_dir": data_dir})
  serve = tf.saved_model.load(out).signatures["serving_default"]
  assert set(serve.structured_input_signature[1]) == {
      "dense", *(f"c{i}" for i in range(26))}

  # The trained model, restored independently, on one held-out batch.
  spec = train_lib.EmbeddingSpec.from_file(CONFIG)
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


def test_sigkill_mid_run_then_restart_equals_an_uninterrupted_run(tmp_path):
  import signal
  import subprocess
  import sys
  import time
  env = {**os.environ, "TFDS_DATA_DIR": str(tmp_path / "tfds"), "TF_CPP_MIN_LOG_LEVEL": "3"}

  def command(model_dir):
    return [sys.executable, "-m", "tpu_embed_ext", "train", "--config", CONFIG,
            "--steps", "120", "--model_dir", str(model_dir), "--tpu", "none"]

  subprocess.run(command(tmp_path / "straight"), env=env, check=True,
                 capture_output=True)
  killed = tmp_path / "killed"
  proc = subprocess.Popen(command(killed), env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  state = killed / "checkpoints" / "checkpoint"
  deadline = time.time() + 300
  while not state.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)  # Right after the first checkpoint.
  proc.wait()
  interrupted_at = int(tf.train.latest_checkpoint(str(killed / "checkpoints")).rsplit("-", 1)[1])
  assert interrupted_at < 120, "the run finished before it could be killed"
  out = subprocess.run(command(killed), env=env, check=True, capture_output=True,
                       text=True)
  assert f"(step {interrupted_at})" in out.stdout + out.stderr
  straight, resumed = _tables(str(tmp_path / "straight"), None), _tables(str(killed), None)
  assert straight.keys() == resumed.keys() and straight
  for key in straight:
    np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)
