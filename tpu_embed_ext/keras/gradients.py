"""How ``EmbeddingLayer`` turns Keras's backward pass into one table step.

The layer owns one trainable
scalar, the *gradient sink*, and routes its activations through a
``tf.custom_gradient`` whose inputs are the sink and the activations. When
Keras's ``train_step`` asks the tape for the gradient of the loss with respect
to its trainable weights, the custom gradient receives ``dL/dactivations``
and hands them to the engine through the layer's adapter
(``keras/adapters.py``): one table step per training batch, which also
advances the engine's ``step`` and so its schedules. The sink is marked ``overwrite_with_gradient``: Keras optimizers write its
gradient into it instead of stepping, clipping or accumulating it, so it
never takes part in the dense optimizer's math.

Loss scaling: ``train_step`` differentiates ``optimizer.scale_loss(loss)``
(``loss_scale_factor``, or ``LossScaleOptimizer``'s dynamic scale under
``mixed_float16``), and Keras divides the scale out of the dense gradients
only, inside ``optimizer.apply``. The layer measures the scale where it
enters: each training call adds a *scale probe* to ``layer.losses``, a loss
term whose value is exactly 0 and whose gradient is therefore the factor the
loss was multiplied by after the losses were summed. Table gradients are
``dL/dactivations`` divided by that factor, i.e. the gradients of the
unscaled loss (bit for bit when the scale is a power of two, as Keras's
scales are). Under ``tf.distribute`` Keras also multiplies the loss by
``1 / num_replicas``; that factor is kept, as the TPU sums replicas'
gradients. A loss that leaves out ``model.losses`` (a hand-written loop that
forgets them) gives the probe a zero gradient: the activations' gradients are
then applied as given, as ``TPUEmbedding.apply_gradients`` would. When the loss
is scaled and a table gradient is not finite (a float16 overflow), the table
step is skipped and the sink's gradient is NaN, so ``LossScaleOptimizer``
skips its step and lowers the scale as it does for dense gradients.

Several calls of one layer in one training step (two towers sharing tables)
make one table step, as a TPU makes one step for all features of a batch:
their batches are concatenated per feature and their gradients applied once,
when the last of them has arrived. A backward pass that leaves some calls out
is reported (``InputError``) at the next call rather than dropped silently.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.util import nest

from tpu_embed_ext import errors

__all__ = ["StepCalls", "route_gradients", "concat_calls"]


class StepCalls:
  """The training calls of one step, until all their gradients have arrived.

  Kept per graph and replica: a ``tf.function`` trace of a training step
  records its calls and its backward pass in the same graph, and each replica
  of a strategy traces its own.
  """

  def __init__(self, graph):
    self.graph = graph
    self.calls = []       # [(features, weights)] in call order
    self.kept = []        # per call, what its adapter keeps for the backward
                          # pass (the prepared batch, preserved outputs)
    self.gradients = {}   # call index -> gradients (scaled)
    self.scale = None     # the scale probe's gradient
    self.done = False


def route_gradients(activations, sink, on_gradients):
  """Identity on ``activations``, plus the scale probe (a zero loss term).

  The backward pass hands ``dL/dactivations`` and the probe's gradient (the
  loss's scale) to ``on_gradients``, which returns the sink's gradient.
  """
  flat = [tf.cast(a, tf.float32) for a in tf.nest.flatten(activations)]

  @tf.custom_gradient
  def route(sink_value, *flat_activations):
    def grad(*upstream):
      *gradients, scale = upstream
      gradients = [tf.cast(g, tf.float32) for g in gradients]
      sink_gradient = on_gradients(
          tf.nest.pack_sequence_as(activations, gradients),
          tf.cast(scale, tf.float32))
      # No gradient flows into the tables' gather: the engine has applied it.
      return ([tf.cast(sink_gradient, sink_value.dtype)]
              + [None] * len(flat_activations))
    outputs = [tf.identity(a) for a in flat_activations]
    return outputs + [tf.zeros([], tf.float32)], grad

  *outputs, probe = route(sink, *flat)
  return tf.nest.pack_sequence_as(activations, outputs), probe


def concat_calls(feature_config, calls, name):
  """One batch of every call's features and weights, concatenated per feature."""
  configs = tf.nest.flatten(feature_config)
  if any(c.output_shape for c in configs):
    raise errors.InputError(
        f"EmbeddingLayer '{name}' was called {len(calls)} times in one "
        "training step with a feature that sets output_shape, whose batch "
        "cannot be concatenated. Fix: call the layer once per step, with "
        "every feature in one structure.")
  flat_features = [tf.nest.flatten(f) for f, _ in calls]
  flat_weights = [[None] * len(configs) if w is None else tf.nest.flatten(w)
                  for _, w in calls]
  features, weights = [], []
  paths = [p for p, _ in nest.flatten_with_joined_string_paths(feature_config)]
  for i, path in enumerate(paths):
    xs = [f[i] for f in flat_features]
    ws = [w[i] for w in flat_weights]
    kinds = sorted({type(x).__name__ for x in xs})
    if len(kinds) > 1:
      raise errors.InputError(
          f"EmbeddingLayer '{name}': feature '{path}' comes as "
          f"{' and '.join(kinds)} in calls of one training step, which cannot "
          "be concatenated into one table step. Fix: pass it as the same kind "
          "of tensor in every call.")
    features.append(_concat(xs))
    if all(w is None for w in ws):
      weights.append(None)
    else:  # A call without weights weighs every id 1.
      weights.append(_concat([_unit_weights(x) if w is None else w
                              for x, w in zip(xs, ws)]))
  any_weights = any(w is not None for w in weights)
  return (tf.nest.pack_sequence_as(feature_config, features),
          tf.nest.pack_sequence_as(feature_config, weights) if any_weights
          else None)


def _concat(xs):
  if isinstance(xs[0], tf.SparseTensor):
    return tf.sparse.concat(0, list(xs), expand_nonconcat_dims=True)
  return tf.concat(list(xs), 0)


def _unit_weights(x):
  """Weight 1 for every id of a ragged or sparse ``x``.

  (Dense ids take no weights: the engine rejects them in the forward pass.)
  """
  return x.with_values(tf.ones_like(x.values, tf.float32))
