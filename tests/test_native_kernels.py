"""Native kernels: the fused lookup, the path choice, the build and the fallback.

The lookup is checked against numpy written from the formulas of
docs/semantics.md (section 0.1) and, bit for bit, against the TF-op path.
The engine's own tests run on both paths (conftest.py ``kernel_paths``).
"""

import json
import logging
import os
import re
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.emulation import native
from tpu_embed_ext.emulation.native import loader

api = tf.tpu.experimental.embedding
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, DIM = 30, 5
OP = "TpuEmbedExtLookup"

needs_native = pytest.mark.skipif(
    native.load() is None, reason=f"native kernels unavailable: {native.why_not()}")


def _values(seed=0):
  return np.random.RandomState(seed).uniform(-2, 2, (VOCAB, DIM)).astype(np.float32)


def _kernel_path_engine(kernels, combiner="sum", quantization=None, engine="v1", **feature):
  table = api.TableConfig(VOCAB, DIM, combiner=combiner, name="t",
                          initializer=tf.constant_initializer(_values()),
                          quantization_config=quantization)
  config = {"f": api.FeatureConfig(table, name="f", **feature)}
  return tee.CPUEmbedding(config, api.SGD(0.1), kernels=kernels, engine=engine)


def _lookup(emb, ids, weights=None, function=False):
  def run(ids, weights):
    emb.enqueue({"f": ids}, None if weights is None else {"f": weights},
                training=False)
    return emb.dequeue()["f"]
  if function:
    return tf.function(run)(ids, weights).numpy()
  return run(ids, weights).numpy()


# --- the lookup, every input kind ---------------------------------------------

RAGGED = [[1, 2, 2], [3], [], [4, 5, 1, 1], [29, 0]]
WEIGHTS = [[1., 2., .5], [3.], [], [1., -1., 2., .25], [.5, .5]]


def _combine(values, rows, weights, combiner):
  out = []
  for ids, ws in zip(rows, weights):
    ws = np.asarray(ws, np.float64)
    total = np.zeros(DIM)
    for i, w in zip(ids, ws):
      total += w * values[i].astype(np.float64)
    denom = {"sum": 1.0, "mean": ws.sum(), "sqrtn": np.sqrt((ws ** 2).sum())}[combiner]
    out.append(total / denom if denom else np.zeros(DIM))
  return np.array(out)


@needs_native
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("function", [False, True])
def test_ragged_combiners_match_numpy_and_tf_path_bitwise(combiner, weighted, function):
  ids = tf.ragged.constant(RAGGED, tf.int64)
  w = tf.ragged.constant(WEIGHTS, tf.float32) if weighted else None
  ours = _lookup(_kernel_path_engine("native", combiner), ids, w, function)
  theirs = _lookup(_kernel_path_engine("tf", combiner), ids, w, function)
  weights = WEIGHTS if weighted else [[1.0] * len(r) for r in RAGGED]
  np.testing.assert_allclose(ours, _combine(_values(), RAGGED, weights, combiner),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(ours, theirs)


@needs_native
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_ragged_gains_op_equals_the_tf_ops_bitwise(combiner, weighted):
  """TpuEmbedExtRaggedGains against lookups._combined (value_rowids,
  segment sums, divide_no_nan) and numpy: a row whose weights sum to zero
  (gains 0), empty rows, int32 row splits."""
  from tpu_embed_ext.emulation import lookups
  from tpu_embed_ext.emulation.native import lookup as native_lookup
  rows = [[1, 2, 2], [], [3, 4], [5], [], [6, 7, 8, 9]]
  weights = [[.5, 2., .25], [], [1., -1.], [3.], [], [.1, .2, .3, 1e-3]]
  ids = tf.ragged.constant(rows, tf.int64, row_splits_dtype=tf.int32)
  w = tf.constant([x for r in weights for x in r], tf.float32) if weighted else None
  got_rows, got = native_lookup.ragged_gains(ids.row_splits, w, combiner)
  table = api.TableConfig(VOCAB, DIM, combiner=combiner, name="t")
  want = lookups._combined(api.FeatureConfig(table), ids.values, ids.value_rowids(),
                           w, ids.nrows(), [6])
  np.testing.assert_array_equal(got_rows.numpy(), want.rows.numpy())
  if combiner == "sum" and not weighted:
    assert got is None  # all ones: the kernels read an absent gain as 1
    return
  np.testing.assert_array_equal(got.numpy(), want.gains.numpy())
  flat = [x for r in (weights if weighted else [[1.] * len(r) for r in rows]) for x in r]
  lengths = [len(r) for r in rows]
  expected = []
  for r, n in enumerate(lengths):
    ws = np.array(flat[sum(lengths[:r]):sum(lengths[:r]) + n], np.float64)
    total = {"sum": 1.0, "mean": ws.sum(), "sqrtn": np.sqrt((ws ** 2).sum())}[combiner]
    expected += list(ws / total if total else np.zeros(n))
  np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_segment_gains_op_equals_the_tf_ops_bitwise(combiner, weighted):
  """TpuEmbedExtSegmentGains against lookups._combined (segment sums,
  divide_no_nan) and numpy: unsorted rows (a SparseTensor's), a row whose
  weights sum to zero (gains 0), empty rows, 1,000 random ids."""
  from tpu_embed_ext.emulation import lookups
  from tpu_embed_ext.emulation.native import lookup as native_lookup
  rng = np.random.default_rng(5)
  rows = np.concatenate([[3, 0, 3, 5, 5, 1], rng.integers(6, 40, 1000)])
  weights = np.concatenate([[.5, 2., .25, 1., -1., 3.],
                            rng.normal(size=1000)]).astype(np.float32)
  w = tf.constant(weights) if weighted else None
  got = native_lookup.segment_gains(tf.constant(rows), w, 40, combiner)
  table = api.TableConfig(VOCAB, DIM, combiner=combiner, name="t")
  want = lookups._combined(api.FeatureConfig(table), tf.zeros(len(rows), tf.int64),
                           tf.constant(rows), w, 40, [40])
  if combiner == "sum" and not weighted:
    assert got is None  # all ones: the kernels read an absent gain as 1
    return
  np.testing.assert_array_equal(got.numpy(), want.gains.numpy())
  ws = weights.astype(np.float64) if weighted else np.ones(len(rows))
  per_row = np.zeros(40)
  np.add.at(per_row, rows, ws ** 2 if combiner == "sqrtn" else ws)
  total = {"sum": np.ones(40), "mean": per_row, "sqrtn": np.sqrt(per_row)}[combiner]
  expected = np.where(total[rows] != 0, ws / np.where(total[rows] != 0, total[rows], 1), 0)
  np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-5)


@needs_native
def test_segment_gains_op_refuses_rows_out_of_range():
  ops = native.load()
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"rows\[1\] = 4 is out of range \[0, 4\)"):
    ops.tpu_embed_ext_segment_gains(tf.constant([0, 4], tf.int64), tf.zeros([0]),
                                    tf.constant(4, tf.int64), combiner=1)
  with pytest.raises(tf.errors.InvalidArgumentError, match="weights must be empty or one per id"):
    ops.tpu_embed_ext_segment_gains(tf.constant([0, 1], tf.int64), tf.zeros([3]),
                                    tf.constant(4, tf.int64), combiner=1)


@needs_native
def test_ragged_gains_op_refuses_bad_row_splits():
  ops = native.load()
  with pytest.raises(tf.errors.InvalidArgumentError, match="row_splits must not decrease"):
    ops.tpu_embed_ext_ragged_gains(tf.constant([0, 3, 2], tf.int64),
                                   tf.zeros([0]), combiner=1)
  with pytest.raises(tf.errors.InvalidArgumentError, match="row_splits must start at 0"):
    ops.tpu_embed_ext_ragged_gains(tf.constant([1, 3], tf.int64),
                                   tf.zeros([0]), combiner=1)
  with pytest.raises(tf.errors.InvalidArgumentError, match="weights must be empty or one per id"):
    ops.tpu_embed_ext_ragged_gains(tf.constant([0, 3], tf.int64),
                                   tf.zeros([2]), combiner=1)


@needs_native
@pytest.mark.parametrize("shape", [[6], [6, 1], [2, 3, 1]])
def test_dense_ids_of_every_rank_gather_rows(shape):
  ids = np.arange(6).reshape(shape) * 5 % VOCAB
  ours = _lookup(_kernel_path_engine("native"), tf.constant(ids, tf.int64))
  expected = _values()[ids.reshape(-1)].reshape(
      (shape if len(shape) == 1 else shape[:-1]) + [DIM])
  np.testing.assert_array_equal(ours, expected)
  np.testing.assert_array_equal(ours, _lookup(_kernel_path_engine("tf"), tf.constant(ids, tf.int64)))


@needs_native
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_high_dimensional_sparse_ids_combine_over_the_last_dimension(combiner):
  # [batch 2, 3 slots, up to 3 ids]: activations [2, 3, DIM].
  rows = {(0, 0): [1, 2], (0, 2): [3], (1, 1): [4, 4, 7], (1, 2): [0]}
  weights = {(0, 0): [1., 3.], (0, 2): [2.], (1, 1): [1., .5, .25], (1, 2): [4.]}
  indices, values, wvalues = [], [], []
  for (b, s), ids in rows.items():
    for k, i in enumerate(ids):
      indices.append([b, s, k])
      values.append(i)
      wvalues.append(weights[(b, s)][k])
  ids = tf.SparseTensor(indices, tf.constant(values, tf.int64), [2, 3, 3])
  w = tf.SparseTensor(indices, tf.constant(wvalues, tf.float32), [2, 3, 3])
  ours = _lookup(_kernel_path_engine("native", combiner), ids, w)
  expected = np.zeros((2, 3, DIM))
  for (b, s), r in rows.items():
    expected[b, s] = _combine(_values(), [r], [weights[(b, s)]], combiner)[0]
  np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(ours, _lookup(_kernel_path_engine("tf", combiner), ids, w))


@needs_native
@pytest.mark.parametrize("sparse", [False, True])
def test_sequence_features_place_positions_and_truncate(sparse):
  ids = tf.ragged.constant(RAGGED, tf.int64)
  if sparse:
    ids = ids.to_sparse()
  ours = _lookup(_kernel_path_engine("native", max_sequence_length=2), ids)
  expected = np.zeros((len(RAGGED), 2, DIM), np.float32)
  for b, row in enumerate(RAGGED):
    for p, i in enumerate(row[:2]):
      expected[b, p] = _values()[i]
  np.testing.assert_array_equal(ours, expected)
  np.testing.assert_array_equal(
      ours, _lookup(_kernel_path_engine("tf", max_sequence_length=2), ids))


@needs_native
@pytest.mark.parametrize("kind", ["dense", "ragged", "shuffled_sparse"])
def test_large_lookups_split_across_threads_stay_bitwise(kind):
  # 20,000 rows of DIM floats: over the 65,536 floats from which the op
  # splits output rows across threads. Shuffled sparse indices give output
  # rows out of order, so every thread scans all occurrences.
  rng = np.random.RandomState(3)
  batch = 20000
  if kind == "dense":
    ids = tf.constant(rng.randint(0, VOCAB, batch), tf.int64)
    rows, weights = [[i] for i in ids.numpy()], [[1.0]] * batch
    w = None
  else:
    lengths = rng.randint(0, 5, batch)
    rows = [list(rng.randint(0, VOCAB, k)) for k in lengths]
    weights = [list(rng.uniform(0.1, 2.0, k).astype(np.float32)) for k in lengths]
    ids = tf.ragged.constant(rows, tf.int64, row_splits_dtype=tf.int64)
    w = tf.ragged.constant(weights, tf.float32, row_splits_dtype=tf.int64)
    if kind == "shuffled_sparse":
      ids, w = ids.to_sparse(), w.to_sparse()
      order = rng.permutation(int(ids.values.shape[0]))
      ids = tf.SparseTensor(tf.gather(ids.indices, order), tf.gather(ids.values, order),
                            ids.dense_shape)
      w = tf.SparseTensor(tf.gather(w.indices, order), tf.gather(w.values, order),
                          w.dense_shape)
  ours = _lookup(_kernel_path_engine("native", "mean"), ids, w)
  np.testing.assert_allclose(ours, _combine(_values(), rows, weights, "mean"),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ours, _lookup(_kernel_path_engine("tf", "mean"), ids, w))


@needs_native
@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_simulated_quantization_runs_in_the_kernel_bitwise(combiner):
  q = api.QuantizationConfig(num_buckets=7, lower=-1.5, upper=1.25)
  ids = tf.ragged.constant(RAGGED, tf.int64)
  ours = _lookup(_kernel_path_engine("native", combiner, quantization=q), ids)
  quantum = (1.25 + 1.5) / 6
  snapped = np.floor((np.clip(_values(), -1.5, 1.25) + 1.5) / quantum + 0.5) * quantum - 1.5
  weights = [[1.0] * len(r) for r in RAGGED]
  np.testing.assert_allclose(ours, _combine(snapped, RAGGED, weights, combiner),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(
      ours, _lookup(_kernel_path_engine("tf", combiner, quantization=q), ids))


@needs_native
def test_v2_engine_weighted_dense_ids():
  ids = tf.constant([3, 1, 4, 1], tf.int64)
  w = tf.constant([1.0, 2.0, 0.5, -1.0])
  ours = _lookup(_kernel_path_engine("native", engine="v2", output_shape=[4]), ids, w)
  np.testing.assert_allclose(ours, _values()[[3, 1, 4, 1]] * w.numpy()[:, None],
                             rtol=1e-6)
  np.testing.assert_array_equal(
      ours, _lookup(_kernel_path_engine("tf", engine="v2", output_shape=[4]), ids, w))


@needs_native
def test_unchecked_out_of_range_id_fails_like_tensorflows_gather():
  emb = tee.CPUEmbedding(
      {"f": api.FeatureConfig(api.TableConfig(VOCAB, DIM, name="t"), name="f")},
      api.SGD(0.1), kernels="native", validate=False)
  emb.enqueue({"f": tf.constant([1, VOCAB + 3], tf.int64)}, training=False)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=rf"indices\[1\] = {VOCAB + 3} is not in \[0, {VOCAB}\)"):
    emb.dequeue()


# --- which path runs ---------------------------------------------------------

def _graph_ops(emb, jit_compile=False):
  @tf.function(jit_compile=jit_compile)
  def step(ids):
    emb.enqueue({"f": ids}, training=False)
    return emb.dequeue()["f"]
  graph = step.get_concrete_function(tf.TensorSpec([4], tf.int64)).graph
  return {op.type for op in graph.get_operations()}


@needs_native
def test_auto_picks_native_and_tf_forces_tensorflow_ops(monkeypatch):
  monkeypatch.delenv(native.ENV, raising=False)
  emb = _kernel_path_engine("auto")
  assert emb.kernels == "native"
  assert OP in _graph_ops(emb)
  emb = _kernel_path_engine("tf")
  assert emb.kernels == "tf"
  assert OP not in _graph_ops(emb)


@needs_native
def test_environment_variable_forces_a_path_unless_the_argument_does(monkeypatch):
  monkeypatch.setenv(native.ENV, "tf")
  assert _kernel_path_engine("auto").kernels == "tf"
  assert _kernel_path_engine("native").kernels == "native"
  monkeypatch.setenv(native.ENV, "native")
  assert _kernel_path_engine("auto").kernels == "native"
  assert _kernel_path_engine("tf").kernels == "tf"


@needs_native
def test_xla_always_runs_tensorflow_ops():
  emb = _kernel_path_engine("native")
  ops = _graph_ops(emb, jit_compile=True)
  assert OP not in ops
  assert {"GatherV2", "ResourceGather"} & ops, sorted(ops)


@needs_native
def test_exported_savedmodel_needs_no_custom_op(tmp_path, monkeypatch):
  from tests import fixed_head_model as fh  # pylint: disable=import-outside-toplevel
  from tpu_embed_ext.keras import serving  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv(native.ENV, "native")
  model = fh.FixedHead(fh.feature_config())
  batches = fh.batches(4)
  fh.fit(model, batches, "sgd")
  assert model.embedding.embedding.kernels == "native"
  signature = {"user": tf.TensorSpec([None], tf.int64, name="user"),
               "item": tf.TensorSpec([None, None], tf.int64, name="item")}
  serving.export_for_serving(model, str(tmp_path / "m"), signature)
  saved = (tmp_path / "m" / "saved_model.pb").read_bytes()
  assert b"TpuEmbedExt" not in saved
  # It loads and serves where the library was never loaded: a fresh process
  # that cannot build it.
  env = dict(os.environ, CXX=str(tmp_path / "no-g++"), TF_CPP_MIN_LOG_LEVEL="3",
             TPU_EMBED_EXT_CACHE_DIR=str(tmp_path / "c"))
  features, _ = batches[0]
  ids = features["item"].to_tensor(default_value=serving.PAD_ID).numpy().tolist()
  done = _run_python_code(f"""
      import tensorflow as tf
      m = tf.saved_model.load({str(tmp_path / "m")!r})
      out = m.signatures["serving_default"](
          user=tf.constant({features["user"].numpy().tolist()}, tf.int64),
          item=tf.constant({ids}, tf.int64))
      print("OUT", out["outputs"].numpy().ravel().tolist())
      """, env)
  served = json.loads(done.stdout.split("OUT ", 1)[1].replace("'", '"'))
  np.testing.assert_allclose(served, model.predict(features, verbose=0).ravel(),
                             rtol=1e-6, atol=1e-6)


def test_bad_kernels_values_are_refused(monkeypatch):
  with pytest.raises(errors.ConfigError,
                     match=r"kernels='fast' is not one of \['auto', 'native', 'tf'\]"):
    _kernel_path_engine("fast")
  monkeypatch.setenv(native.ENV, "gpu")
  with pytest.raises(errors.ConfigError,
                     match=r"TPU_EMBED_EXT_KERNELS='gpu' is not one of"):
    _kernel_path_engine("auto")


@pytest.fixture
def broken_library(monkeypatch, tmp_path, caplog):
  """A cache holding a library that must be refused; the loader reset around it."""
  monkeypatch.setenv("TPU_EMBED_EXT_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv(native.ENV, raising=False)
  directory = loader.library_dir()
  os.makedirs(directory)
  loader._reset_for_tests()
  caplog.set_level(logging.WARNING, logger="tpu_embed_ext")
  yield directory
  loader._reset_for_tests()


def _write_library(directory, version, content=b"not a shared library"):
  with open(os.path.join(directory, loader.LIBRARY), "wb") as f:
    f.write(content)
  with open(os.path.join(directory, "manifest.json"), "w") as f:
    json.dump({"tensorflow": version}, f)


def _train(kernels):
  emb = _kernel_path_engine(kernels, "mean")
  for step in range(3):
    ids = tf.ragged.constant([[1, 2, 2], [3 + step], [4, 1]], tf.int64)
    emb.enqueue({"f": ids})
    acts = emb.dequeue()
    emb.apply_gradients({"f": 2 * acts["f"]})
  return emb.variables["t"]["parameters"].numpy()


@needs_native
def test_library_of_another_tensorflow_is_refused_with_one_log_line(broken_library, caplog):
  _write_library(broken_library, "2.0.0")
  assert native.load() is None
  assert f"built for TensorFlow 2.0.0, this is TensorFlow {tf.__version__}" in native.why_not()
  emb = _kernel_path_engine("auto")
  assert emb.kernels == "tf"
  lines = [r.getMessage() for r in caplog.records if "native kernels" in r.getMessage()]
  assert len(lines) == 1 and "using the TensorFlow-op path" in lines[0], lines
  with pytest.raises(errors.ConfigError,
                     match=r'kernels="native" was asked for, but the native kernels '
                           r"cannot be loaded: .*built for TensorFlow 2.0.0"):
    _kernel_path_engine("native")
  native.load()  # A second load logs nothing more.
  assert len([r for r in caplog.records if "native kernels" in r.getMessage()]) == 1


def test_corrupt_library_is_refused_and_results_are_the_tf_paths(broken_library, caplog):
  _write_library(broken_library, tf.__version__)
  assert native.load() is None
  assert native.why_not()
  fallback = _train("auto")
  np.testing.assert_array_equal(fallback, _train("tf"))


# --- the build ---------------------------------------------------------------

def _run_python_code(code, env, timeout=600):
  done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                        cwd=REPO, text=True, capture_output=True, timeout=timeout)
  assert done.returncode == 0, done.stderr[-3000:]
  return done


@needs_native
def test_no_compiler_falls_back_with_one_line_and_identical_results(tmp_path):
  env = dict(os.environ, CXX=str(tmp_path / "nonexistent-g++"),
             TPU_EMBED_EXT_CACHE_DIR=str(tmp_path / "cache"),
             TF_CPP_MIN_LOG_LEVEL="3")
  env.pop(native.ENV, None)
  done = _run_python_code("""
      import numpy as np
      from tests import test_native_kernels as t
      emb = t._kernel_path_engine("auto")
      print("KERNELS", emb.kernels)
      np.save("out.npy", t._train("auto"))
      """.replace('"out.npy"', repr(str(tmp_path / "out.npy"))), env)
  assert "KERNELS tf" in done.stdout
  lines = [l for l in done.stderr.splitlines() if "native kernels" in l]
  assert len(lines) == 1, done.stderr
  assert "no C++ compiler" in lines[0] and "nonexistent-g++" in lines[0]
  np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), _train("native"))
  assert not (tmp_path / "cache").exists()  # Nothing half-built left behind.


@needs_native
def test_concurrent_builds_compile_once_and_never_expose_a_partial_library(tmp_path):
  # A stand-in compiler: slow, counts its runs, "compiles" by copying the
  # library this session built.
  built = os.path.join(loader.library_dir(), loader.LIBRARY)
  count = tmp_path / "runs"
  cxx = tmp_path / "fake-g++"
  cxx.write_text(textwrap.dedent(f"""\
      #!/bin/sh
      echo run >> {count}
      while [ "$1" != "-o" ]; do shift; done
      sleep 2
      cp {built} "$2"
      """))
  cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, CXX=str(cxx), TPU_EMBED_EXT_CACHE_DIR=str(tmp_path / "c"),
             TF_CPP_MIN_LOG_LEVEL="3")
  code = ("from tpu_embed_ext.emulation import native\n"
          "assert native.load() is not None, native.why_not()\n"
          "print('LOADED')\n")
  procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for _ in range(3)]
  try:
    outs = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert all(p.returncode == 0 and "LOADED" in o for p, (o, _) in zip(procs, outs)), outs
  assert count.read_text().count("run") == 1
  entries = os.listdir(tmp_path / "c" / "kernels")
  dirs = [e for e in entries if not e.endswith(".lock")]
  assert len(dirs) == 1 and dirs[0].startswith(f"tf-{tf.__version__}-"), entries
  with open(tmp_path / "c" / "kernels" / dirs[0] / "manifest.json") as f:
    assert json.load(f)["tensorflow"] == tf.__version__


@needs_native
def test_first_compile_is_announced_in_one_line_with_its_duration(tmp_path):
  """The first run after an install compiles for about a minute: one line
  says so, then its duration; a run with the library cached says nothing."""
  built = os.path.join(loader.library_dir(), loader.LIBRARY)
  cxx = tmp_path / "fake-g++"
  cxx.write_text(f'#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\n'
                 f'sleep 1\ncp {built} "$2"\n')
  cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, CXX=str(cxx), TPU_EMBED_EXT_CACHE_DIR=str(tmp_path / "c"),
             TF_CPP_MIN_LOG_LEVEL="3")
  code = ("from tpu_embed_ext.emulation import native\n"
          "assert native.load() is not None, native.why_not()\n")
  runs = [subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=False)
          for _ in range(2)]
  assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:]
  first = [line for line in runs[0].stdout.splitlines() if "tpu_embed_ext" in line]
  assert len(first) == 1, runs[0].stdout[-2000:] + runs[0].stderr[-2000:]
  assert re.fullmatch(re.escape(loader.COMPILING) + r" done in \d+ s\.", first[0])
  assert "tpu_embed_ext" not in runs[1].stdout + runs[1].stderr


@needs_native
def test_failed_build_keeps_its_log_and_falls_back(tmp_path):
  cxx = tmp_path / "failing-g++"
  cxx.write_text("#!/bin/sh\necho 'error: the compiler said no' >&2\nexit 3\n")
  cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, CXX=str(cxx), TPU_EMBED_EXT_CACHE_DIR=str(tmp_path / "c"),
             TF_CPP_MIN_LOG_LEVEL="3")
  env.pop(native.ENV, None)
  done = _run_python_code("""
      from tpu_embed_ext.emulation import native
      print("KERNELS", native.choose("auto"))
      """, env)
  assert "KERNELS tf" in done.stdout
  line, = [l for l in done.stderr.splitlines() if "native kernels unavailable" in l]
  log = line.split("build log: ")[1].split(")")[0]
  assert "the C++ build failed (exit 3)" in line
  assert re.search(re.escape(loader.COMPILING) + r" failed in \d+ s\.", done.stdout)
  assert "the compiler said no" in open(log).read()


@needs_native
def test_make_test_with_the_compiler_hidden_falls_back_and_passes(tmp_path):
  """A representative subset of `make test` (the whole suite is too slow)."""
  env = dict(os.environ, CXX="/nonexistent", TPU_EMBED_EXT_CACHE_DIR=str(tmp_path),
             TF_CPP_MIN_LOG_LEVEL="3")
  env.pop(native.ENV, None)
  done = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "tests/test_engine_tensorflow_goldens.py", "tests/test_engine_lookups.py",
       "tests/test_engine_checkpoints.py"],
      env=env, cwd=REPO, text=True, capture_output=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:]
  assert " passed" in done.stdout and "failed" not in done.stdout
  assert "skipped" in done.stdout  # The [native] runs, saying why.
  assert not (tmp_path / "kernels").exists()

