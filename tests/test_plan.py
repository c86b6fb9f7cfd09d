"""The plan: bytes, tags, warnings, config proto; the `plan` command; and
`plan --engine v2`: SparseCore stacks, padding and memory per chip."""

import subprocess
import sys

import numpy as np
import pytest
import yaml
from tensorflow.core.protobuf.tpu import optimization_parameters_pb2 as pb

import tpu_embed_ext as tee

CONFIG = {
    "optimizer": {"type": "adagrad", "learning_rate": 0.1},
    "schedules": {"decay": {"class": "InverseTimeDecay", "initial_learning_rate": 0.1,
                            "decay_steps": 10, "decay_rate": 0.5}},
    "tables": {
        "a": {"vocabulary_size": 100, "dim": 8},                           # 1 slot
        "b": {"vocabulary_size": 10, "dim": 4, "optimizer": {
            "type": "adam", "learning_rate": "decay", "lazy_adam": False}},  # 2 slots
        "c": {"vocabulary_size": 7, "dim": 2, "optimizer": {
            "type": "sgd", "learning_rate": "decay", "clip_weight_max": 1.0,
            "weight_decay_factor": 0.1, "low_dimensional_packing_status": True}},
        "d": {"vocabulary_size": 5, "dim": 2, "optimizer": {
            "type": "ftrl", "learning_rate": {"class": "InverseTimeDecay",
                                              "initial_learning_rate": 0.1,
                                              "decay_steps": 10, "decay_rate": 0.5}}},
    },
    "features": {"fa": {"table": "a"}, "fb": {"table": "b"}, "fc": {"table": "c"},
                 "fd": {"table": "d"}},
}


def test_bytes_match_hand_computed_values():
  plan = tee.plan(tee.EmbeddingSpec.from_dict(CONFIG))
  by_name = {t.name: t for t in plan.tables}
  assert by_name["a"].total_bytes == 4 * 100 * 8 * 2      # parameters + accumulators
  assert by_name["b"].total_bytes == 4 * 10 * 4 * 3       # + momenta + velocities
  assert by_name["c"].total_bytes == 4 * 7 * 2 * 1        # SGD: no slots
  assert by_name["d"].total_bytes == 4 * 5 * 2 * 3        # + accumulators + linears
  assert plan.total_bytes == 6400 + 480 + 56 + 120


def test_equal_schedules_share_one_tag_in_plan_and_proto():
  plan = tee.plan(tee.EmbeddingSpec.from_dict(CONFIG))
  # "decay" by name twice and once written inline: one schedule, one tag.
  assert plan.tags == {"a": None, "b": 0, "c": 0, "d": 0}
  proto = plan.config_proto()
  tags = {t.name: (t.optimization_parameters.learning_rate.WhichOneof("learning_rate"),
                   t.optimization_parameters.learning_rate.dynamic.tag)
          for t in proto.table_descriptor}
  assert tags == {"a": ("constant", 0), "b": ("dynamic", 0), "c": ("dynamic", 0),
                  "d": ("dynamic", 0)}
  c = next(t for t in proto.table_descriptor if t.name == "c")
  assert (c.optimization_parameters.low_dimensional_packing_status
          == pb.LowDimensionalPackingStatus.ENABLED)
  assert [f.name for f in proto.feature_descriptor] == ["fa", "fb", "fc", "fd"]
  assert {t.name: t.vocabulary_size for t in proto.table_descriptor} == {
      "a": 100, "b": 10, "c": 7, "d": 5}


def test_sparsecore_warnings():
  plan = tee.plan(tee.EmbeddingSpec.from_dict(CONFIG))
  assert plan.warnings == [
      "table 'b': lazy_adam=False is ignored by TPUEmbeddingV2 (SparseCore): no "
      "non-lazy Adam (SparseCore updates only looked-up rows).",
      "table 'c': clip_weight_max=1.0 is ignored by TPUEmbeddingV2 (SparseCore): no "
      "weight clipping.",
      "table 'c': low_dimensional_packing_status=True is ignored by TPUEmbeddingV2 "
      "(SparseCore): no low-dimensional packing.",
      "table 'c': weight_decay_factor=0.1 is rejected by TPUEmbeddingV2 (SparseCore): "
      "it raises NotImplementedError."]


def test_str_shows_tables_totals_and_tag_values():
  text = str(tee.plan(tee.EmbeddingSpec.from_dict(CONFIG)))
  assert "a      100 x 8" in text
  assert "total  122 rows" in text
  # InverseTimeDecay: 0.1 / (1 + 0.5 * t / 10) at t=0 and t=10.
  assert "tag 0: InverseTimeDecay(" in text and "t=0: 0.1, t=10: 0.06667" in text


@pytest.mark.parametrize("config", ["configs/ranking.yaml", "configs/criteo.yaml"])
def test_plan_command(config):
  out = subprocess.run([sys.executable, "-m", "tpu_embed_ext", "plan", "--config",
                        config, "--proto"], capture_output=True, text=True, check=True)
  assert "total" in out.stdout and "table_descriptor" in out.stdout


def test_plan_command_reports_config_errors(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text("tables: {a: {vocabulary_size: 0, dim: 2}}\nfeatures: {f: {table: a}}\n"
                 "optimizer: {type: sgd}\n")
  out = subprocess.run([sys.executable, "-m", "tpu_embed_ext", "plan", "--config",
                        str(bad)], capture_output=True, text=True)
  assert out.returncode == 2
  assert f"error: {bad}: tables.a.vocabulary_size: vocabulary_size must be a positive" in out.stderr


# --- plan --engine v2: SparseCore stacks, padding and memory per chip -----------

SPARSECORE_CONFIG = {
    "optimizer": {"type": "adagrad", "learning_rate": 0.1},
    "tables": {
        "a": {"vocabulary_size": 100, "dim": 8},
        "b": {"vocabulary_size": 1000, "dim": 5},
        "c": {"vocabulary_size": 10, "dim": 8, "optimizer": {"type": "adam",
                                                            "learning_rate": 0.01}},
        "d": {"vocabulary_size": 7, "dim": 8, "optimizer": {"type": "sgd",
                                                           "learning_rate": 0.1}},
    },
    "features": {"fa": {"table": "a"}, "fb": {"table": "b"}, "fc": {"table": "c"},
                 "fd": {"table": "d"}},
}


def test_stacks_and_memory_per_chip_by_hand():
  plan = tee.plan(tee.EmbeddingSpec.from_dict(SPARSECORE_CONFIG)).sparsecore("v6e:4")
  # 4 chips x 2 SparseCores = 8 shards: rows pad to a multiple of 64, columns to 8.
  stacks = {s: [l.table for l in ls] for s, ls in plan.stacks.items()}
  assert stacks == {"a_b": ["a", "b"], "c": ["c"], "d": ["d"]}
  a, b = plan.stacks["a_b"]
  assert (a.padded_rows, b.padded_rows, b.padded_dim) == (128, 1024, 8)
  assert (b.row_offset, b.rotation, a.rows_per_shard) == (16, 2, 144)
  # Per chip: 144 rows x 2 SparseCores x 8 columns x 4 bytes, once per slot.
  assert plan.stack_bytes_per_chip("a_b") == {"parameters": 9216, "slots": 9216}
  # c and d: 64 padded rows / 4 chips = 16 rows x 8 columns x 4 bytes.
  assert plan.stack_bytes_per_chip("c") == {"parameters": 512, "slots": 1024}
  assert plan.stack_bytes_per_chip("d") == {"parameters": 512, "slots": 0}
  assert plan.bytes_per_chip == 9216 * 2 + 512 * 3 + 512 == 20480


def test_plan_command_prints_stacks(tmp_path):
  config = tmp_path / "c.yaml"
  config.write_text(yaml.safe_dump(SPARSECORE_CONFIG))
  out = subprocess.run(
      [sys.executable, "-m", "tpu_embed_ext", "plan", "--config", str(config),
       "--engine", "v2", "--topology", "v6e:4"], capture_output=True, text=True,
      timeout=600, check=True).stdout
  assert "SparseCore (TPUEmbeddingV2) layout on v6e:4 (4 chips x 2 SparseCores)" in out
  layout = out[out.index("SparseCore (TPUEmbeddingV2) layout"):]
  line = next(l for l in layout.splitlines() if l.startswith("a_b "))
  assert line.split() == ["a_b", "a", "100", "x", "8", "128", "x", "8", "0", "0",
                          "9.0", "KiB", "9.0", "KiB"]
  assert "3 stacks" in out and "20.0 KiB per chip" in out
  # --topology adds the memory per device, the same tables and slots per chip.
  assert "memory per device, TPUEmbeddingV2 on v6e:4" in out
  assert "20.0 KiB of 32.0 GiB per device on v6e:4 (4 devices)" in out


def test_plan_data_counts_a_single_hot_table_like_numpy():
  from tpu_embed_ext import job
  out = subprocess.run(
      [sys.executable, "-m", "tpu_embed_ext", "plan", "--config", "configs/tiny.yaml",
       "--engine", "v2", "--topology", "2x4", "--data", "2"], capture_output=True,
      text=True, timeout=300, check=True).stdout
  data = out.split("SparseCore input per step", 1)[1]
  row = next(l for l in data.splitlines() if l.startswith("t_c9 ")).split()
  spec = tee.EmbeddingSpec.from_file("configs/tiny.yaml")
  cfg = job.TrainConfig.from_dict(spec.train)
  dataset, _ = job.input_datasets(spec, cfg)
  # t_c9 stacks alone (its own Adam optimizer), rotation 0, one id per sample:
  # each (source SparseCore, destination) gets the samples whose id % 8 is the
  # destination, each once; unique ids are the distinct ids among them.
  most, most_unique = 0, 0
  for inputs, _ in dataset.take(2):
    ids = np.asarray(inputs["categorical"]["c9"]).reshape(2, 4, -1)  # chip, source
    for chip in range(2):
      for source in range(4):
        for dst in range(8):
          mine = ids[chip, source][ids[chip, source] % 8 == dst]
          most, most_unique = max(most, len(mine)), max(most_unique, len(set(mine)))
  assert "2 steps" in data
  # stack, max ids, limit, max unique, limit, ...
  assert (int(row[1]), int(row[2]), int(row[3])) == (most, 256, most_unique)
  assert most > 0
