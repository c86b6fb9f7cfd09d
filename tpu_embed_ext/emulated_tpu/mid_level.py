"""``TPUEmbedding`` on the emulated TPU: ``CPUEmbedding`` with its TPU-side contract."""

from __future__ import annotations

from tpu_embed_ext import emulated_tpu
from tpu_embed_ext.emulation import engine

__all__ = ["TPUEmbedding", "TPUEmbeddingV2WithoutSparseCore"]


class TPUEmbedding(engine.CPUEmbedding):
  """``tf.tpu.experimental.embedding.TPUEmbedding`` under the emulated TPU."""

  def __init__(self, feature_config, optimizer,
               pipeline_execution_with_tensor_core: bool = False):
    super().__init__(feature_config, optimizer,
                     pipeline_execution_with_tensor_core, engine="v1")


class TPUEmbeddingV2WithoutSparseCore:
  """``TPUEmbeddingV2`` on an emulated TPU without SparseCore: refused."""

  def __init__(self, *args, **kwargs):
    del args, kwargs
    raise emulated_tpu.NotEmulatedError(
        "TPUEmbeddingV2 needs SparseCore, and this emulated TPU has none (as a "
        "TPU v2-v4). Fix: emulate_tpu(sparsecore=True) (or `emulate "
        "--sparsecore`), or use tf.tpu.experimental.embedding.TPUEmbedding.")
