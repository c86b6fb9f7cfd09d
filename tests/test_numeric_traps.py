"""Numeric traps (docs/numeric-traps.md): one test per trap.

Each test (a) pins the error (or warning) raised when the spec is made, and
(b) shows on CPU that the TPU's formula, as docs/semantics.md writes it, would
indeed write NaN or Inf: in numpy float32 (tests/references.py's formula), and
through ``CPUEmbedding`` built from TensorFlow optimizer objects, which are
taken as ``TPUEmbedding`` takes them (without the spec's checks), so the
engine's own rejection of a non-finite update fires and nothing is written.
"""

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.spec import numeric_traps, optimizers
from tpu_embed_ext.tf import optimizers as tf_optimizers
from tpu_embed_ext.spec.numeric_traps import (NumericTrapError,
                                              NumericTrapWarning)
from tpu_embed_ext.spec import EmbeddingSpec
from tests.builders import assert_same_state, engine_state
from tests import references

api = tf.tpu.experimental.embedding
f32 = np.float32
REJECTED = r"table \\?'t\\?': the update would write NaN or Inf into its"


def _spec(optimizer, schedules=None, **table):
  config = {"optimizer": optimizer,
            "tables": {"t": {"vocabulary_size": 4, "dim": 2, **table}},
            "features": {"f": {"table": "t"}}}
  if schedules:
    config["schedules"] = schedules
  return EmbeddingSpec.from_dict(config)


def _spec_error(message, optimizer, **kwargs):
  with pytest.raises(NumericTrapError, match=re.escape(message)):
    _spec(optimizer, **kwargs)


def _constant_table_engine(optimizer, init=0.5):
  table = api.TableConfig(4, 2, initializer=tf.constant_initializer(init), name="t")
  return tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")}, optimizer)


def _one_id_step(emb, g):
  emb.enqueue({"f": tf.constant([1])}, training=True)
  emb.dequeue()
  emb.apply_gradients({"f": tf.fill([1, 2], f32(g))})


def _rejected(emb, g):
  """The engine refuses the step that would write NaN/Inf and changes nothing."""
  before = engine_state(emb)
  with pytest.raises(tee.InputError, match=REJECTED):
    _one_id_step(emb, g)
  assert_same_state(engine_state(emb), before)  # the step counter too


def _finite(*xs):
  with np.errstate(all="ignore"):
    return all(np.all(np.isfinite(np.asarray(x, f32))) for x in xs)


# --- tests/references.py's rules in float32 ------------------------------------

def _f32_update(name, w, slots, g, lr, **given):
  """The reference rule with every value and hyperparameter in float32, as
  the engine computes (NumPy keeps float32 through the formulas)."""
  cast = lambda x: f32(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x
  with np.errstate(all="ignore"):
    return references.update(name, f32(w), {k: f32(v) for k, v in slots.items()},
                             f32(g), f32(lr), **{k: cast(v) for k, v in given.items()})


def ftrl_np(w, acc, lin, g, lr, power, l1=0.0, l2=0.0, beta=0.0, linear_x_lr=False):
  w, s = _f32_update("ftrl", w, {"accumulators": acc, "linears": lin}, g, lr,
                     learning_rate_power=power, l1_regularization_strength=l1,
                     l2_regularization_strength=l2, beta=beta,
                     multiply_linear_by_learning_rate=linear_x_lr)
  return w, s["accumulators"], s["linears"]


def adagrad_np(w, acc, g, lr):
  w, s = _f32_update("adagrad", w, {"accumulators": acc}, g, lr)
  return w, s["accumulators"]


def adagrad_momentum_np(w, acc, m, g, lr, momentum, exponent, epsilon, beta2=1.0):
  w, s = _f32_update("adagrad_momentum", w, {"accumulators": acc, "momenta": m}, g,
                     lr, momentum=momentum, exponent=exponent, epsilon=epsilon,
                     beta2=beta2)
  return w, s["accumulators"], s["momenta"]


def adam_np(w, m, v, g, lr, beta_1, beta_2, epsilon, sum_inside_sqrt=True):
  w, s = _f32_update("adam", w, {"momenta": m, "velocities": v}, g, lr,
                     beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
                     sum_inside_sqrt=sum_inside_sqrt)
  return w, s["momenta"], s["velocities"]


# --- FTRL divides by the learning rate --------------------------------------------

def test_ftrl_constant_learning_rate_zero():
  _spec_error("table 't': learning_rate=0.0, and FTRL without "
              "multiply_linear_by_learning_rate divides by it (lin += g - (dp / lr) w; "
              "D = (acc^k + beta) / lr = inf): the step writes NaN or Inf into the "
              "table. Fix: set multiply_linear_by_learning_rate: true",
              {"type": "ftrl", "learning_rate": 0.0})
  _spec({"type": "ftrl", "learning_rate": 0.0,
         "multiply_linear_by_learning_rate": True})  # the fix
  w, _, _ = ftrl_np(0.5, 0.1, 0.0, 0.0, 0.0, -0.5)
  assert not _finite(w)
  w, _, _ = ftrl_np(0.5, 0.1, 0.0, 0.0, 0.0, -0.5, linear_x_lr=True)
  assert _finite(w)
  _rejected(_constant_table_engine(api.FTRL(learning_rate=0.0)), 0.0)


def test_ftrl_schedule_that_starts_at_zero():
  # configs/criteo.yaml's trap: warm_cosine starts at 0 on an FTRL table.
  schedules = {"warm": {"class": "CosineDecay", "initial_learning_rate": 0.0,
                        "warmup_target": 0.05, "warmup_steps": 10, "decay_steps": 50,
                        "alpha": 0.1}}
  _spec_error("table 't': the learning rate warm (CosineDecay(alpha=0.1, "
              "decay_steps=50, initial_learning_rate=0.0, warmup_steps=10, "
              "warmup_target=0.05)) is 0 at step 0, and FTRL without "
              "multiply_linear_by_learning_rate divides by it",
              {"type": "ftrl", "learning_rate": "warm"}, schedules=schedules)
  step = tf.Variable(0, dtype=tf.int64)
  keras_schedule = keras.optimizers.schedules.CosineDecay(
      0.0, 50, alpha=0.1, warmup_target=0.05, warmup_steps=10)
  emb = _constant_table_engine(api.FTRL(learning_rate=lambda: keras_schedule(step)))
  _rejected(emb, 1.0)
  w, _, _ = ftrl_np(0.5, 0.1, 0.0, 1.0, float(keras_schedule(0)), -0.5)
  assert not _finite(w)


def test_ftrl_schedule_that_decays_to_zero():
  schedules = {"decay": {"class": "ExponentialDecay", "initial_learning_rate": 0.05,
                         "decay_steps": 1000, "decay_rate": 0.5}}
  _spec_error("table 't': the learning rate decay (ExponentialDecay(decay_rate=0.5, "
              "decay_steps=1000, initial_learning_rate=0.05)) is 0 at step 121679, "
              "and FTRL without multiply_linear_by_learning_rate divides by it",
              {"type": "ftrl", "learning_rate": "decay"}, schedules=schedules)
  # The first such step: the rate one step earlier still gives a finite D.
  keras_schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 1000, 0.5)
  late, before = float(keras_schedule(121679)), float(keras_schedule(121678))
  assert late == 0.0 and np.isfinite(f32(np.sqrt(f32(0.1))) / f32(before))
  _rejected(_constant_table_engine(api.FTRL(learning_rate=lambda: tf.constant(late))), 1.0)


def test_ftrl_learning_rate_so_small_the_denominator_overflows():
  _spec_error("table 't': learning_rate=1e-40, and FTRL without "
              "multiply_linear_by_learning_rate divides by it",
              {"type": "ftrl", "learning_rate": 1e-40})
  w, _, _ = ftrl_np(0.5, 0.1, 0.0, 1.0, 1e-40, -0.5)
  assert not _finite(w)
  _rejected(_constant_table_engine(api.FTRL(learning_rate=1e-40)), 1.0)


# --- accumulators that start at 0 --------------------------------------------------

def test_adagrad_initial_accumulator_that_is_zero_in_float32():
  _spec_error("table 't': initial_accumulator_value=1e-46 is 0 in float32 (the TPU "
              "flushes values below 1.2e-38 to 0): the accumulator starts at 0 and a "
              "zero gradient on a fresh row writes g / sqrt(acc) = 0 / 0 = NaN. Fix: "
              "use a small positive value such as 0.1.",
              {"type": "adagrad", "initial_accumulator_value": 1e-46})
  w, _ = adagrad_np(0.5, f32(1e-46), 0.0, 0.1)
  assert not _finite(w)
  _rejected(_constant_table_engine(api.Adagrad(0.1, initial_accumulator_value=1e-46)), 0.0)


def test_ftrl_initial_accumulator_that_is_zero_in_float32():
  _spec_error("table 't': initial_accumulator_value=1e-46 is 0 in float32",
              {"type": "ftrl", "initial_accumulator_value": 1e-46,
               "multiply_linear_by_learning_rate": True})
  w, _, _ = ftrl_np(0.5, f32(1e-46), 0.0, 0.0, 0.1, -0.5, linear_x_lr=True)
  assert not _finite(w)
  _rejected(_constant_table_engine(api.FTRL(0.1, initial_accumulator_value=1e-46,
                             multiply_linear_by_learning_rate=True)), 0.0)


def test_ftrl_power_that_flushes_the_accumulator_to_zero():
  _spec_error("table 't': initial_accumulator_value^(-learning_rate_power) = 0.1^50.0 "
              "is 0 in float32: the denominator D (acc^k + beta ...) is 0 with beta = "
              "l2 = 0, so w = N / D = 0 / 0 = NaN on the first step",
              {"type": "ftrl", "learning_rate_power": -50.0})
  with pytest.warns(NumericTrapWarning, match="acc\\^50 overflows float32"):
    _spec({"type": "ftrl", "learning_rate_power": -50.0, "beta": 0.1})  # D > 0
  w, _, _ = ftrl_np(0.5, 0.1, 0.0, 0.0, 0.001, -50.0)
  assert not _finite(w)
  _rejected(_constant_table_engine(api.FTRL(0.001, learning_rate_power=-50.0)), 0.0)


def test_ftrl_power_below_minus_one_warns_and_overflows_with_large_accumulators():
  with pytest.warns(NumericTrapWarning, match=re.escape(
      "learning_rate_power=-20.0: acc^20 overflows float32 once the accumulator "
      "(a sum of squared gradients) passes 84.4, and the row becomes NaN.")):
    _spec({"type": "ftrl", "learning_rate_power": -20.0, "initial_accumulator_value": 1.0})
  w, _, _ = ftrl_np(0.5, 1.0, 0.0, 10.0, 0.001, -20.0)
  assert not _finite(w)
  _rejected(_constant_table_engine(api.FTRL(0.001, learning_rate_power=-20.0,
                             initial_accumulator_value=1.0)), 10.0)


# --- AdagradMomentum: (acc + epsilon)^(-1/exponent) on a zero accumulator ----------

def test_adagrad_momentum_epsilon_to_a_power_that_overflows():
  _spec_error("table 't': epsilon=1e-10 with exponent=0.2: the accumulator starts at "
              "0, so the first step scales the gradient by (0 + epsilon)^(-1/exponent) "
              "= inf in float32, and a zero gradient on a fresh row writes Inf * 0 = NaN",
              {"type": "adagrad_momentum", "exponent": 0.2})
  w, _, _ = adagrad_momentum_np(0.5, 0.0, 0.0, 0.0, 0.1, 0.0, 0.2, 1e-10)
  assert not _finite(w)
  _rejected(_constant_table_engine(api.AdagradMomentum(0.1, exponent=0.2)), 0.0)


def test_adagrad_momentum_epsilon_that_is_zero_in_float32():
  _spec_error("table 't': epsilon=1e-46 with exponent=2.0",
              {"type": "adagrad_momentum", "epsilon": 1e-46})
  w, _, _ = adagrad_momentum_np(0.5, 0.0, 0.0, 0.0, 0.1, 0.0, 2.0, 1e-46)
  assert not _finite(w)
  _rejected(_constant_table_engine(api.AdagradMomentum(0.1, epsilon=1e-46)), 0.0)


def test_adagrad_momentum_above_one_grows_to_inf():
  _spec_error("table 't': momentum=1.5 > 1: m <- momentum * m + s grows as "
              "momentum^t and overflows float32 (Inf) within about 220 steps of a row",
              {"type": "adagrad_momentum", "momentum": 1.5})
  with pytest.warns(NumericTrapWarning, match=re.escape("momentum=1.0: m <- m + s never decays")):
    _spec({"type": "adagrad_momentum", "momentum": 1.0})
  # momentum 1e10: m = 1, 1e10, 1e20, 1e30, then Inf at the fifth step.
  emb = _constant_table_engine(api.AdagradMomentum(0.1, momentum=1e10))
  w, acc, m = f32(0.5), f32(0), f32(0)
  for _ in range(4):
    w, acc, m = adagrad_momentum_np(w, acc, m, 1.0, 0.1, 1e10, 2.0, 1e-10)
    assert _finite(w, m)
    _one_id_step(emb, 1.0)
    np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy()[1], [w, w],
                               rtol=1e-5)
  w, acc, m = adagrad_momentum_np(w, acc, m, 1.0, 0.1, 1e10, 2.0, 1e-10)
  assert not _finite(w, m)
  _rejected(emb, 1.0)


def test_adagrad_momentum_beta2_that_is_one_in_float32():
  _spec_error("table 't': beta2=0.99999999 is 1.0 in float32, the TPU's precision: "
              "the TPU then sums squares (its beta2 == 1 branch, Adagrad) while the "
              "spec asks for a moving average",
              {"type": "adagrad_momentum", "beta2": 0.99999999})
  # Not NaN but a different optimizer: the float32 formula sums squares.
  _, acc, _ = adagrad_momentum_np(0.5, 1.0, 0.0, 1.0, 0.1, 0.0, 2.0, 1e-10,
                                  beta2=0.99999999)
  assert acc == 2.0


# --- Adam -----------------------------------------------------------------------

def test_adam_epsilon_whose_square_is_zero_in_float32():
  _spec_error("table 't': epsilon=1e-30: the denominator sqrt(v + epsilon^2) is 0 in "
              "float32 (the TPU flushes values below 1.2e-38 to 0) for a row whose v "
              "is 0, so a zero gradient on a fresh row writes m / 0 = 0 / 0 = NaN on "
              "the first step",
              {"type": "adam", "epsilon": 1e-30})
  _spec({"type": "adam", "epsilon": 1e-30, "sum_inside_sqrt": False})  # eps alone is fine
  w, _, _ = adam_np(0.5, 0.0, 0.0, 0.0, 0.001, 0.9, 0.999, 1e-30)
  assert not _finite(w)
  _rejected(_constant_table_engine(api.Adam(0.001, epsilon=1e-30)), 0.0)


def test_adam_betas_that_are_one_in_float32():
  _spec_error("table 't': beta_2=0.99999999 is 1.0 in float32, the TPU's precision: "
              "the second moment v <- 1 * v + 0 * g^2 stays 0, so each step divides m "
              "by epsilon alone", {"type": "adam", "beta_2": 0.99999999})
  _spec_error("table 't': beta_1=0.999999999 is 1.0 in float32, the TPU's precision: "
              "the first moment m <- 1 * m + 0 * g never leaves 0",
              {"type": "adam", "beta_1": 0.999999999})
  # In float32 v stays 0 and the step is lr * m / epsilon: 1e6 times the rate.
  w, _, v = adam_np(0.0, 0.0, 0.0, 1.0, 0.001, 0.9, 0.99999999, 1e-7)
  assert v == 0.0 and abs(w) > 100.0


def test_adam_bias_correction_at_step_zero_is_finite():
  # Not a trap: the correction uses t + 1, and beta_1 < 1 in float64.
  spec = _spec({"type": "adam", "bias_correction": True, "beta_1": 0.9999999,
                "beta_2": 0.0})
  rates = numeric_traps.rate_samples(0.001, (0.9999999, 0.0))
  assert rates[0][0] == 0 and np.isfinite(rates[0][1]) and rates[0][1] > 1.0
  assert spec.optimizer_for("t").bias_correction


# --- rates, decay, float32 range -------------------------------------------------

def test_learning_rate_1e30():
  _spec_error("table 't': learning_rate=1e+30, above 1e+06: one step moves a weight "
              "by lr * g, and float32 overflows (Inf, then NaN) within a few steps. "
              "Fix: use a rate such as 0.01", {"type": "sgd", "learning_rate": 1e30})
  with np.errstate(over="ignore"):
    assert not np.isfinite(f32(0.5) - f32(1e30) * f32(1e9))
  _rejected(_constant_table_engine(api.SGD(1e30)), 1e9)


def test_hyperparameter_beyond_float32():
  _spec_error("table 't': learning_rate=1e+39 is beyond float32's range "
              "(+-3.403e+38): the TPU stores it as Inf",
              {"type": "sgd", "learning_rate": 1e39})
  _spec_error("table 't': l1_regularization_strength=1e+39 is beyond float32's range",
              {"type": "ftrl", "l1_regularization_strength": 1e39})
  with np.errstate(over="ignore"):
    assert np.isinf(f32(1e39))
  _rejected(_constant_table_engine(api.SGD(1e39)), 0.0)  # Inf * 0 = NaN


def test_weight_decay_of_two_or_more_grows_to_inf():
  _spec_error("table 't': weight_decay_factor=3.0: decay is w <- (1 - wd) w, so |w| "
              "grows by 2 on every touched step and float32 overflows to Inf",
              {"type": "sgd", "weight_decay_factor": 3.0})
  schedules = {"two": {"class": "PiecewiseConstantDecay", "boundaries": [100],
                       "values": [0.1, 0.5]}}
  _spec_error("table 't': weight_decay_factor * learning rate = 10 * 0.5 = 5 at step "
              "101: decay is w <- (1 - wd) w",
              {"type": "sgd", "learning_rate": "two", "weight_decay_factor": 10.0,
               "multiply_weight_decay_factor_by_learning_rate": True},
              schedules=schedules)
  with pytest.warns(NumericTrapWarning, match=re.escape(
      "weight_decay_factor=1.5: decay is w <- (1 - wd) w, which zeroes or flips the "
      "sign of every touched row")):
    _spec({"type": "sgd", "weight_decay_factor": 1.5})
  emb = _constant_table_engine(api.SGD(0.1, weight_decay_factor=3.0), init=1e38)
  _one_id_step(emb, 0.0)  # w = 1e38 - 3 * 1e38 = -2e38: still finite
  np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy()[1],
                             [-2e38, -2e38], rtol=1e-6)
  with np.errstate(over="ignore"):
    assert not np.isfinite(f32(-2e38) - f32(3) * f32(-2e38))
  _rejected(emb, 0.0)


# --- table fields ----------------------------------------------------------------

def test_quantization_step_that_overflows_or_underflows():
  with pytest.raises(tee.ConfigError, match=re.escape(
      "quantization step q = (upper - lower) / (num_buckets - 1) = (3e+38 - -3e+38) / "
      "255 is inf in float32: (x - lower) / q then divides by Inf, and 0 * Inf writes "
      "NaN into the activations")):
    _spec({"type": "sgd"}, quantization={"num_buckets": 256, "lower": -3e38,
                                         "upper": 3e38})
  with np.errstate(all="ignore"):  # x = floor((x - lower) / q + 0.5) * q + lower
    q = (f32(3e38) - f32(-3e38)) / f32(255)
    assert np.isnan(np.floor((f32(0.5) + f32(3e38)) / q + f32(0.5)) * q - f32(3e38))
  with pytest.raises(tee.ConfigError, match=re.escape(
      "quantization step q = (upper - lower) / (num_buckets - 1) = (1e-37 - 0.0) / "
      "2147483647 is 0 in float32: (x - lower) / q then divides by 0, and writes "
      "Inf or NaN into the activations")):
    _spec({"type": "sgd"}, quantization={"num_buckets": 2 ** 31, "lower": 0.0,
                                         "upper": 1e-37})
  # The emulator computes q in float64 and rounds it to float32 (the overflow
  # case stays finite there); q = 4.7e-47 is 0 in float32 either way.
  table = api.TableConfig(4, 2, initializer=tf.constant_initializer(0.5), name="t",
                          quantization_config=api.QuantizationConfig(2 ** 31, 0.0, 1e-37))
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")}, api.SGD(0.1))
  emb.enqueue({"f": tf.constant([1])}, training=False)
  assert not np.any(np.isfinite(emb.dequeue()["f"].numpy()))


def test_initializer_beyond_float32():
  with pytest.raises(tee.ConfigError, match=re.escape(
      "tables.t.initializer.value: value=1e+39 is beyond float32's range "
      "(+-3.403e+38): the TPU would store Inf.")):
    _spec({"type": "sgd"}, initializer={"type": "constant", "value": 1e39})
  emb = _constant_table_engine(api.SGD(0.1), init=1e39)
  emb.build()
  assert np.all(np.isinf(emb.variables["t"]["parameters"].numpy()))


def test_tf_optimizer_objects_are_taken_unchecked_and_specs_are_checked():
  assert tf_optimizers.from_tf(api.FTRL(learning_rate=0.0)).learning_rate == 0.0
  with pytest.raises(NumericTrapError):
    optimizers.FTRL(learning_rate=0.0)


def test_shipped_configs_pass_every_check_without_warnings():
  import glob
  for path in sorted(glob.glob("configs/*.yaml")):
    with warnings.catch_warnings():
      warnings.simplefilter("error", NumericTrapWarning)
      EmbeddingSpec.from_file(path)


def test_spec_built_directly_is_checked():
  from tpu_embed_ext.spec import FeatureSpec, TableSpec
  with pytest.raises(NumericTrapError, match=re.escape(
      "optimizer.learning_rate: table 't': learning_rate=0.0, and FTRL without "
      "multiply_linear_by_learning_rate divides by it")):
    EmbeddingSpec(optimizer={"type": "ftrl", "learning_rate": 0.0},
                  tables=(TableSpec(name="t", vocabulary_size=4, dim=2),),
                  features=(FeatureSpec(name="f", table="t"),))
