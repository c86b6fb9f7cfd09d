"""The plan: bytes, tags, warnings, config proto; the `plan` command."""

import subprocess
import sys

import pytest
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
