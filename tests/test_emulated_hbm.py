"""Every emulated TPU has a slice, and ``build()`` refuses what its HBM cannot hold
(issue 44).

The boundary is computed here from the published counting rule
(``sparsecore/hbm.py``): per device, ``ceil(rows / replicas)`` rows of ``dim``
float32 values times (parameters + the optimizer's slots + one gradient
accumulator with ``use_gradient_accumulation``, TensorFlow's default), plus
the step's activations and their gradients, ``2 x batch x dim x 4`` bytes per
feature; v5e's capacity is XLA's published 15.75G. A table one row over is
refused end to end (nothing is allocated); one row under passes the check,
with the engine's variable creation stubbed out (a 16 GiB table cannot be
allocated here) and the nearly-full warning.
"""

import math
import os
import subprocess
import sys
from unittest import mock

import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.emulated_tpu import runner, session
from tpu_embed_ext.emulation import engine
from tpu_embed_ext.job import strategy as job_strategy
from tpu_embed_ext.sparsecore import chips, hbm

emb_api = tf.tpu.experimental.embedding
GIB = 1 << 30
XLA = "Ran out of memory in memory space hbm. Used "
BATCH, DIM = 16, 8  # DIM a multiple of 8: the upper bound (widths padded) is the lower.


def _v5e_rows_that_fit(states: int) -> int:
  """The most rows one table of DIM (and one feature of BATCH ids) may have
  on one v5e chip, with ``states`` floats per element."""
  capacity = round(15.75 * GIB)
  buffers = 2 * BATCH * DIM * 4
  return (capacity - buffers) // (DIM * 4 * states)


def _embedding(rows: int, optimizer=None, name="big"):
  table = emb_api.TableConfig(vocabulary_size=rows, dim=DIM, name=name)
  feature = emb_api.FeatureConfig(table=table, name="ids")
  return emb_api.TPUEmbedding(feature, optimizer or emb_api.Adagrad(0.1))


def _creations(fn):
  """(names of the variables ``fn()`` creates, the ResourceExhaustedError it
  raised or None)."""
  made = []

  def creator(next_creator, **kwargs):
    made.append(kwargs.get("name"))
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    try:
      fn()
    except tf.errors.ResourceExhaustedError as e:
      return made, e
  return made, None


def test_the_boundary_of_a_v5e_chip_through_the_count():
  slice_ = chips.parse_slice("v5e:1")
  # Adagrad: parameters, accumulators, gradient_accumulators (TF's default).
  rows = _v5e_rows_that_fit(states=3)
  for n, fits in ((rows, True), (rows + 1, False)):
    table = emb_api.TableConfig(vocabulary_size=n, dim=DIM, name="t")
    config = emb_api.FeatureConfig(table=table)
    memory = hbm.for_tpu_embedding(config, emb_api.Adagrad(0.1),
                                   [tf.TensorShape([BATCH])], slice_)
    assert memory.lower == n * DIM * 4 * 3 + 2 * BATCH * DIM * 4
    assert memory.fits is fits


def test_one_row_over_a_v5e_chip_is_refused_by_build_in_xlas_words():
  with tee.emulate_tpu(topology="v5e:1") as emulation:
    assert str(emulation.slice) == "v5e:1" and not emulation.sparsecore
    strategy = tf.distribute.TPUStrategy()
    rows = _v5e_rows_that_fit(states=3) + 1
    with strategy.scope():
      embedding = _embedding(rows)
    made, error = _creations(lambda: embedding.build(per_replica_batch_size=BATCH))
    assert isinstance(error, hbm.HBMExhaustedError)
    assert isinstance(error, tf.errors.ResourceExhaustedError)
    used = rows * DIM * 4 * 3 + 2 * BATCH * DIM * 4
    assert used > round(15.75 * GIB)
    assert str(error).startswith(XLA + f"{hbm.xla_size(used)} of 15.75G hbm.")
    assert "'big'" in str(error) and "v5e:1" in str(error) and "Fix:" in str(error)
    assert made == [] and embedding._table_vars is None  # pylint: disable=protected-access
    # The TPU's embedding engine is not claimed: a corrected object builds.
    with strategy.scope():
      small = _embedding(64, name="small")
    small.build(per_replica_batch_size=BATCH)
    assert small._table_vars  # pylint: disable=protected-access


def test_one_row_under_a_v5e_chip_passes_the_check_and_warns():
  """Variable creation (the engine's build) is stubbed: 15.75 GiB is not allocated."""
  created = []

  def stub_build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
    created.append(per_replica_batch_size)
    object.__setattr__(self, "_table_vars", {})

  with tee.emulate_tpu(replicas=1, topology="v5e:1"):
    strategy = tf.distribute.TPUStrategy()
    with strategy.scope():
      embedding = _embedding(_v5e_rows_that_fit(states=3))
    with mock.patch.object(engine.CPUEmbedding, "build", stub_build):
      with pytest.warns(hbm.HBMNearlyFullWarning, match="v5e:1"):
        embedding.build(per_replica_batch_size=BATCH)
  assert created == [BATCH]


def test_sgd_without_gradient_accumulation_counts_parameters_only():
  rows = _v5e_rows_that_fit(states=1)
  sgd = emb_api.SGD(0.1, use_gradient_accumulation=False)
  with tee.emulate_tpu(replicas=1, topology="v5e:1"):
    with tf.distribute.TPUStrategy().scope():
      embedding = _embedding(rows + 1, sgd)
    with pytest.raises(hbm.HBMExhaustedError, match="^" + XLA):
      embedding.build(per_replica_batch_size=BATCH)


def test_tables_are_divided_over_a_v3_slices_eight_cores():
  """v3:4 is 8 replicas (two TensorCores per chip, each a device of 15.48G)."""
  with tee.emulate_tpu(topology="v3:4") as emulation:
    assert (emulation.replicas, emulation.slice.replicas) == (8, 8)
    assert tf.distribute.TPUStrategy().num_replicas_in_sync == 8
  assert runner._shape(runner.parse(["--topology", "v3:4", "s.py"]))[:2] == (8, False)  # pylint: disable=protected-access
  slice_ = chips.parse_slice("v3:4")
  per_device = (round(15.48 * GIB) - 2 * BATCH * DIM * 4) // (DIM * 4 * 3)
  for rows, fits in ((per_device * 8, True), (per_device * 8 + 1, False)):
    config = emb_api.FeatureConfig(table=emb_api.TableConfig(rows, DIM, name="t"))
    memory = hbm.for_tpu_embedding(config, emb_api.Adagrad(0.1),
                                   [tf.TensorShape([BATCH])], slice_)
    assert memory.tables[0].rows == math.ceil(rows / 8)
    assert memory.fits is fits


def test_a_v1_generation_reports_the_v1_hardware_feature():
  with tee.emulate_tpu(replicas=1, topology="v5e:1"):
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver()
    strategy = tf.distribute.TPUStrategy(resolver)
    v1 = tf.tpu.experimental.HardwareFeature.EmbeddingFeature.V1
    assert resolver.tpu_hardware_feature.embedding_feature == v1
    assert strategy.extended.tpu_hardware_feature.embedding_feature == v1
  with tee.emulate_tpu(replicas=2, topology="2x2") as emulation:
    feature = tf.distribute.TPUStrategy().extended.tpu_hardware_feature
    assert emulation.sparsecore and emulation.topology.sparsecores_per_chip == 2
    assert feature.num_embedding_devices_per_chip == 2
    assert feature.embedding_feature == feature.EmbeddingFeature.V2


def test_every_emulation_has_a_slice():
  with tee.emulate_tpu(replicas=2) as emulation:
    assert (emulation.slice.generation.name, emulation.slice.chips) == (chips.DEFAULT_V1, 2)
    assert emulation.topology is None
  with tee.emulate_tpu(replicas=2, sparsecore=True) as emulation:
    assert (emulation.slice.generation.name, emulation.slice.chips) == (chips.DEFAULT_V2, 2)
    assert emulation.topology.num_sparse_cores == 8


_NO_SC = ("with topology 'v5e:1': a TPU v5e has no SparseCore for TPUEmbeddingV2 "
          "(its embedding engine is TPUEmbedding, embedding_feature V1). Fix: drop {f} "
          "to emulate v5e:1 with TPUEmbedding, or name a SparseCore slice (v5p:4, "
          "v6e:4, tpu7x:4 or CHIPSxSPARSECORES, e.g. 4x4).")


def test_sparsecore_on_a_generation_without_it_is_refused(tmp_path, monkeypatch, capsys):
  with pytest.raises(errors.ConfigError) as e:
    with tee.emulate_tpu(replicas=1, topology="v5e:1", sparsecore=True):
      pass
  assert str(e.value) == "emulate_tpu sparsecore=True " + _NO_SC.format(f="sparsecore=True")
  assert not session.is_active()
  monkeypatch.chdir(tmp_path)
  (tmp_path / "prog.py").write_text("raise SystemExit(7)\n")
  assert runner.main(["--sparsecore", "--topology", "v5e:1", "prog.py"]) == 2
  assert capsys.readouterr().err == (
      f"error: emulate: --sparsecore {_NO_SC.format(f='--sparsecore')} "
      f"Usage: {runner.USAGE}\n")


def test_replicas_other_than_a_v3_slices_are_refused():
  with pytest.raises(errors.ConfigError) as e:
    with tee.emulate_tpu(replicas=4, topology="v3:4"):
      pass
  assert str(e.value) == (
      "emulate_tpu topology 'v3:4' has 4 chips but replicas=4: a TPU v3 runs 2 "
      "replicas per chip (one per TensorCore), 8 in all. Fix: replicas=8, or a "
      "topology of 2 chips.")


@pytest.mark.parametrize("tpu, replicas, generation, sparsecore", [
    ("emulate:v5e:1", 1, "v5e", False), ("emulate:v3:4", 8, "v3", False),
    ("emulate:v5p:4", 4, "v5p", True)])
def test_the_jobs_emulated_tpu_takes_every_generation(tpu, replicas, generation,
                                                      sparsecore):
  asked = job_strategy.emulated_tpu_of(tpu)
  assert (asked.replicas, asked.slice.generation.name) == (replicas, generation)
  assert (asked.topology is not None) is sparsecore


def test_a_v1_slice_that_no_tpu_has_is_refused():
  with pytest.raises(errors.ConfigError) as e:
    job_strategy.emulated_tpu_of("emulate:v5e:3")
  assert str(e.value).endswith(
      "topology 'v5e:3' is not a v5e slice: v5e slices have 1, 4, 8, 16, 32, 64, "
      "128 or 256 chips. Fix: e.g. v5e:4.")


def test_a_sparsecore_build_that_cannot_fit_is_refused_before_any_variable():
  with tee.emulate_tpu(replicas=4, topology="v6e:4"):
    strategy = tf.distribute.TPUStrategy()
    table = emb_api.TableConfig(vocabulary_size=10 ** 9, dim=64, name="huge")
    feature = emb_api.FeatureConfig(table=table, output_shape=[BATCH], name="ids")
    with strategy.scope():
      embedding = emb_api.TPUEmbeddingV2(feature, emb_api.Adagrad(0.1))
    made, error = _creations(embedding.build)
    assert isinstance(error, hbm.HBMExhaustedError), error
    assert str(error).startswith(XLA) and "'huge'" in str(error)
    assert "of 32.00G hbm." in str(error)  # v6e: 32 GiB per chip.
    assert made == [] and embedding._table_vars is None  # pylint: disable=protected-access


def test_the_shipped_criteo_config_is_refused_on_one_v5e_chip():
  """Issue 44's done-when: refused at build(), in XLA's words, with bytes per
  chip (that it builds on v5e:4, 23.7 GiB of tables, is not run here)."""
  from tpu_embed_ext.spec import files  # pylint: disable=g-import-not-at-top
  spec = tee.EmbeddingSpec.from_file(files.resolve("criteo"))
  tables = 0
  for t in spec.tables:
    o = spec.optimizer_for(t.name)
    states = 1 + len(o.slot_names) + (1 if o.use_gradient_accumulation else 0)
    tables += t.vocabulary_size * t.dim * states * 4
  dim_of = {t.name: t.dim for t in spec.tables}
  used = tables + 2 * 512 * sum(dim_of[f.table] for f in spec.features) * 4
  with tee.emulate_tpu(replicas=1, topology="v5e:1"):
    with tf.distribute.TPUStrategy().scope():
      embedding = tee.create_embedding(spec)
    made, error = _creations(lambda: embedding.build(per_replica_batch_size=512))
  assert isinstance(error, hbm.HBMExhaustedError), error
  assert str(error).startswith(f"{XLA}{used / GIB:.2f}G of 15.75G hbm."), str(error)
  assert "v5e:4 holds it" in str(error)
  assert made == []


_SESSION = """
import tensorflow as tf

def test_the_session_is_a_v5e_chip(emulated_tpu):
  assert (str(emulated_tpu.slice), emulated_tpu.replicas) == ("v5e:1", 1)
  assert not emulated_tpu.sparsecore and emulated_tpu.topology is None
  feature = tf.distribute.TPUStrategy().extended.tpu_hardware_feature
  assert feature.embedding_feature == feature.EmbeddingFeature.V1
"""


def test_the_pytest_plugin_takes_a_v1_slice(tmp_path):
  (tmp_path / "test_user.py").write_text(_SESSION)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "--emulate-tpu=1", "--emulate-tpu-topology=v5e:1", "test_user.py"]
  done = subprocess.run(command, cwd=str(tmp_path), env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  done = subprocess.run(command[:-1] + ["--emulate-tpu-sparsecore", "test_user.py"],
                        cwd=str(tmp_path), env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
  assert done.stderr.strip() == "ERROR: --emulate-tpu-sparsecore " + _NO_SC.format(
      f="--emulate-tpu-sparsecore")


def test_reading_a_slice_loads_no_tensorflow():
  """A bad --topology is a usage error before TensorFlow's start-up lines."""
  code = ("import sys\n"
          "from tpu_embed_ext.emulated_tpu import runner\n"
          "assert runner.check_slice('v3:4').replicas == 8\n"
          "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr


def test_a_programs_own_slice_joins_the_runners_only_if_it_is_the_same():
  with tee.emulate_tpu(replicas=1, topology="v5e:1") as outer:
    session.hosted_by("the runner", "emulate --replicas {replicas}{flags}")
    with tee.emulate_tpu(replicas=1, topology="v5e:1") as joined:
      assert joined is outer
    with pytest.raises(tee.emulated_tpu.EmulationError) as e:
      with tee.emulate_tpu(replicas=1, topology="v4:1"):
        pass
  assert str(e.value) == (
      "emulate_tpu(replicas=1, topology='v4:1') entered inside the runner, whose "
      "emulated TPU has 1 replicas on v5e:1: one emulation per process, and the "
      "program's own emulate_tpu joins it only with the same shape. Fix: emulate "
      "--replicas 1 --topology v4:1")
