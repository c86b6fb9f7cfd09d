"""``TPUEmbedding`` on the emulated TPU: the engine with its TPU-side contract.

Under the emulated ``TPUStrategy``, ``tf.tpu.experimental.embedding.TPUEmbedding``
is ``TPUEmbedding`` here: ``CPUEmbedding`` (engine ``"v1"``), which already
has the TPU's protocol, optimizer math, shapes, input checks and checkpoint
keys, plus what ``tpu_embedding_v2.py`` does differently under a
``TPUStrategy`` (TensorFlow 2.21):

* created outside a ``TPUStrategy`` scope, ``TPUEmbedding`` is TensorFlow's
  own object in its CPU mode (``_using_tpu`` False: ``embedding_tables``
  works, ``enqueue`` raises), exactly as on a TPU host;
* every table needs one of TensorFlow's optimizers (``ValueError`` there);
  ``EmbeddingSpec`` and our optimizer specs are ``create_embedding``'s, not
  ``TPUEmbedding``'s;
* ``embedding_tables`` raises the TPU's ``RuntimeError`` (the tables live on
  the TPU), except while a SavedModel is being written;
* it is not callable (lookups go through ``enqueue`` / ``dequeue``);
* ``pipeline_execution_with_tensor_core=True`` makes the TPU look up with
  tables one step old (TensorFlow's docstring); that schedule is not
  emulated, so it is refused rather than silently giving other numbers.

Private state TPU programs and TensorFlow's own tests touch, with its CPU
meaning: ``_output_shapes`` can be assigned (the shapes ``build`` would
fix); ``_retrieve_variables`` / ``_load_variables`` copy between the TPU and
the host variables on a TPU, and do nothing here (the host variables are the
tables); each table and slot variable has ``.variables``, its shards as on a
TPU (``TPUEmbeddingVariable``): one, the whole table, as on a one-host TPU.

Identity: ``isinstance(e, tf.tpu.experimental.embedding.TPUEmbedding)`` and
``isinstance(e, tpu_embedding_v2.TPUEmbedding)`` hold while the emulation is
active (the names are patched; ``EmbeddingLayer`` decides its TPU branch
so). This class does not subclass TensorFlow's ``TPUEmbedding``: every
method of it would reach for a TPU, and nothing in TensorFlow, Keras or
keras-rs checks an embedding against the class it imported before.
"""

from __future__ import annotations

from typing import List

import tensorflow as tf
from tensorflow.python.saved_model import save_context
from tensorflow.python.tpu import tpu_embedding_v2_utils
from tensorflow.python.util import nest

from tpu_embed_ext import emulated_tpu, errors
from tpu_embed_ext.emulated_tpu import outer_jit, patching, strategy as strategy_lib
from tpu_embed_ext.emulation import engine

__all__ = ["TPUEmbedding", "TPUEmbeddingV2WithoutSparseCore"]


class TPUEmbedding(engine.CPUEmbedding):
  """``tf.tpu.experimental.embedding.TPUEmbedding`` under the emulated TPU."""

  def __new__(cls, feature_config=None, optimizer=None,
              pipeline_execution_with_tensor_core: bool = False):
    if not strategy_lib.is_emulated_tpu_strategy(tf.distribute.get_strategy()):
      # Not under a TPUStrategy: TensorFlow's own object, in its CPU mode.
      real = patching.original("tensorflow.python.tpu.tpu_embedding_v2",
                               "TPUEmbedding")
      return real(feature_config, optimizer, pipeline_execution_with_tensor_core)
    return super().__new__(cls)

  def __init__(self, feature_config, optimizer,
               pipeline_execution_with_tensor_core: bool = False):
    if pipeline_execution_with_tensor_core:
      raise emulated_tpu.NotEmulatedError(
          "TPUEmbedding(pipeline_execution_with_tensor_core=True) is not "
          "emulated: a TPU then looks ids up in tables one step old, a schedule "
          "the emulation does not reproduce. Fix: "
          "pipeline_execution_with_tensor_core=False under emulate_tpu (the "
          "results a TPU gives without pipelining).")
    _check_tpu_optimizers(feature_config, optimizer)
    super().__init__(feature_config, optimizer, engine="v1")

  def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
    built = self._table_vars is not None
    super().build(per_replica_input_shapes, per_replica_batch_size)
    if not built:
      for variables in self._table_vars.values():
        for variable in variables.values():
          variable.variables = (variable,)  # One shard: the whole table.

  @property
  def embedding_tables(self):
    if save_context.in_save_context():
      return super().embedding_tables
    raise RuntimeError(
        "Unable to retrieve embedding tables when using a TPU strategy. If you "
        "need access, save your model, create this object under a CPU strategy "
        "and restore.")

  @property
  def _output_shapes(self) -> List[tf.TensorShape]:
    return self._shapes.stored

  @_output_shapes.setter
  def _output_shapes(self, shapes):
    shapes = [tf.TensorShape(s) for s in shapes]
    if len(shapes) != len(self._features):
      raise errors.InputError(
          f"_output_shapes has {len(shapes)} shapes for {len(self._features)} "
          "features. Fix: one shape per FeatureConfig, in its flattened order.")
    self._shapes.stored = shapes

  @tf.autograph.experimental.do_not_convert
  def enqueue(self, features, weights=None, training: bool = True, name=None,
              device=None):
    # On the host inside jit_compile=True: TensorFlow's XLA error (outer_jit).
    outer_jit.check_host_enqueue(self._replicas)
    return super().enqueue(features, weights, training, name, device)

  def _retrieve_variables(self):
    pass  # The host variables are the tables: nothing to copy back.

  def _load_variables(self):
    pass  # Nor to copy to a TPU.

  def __call__(self, features, weights=None):
    raise errors.InputTypeError(
        "TPUEmbedding is not callable, on a TPU either. Fix: enqueue the "
        "features, then dequeue the activations inside strategy.run.")


def _check_tpu_optimizers(feature_config, optimizer):
  """Every table's optimizer is one of TensorFlow's (as under a TPUStrategy)."""
  if hasattr(feature_config, "feature_config"):
    raise errors.ConfigTypeError(
        "TPUEmbedding takes a nested structure of FeatureConfigs, not an "
        "EmbeddingSpec. Fix: tpu_embed_ext.create_embedding(spec), which builds "
        "TPUEmbedding from it under a TPUStrategy.")
  for feature in nest.flatten(feature_config):
    table = getattr(feature, "table", None)
    chosen = getattr(table, "optimizer", None) or optimizer
    if not isinstance(chosen, tpu_embedding_v2_utils._Optimizer):  # pylint: disable=protected-access
      name = getattr(table, "name", None) or "(unnamed)"
      raise errors.ConfigTypeError(
          f"table {name!r}: TPUEmbedding under a TPUStrategy needs one of "
          f"tf.tpu.experimental.embedding's optimizers, got {chosen!r}. Fix: "
          "pass optimizer= (e.g. tf.tpu.experimental.embedding.SGD(0.1)) or "
          "set TableConfig.optimizer; for our optimizer specs use "
          "tpu_embed_ext.create_embedding.")


class TPUEmbeddingV2WithoutSparseCore:
  """``TPUEmbeddingV2`` on an emulated TPU without SparseCore: refused."""

  def __init__(self, *args, **kwargs):
    del args, kwargs
    raise emulated_tpu.NotEmulatedError(
        "TPUEmbeddingV2 needs SparseCore, and this emulated TPU has none (as a "
        "TPU v2-v4). Fix: emulate_tpu(sparsecore=True) (or `emulate "
        "--sparsecore`), or use tf.tpu.experimental.embedding.TPUEmbedding.")
