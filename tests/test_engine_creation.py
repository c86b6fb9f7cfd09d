"""How an engine comes to be: create_embedding picks TPUEmbedding,
TPUEmbeddingV2 or CPUEmbedding; tables are named and sized at build without
touching the user's configs, and refused by name when memory cannot hold them."""

import re

import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.emulation import dispatch

api = tf.tpu.experimental.embedding


def test_create_embedding_dispatch_with_a_stand_in_tpu_strategy(monkeypatch):
  from tensorflow.python.distribute import tpu_strategy
  from tensorflow.python.tpu import tpu_embedding_v3
  real_v2 = tpu_embedding_v3.TPUEmbeddingV2

  class FakeStrategy(tpu_strategy.TPUStrategyV2):
    def __init__(self, sparsecore):  # No TPU: skip the real constructor.
      self.sparsecore = sparsecore

  made = []

  class Recorder:
    def __init__(self, kind):
      self.kind = kind

    def __call__(self, config, optimizer):
      made.append((self.kind, optimizer))
      return object.__new__(real_v2) if self.kind == "v2" else \
          type("FakeV1", (), {})()

  monkeypatch.setattr(api, "TPUEmbedding", Recorder("v1"))
  monkeypatch.setattr(tpu_embedding_v3, "TPUEmbeddingV2", Recorder("v2"))
  monkeypatch.setattr(dispatch, "_sparsecore", lambda s: s.sparsecore)
  config = {"f": api.FeatureConfig(api.TableConfig(5, 2, name="t"), output_shape=[2])}
  dispatch.create_embedding(config, tee.SGD(learning_rate=0.2),
                              strategy=FakeStrategy(False))
  dispatch.create_embedding(config, api.SGD(0.1), strategy=FakeStrategy(True))
  dispatch.create_embedding(config, api.SGD(0.1), engine="v2",
                              strategy=FakeStrategy(False))
  assert [k for k, _ in made] == ["v1", "v2", "v2"]
  assert isinstance(made[0][1], api.SGD) and made[0][1].learning_rate == 0.2
  cpu = dispatch.create_embedding(config, api.SGD(0.1), engine="v2")
  assert isinstance(cpu, tee.CPUEmbedding) and cpu.engine == "v2"


def test_user_table_configs_are_never_mutated():
  table = api.TableConfig(10, 2)  # No name, no optimizer.
  config = {"f": api.FeatureConfig(table)}
  emb = tee.CPUEmbedding(config, api.SGD(0.1))
  assert table.name is None and table.optimizer is None
  assert list(emb.variables) == ["table_0"]
  assert emb.embedding_tables[table] is emb.variables["table_0"]["parameters"]


def test_tables_larger_than_memory_are_refused_by_build_naming_the_table(monkeypatch):
  """Before: ResourceExhaustedError from build() naming no table (2^40 rows)."""
  from tpu_embed_ext.host import memory as host_memory  # pylint: disable=g-import-not-at-top
  huge = api.TableConfig(2 ** 40, 8, name="huge")
  small = api.TableConfig(6, 2, name="small")
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(huge, name="f"),
                          "g": api.FeatureConfig(small, name="g")}, api.Adagrad(0.1))
  with pytest.raises(host_memory.MemoryLimitError, match=re.escape(
      "table 'huge' (1,099,511,627,776 x 8, 1 slot(s)) needs 65,536.0 GiB (float32), "
      "and all tables and slots 65,536.0 GiB, but this machine has ")):
    emb.build()
  assert emb._variables is None  # pylint: disable=protected-access
  # The bound is what the machine has: 6 x 2 x 4 bytes x 2 = 96 bytes.
  monkeypatch.setattr(host_memory, "available_memory", lambda: 95)
  with pytest.raises(host_memory.MemoryLimitError, match=re.escape(
      "table 'small' (6 x 2, 1 slot(s)) needs 0.0 GiB")):
    tee.CPUEmbedding({"g": api.FeatureConfig(small, name="g")}, api.Adagrad(0.1)).build()
  monkeypatch.setattr(host_memory, "available_memory", lambda: 96)
  tee.CPUEmbedding({"g": api.FeatureConfig(small, name="g")}, api.Adagrad(0.1)).build()


