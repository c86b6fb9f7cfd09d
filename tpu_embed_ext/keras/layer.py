"""Keras 3 layer that trains embedding tables with their own TPU optimizers.

``EmbeddingLayer`` hides the enqueue / dequeue / apply_gradients protocol of the
TPU embedding mid-level API inside ``model.fit``. Tables are never trainable
Keras weights, so the model's Keras optimizer never touches them: each table
is updated by its own table optimizer (per-table overrides and schedules
included), exactly as on a TPU. ``model.summary()`` and ``layer.weights``
list the tables as non-trainable weights (their optimizer slots are optimizer
state, like a Keras optimizer's, and are not counted).

How the table update is wired into ``fit`` (the gradient sink, the loss-scale
probe, several calls in one step): see ``keras/gradients.py``.

Engines: on CPU (no ``TPUStrategy`` in scope) the layer runs
``CPUEmbedding``, our emulation of the TPU engine. Under a ``TPUStrategy`` it
runs ``TPUEmbedding`` (TPU v2-v4) or ``TPUEmbeddingV2`` (SparseCore, v5p/v6e),
chosen by ``create_embedding`` as TensorFlow documents for the hardware. Each
engine's protocol is spoken by one adapter (``keras/adapters.py``), picked
when the layer is made. The TPU adapters were NOT run on TPU hardware: no TPU is reachable where this
package is developed. They run end to end under the emulated TPU
(``emulate_tpu``, whose ``TPUEmbedding`` / ``TPUEmbeddingV2`` are this
package's engine): tests/test_emulated_keras.py.

Saving: see ``save_own_variables`` and the README's "Saving and restoring".
"""

from __future__ import annotations

from typing import List, Optional

import keras
from keras.src.backend.common import symbolic_scope
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import values_util
from tensorflow.python.eager import record
from tensorflow.python.util import nest

from tpu_embed_ext import errors
from tpu_embed_ext.keras import adapters
from tpu_embed_ext.keras import distributed_fit
from tpu_embed_ext.keras import gradients as layer_gradients
from tpu_embed_ext.keras import weights as layer_weights
from tpu_embed_ext.emulation import dispatch
from tpu_embed_ext.spec import EmbeddingSpec

__all__ = ["EmbeddingLayer", "PAD_ID"]

PAD_ID = -1
"""Padding of a ragged or sparse feature given as a dense id matrix."""

@keras.saving.register_keras_serializable(package="tpu_embed_ext")
class EmbeddingLayer(keras.layers.Layer):
  """Embedding lookups whose tables train with TPU embedding optimizers.

  Args:
    spec_or_feature_config: an ``EmbeddingSpec`` (schedules bind to this
      layer's ``step``), or a nested ``tf.tpu.experimental.embedding``
      ``FeatureConfig`` structure as ``TPUEmbedding`` takes it (such a layer
      cannot be saved as a Keras config: ``model.save`` needs a spec).
    optimizer: the global table optimizer for a feature config whose tables
      have none (a ``tf.tpu.experimental.embedding`` optimizer or our spec).
      Ignored for an ``EmbeddingSpec``, which carries its own.
    engine: which TPU engine to run or emulate: ``"v1"`` (``TPUEmbedding``),
      ``"v2"`` (``TPUEmbeddingV2``, SparseCore), or None to follow the
      hardware (``"v1"`` off-TPU).
    validate: check ids and gradients on every step (CPU engine only).

  Call with ``features`` (the structure of the feature config) and optional
  ``weights``; returns activations with the structure of ``features``, in the
  layer's compute dtype (float16 under ``mixed_float16``; the engine computes
  in float32). ``training=True`` looks up and trains on the backward pass;
  ``training=False`` (``evaluate``, ``predict``) and ``trainable=False`` only
  look up.
  """

  def __init__(self, spec_or_feature_config, optimizer=None,
               engine: Optional[str] = None, *, validate: bool = True,
               **kwargs):
    super().__init__(**kwargs)
    # Keras would cast float feature weights to the compute dtype (float16
    # under mixed precision); the engine takes them in float32.
    self._convert_input_args = False
    self._serving = False
    spec_or_feature_config = EmbeddingSpec.coerce(spec_or_feature_config)
    self._spec = (spec_or_feature_config
                  if isinstance(spec_or_feature_config, EmbeddingSpec) else None)
    self._engine_arg = engine
    self._validate = validate
    # Replica (under a tf.distribute strategy) -> its calls of this step.
    object.__setattr__(self, "_step_calls", {})
    # Flat feature index -> "ragged" / "sparse", for features whose
    # keras.Input was declared so (seen by compute_output_spec).
    # (Set untracked: a tracked dict would become checkpoint state.)
    object.__setattr__(self, "_composite_inputs", {})
    # Created eagerly, outside any tf.function, so the tables and slots exist
    # (and can be restored) before the first call.
    self.embedding = dispatch.create_embedding(
        spec_or_feature_config, optimizer, engine=engine, validate=validate)
    # The engine's protocol (set untracked: not checkpoint state).
    object.__setattr__(self, "_adapter",
                       adapters.for_engine(self.embedding, self.name))
    # fit/evaluate under a strategy with ragged or sparse ids (keras/distributed_fit.py).
    distributed_fit.install()
    # The engine leaves its step out of its own checkpoint keys (they equal
    # TPUEmbedding's); the layer checkpoints it, so schedules resume.
    self.table_step = self.embedding.step
    self.gradient_sink = self.add_weight(
        shape=(), initializer="zeros", trainable=True, name="gradient_sink",
        overwrite_with_gradient=True)
    self.built = True

  @property
  def step(self) -> tf.Variable:
    """Table updates applied so far (drives the table schedules)."""
    return self.embedding.step

  @property
  def variables_by_table(self):
    """``{table_name: {"parameters": var, <slot>: var}}`` of the engine."""
    return self.embedding.variables

  # --- Keras weights -------------------------------------------------------

  def _tables(self) -> List[tf.Variable]:
    # Under a TPUStrategy the tables are the TPU engine's, checkpointed with
    # the engine, not Keras weights (keras/adapters.py).
    return self._adapter.tables()

  @property
  def weights(self):
    """Keras's weights plus the tables (``trainable=False`` variables)."""
    return super().weights + self._tables()

  @property
  def variables(self):
    return super().variables + self._tables()

  # --- call ----------------------------------------------------------------

  def call(self, features, weights=None, training=None):
    if symbolic_scope.in_symbolic_scope():
      return self._shape_only(features, weights, training)
    features = self._composite_features(features, training)
    if self._serving:
      return self._cast(self._serving_lookup(features, weights))
    if not training or not self.trainable or (
        tf.executing_eagerly() and not record.could_possibly_record()):
      # Nothing can train: no backward pass will come (evaluation, a frozen
      # layer, or an eager call that no tape records).
      return self._cast(self._adapter.lookup(features, weights))
    activations, on_gradients = self._train_lookup(features, weights)
    outputs, probe = layer_gradients.route_gradients(
        activations, self.gradient_sink, on_gradients)
    self.add_loss(probe)
    return self._cast(outputs)

  def _shape_only(self, features, weights, training):
    """Zeros of the activations' shapes, without touching the engine.

    Keras builds a model under a strategy by calling it in a symbolic scope
    on a batch it has reduced with MEAN across replicas (ids become floats);
    only shapes matter there, and no table may be read or stepped.
    """
    specs = tf.nest.flatten(self.compute_output_spec(features, weights, training))
    outputs = []
    for spec, x in zip(specs, tf.nest.flatten(features)):
      if isinstance(x, tf.RaggedTensor):
        batch = x.nrows(out_type=tf.int32)
      elif isinstance(x, tf.SparseTensor):
        batch = tf.cast(x.dense_shape[0], tf.int32)
      else:
        batch = tf.shape(x)[0]
      dims = [batch if d is None else d for d in spec.shape]
      outputs.append(tf.zeros(tf.stack(dims), spec.dtype))
    return tf.nest.pack_sequence_as(features, outputs)

  def _cast(self, activations):
    dtype = self.compute_dtype
    if dtype == "float32":
      return activations
    return tf.nest.map_structure(lambda a: tf.cast(a, dtype), activations)

  def compute_output_spec(self, features, weights=None, training=None):
    """Output shapes from the feature config, for ragged and sparse inputs too.

    Keras traces symbolic calls (``keras.Input``) with dense placeholders;
    looking those up would give ragged and sparse features the dense
    ``[batch, length, dim]`` shape instead of ``[batch, dim]``.
    """
    del weights, training
    configs = tf.nest.flatten(self.embedding.feature_config)
    flat = tf.nest.flatten(features)
    if len(configs) != len(flat):
      raise errors.InputError(
          f"EmbeddingLayer '{self.name}' got {len(flat)} inputs, its feature "
          f"config has {len(configs)} features. Fix: pass one keras.Input per "
          "FeatureConfig, in the feature config's structure.")
    specs = [keras.KerasTensor(_output_shape(c, x), dtype=self.compute_dtype)
             for c, x in zip(configs, flat)]
    for i, x in enumerate(flat):
      if getattr(x, "ragged", False) or getattr(x, "sparse", False):
        self._composite_inputs[i] = "ragged" if x.ragged else "sparse"
    return tf.nest.pack_sequence_as(features, specs)

  def _composite_features(self, features, training):
    """Ragged/sparse again for declared inputs that arrive as padded matrices.

    Keras gives a ``keras.Input(ragged=True)`` (or ``sparse=True``) a dense
    placeholder where it cannot trace composites, as ``model.export`` does
    for its serving signature. Such a feature arrives as an integer
    ``[batch, max_ids]`` matrix padded with ``PAD_ID`` (-1), the convention
    of ``serving.export_for_serving``; its ``PAD_ID`` entries are dropped.
    Training refuses such a matrix: its padding cannot be told from ids
    (``RaggedTensor.to_tensor`` pads with 0, a valid id).
    """
    if not self._composite_inputs:
      return features
    flat = tf.nest.flatten(features)
    paths = [p for p, _ in nest.flatten_with_joined_string_paths(
        self.embedding.feature_config)]
    for i, kind in self._composite_inputs.items():
      x = flat[i] if i < len(flat) else None
      if not isinstance(x, tf.Tensor) or x.shape.rank != 2:
        continue
      where = f"EmbeddingLayer '{self.name}': feature '{paths[i]}'"
      if training and self.trainable:
        wanted = "tf.RaggedTensor" if kind == "ragged" else "tf.SparseTensor"
        raise errors.InputError(
            f"{where} was declared keras.Input({kind}=True) but got a dense "
            f"{x.shape.as_list()} tensor for training. Fix: pass a {wanted} "
            f"(a matrix padded with {PAD_ID} is read only for serving).")
      if not x.dtype.is_integer:
        raise errors.InputError(
            f"{where}: ids must be integers, got dtype {x.dtype.name} for a "
            f"{kind} input. Fix: cast the ids to int64; for model.export of a "
            "subclassed model pass input_signature= with integer "
            "tf.TensorSpecs.")
      keep = tf.not_equal(x, PAD_ID)
      if kind == "ragged":
        flat[i] = tf.ragged.boolean_mask(x, keep)
      else:
        indices = tf.where(keep)
        flat[i] = tf.SparseTensor(indices, tf.gather_nd(x, indices),
                                  tf.shape(x, out_type=tf.int64))
    return tf.nest.pack_sequence_as(features, flat)

  # --- the training step ---------------------------------------------------

  def _train_lookup(self, features, weights):
    """Activations, and what to do with their (scaled) gradients."""
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    replica = values_util.get_current_replica_id_as_int() or 0
    step = self._step_calls.setdefault(replica, layer_gradients.StepCalls(graph))
    if step.graph is graph and step.gradients and not step.done:
      # A backward pass has run (this is a new forward pass) without the
      # gradients of some calls: their step can never be applied.
      raise errors.InputError(
          f"EmbeddingLayer '{self.name}': gradients arrived for "
          f"{len(step.gradients)} of the {len(step.calls)} training calls of "
          "the last step, so its table step was not applied. Fix: take the "
          "gradient once per step, of a loss that depends on every training "
          "call (model.losses included), with respect to the layer's "
          "trainable variables.")
    if step.graph is not graph or step.done:
      step = layer_gradients.StepCalls(graph)
      self._step_calls[replica] = step
    self._adapter.check_call(step)
    index = len(step.calls)
    step.calls.append((features, weights))
    activations, kept = self._adapter.train_lookup(features, weights)
    step.kept.append(kept)

    def on_gradients(gradients, scale):
      step.gradients[index] = gradients
      step.scale = scale
      if len(step.gradients) < len(step.calls):
        return tf.zeros([])
      step.done = True
      return self._table_step(step)
    return activations, on_gradients

  def _table_step(self, step: "layer_gradients.StepCalls"):
    """Applies a step's unscaled gradients; returns the sink's gradient."""
    flat = [tf.nest.flatten(step.gradients[i]) for i in range(len(step.calls))]
    # The probe's gradient is s / R: the optimizer's scale s times Keras's
    # 1 / R for R > 1 replicas (keras.src.losses.loss's
    # scale_loss_for_distribution). Only s is divided out.
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    probe = step.scale * replicas if replicas > 1 else step.scale
    scaled = tf.logical_and(tf.not_equal(probe, 0.0), tf.not_equal(probe, 1.0))
    scale = tf.where(tf.equal(probe, 0.0), 1.0, probe)
    flat = [[g / scale for g in grads] for grads in flat]

    def apply():
      self._adapter.apply_gradients(step, [
          tf.nest.pack_sequence_as(step.gradients[0], grads) for grads in flat])
      return tf.constant(0.0)

    if replicas > 1 or tf.distribute.has_strategy():
      # The engine sums replicas in a merge_call (and a MirroredVariable's
      # update is one), which cannot run inside tf.cond: no overflow skip
      # under a strategy, even of one replica (the engine's finite check
      # stops the step instead).
      return apply()
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g))
                            for grads in flat for g in grads])
    skip = tf.logical_and(scaled, tf.logical_not(finite))
    return tf.cond(skip, lambda: tf.constant(np.nan, tf.float32), apply)

  def _serving_lookup(self, features, weights):
    # The standard CPU lookup of a TPU-trained model, with no TPU ops.
    return tf.tpu.experimental.embedding.serving_embedding_lookup(
        features, weights, self.embedding.embedding_tables,
        self.embedding.feature_config)

  def serving_mode(self, enabled: bool = True):
    """Switches calls to ``serving_embedding_lookup`` (used by export)."""
    self._serving = enabled

  # --- Keras saving --------------------------------------------------------

  def save_own_variables(self, store):
    """Writes tables, slots, the table step and the sink (``keras/weights.py``)."""
    layer_weights.save(self, store)

  def load_own_variables(self, store):
    """Restores what ``save_own_variables`` wrote, or changes nothing.

    Every table, slot and shape is checked before the first variable is
    written; a mismatch names the table.
    """
    layer_weights.load(self, store)

  def get_config(self):
    if self._spec is None:
      raise errors.ConfigTypeError(
          f"EmbeddingLayer '{self.name}' was built from a "
          "tf.tpu.experimental.embedding FeatureConfig structure, which has "
          "no Keras config (model.save / get_config). Fix: build the layer "
          "from a tpu_embed_ext.EmbeddingSpec (EmbeddingSpec.from_dict or "
          "from_file), or save weights only (save_weights, "
          "tf.train.Checkpoint).")
    config = super().get_config()
    config.update(spec=self._spec.to_dict(), engine=self._engine_arg,
                  validate=self._validate)
    return config

  @classmethod
  def from_config(cls, config):
    config = dict(config)
    spec = EmbeddingSpec.from_dict(config.pop("spec"))
    return cls(spec, **config)

  def get_build_config(self):
    # Everything is created in __init__: there is nothing to rebuild.
    return {}

  def build_from_config(self, config):
    del config


def _output_shape(config, x) -> tuple:
  """The activation shape the engine gives ``x`` (a KerasTensor or tensor).

  The engine's (``TPUEmbedding``'s) rules, docs/shapes.md: ``output_shape``
  first; ragged and sparse ids combine over their last dimension (sequence
  features get ``max_sequence_length``); dense ids of rank >= 2 drop their
  trailing dimension of 1.
  """
  dim = config.table.dim
  shape = tuple(x.shape)
  if config.output_shape:
    return tuple(config.output_shape) + (dim,)
  composite = (getattr(x, "ragged", False) or getattr(x, "sparse", False) or
               isinstance(x, (tf.RaggedTensor, tf.SparseTensor)))
  if composite and config.max_sequence_length > 0 and len(shape) == 2:
    return (shape[0], config.max_sequence_length, dim)
  return (shape if len(shape) == 1 else shape[:-1]) + (dim,)
