"""SparseCore input limits against batches counted by hand (sparse_core_preprocess_ops.cc).

TensorFlow's CPU wheel registers no kernel for the preprocessing ops
(ConvertToListOfSparseCoreCooTensors, SortListOfSparseCoreCooTensors,
GetStatsFromListOfSparseCoreCooTensors: "no registered kernels"); the first
test pins that, so this file switches to them as an oracle when they appear.
"""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.limits import (FeatureIds, Limits, check_limits,
                                             count_ids)
from tpu_embed_ext.sparsecore.topology import Topology

TOPOLOGY = Topology(2, 2)  # 4 SparseCores
LAYOUTS = sc_layout.compute_layouts([sc_layout.StackingInput("a", 64, 8, "g"),
                                     sc_layout.StackingInput("b", 32, 8, "g")], TOPOLOGY)


def _feature(table, rows):
  samples = [s for s, ids in enumerate(rows) for _ in ids]
  return FeatureIds(table, np.array(samples, np.int64),
                    np.array([i for ids in rows for i in ids], np.int64), len(rows))


# 8 samples: chip 0 gets samples 0-3 (SparseCore 0: 0-1, 1: 2-3), chip 1 4-7.
FA = _feature("a", [[0, 0, 5], [4], [1, 2], [], [3], [3], [7], [8]])
FB = _feature("b", [[1], [1], [], [], [2, 2], [], [], []])


def test_tensorflow_ships_no_cpu_kernel_for_the_preprocessing_ops():
  with pytest.raises(tf.errors.NotFoundError, match="no registered kernels"):
    tf.raw_ops.ConvertToListOfSparseCoreCooTensors(
        indices_or_row_splits=tf.zeros((0,), tf.int32), values=tf.constant([1]),
        weights=tf.constant([1.0]), sample_count=1, num_sc_per_chip=1, row_offset=0,
        col_offset=0, col_shift=0, num_sc_shards=1, stacked_table_sample_count=1,
        combiner="sum")


def test_layout_of_the_hand_example():
  a, b = LAYOUTS
  assert (a.stack, a.row_offset, a.rotation, b.row_offset, b.rotation) == (
      "a_b", 0, 0, 16, 2)


def test_counts_by_hand():
  (counts,) = count_ids([FA, FB], LAYOUTS, TOPOLOGY)
  ids = np.zeros((2, 2, 4), int)
  unique = np.zeros((2, 2, 4), int)
  # Table a (offset 0, rotation 0): id i -> SparseCore i % 4. Table b (offset
  # 16, rotation 2): id i -> SparseCore (i % 4 + 2) % 4.
  # chip 0, source 0 (samples 0, 1): a: (0,0) (0,5) (1,4); b: (0,1) (1,1).
  ids[0, 0] = [2, 1, 0, 2]
  unique[0, 0] = [2, 1, 0, 1]     # b's id 1 twice: one row, two ids
  # chip 0, source 1 (samples 2, 3): a: (2,1) (2,2).
  ids[0, 1] = unique[0, 1] = [0, 1, 1, 0]
  # chip 1, source 0 (samples 4, 5): a: (4,3) (5,3); b: (4,2) once (duplicate).
  ids[1, 0] = [1, 0, 0, 2]
  unique[1, 0] = [1, 0, 0, 1]
  # chip 1, source 1 (samples 6, 7): a: (6,7) (7,8).
  ids[1, 1] = unique[1, 1] = [1, 0, 0, 1]
  np.testing.assert_array_equal(counts.ids, ids)
  np.testing.assert_array_equal(counts.unique_ids, unique)
  assert counts.samples_per_chip == 8 and counts.chip_capacity == 64 * 8


def test_dropping_by_hand():
  counts, keep = check_limits([FA, FB], LAYOUTS, TOPOLOGY, Limits(
      max_ids_per_chip_per_sample=2, allow_id_dropping=True))
  # 16 slots per chip, each (source, destination) segment padded to 8:
  # chip 0: (0,0) 2 ids -> 8 slots, (0,1) 1 -> 16 slots, then nothing fits.
  # chip 1: (0,0) 1 -> 8, (0,3) 2 -> 16, then nothing fits.
  np.testing.assert_array_equal(keep[0], [1, 1, 1, 1, 0, 0, 1, 1, 0, 0])
  np.testing.assert_array_equal(keep[1], [0, 0, 1, 1])
  assert counts[0].dropped == 6 and list(counts[0].chip_slots) == [16, 16]
  # Room for all: nothing dropped, same counts.
  counts, keep = check_limits([FA, FB], LAYOUTS, TOPOLOGY, Limits(
      max_ids_per_chip_per_sample=8))
  assert all(k.all() for k in keep) and counts[0].dropped == 0
  assert list(counts[0].chip_slots) == [40, 32]


@pytest.mark.parametrize("limits, message", [
    # chip 0 has 7 ids; 3 are packed when (0,3) overflows: 4 remain.
    (Limits(max_ids_per_chip_per_sample=2),
     "table 'a_b': chip 0 needs more than its 16 id slots (max_ids_per_chip_per_sample=2"
     " x 8 samples); 4 ids do not fit. Fix: raise max_ids_per_chip_per_sample, or set "
     "allow_id_dropping=True to drop them as SparseCore does."),
    (Limits(max_ids_per_table={"a_b": 1}, allow_id_dropping=True),
     "table 'a_b': SparseCore 0 gets 2 ids from SparseCore 0 of chip 0, over the limit "
     "max_ids_per_table['a_b']=1. SparseCore fails this step (it never drops for this "
     "limit). Fix: raise max_ids_per_table['a_b'] (the stacked table's name) to at "
     "least 2."),
    (Limits(max_unique_ids_per_table={"a_b": 1}),
     "table 'a_b': SparseCore 0 gets 2 unique ids from SparseCore 0 of chip 0, over "
     "the limit max_unique_ids_per_table['a_b']=1. SparseCore fails this step (it "
     "never drops for this limit). Fix: raise max_unique_ids_per_table['a_b'] (the "
     "stacked table's name) to at least 2."),
])
def test_limit_errors_name_the_table_limit_and_count(limits, message):
  with pytest.raises(errors.InputError) as e:
    check_limits([FA, FB], LAYOUTS, TOPOLOGY, limits)
  assert str(e.value) == message


def test_input_errors():
  with pytest.raises(errors.InputError) as e:
    count_ids([FA], sc_layout.compute_layouts(
        [sc_layout.StackingInput("a", 64, 8, "g")], Topology(3, 1)), Topology(3, 1))
  assert str(e.value) == (
      "SparseCore preprocessing needs a power-of-two number of SparseCores, the "
      "topology 3 chips x 1 SparseCores has 3 (ConvertToListOfSparseCoreCooTensors: "
      "num_sc_shards is not a power of two). Fix: use 2^k chips.")
  with pytest.raises(errors.InputError) as e:
    count_ids([_feature("a", [[1]] * 6)], LAYOUTS, TOPOLOGY)
  assert str(e.value) == (
      "feature 0 (table 'a') has 6 samples, not a multiple of 2 chips x 2 SparseCores"
      " per chip: the TPU splits each chip's batch evenly over its SparseCores. Fix: "
      "use a batch size divisible by 4.")


def test_count_slots_without_limits():
  (counts,) = count_ids([FA, FB], LAYOUTS, TOPOLOGY)
  # chip 0: segments 2, 1, 2 | 1, 1 -> 5 segments of 8; chip 1: 1, 2 | 1, 1 -> 4.
  assert list(counts.chip_slots) == [40, 32]


def test_measure_reports_maxima_and_suggests_limits():
  from tpu_embed_ext.cli import sparsecore_report
  api = tf.tpu.experimental.embedding
  tables = {n: api.TableConfig(vocabulary_size=r, dim=8, name=n, optimizer=api.SGD(0.1))
            for n, r in (("a", 64), ("b", 32))}
  sgd = api.SGD(0.1)
  for t in tables.values():
    t.optimizer = sgd  # one optimizer object: one stack, as in LAYOUTS
  config = {"fa": api.FeatureConfig(table=tables["a"]),
            "fb": api.FeatureConfig(table=tables["b"])}
  ragged = lambda f: tf.RaggedTensor.from_value_rowids(f.ids, f.samples, f.sample_count)
  step = {"fa": ragged(FA), "fb": ragged(FB)}
  doubled = {"fa": ragged(FA._replace(ids=FA.ids * 0)), "fb": ragged(FB)}
  out = sparsecore_report.measure(config, [step, doubled], TOPOLOGY,
                       Limits(max_ids_per_table={"a_b": 2}))
  assert out.steps == 2
  # Step 2 sends all of a's ids to id 0 (SparseCore 0): chip 1 source 0 gets
  # (4,0) (5,0) from a and (4,2) from b there: 3 ids, 2 unique (step 1: 2, 2).
  assert out.max_ids == {"a_b": 3} and out.max_unique_ids == {"a_b": 2}
  assert out.max_chip_slots == {"a_b": 40}
  # 40 slots / 8 samples -> 5 ids per sample; 5 x 8 = 40 is a multiple of 8.
  assert out.suggested_ids_per_chip_per_sample() == 5
  text = str(out)
  assert "max_ids_per_table={'a_b': 8}" in text and "2 steps" in text
  assert text.splitlines()[3].split()[:3] == ["a_b", "3", "OVER"]


def test_more_input_errors():
  unsorted = FeatureIds("a", np.array([1, 0]), np.array([3, 4]), 8, "fa")
  with pytest.raises(errors.InputError) as e:
    count_ids([unsorted], LAYOUTS, TOPOLOGY)
  assert str(e.value) == (
      "feature 'fa' (table 'a'): samples must be non-decreasing, as SparseCore's "
      "preprocessing requires (sorted SparseTensor indices). Fix: reorder the "
      "SparseTensor (tf.sparse.reorder).")
  with pytest.raises(errors.InputError) as e:
    count_ids([FA._replace(table="z")], LAYOUTS, TOPOLOGY)
  assert str(e.value) == (
      "feature 0 (table 'z'): the table has no SparseCore layout. Fix: compute the "
      "layouts for every table (['a', 'b']).")
