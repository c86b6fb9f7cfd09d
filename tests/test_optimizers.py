"""Optimizer specs: every field reaches the TF object; TF's checks, fixed messages."""

import dataclasses

import google.protobuf

import pytest
import tensorflow as tf
from tensorflow.core.protobuf.tpu import optimization_parameters_pb2 as pb

import tpu_embed_ext as tee
from tpu_embed_ext.spec import optimizers
from tpu_embed_ext.tf import optimizers as tf_optimizers

api = tf.tpu.experimental.embedding
COMMON = dict(learning_rate=0.3, use_gradient_accumulation=True, clip_weight_min=-2.0,
              clip_weight_max=3.0, weight_decay_factor=0.01,
              multiply_weight_decay_factor_by_learning_rate=True,
              clipvalue=(-0.5, 0.7), low_dimensional_packing_status=True)
# Non-default values for every field of every optimizer.
SPECS = {
    "sgd": (optimizers.SGD(**COMMON), api.SGD),
    "adagrad": (optimizers.Adagrad(initial_accumulator_value=0.7, **COMMON), api.Adagrad),
    "adagrad_momentum": (optimizers.AdagradMomentum(
        momentum=0.8, use_nesterov=True, exponent=3.0, beta2=0.9, epsilon=0.01,
        **COMMON), api.AdagradMomentum),
    "adam": (optimizers.Adam(beta_1=0.7, beta_2=0.8, epsilon=0.01, lazy_adam=False,
                             sum_inside_sqrt=False, **COMMON), api.Adam),
    "ftrl": (optimizers.FTRL(
        learning_rate_power=-0.3, l1_regularization_strength=0.1,
        l2_regularization_strength=0.2, beta=0.4, initial_accumulator_value=0.6,
        multiply_linear_by_learning_rate=True, allow_zero_accumulator=True, **COMMON),
             api.FTRL),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_field_reaches_the_tf_optimizer(name):
  spec, tf_class = SPECS[name]
  tf_opt = tf_optimizers.to_tf(spec)
  assert type(tf_opt) is tf_class
  for field in dataclasses.fields(spec):
    if field.name in ("clipvalue", "low_dimensional_packing_status", "bias_correction"):
      continue
    assert getattr(tf_opt, field.name) == getattr(spec, field.name), field.name
  assert (tf_opt.clip_gradient_min, tf_opt.clip_gradient_max) == (-0.5, 0.7)
  assert tf_optimizers.from_tf(tf_opt) == spec
  # The proto TensorFlow writes carries the settings, packing included.
  params = pb.OptimizationParameters()
  tf_opt._set_optimization_parameters(params)
  assert params.low_dimensional_packing_status == pb.LowDimensionalPackingStatus.ENABLED
  assert params.clipping_limits.lower.value == -2.0
  assert params.gradient_clipping_limits.upper.value == pytest.approx(0.7)
  assert params.weight_decay_factor == pytest.approx(0.01)
  assert params.multiply_weight_decay_factor_by_learning_rate
  assert params.WhichOneof("parameters") == {
      "sgd": "stochastic_gradient_descent", "adagrad": "adagrad",
      "adagrad_momentum": "adagrad_momentum", "adam": "adam", "ftrl": "ftrl"}[name]


def test_upstream_packing_flag_bug_is_real_and_fixed():
  """Upstream writes a bool into an enum field: protobuf 7 raises TypeError
  (setup.py pins protobuf < 7 for that reason); protobuf 6 stores the bool's
  number (True: ENABLED)."""
  params = pb.OptimizationParameters()
  if int(google.protobuf.__version__.split(".")[0]) >= 7:
    with pytest.raises(TypeError, match="Expected an int, got a boolean"):
      api.SGD(0.1, low_dimensional_packing_status=True)._set_optimization_parameters(params)
  else:
    api.SGD(0.1, low_dimensional_packing_status=True)._set_optimization_parameters(params)
    assert params.low_dimensional_packing_status == pb.LowDimensionalPackingStatus.ENABLED
  tf_optimizers.to_tf(optimizers.SGD(low_dimensional_packing_status=False)
                   )._set_optimization_parameters(params)
  assert params.low_dimensional_packing_status == pb.LowDimensionalPackingStatus.UNSPECIFIED


def test_bias_correction_never_reaches_tensorflow():
  tf_opt = tf_optimizers.to_tf(optimizers.Adam(bias_correction=True))
  assert not hasattr(tf_opt, "bias_correction")


def test_clipvalue_scalar_is_canonical():
  assert optimizers.SGD(clipvalue=2.0) == optimizers.SGD(clipvalue=(-2.0, 2.0))
  assert optimizers.SGD(clipvalue=[None, 1]).gradient_clip_limits == (None, 1.0)


BAD = [
    ("adam_beta_2", lambda: optimizers.Adam(beta_2=1.0),
     "beta_2: beta_2 must be in [0, 1), got beta_2=1.0. Fix: use a value such as 0.999."),
    ("adam_beta_1", lambda: optimizers.Adam(beta_1=-0.1),
     "beta_1: beta_1 must be in [0, 1), got beta_1=-0.1."),
    ("non_lazy_adam", lambda: optimizers.Adam(lazy_adam=False, use_gradient_accumulation=False),
     "lazy_adam: lazy_adam=False (update every row) needs gradient accumulation, got use_gradient_accumulation=False. Fix: set use_gradient_accumulation=True, or lazy_adam=True."),
    ("clipvalue_without_accumulation",
     lambda: optimizers.SGD(clipvalue=1.0, use_gradient_accumulation=False),
     "clipvalue: clipvalue=(-1.0, 1.0) needs gradient accumulation, got use_gradient_accumulation=False. Fix: set use_gradient_accumulation=True, or remove clipvalue."),
    ("adagrad_init", lambda: optimizers.Adagrad(initial_accumulator_value=0.0),
     "initial_accumulator_value: initial_accumulator_value must be > 0, got initial_accumulator_value=0.0."),
    ("ftrl_init", lambda: optimizers.FTRL(initial_accumulator_value=-1.0),
     "initial_accumulator_value: initial_accumulator_value must be > 0"),
    ("ftrl_power", lambda: optimizers.FTRL(learning_rate_power=0.1),
     "learning_rate_power: learning_rate_power must be <= 0, got learning_rate_power=0.1."),
    ("ftrl_l1", lambda: optimizers.FTRL(l1_regularization_strength=-1.0),
     "l1_regularization_strength: l1_regularization_strength must be >= 0"),
    ("momentum_epsilon", lambda: optimizers.AdagradMomentum(epsilon=0.0),
     "epsilon: epsilon must be > 0, got epsilon=0.0."),
    ("momentum_exponent", lambda: optimizers.AdagradMomentum(exponent=-2.0),
     "exponent: exponent must be > 0, got exponent=-2.0."),
    ("momentum_beta2", lambda: optimizers.AdagradMomentum(beta2=0.0),
     "beta2: beta2 must be in (0, 1], got beta2=0.0."),
    ("weight_clip_order", lambda: optimizers.SGD(clip_weight_min=1.0, clip_weight_max=0.0),
     "clip_weight_min: clip_weight_min must not exceed clip_weight_max"),
    ("negative_decay", lambda: optimizers.SGD(weight_decay_factor=-0.1),
     "weight_decay_factor: weight_decay_factor must be >= 0"),
    ("clipvalue_zero", lambda: optimizers.SGD(clipvalue=0.0),
     "clipvalue: clipvalue must be a positive number, got clipvalue=0.0."),
    ("lr_string", lambda: optimizers.SGD(learning_rate="0.1"),
     "learning_rate: learning_rate must be a number, a schedule or a zero-arg callable, got str '0.1'."),
    ("bool_field", lambda: optimizers.Adam(lazy_adam="yes"),
     "lazy_adam: lazy_adam must be true or false, got str 'yes'."),
]


@pytest.mark.parametrize("make,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_invalid_values_are_pinned(make, message):
  with pytest.raises(tee.ConfigError) as info:
    make()
  assert str(info.value).startswith(message), str(info.value)


def test_from_tf_rejects_foreign_objects():
  with pytest.raises(TypeError, match="unsupported optimizer str"):
    tf_optimizers.from_tf("sgd")
