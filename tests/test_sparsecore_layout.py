"""SparseCore stacking plans against TensorFlow's own stacker and shard functions."""

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.tpu import tpu_embedding_v3
from tensorflow.python.tpu import tpu_embedding_v3_utils
from tensorflow.python.util import nest

from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.topology import Topology, parse_topology

TOPOLOGIES = [parse_topology("v5p:4"), parse_topology("v6e:8"), Topology(2, 4),
              parse_topology("tpu7x:1")]


def _random_tables(seed, n, groups=("g1", "g2"), big=False):
  rng = random.Random(seed)
  return [sc_layout.StackingInput(
      f"t{i:02d}", rng.choice([1, 7, 100, 999, 4096, 50_000] + [10**8] * big),
      rng.choice([3, 8, 13, 16, 64, 128]), rng.choice(groups),
      rng.choice([0, 0, 128, 65_536, 1_000_000]), rng.choice([0, 1, 2]))
          for i in range(n)]


TABLE_SETS = {
    "mixed_widths_groups": _random_tables(1, 12),
    "one_group_many_tables": _random_tables(2, 30, groups=("g",)),
    "activation_limit": [sc_layout.StackingInput(f"t{i}", 1000, 16, "g", 300_000)
                         for i in range(5)],
    "shard_limit": _random_tables(3, 10, groups=("g",), big=True),
    "random_large_set": _random_tables(4, 60, groups=("a", "b", "c")),
}


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=str)
@pytest.mark.parametrize("name", sorted(TABLE_SETS))
@pytest.mark.parametrize("stacking", [True, False])
def test_formula_equals_tensorflow_stacker(name, topology, stacking):
  tables = TABLE_SETS[name]
  ours = sc_layout.compute_layouts(tables, topology, stacking=stacking,
                                   use_tensorflow=False)
  theirs = sc_layout.compute_layouts(tables, topology, stacking=stacking)
  assert ours == theirs
  assert len(ours) == len(tables)


def test_limits_split_stacks():
  tables = TABLE_SETS["activation_limit"]
  # 300,000 samples / 4 SparseCores x 16 columns x 4 bytes = 4.8 MB > 2 MiB:
  # no two of these tables fit one stack.
  layouts = sc_layout.compute_layouts(tables, Topology(1, 4), use_tensorflow=False)
  assert [l.stack for l in layouts] == ["t0", "t1", "t2", "t3", "t4"]
  small = [sc_layout.StackingInput(f"t{i}", 1000, 16, "g", 128) for i in range(3)]
  layouts = sc_layout.compute_layouts(small, Topology(1, 4), use_tensorflow=False)
  assert {l.stack for l in layouts} == {"t0_t1_t2"}


def test_hand_computed_layout():
  # 2 chips x 4 SparseCores = 8 shards; rows pad to a multiple of 64.
  tables = [sc_layout.StackingInput("a", 100, 13, "g"),
            sc_layout.StackingInput("b", 10, 16, "g"),
            sc_layout.StackingInput("c", 64, 16, "other")]
  a, b, c = sc_layout.compute_layouts(tables, Topology(2, 4), use_tensorflow=False)
  assert (a.stack, a.padded_rows, a.padded_dim, a.row_offset, a.rotation,
          a.rows_per_shard) == ("a_b", 128, 16, 0, 0, 24)
  assert (b.stack, b.padded_rows, b.padded_dim, b.row_offset, b.rotation,
          b.rows_per_shard) == ("a_b", 64, 16, 16, 4, 24)
  assert (c.stack, c.padded_rows, c.row_offset, c.rotation) == ("c", 64, 0, 0)
  # Row 13 of b: shard (13 % 8 + 4) % 8 = 1, position 16 + 13 // 8 = 17.
  assert [int(x) for x in b.shard_and_position(13)] == [1, 17]
  assert int(b.stacked_index(13)) == 1 * 24 + 17


def _feature_configs():
  tpu = tf.tpu.experimental.embedding
  adagrad = tpu.Adagrad(0.1)
  tables = [tpu.TableConfig(vocabulary_size=v, dim=d, name=n, optimizer=o)
            for v, d, n, o in [(1000, 16, "user", adagrad), (77, 13, "cat", adagrad),
                               (5000, 64, "item", tpu.SGD(0.1)),
                               (300, 16, "zip", tpu.Adagrad(0.1)),
                               (40, 16, "ad", tpu.Adagrad(0.2))]]
  features = {t.name: tpu.FeatureConfig(table=t, output_shape=[64]) for t in tables}
  features["history"] = tpu.FeatureConfig(table=tables[2], output_shape=[64, 5])
  return features


@pytest.mark.parametrize("topology", TOPOLOGIES[:3], ids=str)
def test_feature_config_plan_equals_tpu_embedding_v2(topology):
  features = _feature_configs()
  clone = tpu_embedding_v3._clone_feature_config(features)
  flat = tf.nest.flatten(clone)
  s = tpu_embedding_v3._stack_tables_with_same_table_dim_and_optimizer(
      list({id(f.table): f.table for f in flat}.values()),
      nest.flatten_with_joined_string_paths(clone),
      topology.chips, topology.sparsecores_per_chip)
  theirs = {name: l for name, l in s.table_to_layout.items()}
  ours = sc_layout.compute_layouts(sc_layout.stacking_inputs(features), topology)
  assert {l.table: l for l in sc_layout.layouts_from_proto(
      sc_layout.layouts_to_proto(ours))} == {l.table: l for l in ours}
  assert {l.table_name: l.SerializeToString() for l in
          sc_layout.layouts_to_proto(ours).tables} == {
              n: l.SerializeToString() for n, l in theirs.items()}
  # Equal optimizers stack together, a different learning rate does not.
  stacks = {l.table: l.stack for l in ours}
  assert stacks["cat"] == stacks["user"] == stacks["zip"] == "cat_user_zip"
  assert stacks["ad"] == "ad" and stacks["item"] == "item"


_LAYOUT_BYTES = """
import sys
import tensorflow as tf
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.topology import parse_topology
opts = [tf.tpu.experimental.embedding.Adagrad(0.1),
        tf.tpu.experimental.embedding.SGD(0.2),
        tf.tpu.experimental.embedding.Adam(0.3),
        tf.tpu.experimental.embedding.FTRL(0.4)]
tables = [tf.tpu.experimental.embedding.TableConfig(
    1000, 8, optimizer=opts[i % 4], name=f"t{i}") for i in range(8)]
features = {t.name: tf.tpu.experimental.embedding.FeatureConfig(
    t, output_shape=[64]) for t in tables}
layouts = sc_layout.compute_layouts(sc_layout.stacking_inputs(features),
                                    parse_topology("v6e:8"))
print(",".join(dict.fromkeys(l.stack for l in layouts)))
print(",".join(sc_layout.layouts_by_stack(layouts)))
sys.stdout.flush()
sys.stdout.buffer.write(sc_layout.layouts_to_proto(layouts).SerializeToString().hex().encode())
"""


def test_layouts_are_the_same_bytes_in_every_process():
  # Stacks are grouped by hash(optimizer), which Python seeds per process: the
  # stacker's order of stacks differs between processes, the saved bytes
  # (checkpoints, conversions) must not.
  orders, plans, values = set(), set(), set()
  for seed in range(3):  # seeds whose stack orders differ
    out = subprocess.run(
        [sys.executable, "-c", _LAYOUT_BYTES], capture_output=True, check=True,
        env={**os.environ, "PYTHONHASHSEED": str(seed), "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=300).stdout.decode().split("\n")
    orders.add(out[0])
    plans.add(out[1])
    values.add(out[2])
  assert len(orders) > 1, "the stack order did not vary: the test shows nothing"
  assert len(plans) == 1 and len(values) == 1


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=str)
def test_rows_agree_with_tensorflow_shard_functions(topology):
  tables = [sc_layout.StackingInput(n, r, 8, "g") for n, r in
            [("a", 100), ("b", 3), ("c", 257)]]
  layouts = sc_layout.compute_layouts(tables, topology)
  stacked_rows = layouts[0].stacked_rows
  stacked = np.full((stacked_rows, 8), np.nan, np.float32)
  values = {}
  for l in layouts:
    values[l.table] = np.random.default_rng(l.rotation).normal(
        size=(l.padded_rows, 8)).astype(np.float32)
    stacked[l.stacked_index(np.arange(l.padded_rows))] = values[l.table]
  assert not np.isnan(stacked).any()  # every row of the stack is some table's
  for l in layouts:
    back = tpu_embedding_v3_utils.unshuffle_from_sc_to_cpu(
        tf.constant(stacked), l.num_sparse_cores, l.row_offset, l.rows_in_shard,
        l.rotation)
    np.testing.assert_array_equal(back.numpy(), values[l.table])
    shard, pos = tpu_embedding_v3_utils.map_indices_in_shard(
        l.num_sparse_cores, l.row_offset, l.rotation, tf.range(l.padded_rows))
    ours = l.shard_and_position(np.arange(l.padded_rows))
    np.testing.assert_array_equal(shard.numpy(), ours[0])
    np.testing.assert_array_equal(pos.numpy(), ours[1])
    for k in range(l.num_sparse_cores):
      block = stacked[k * l.rows_per_shard + l.row_offset:][:l.rows_in_shard]
      np.testing.assert_array_equal(block, values[l.table][l.shard_block(k)])
  # A lone table without rotation is TensorFlow's mod sharding (shard_table).
  single = layouts[0]
  np.testing.assert_array_equal(
      tpu_embedding_v3_utils.shard_table(single.num_sparse_cores,
                                         tf.constant(values["a"])).numpy(),
      stacked[np.concatenate([k * single.rows_per_shard + np.arange(
          single.rows_in_shard) for k in range(single.num_sparse_cores)])])


@pytest.mark.parametrize("text, error", [
    ("v9:4", 'unknown TPU generation "v9". Valid: "tpu7x", "v5p", "v6e".'),
    ("v5p", "cannot read topology 'v5p'. Fix: write GENERATION:CHIPS (v5p:4, "
            "v6e:4, tpu7x:4) or CHIPSxSPARSECORES (8x4)."),
    ("0x4", "topology chips must be a positive integer, got chips=0."),
])
def test_topology_errors(text, error):
  with pytest.raises(errors.ConfigError) as e:
    parse_topology(text)
  assert str(e.value) == error


def test_topology_presets():
  assert parse_topology("v5p:4").num_sparse_cores == 16
  assert parse_topology("v6e:8").num_sparse_cores == 16
  assert parse_topology("8x4") == Topology(8, 4, name="8x4")
