"""TPU programs, unmodified, on the emulated TPU: the runner and the pytest plugin.

``tests/tpu_programs/mid_level.py`` is written against TensorFlow's API only
(the TPU embedding guide's mid-level loop). It trains in a subprocess under
``python -m tpu_embed_ext emulate --replicas R`` (R = 1, 2, 8) and under
``pytest --emulate-tpu=2``; its checkpoint is restored here, outside any
emulation, into TensorFlow's ``TPUEmbeddingForServing``, and its tables must
equal (a) ``CPUEmbedding`` trained on the same global batches on one device
and (b) the TPU's math written below in numpy: each id's gradient summed over
every replica and every occurrence, one optimizer update per step.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests import references

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(ROOT, "tests", "tpu_programs")
STEPS = 4
BATCH = 16
VIDEO, USER = (16, 4), (12, 2)  # (rows, dim)
SGD_LR, ADAGRAD_LR, ADAGRAD_INIT = 0.05, 0.1, 0.1
# Far above a run's minute even on a loaded machine; a hang still ends.
SUBPROCESS_LIMIT = 900


# --- the program's inputs, as its docstring states them -------------------------

def _examples(step):
  """Per example: (watched ids, favorited ids, friend id, label)."""
  return [([(3 * step + 5 * e + 2 * j) % VIDEO[0] for j in range(1 + (step + e) % 3)],
           [(7 * e + step + 4 * j) % VIDEO[0] for j in range((step * e) % 3)],
           (e + 2 * step) % USER[0], (e % 4 - 1.5) / 2) for e in range(BATCH)]


def _initial():
  return {"video": 0.01 * (np.arange(VIDEO[0])[:, None] + 1)
                   - 0.02 * np.arange(VIDEO[1])[None, :],
          "user": 0.03 * (np.arange(USER[0])[:, None] % 5)
                  + 0.01 * np.arange(USER[1])[None, :]}


# --- (b) the TPU's math in numpy ---------------------------------------------------

def numpy_reference(steps=STEPS):
  """Tables after ``steps``: loss 0.5 * sum((activation - y)^2) per feature.

  The video table's combiner is TableConfig's default, mean, for both of its
  features (an example without ids gives 0 and no gradient); friend: one id. Every id's gradient is summed over the whole
  global batch (all replicas), then video takes one Adagrad step
  (a += g^2; w -= lr g / sqrt(a)) and user one SGD step (w -= lr g).
  """
  w = {name: table.astype(np.float64) for name, table in _initial().items()}
  accumulator = np.full(VIDEO, ADAGRAD_INIT)
  for step in range(steps):
    g = {name: np.zeros_like(table) for name, table in w.items()}
    for watched, favorited, friend, y in _examples(step):
      g_watched = w["video"][watched].mean(axis=0) - y
      for i in watched:
        g["video"][i] += g_watched / len(watched)
      if favorited:
        g_favorited = w["video"][favorited].mean(axis=0) - y
        for i in favorited:
          g["video"][i] += g_favorited / len(favorited)
      g["user"][friend] += w["user"][friend] - y
    # Every row at once: a zero gradient leaves an Adagrad or SGD row as it is.
    w["video"], slots = references.update(
        "adagrad", w["video"], {"accumulators": accumulator}, g["video"], ADAGRAD_LR)
    accumulator = slots["accumulators"]
    w["user"], _ = references.update("sgd", w["user"], {}, g["user"], SGD_LR)
  return w, accumulator


def test_numpy_reference_moves_every_kind_of_row():
  """The reference is not trivial: shared, mean-combined and dense rows move."""
  w, _ = numpy_reference()
  assert not np.allclose(w["video"], _initial()["video"])
  assert not np.allclose(w["user"], _initial()["user"])


# --- (a) CPUEmbedding on the same global batches ------------------------------------

def _feature_config():
  emb = tf.tpu.experimental.embedding
  initial = _initial()
  video = emb.TableConfig(
      vocabulary_size=VIDEO[0], dim=VIDEO[1], name="video",
      initializer=tf.constant_initializer(initial["video"]),
      optimizer=emb.Adagrad(learning_rate=ADAGRAD_LR,
                            initial_accumulator_value=ADAGRAD_INIT))
  user = emb.TableConfig(vocabulary_size=USER[0], dim=USER[1], name="user",
                         initializer=tf.constant_initializer(initial["user"]))
  return {"watched": emb.FeatureConfig(table=video, name="watched"),
          "favorited": emb.FeatureConfig(table=video, name="favorited"),
          "friend": emb.FeatureConfig(table=user, name="friend")}


def _tf_batch(step):
  examples = _examples(step)
  favorited = [(e, j, i) for e, (_, ids, _, _) in enumerate(examples)
               for j, i in enumerate(ids)]
  features = {
      "watched": tf.ragged.constant([x[0] for x in examples], dtype=tf.int64),
      "favorited": tf.sparse.SparseTensor(
          tf.constant([[e, j] for e, j, _ in favorited], tf.int64,
                      shape=[len(favorited), 2]),
          tf.constant([i for _, _, i in favorited], tf.int64), [BATCH, 2]),
      "friend": tf.constant([x[2] for x in examples], tf.int64)}
  return features, tf.constant([x[3] for x in examples], tf.float32)


@pytest.fixture(scope="module")
def cpu_embedding_tables():
  embedding = tee.CPUEmbedding(_feature_config(),
                               tf.tpu.experimental.embedding.SGD(SGD_LR))
  for step in range(STEPS):
    features, labels = _tf_batch(step)
    embedding.enqueue(features, training=True)
    with tf.GradientTape() as tape:
      activations = embedding.dequeue()
      tape.watch(activations)
      loss = sum(0.5 * tf.reduce_sum(tf.square(a - labels[:, None]))
                 for a in tf.nest.flatten(activations))
    embedding.apply_gradients(tape.gradient(loss, activations))
  return {name: v["parameters"].numpy() for name, v in embedding.variables.items()}


def test_cpu_embedding_matches_the_numpy_reference(cpu_embedding_tables):
  w, _ = numpy_reference()
  for name in w:
    np.testing.assert_allclose(cpu_embedding_tables[name], w[name], rtol=1e-5,
                               atol=1e-6, err_msg=name)


# --- the program, run ---------------------------------------------------------------

def _served_tables(checkpoint):
  """The checkpoint restored into TensorFlow's TPUEmbeddingForServing (no TPU)."""
  serving = tf.tpu.experimental.embedding.TPUEmbeddingForServing(
      _feature_config(), tf.tpu.experimental.embedding.SGD(SGD_LR))
  tf.train.Checkpoint(embedding=serving).restore(checkpoint).expect_partial()
  return {table.name: variable.numpy()
          for table, variable in serving.embedding_tables.items()}


def _check_tables(model_dir, cpu_embedding_tables):
  checkpoint = tf.train.latest_checkpoint(model_dir)
  assert checkpoint, f"no checkpoint in {model_dir}"
  tables = _served_tables(checkpoint)
  w, accumulator = numpy_reference()
  for name in w:
    np.testing.assert_allclose(tables[name], cpu_embedding_tables[name],
                               rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(tables[name], w[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)
  np.testing.assert_allclose(
      tf.train.load_checkpoint(checkpoint).get_tensor(
          "embedding/video.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"),
      accumulator, rtol=1e-5)


def _python(args, env=None):
  out = subprocess.run([sys.executable] + args, cwd=ROOT, capture_output=True,
                       text=True, timeout=SUBPROCESS_LIMIT, check=False,
                       env=dict(os.environ, **(env or {})))
  return out


@pytest.mark.parametrize("replicas", [1, 2, 8])
def test_program_trains_under_the_runner(replicas, tmp_path, cpu_embedding_tables):
  out = _python(["-m", "tpu_embed_ext", "emulate", "--replicas", str(replicas),
              os.path.join(PROGRAMS, "mid_level.py"), "--tpu", "my-tpu",
              "--model_dir", str(tmp_path), f"--steps={STEPS}"])
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"saved {tmp_path}" in out.stdout
  _check_tables(str(tmp_path), cpu_embedding_tables)


def test_program_trains_under_the_pytest_plugin(tmp_path, cpu_embedding_tables):
  out = _python(["-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
              "--emulate-tpu=2", os.path.join(PROGRAMS, "check_under_plugin.py")],
             env={"TPU_PROGRAM_OUT": str(tmp_path)})
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
  assert "3 passed" in out.stdout
  _check_tables(str(tmp_path), cpu_embedding_tables)


_EXITING_SCRIPT = """
import atexit, sys, threading, time
import tensorflow as tf
out = sys.argv[1]
unclosed = open(out + "/unclosed.txt", "w")
unclosed.write("written, never closed\\n")
gfile = tf.io.gfile.GFile(out + "/gfile.txt", "w")
gfile.write("gfile, never closed\\n")
writer = tf.summary.create_file_writer(out + "/logs", flush_millis=10 ** 9)
with writer.as_default():
  tf.summary.scalar("loss", 0.25, step=7)
atexit.register(lambda: open(out + "/atexit.txt", "w").write("atexit ran\\n"))
def late():
  time.sleep(1)
  open(out + "/thread.txt", "w").write("thread finished\\n")
threading.Thread(target=late).start()
print("strategy", type(tf.distribute.TPUStrategy()).__name__, flush=True)
sys.exit(3)
"""


def test_tpu_embed_emulate_exits_with_the_scripts_status_and_outputs(tmp_path):
  """The exit (Python's own) keeps what a script can observe: files, threads, atexit."""
  script = tmp_path / "exiting.py"
  script.write_text(_EXITING_SCRIPT)
  tpu_embed = os.path.join(os.path.dirname(sys.executable), "tpu-embed")
  out = subprocess.run([tpu_embed, "emulate", "--replicas", "2", str(script),
                        str(tmp_path)], capture_output=True, text=True,
                       timeout=SUBPROCESS_LIMIT, check=False)
  assert out.returncode == 3, out.stderr[-3000:]
  assert out.stdout == "strategy EmulatedTPUStrategy\n"
  assert (tmp_path / "unclosed.txt").read_text() == "written, never closed\n"
  assert (tmp_path / "gfile.txt").read_text() == "gfile, never closed\n"
  assert (tmp_path / "atexit.txt").read_text() == "atexit ran\n"
  assert (tmp_path / "thread.txt").read_text() == "thread finished\n"
  events = tf.io.gfile.glob(str(tmp_path / "logs" / "events.out.tfevents.*"))
  values = [(e.step, v.tag, tf.make_ndarray(v.tensor).item())
            for path in events for e in tf.compat.v1.train.summary_iterator(path)
            for v in e.summary.value]
  assert values == [(7, "loss", 0.25)]
