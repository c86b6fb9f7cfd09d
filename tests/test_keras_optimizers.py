"""Keras 3 optimizers translate by math: same updates, or a pinned refusal."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tpu_embed_ext as tee
from tpu_embed_ext.spec import optimizers
from tpu_embed_ext.tf import optimizers as tf_optimizers

api = tf.tpu.experimental.embedding
SCHEDULE = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)


@pytest.mark.parametrize("keras_opt,expected", [
    (keras.optimizers.SGD(0.3, weight_decay=0.01, clipvalue=2.0),
     optimizers.SGD(learning_rate=0.3, weight_decay_factor=0.01,
                    multiply_weight_decay_factor_by_learning_rate=True, clipvalue=2.0)),
    (keras.optimizers.Adagrad(SCHEDULE, initial_accumulator_value=0.2),
     optimizers.Adagrad(learning_rate=tee.Schedule.from_keras(SCHEDULE),
                        initial_accumulator_value=0.2)),
    (keras.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-5),
     optimizers.Adam(learning_rate=0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-5,
                     bias_correction=True, sum_inside_sqrt=False, lazy_adam=False)),
    (keras.optimizers.AdamW(0.01, weight_decay=0.05),
     optimizers.Adam(learning_rate=0.01, epsilon=1e-7, bias_correction=True,
                     sum_inside_sqrt=False, lazy_adam=False,
                     weight_decay_factor=0.05 * 0.01)),
    (keras.optimizers.Ftrl(0.05, learning_rate_power=-0.4, initial_accumulator_value=0.3,
                           l1_regularization_strength=0.01,
                           l2_regularization_strength=0.02, beta=0.5),
     optimizers.FTRL(learning_rate=0.05, learning_rate_power=-0.4,
                     initial_accumulator_value=0.3, l1_regularization_strength=0.01,
                     l2_regularization_strength=0.02, beta=0.5)),
], ids=["sgd", "adagrad_schedule", "adam", "adamw", "ftrl"])
def test_translation(keras_opt, expected):
  spec = tee.from_keras_optimizer(keras_opt)
  assert spec == expected
  if not callable(spec.learning_rate):
    tf_opt = tf_optimizers.to_tf(spec)
    assert tf_optimizers.from_tf(tf_opt) == spec.replace(
        **({"bias_correction": False} if isinstance(spec, optimizers.Adam) else {}))


def test_translated_adam_equals_keras_adam_step_by_step():
  rng = np.random.RandomState(0)
  w0 = rng.normal(size=(5, 3)).astype(np.float32)
  keras_opt = keras.optimizers.Adam(0.05, beta_1=0.8, beta_2=0.9, epsilon=1e-3,
                                    weight_decay=0.1)
  var = keras.Variable(w0)
  table = api.TableConfig(5, 3, combiner="sum", name="t",
                          initializer=tf.constant_initializer(w0))
  spec = tee.from_keras_optimizer(keras_opt)
  holder = {}
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(table)}, tf_optimizers.to_tf(
      spec, learning_rate=lambda: spec.learning_rate * _bias(holder["e"].step)))
  holder["e"] = emb
  for step in range(6):
    g = rng.normal(size=(5, 3)).astype(np.float32)
    keras_opt.apply_gradients([(tf.constant(g), var)])
    emb.enqueue({"f": tf.range(5, dtype=tf.int64)}, training=True)
    emb.dequeue()
    emb.apply_gradients({"f": tf.constant(g)})
  np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy(), var.numpy(),
                             rtol=1e-5, atol=1e-6)


def _bias(step):
  t = tf.cast(step, tf.float32) + 1
  return tf.sqrt(1 - 0.9 ** t) / (1 - 0.8 ** t)


@pytest.mark.parametrize("keras_opt,message", [
    (keras.optimizers.SGD(0.1, momentum=0.9),
     "momentum: Keras SGD option momentum=0.9 has no TPU embedding equivalent. Fix: "
     "set momentum=0.0 for the embedding tables"),
    (keras.optimizers.SGD(0.1, nesterov=True),
     "nesterov: Keras SGD option nesterov=True has no TPU embedding equivalent."),
    (keras.optimizers.Adam(amsgrad=True),
     "amsgrad: Keras Adam option amsgrad=True has no TPU embedding equivalent."),
    (keras.optimizers.Adam(clipnorm=1.0),
     "clipnorm: Keras Adam option clipnorm=1.0 has no TPU embedding equivalent."),
    (keras.optimizers.Adagrad(global_clipnorm=1.0),
     "global_clipnorm: Keras Adagrad option global_clipnorm=1.0 has no TPU"),
    (keras.optimizers.SGD(use_ema=True),
     "use_ema: Keras SGD option use_ema=True has no TPU embedding equivalent."),
    (keras.optimizers.SGD(loss_scale_factor=128.0),
     "loss_scale_factor: Keras SGD option loss_scale_factor=128.0 has no TPU"),
    (keras.optimizers.SGD(gradient_accumulation_steps=4),
     "gradient_accumulation_steps: Keras SGD option gradient_accumulation_steps=4"),
    (keras.optimizers.Ftrl(l2_shrinkage_regularization_strength=0.1),
     "l2_shrinkage_regularization_strength: Keras Ftrl option "
     "l2_shrinkage_regularization_strength=0.1 has no TPU embedding equivalent."),
    (keras.optimizers.Adam(SCHEDULE, weight_decay=0.1),
     "weight_decay: Keras Adam weight_decay=0.1 with a learning-rate schedule has no "
     "exact TPU equivalent"),
    (keras.optimizers.Adagrad(epsilon=0.01),
     "epsilon: Keras Adagrad epsilon=0.01 is too large to drop"),
], ids=["momentum", "nesterov", "amsgrad", "clipnorm", "global_clipnorm", "use_ema",
        "loss_scale", "grad_accumulation", "l2_shrinkage", "adam_decay_schedule",
        "adagrad_epsilon"])
def test_rejected_options_are_pinned(keras_opt, message):
  with pytest.raises(tee.ConfigError) as info:
    tee.from_keras_optimizer(keras_opt)
  assert str(info.value).startswith(message), str(info.value)


def test_unsupported_optimizer_class():
  with pytest.raises(tee.ConfigTypeError, match="no TPU embedding equivalent for Keras RMSprop"):
    tee.from_keras_optimizer(keras.optimizers.RMSprop())
