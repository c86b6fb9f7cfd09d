"""`plan --engine v2`: stacks, padding and memory per chip."""

import subprocess
import sys

import numpy as np
import yaml

import tpu_embed_ext as tee

CONFIG = {
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
  plan = tee.plan(tee.EmbeddingSpec.from_dict(CONFIG)).sparsecore("v6e:4")
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
  config.write_text(yaml.safe_dump(CONFIG))
  out = subprocess.run(
      [sys.executable, "-m", "tpu_embed_ext", "plan", "--config", str(config),
       "--engine", "v2", "--topology", "v6e:4"], capture_output=True, text=True,
      timeout=600, check=True).stdout
  assert "SparseCore (TPUEmbeddingV2) layout on v6e:4 (4 chips x 2 SparseCores)" in out
  line = next(l for l in out.splitlines() if l.startswith("a_b "))
  assert line.split() == ["a_b", "a", "100", "x", "8", "128", "x", "8", "0", "0",
                          "9.0", "KiB", "9.0", "KiB"]
  assert "3 stacks" in out and "20.0 KiB per chip" in out


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
