"""``create_embedding``: the right mid-level API object for where code runs.

The TPU branch was not run on TPU hardware (none is reachable where this
package is developed); it runs end to end under the emulated TPU
(``emulate_tpu``: tests/test_emulated_keras.py).
"""

from __future__ import annotations

import tensorflow as tf

from tpu_embed_ext.spec import optimizers
from tpu_embed_ext.tf import optimizers as tf_optimizers
from tpu_embed_ext.spec import EmbeddingSpec
from tpu_embed_ext.emulation import engine as engine_lib

__all__ = ["create_embedding", "uses_sparsecore"]


def uses_sparsecore(strategy=None) -> bool:
  """Whether ``create_embedding`` makes a ``TPUEmbeddingV2`` under ``strategy``
  (default: the one in scope): a ``TPUStrategy`` on SparseCore hardware."""
  from tensorflow.python.distribute import tpu_strategy
  strategy = strategy or tf.distribute.get_strategy()
  return (isinstance(strategy, (tpu_strategy.TPUStrategy, tpu_strategy.TPUStrategyV2))
          and _sparsecore(strategy))


def _sparsecore(strategy) -> bool:
  """Whether a TPUStrategy's hardware embeds with SparseCore (TPUEmbeddingV2)."""
  feature = strategy.extended.tpu_hardware_feature.embedding_feature
  from tensorflow.python.tpu import tpu_hardware_feature
  return feature in (tpu_hardware_feature.HardwareFeature.EmbeddingFeature.V2,)


def create_embedding(feature_config, optimizer=None, *, engine=None,
                     validate: bool = True, strategy=None):
  """The right mid-level API object for where the code runs.

  Under a ``TPUStrategy`` (the one in scope, or ``strategy``):
  ``TPUEmbeddingV2`` on SparseCore hardware (``embedding_feature`` V2, e.g.
  v5p/v6e) or when ``engine="v2"``, ``TPUEmbedding`` otherwise. Anywhere
  else: ``CPUEmbedding`` emulating ``engine`` (default ``"v1"``), under the
  strategy in scope (default, one-device, mirrored or multi-worker mirrored).

  An ``EmbeddingSpec`` on a TPU binds its schedules to a fresh step variable
  that the caller must advance (``EmbeddingLayer`` does).
  """
  from tensorflow.python.distribute import tpu_strategy
  feature_config = EmbeddingSpec.coerce(feature_config)
  strategy = strategy or tf.distribute.get_strategy()
  if isinstance(strategy, (tpu_strategy.TPUStrategy, tpu_strategy.TPUStrategyV2)):
    # Every replica advances it once per step (EmbeddingLayer): the first
    # replica's increment is the step's, so it counts steps, not replicas
    # times steps.
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step",
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    if hasattr(feature_config, "feature_config"):
      feature_config = feature_config.feature_config(step=step)
    if isinstance(optimizer, optimizers.OptimizerSpec):
      optimizer = tf_optimizers.to_tf(optimizer)
    use_v2 = engine == "v2" or (engine is None and _sparsecore(strategy))
    if use_v2:
      from tensorflow.python.tpu import tpu_embedding_v3
      embedding = tpu_embedding_v3.TPUEmbeddingV2(feature_config, optimizer)
    else:
      embedding = tf.tpu.experimental.embedding.TPUEmbedding(
          feature_config, optimizer)
    # TPU engines have no step; the caller advances this one per update.
    object.__setattr__(embedding, "step", step)
    return embedding
  return engine_lib.CPUEmbedding(feature_config, optimizer, engine=engine or "v1",
                                 validate=validate)
