"""A DLRM-style ranking model whose embeddings come from ``EmbeddingLayer``.

Bottom MLP over the dense features, one embedding vector per categorical
feature, pairwise dot-product interaction (Naumov et al., 2019), top MLP to one
logit. Tables with different widths cannot be dotted with each other; set
``interaction="concat"`` for those specs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import keras
import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.keras.layer import EmbeddingLayer

__all__ = ["RankingModel"]


def _mlp(units: Sequence[int], name: str, last_activation="relu"):
  layers = [keras.layers.Dense(u, activation="relu") for u in units[:-1]]
  layers.append(keras.layers.Dense(units[-1], activation=last_activation))
  return keras.Sequential(layers, name=name)


class RankingModel(keras.Model):
  """``features = {"dense": [B, n], "categorical": {name: ids}}`` -> logits [B, 1].

  A multi-hot feature's ids are a ``tf.RaggedTensor`` or ``tf.SparseTensor``,
  on CPU and under a TPU strategy alike (``keras/distributed_fit.py``).
  """

  def __init__(self, spec, *, bottom: Sequence[int] = (64, 16),
               top: Sequence[int] = (64, 32), interaction: str = "dot",
               engine: Optional[str] = None, validate: bool = True, **kwargs):
    super().__init__(**kwargs)
    if interaction not in ("dot", "concat"):
      raise errors.ConfigError(
          f'interaction must be "dot" or "concat", got {interaction!r}.',
          path="train.model.interaction")
    dims = {t.dim for t in spec.tables}
    if interaction == "dot" and (len(dims) != 1 or bottom[-1] not in dims):
      raise errors.ConfigError(
          f"interaction='dot' needs every table and the bottom MLP's last "
          f"layer to have one width, got table dims {sorted(dims)} and bottom "
          f"{list(bottom)}. Fix: make them equal or use interaction='concat'.",
          path="train.model.bottom")
    self.interaction = interaction
    self.feature_names = [f.name for f in spec.features]
    self.embedding = EmbeddingLayer(spec, engine=engine, validate=validate,
                                    name="embedding")
    self.bottom = _mlp(bottom, "bottom_mlp")
    self.top = _mlp(tuple(top) + (1,), "top_mlp", last_activation=None)

  def call(self, inputs, training=False):
    activations = self.embedding(dict(inputs["categorical"]), training=training)
    vectors = [self.bottom(inputs["dense"])]
    for name in self.feature_names:
      a = activations[name]
      # Sequence features come back as [B, L, D]: pool them to one vector.
      vectors.append(tf.reduce_sum(a, axis=1) if a.shape.rank == 3 else a)
    if self.interaction == "concat":
      return self.top(tf.concat(vectors, axis=1))
    stacked = tf.stack(vectors, axis=1)                        # [B, F, D]
    dots = tf.linalg.matmul(stacked, stacked, transpose_b=True)  # [B, F, F]
    n = len(vectors)
    upper = tf.constant([i * n + j for i in range(n) for j in range(i + 1, n)])
    pairs = tf.gather(tf.reshape(dots, [-1, n * n]), upper, axis=1)
    return self.top(tf.concat([vectors[0], pairs], axis=1))
