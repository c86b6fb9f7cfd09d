"""Keras ``fit`` / ``evaluate`` under a TPU strategy with ragged and sparse ids.

A TPU embedding program feeds multi-hot ids as ``tf.RaggedTensor`` or
``tf.SparseTensor`` straight from its distributed dataset
(``InputOptions(experimental_fetch_to_device=False)``): ``TPUEmbedding``
refuses ids computed inside ``strategy.run``. Keras 3 trains such batches
(its train step passes them to ``strategy.run`` as they are), with one
exception, before the first step:

``keras/src/backend/tensorflow/trainer.py``, ``TensorFlowTrainer.
_maybe_symbolic_build`` (called by ``fit`` and ``evaluate`` of a model made
under a strategy's scope) takes the first distributed batch and reduces it
with ``strategy.reduce("MEAN", batch, axis=None)`` to get one batch whose
shapes and dtypes build the model, its compiled metrics and loss
(``Trainer._symbolic_build`` keeps only ``v.shape`` and ``v.dtype``). A
mean of ragged or sparse per-replica values does not exist:
``MirroredStrategy`` fails on ``RaggedTensor.device``, ``TPUStrategy``
(``_reduce_to``) adds them with ``add_n``, which fails on rows of other
lengths and on sparse values.

``install()`` (called when an ``EmbeddingLayer`` is made under a strategy)
wraps that method: a batch with a ragged or sparse per-replica value is
built from the first replica's value for those leaves (the shape and dtype
the mean would have had: every replica's batch has the per-replica shape),
and from the mean, as before, for the others. Any other batch takes
Keras's own path unchanged. No value of the batch reaches a table or a
metric: the build only traces shapes (``EmbeddingLayer`` answers a symbolic
call with zeros, ``layer._shape_only``).
"""

from __future__ import annotations

import functools

import tensorflow as tf

__all__ = ["install", "installed"]

_COMPOSITE = (tf.RaggedTensor, tf.SparseTensor)


def _trainer_class():
  """Keras's TensorFlow trainer class, or None (another Keras or backend)."""
  try:
    # pylint: disable=g-import-not-at-top
    from keras.src.backend.tensorflow import trainer
  except ImportError:
    return None
  cls = getattr(trainer, "TensorFlowTrainer", None)
  if cls is None or not hasattr(cls, "_maybe_symbolic_build"):
    return None
  return cls


def installed() -> bool:
  cls = _trainer_class()
  return cls is not None and getattr(cls._maybe_symbolic_build, "_tpu_embed_ext", False)


def install() -> None:
  """Wraps ``TensorFlowTrainer._maybe_symbolic_build`` once (see the module)."""
  cls = _trainer_class()
  if cls is None or installed():
    return
  keras_build = cls._maybe_symbolic_build

  @functools.wraps(keras_build)
  def maybe_symbolic_build(self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy
    if strategy is None or iterator is None:
      return keras_build(self, iterator=iterator, data_batch=data_batch)
    for _, _, it in iterator:  # Keras's own read of the first batch.
      batch = next(it)
      break
    leaves = tf.nest.flatten(batch)
    if not any(_composite_per_replica(strategy, x) for x in leaves):
      return keras_build(self, data_batch=_mean(strategy, batch))
    batch = tf.nest.pack_sequence_as(batch, [
        strategy.experimental_local_results(x)[0]
        if _composite_per_replica(strategy, x) else _mean(strategy, x)
        for x in leaves])
    return keras_build(self, data_batch=batch)

  maybe_symbolic_build._tpu_embed_ext = True  # pylint: disable=protected-access
  cls._maybe_symbolic_build = maybe_symbolic_build


def _composite_per_replica(strategy, x) -> bool:
  if not isinstance(x, tf.distribute.DistributedValues):
    return False
  return isinstance(strategy.experimental_local_results(x)[0], _COMPOSITE)


def _mean(strategy, batch):
  """Keras's reduction: MEAN of a batch whose leaves are all distributed."""
  flat = tf.nest.flatten(batch)
  if flat and all(isinstance(x, tf.distribute.DistributedValues) for x in flat):
    return strategy.reduce("MEAN", batch, axis=None)
  if isinstance(batch, tf.distribute.DistributedValues):
    return strategy.reduce("MEAN", batch, axis=None)
  return batch
