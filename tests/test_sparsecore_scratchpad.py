"""SparseCore's compile-time limits: E3001 (scratchpad) and E3000 (HBM stack).

Every number is computed here from the published facts (sparsecore/scratchpad.py):
OpenXLA's E3001 sample (max_nz_per_row = 141352, max_unique_nz_per_row = 8,
feature_width = 8, sample_count = 204800, fixed_size_allocation_bytes =
410880, row_dependent_size_allocation_bytes = 1696224, total_spmem_size_bytes
= 524288), 12 B per id (inferred from that sample: 141,352 x 12 = 1,696,224),
the fixed part's estimate (2 B x sample_count + 1,280: warns only) and the
deep dive's HBM stack ((2w + 1) x u x 4 forward + 3w x u x 4 backward).
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.cli import sparsecore_report
from tpu_embed_ext.sparsecore import chips, hbm, layout as sc_layout, scratchpad as sp
from tpu_embed_ext.sparsecore.limits import Limits
from tpu_embed_ext.sparsecore.state import (SparseCoreCompileError,
                                            SparseCoreCompileWarning, SparseCoreState)
from tpu_embed_ext.sparsecore.topology import Topology
from tests import sparsecore_program as sc

api = tf.tpu.experimental.embedding

TOTAL = 131_072 * 4          # E3000's 131,072 words of TileSpmem = E3001's total
PER_ID = 1_696_224 // 141_352  # E3001's sample: row-dependent bytes per id
LARGEST = TOTAL // PER_ID      # the most max_ids whose ids alone fit


def fixed(samples):
  return 2 * samples + 1_280  # our estimate, scaled from the sample


def _state(dim=8, topology="v5p:1", batch=8, **limits):
  table = api.TableConfig(64, dim, name="t", optimizer=api.SGD(0.1))
  config = {"f": api.FeatureConfig(table, output_shape=[batch])}
  return SparseCoreState(config, None, topology, api.SparseCoreEmbeddingConfig(**limits))


def test_constants_are_the_published_ones():
  assert (PER_ID, 141_352 * PER_ID, TOTAL, LARGEST) == (12, 1_696_224, 524_288, 43_690)
  assert fixed(204_800) == 410_880
  assert (sp.BYTES_PER_ID, sp.TOTAL_SPMEM_BYTES, sp.largest_max_ids()) == (
      PER_ID, TOTAL, LARGEST)


def test_openxla_e3001_sample_is_reproduced_and_refused():
  # One chip of 4 SparseCores: 204,800 samples per SparseCore = 819,200 global.
  state = _state(max_ids_per_table={"t": 141_352}, max_unique_ids_per_table={"t": 8})
  with pytest.raises(SparseCoreCompileError) as e:
    state.check_compile([204_800 * 4])
  assert isinstance(e.value, tf.errors.ResourceExhaustedError)
  assert isinstance(e.value, errors.Error) and e.value.code_name == "E3001"
  published = (
      "XLA:TPU compile permanent error. Compilation failure: No viable logical replica "
      "count for the embedding table with metadata: max_nz_per_row = 141352, "
      "max_unique_nz_per_row = 8, feature_width = 8, sample_count = 204800 (last "
      "tried split factor for vector splitting = 1, last tried split factor for "
      "sample dimension splitting = 1, fixed_size_allocation_bytes = 410880, "
      "row_dependent_size_allocation_bytes = 1696224, total_spmem_size_bytes = "
      "524288)")
  assert str(e.value).startswith("E3001: " + published + ". (emulated TPUEmbeddingV2: "
                                 "stacked table 't' (tables 't') on v5p:1")
  assert (f"Fix: lower max_ids_per_table['t'] (the stacked table's name) to at most "
          f"{LARGEST:,}") in str(e.value)
  assert "fixed_size_allocation_bytes = 410,880 B is our estimate" in str(e.value)


@pytest.mark.parametrize("samples", [0, 8, 204_800])
def test_boundary_one_id_over_is_refused(samples):
  layouts = sc_layout.compute_layouts([sc_layout.StackingInput("t", 64, 8, "g")],
                                      Topology(1, 4), use_tensorflow=False)
  def verdict(max_ids):
    (s,) = sp.scratchpad(layouts, {"t": samples}, Limits(max_ids_per_table={"t": max_ids}))
    return s
  # Refused only when the ids alone need strictly more than the scratchpad.
  at = verdict(LARGEST)
  assert PER_ID * LARGEST <= TOTAL < PER_ID * (LARGEST + 1)
  assert not at.refused and at.row_dependent_bytes == PER_ID * LARGEST
  assert at.verdict == (sp.WARNED if PER_ID * LARGEST + fixed(samples) > TOTAL else sp.FITS)
  over = verdict(LARGEST + 1)
  assert over.refused and over.row_dependent_bytes == PER_ID * (LARGEST + 1)


def test_the_estimate_warns_and_never_refuses():
  samples = 100_000
  quiet = (TOTAL - fixed(samples)) // PER_ID  # the most ids with the estimate fitting
  state = _state(topology="1x4", batch=samples * 4,
                 max_ids_per_table={"t": quiet + 1})
  with pytest.warns(SparseCoreCompileWarning) as record:
    state.check_compile([samples * 4])  # no error: the fixed part is an estimate
  text = str(record[0].message)
  assert text.startswith("E3001: XLA:TPU compile permanent error.")
  assert (f"row_dependent_size_allocation_bytes = {PER_ID * (quiet + 1)}, "
          f"total_spmem_size_bytes = {TOTAL})") in text
  assert "a warning, not a refusal" in text
  assert f"to at most {quiet:,}" in text
  # Checked once per batch shape: the same step again says nothing.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state.check_compile([samples * 4])
    _state(topology="1x4", max_ids_per_table={"t": quiet}).check_compile([samples * 4])


@pytest.mark.parametrize("dim", [1, 8, 129, 1024])
@pytest.mark.parametrize("samples", [1, 4_096, 1 << 20])
def test_default_limits_are_never_refused(dim, samples):
  state = _state(dim=dim, topology="1x2")
  stacks, stack_hbm = state.compile_verdicts([samples * 2])
  assert not stacks[0].refused and not stack_hbm.refused
  assert stacks[0].max_ids == stacks[0].max_unique_ids == 256
  if PER_ID * 256 + fixed(samples) <= TOTAL:
    state.check_compile([samples * 2])


def test_hbm_stack_e3000_at_the_boundary():
  state = _state(dim=8, topology="v5p:1")
  stacks, stack_hbm = state.compile_verdicts([8])
  width = stacks[0].feature_width
  per_unique = (2 * width + 1) * 4 + 3 * width * 4
  # Tables and slots per chip: 64 rows padded to 8 x 4 SparseCores, width 8, SGD: 1 state.
  used = 64 * 8 * 4 * 1
  capacity = chips.GENERATIONS["v5p"].capacity_bytes
  assert (stack_hbm.used, stack_hbm.capacity) == (used, capacity)
  # The same tables and slots per chip as hbm.py counts for TPUEmbeddingV2.
  table = api.TableConfig(64, 8, name="t", optimizer=api.SGD(0.1))
  memory = hbm.for_tpu_embedding_v2({"f": api.FeatureConfig(table, output_shape=[8])},
                                    None, None, chips.parse_slice("v5p:1", check=False))
  assert sum(t.lower for t in memory.tables) == used
  most = (capacity - used) // per_unique
  _state(dim=8, topology="v5p:1", max_unique_ids_per_table={"t": most}).check_compile([8])
  with pytest.raises(SparseCoreCompileError) as e:
    _state(dim=8, topology="v5p:1",
           max_unique_ids_per_table={"t": most + 1}).check_compile([8])
  assert e.value.code_name == "E3000"
  need = per_unique * (most + 1)
  assert str(e.value).startswith(
      f"E3000: 'memref.alloca' op current allocation offset upper bound "
      f"({(used + need) // 4} words) exceeds the legitimate user allocatable offset "
      f"upper bound ({capacity // 4 - 1} words) in memory space 203 when allocating "
      f"{need // 4} words.")
  assert f"max_unique_ids_per_table['t'] to at most {most:,}" in str(e.value)


def _table_values(embedding):
  return {n: {s: v.numpy().copy() for s, v in embedding.table_variables(n).items()}
          for n in sc.VOCAB}


def test_first_step_on_the_emulated_tpu_is_refused_and_changes_nothing():
  config = api.SparseCoreEmbeddingConfig(max_ids_per_table={"item_user": LARGEST + 1})
  batch = sc.global_batches()[0]
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None,
                                     sparse_core_embedding_config=config)
    embedding.build()
    before = _table_values(embedding)

    @tf.function
    def step(features):
      def replica_step(f):
        activations, preserved = embedding.embedding_lookup(f)
        embedding.apply_gradients(sc.gradients(activations), preserved)
      strategy.run(replica_step, args=(features,))

    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: sc.as_tensors(batch, ctx.replica_id_in_sync_group * sc.PER_REPLICA,
                                  (ctx.replica_id_in_sync_group + 1) * sc.PER_REPLICA))
    with pytest.raises(tf.errors.ResourceExhaustedError) as e:
      step(per_replica)
    after = _table_values(embedding)
  assert str(e.value).startswith(
      f"E3001: XLA:TPU compile permanent error. Compilation failure: No viable logical "
      f"replica count for the embedding table with metadata: max_nz_per_row = "
      f"{LARGEST + 1}, max_unique_nz_per_row = 256, feature_width = 8, "
      # 2 features x 8 samples per chip over 4 SparseCores (v5p's default).
      f"sample_count = {2 * sc.PER_REPLICA // 4} ")
  assert "stacked table 'item_user' (tables 'item', 'user')" in str(e.value)
  for name in sc.VOCAB:
    for slot, value in before[name].items():
      np.testing.assert_array_equal(after[name][slot], value)


def test_cpu_embedding_on_a_topology_is_refused_at_its_first_step():
  emb = tee.CPUEmbedding(sc.feature_config(16), api.Adagrad(0.1), engine="v2",
                         topology="v5p:4", sparse_core_config=api.SparseCoreEmbeddingConfig(
                             max_ids_per_table={"item_user": LARGEST + 1}))
  emb.build()
  before = {n: emb.variables[n]["parameters"].numpy().copy() for n in sc.VOCAB}
  with pytest.raises(SparseCoreCompileError, match="E3001"):
    emb.enqueue(sc.as_tensors(sc.global_batches()[0]), training=True)
  for name in sc.VOCAB:
    np.testing.assert_array_equal(emb.variables[name]["parameters"].numpy(), before[name])


def _report(limits):
  sgd = api.SGD(0.1)
  tables = {n: api.TableConfig(r, 8, name=n, optimizer=sgd) for n, r in (("a", 64), ("b", 32))}
  config = {"fa": api.FeatureConfig(tables["a"]), "fb": api.FeatureConfig(tables["b"])}
  step = {"fa": tf.ragged.constant([[0, 0, 5], [4], [1, 2], [], [3], [3], [7], [8]],
                                   tf.int64),
          "fb": tf.ragged.constant([[1], [1], [], [], [2, 2], [], [], []], tf.int64)}
  return sparsecore_report.measure(config, [step], Topology(2, 2), limits)


def test_plan_data_says_whether_the_limits_compile():
  text = str(_report(Limits(max_ids_per_table={"a_b": LARGEST + 1})))
  lines = text.splitlines()
  start = lines.index(
      f"compile-time limits (OpenXLA E3001: {PER_ID} B per id of max_ids_per_table "
      f"must fit SparseCore's {TOTAL:,} B scratchpad; the fixed part is an estimate "
      "and only warns):")
  # 8 samples of each of 2 features over 2 chips x 2 SparseCores: 4 per SparseCore.
  table = [l.split() for l in lines[start + 1:start + 6] if not l.startswith("---")]
  assert table == [
      ["stack", "width", "samples/SparseCore", "max_ids_per_table",
       "compiles?", "proposed", "compiles?"],
      ["a_b", "8", "4", str(LARGEST + 1), "refused", "(E3001)", "8", "fits"],
      ["1", "stacks", "1", "refused", "0", "refused"]]
  assert lines[start + 6].startswith("  E3001: XLA:TPU compile permanent error.")
  assert (f"max_nz_per_row = {LARGEST + 1}, max_unique_nz_per_row = 256, "
          f"feature_width = 8, sample_count = 4 ") in lines[start + 6]
  assert "max_ids_per_table={'a_b': 8}," in text
  assert f"max_ids_per_table at most {LARGEST:,} (E3001)" in text


def test_plan_data_proposals_are_capped_where_the_rule_decides():
  report = _report(Limits())
  report.max_ids["a_b"] = LARGEST + 5  # a batch far over what compiles
  proposed = report.proposed_limits()
  assert proposed.max_ids_per_table == {"a_b": LARGEST}
  text = str(report)
  assert (f"  a_b: {LARGEST + 5:,} ids reached one SparseCore, more than any "
          f"max_ids_per_table that compiles (at most {LARGEST:,}): use a smaller "
          "batch per chip or more chips.") in text.splitlines()


PUBLISHED_E3001 = (
    "E3001: XLA:TPU compile permanent error. Compilation failure: No viable logical "
    "replica count for the embedding table with metadata: max_nz_per_row = 141352, "
    "max_unique_nz_per_row = 8, feature_width = 8, sample_count = 204800 (last tried "
    "split factor for vector splitting = 1, last tried split factor for sample "
    "dimension splitting = 1, fixed_size_allocation_bytes = 410880, "
    "row_dependent_size_allocation_bytes = 1696224, total_spmem_size_bytes = 524288). ")


@pytest.mark.parametrize("engine", ["emulated TPUEmbeddingV2", "CPUEmbedding"])
def test_the_published_sample_is_refused_before_the_first_step(engine):
  # One chip of 4 SparseCores (v5p; TPUEmbeddingV2's default): 204,800 x 4 samples.
  batch = 204_800 * 4
  limits = api.SparseCoreEmbeddingConfig(max_ids_per_table={"t": 141_352},
                                         max_unique_ids_per_table={"t": 8})
  table = api.TableConfig(64, 8, name="t", optimizer=api.SGD(0.1))
  config = {"f": api.FeatureConfig(table, output_shape=[batch])}
  ids = tf.zeros([batch], tf.int64)
  if engine == "CPUEmbedding":
    emb = tee.CPUEmbedding(config, engine="v2", topology="v5p:1", sparse_core_config=limits)
    emb.build()
    before = emb.variables["t"]["parameters"].numpy().copy()
    with pytest.raises(SparseCoreCompileError) as e:
      emb.enqueue({"f": ids}, training=True)
    after = emb.variables["t"]["parameters"].numpy()
  else:
    with tee.emulate_tpu(replicas=1, sparsecore=True):
      strategy = tf.distribute.TPUStrategy(
          tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
      with strategy.scope():
        emb = api.TPUEmbeddingV2(config, None, sparse_core_embedding_config=limits)
      emb.build()
      before = emb.table_variables("t")["parameters"].numpy().copy()

      @tf.function
      def step(x):
        def replica_step(f):
          activations, preserved = emb.embedding_lookup(f)
          emb.apply_gradients(activations, preserved)
        strategy.run(replica_step, args=(x,))

      with pytest.raises(SparseCoreCompileError) as e:
        step({"f": ids})
      after = emb.table_variables("t")["parameters"].numpy()
  assert e.value.code_name == "E3001"
  assert str(e.value).startswith(PUBLISHED_E3001 + "(emulated TPUEmbeddingV2: stacked "
                                 "table 't' (tables 't')")
  np.testing.assert_array_equal(after, before)
