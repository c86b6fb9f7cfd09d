"""Schedules drive the CPU engine step by step; tags are the fewest possible."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.spec import schedules as learning_rates
from tpu_embed_ext.tf import rates as rate_binding, tags as rate_tags

api = tf.tpu.experimental.embedding


def exponential(t, init=0.1, ds=4, rate=0.5, staircase=False):
  p = t // ds if staircase else t / ds
  return init * rate ** p


def piecewise(t, boundaries=(3, 7), values=(0.3, 0.2, 0.1)):
  for b, v in zip(boundaries, values):
    if t <= b:
      return v
  return values[-1]


def polynomial(t, init=0.2, ds=10, end=0.01, power=2.0):
  t = min(t, ds)
  return (init - end) * (1 - t / ds) ** power + end


def inverse_time(t, init=0.2, ds=5, rate=0.5):
  return init / (1 + rate * t / ds)


def cosine_warmup(t, init=0.0, target=0.2, warmup=5, ds=10, alpha=0.1):
  if t < warmup:
    return init + (target - init) * t / warmup
  t = min(t - warmup, ds)
  return target * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * t / ds)) + alpha)


def cosine_restarts(t, init=0.2, first=4, t_mul=2.0, m_mul=0.5, alpha=0.05):
  frac = t / first
  i = math.floor(math.log(1 - frac * (1 - t_mul)) / math.log(t_mul))
  done = (1 - t_mul ** i) / (1 - t_mul)
  frac = (frac - done) / t_mul ** i
  cos = 0.5 * m_mul ** i * (1 + math.cos(math.pi * frac))
  return init * ((1 - alpha) * cos + alpha)


SCHEDULES = {
    "exponential": ({"class": "ExponentialDecay", "initial_learning_rate": 0.1,
                     "decay_steps": 4, "decay_rate": 0.5}, exponential),
    "exponential_staircase": (
        {"class": "ExponentialDecay", "initial_learning_rate": 0.1, "decay_steps": 4,
         "decay_rate": 0.5, "staircase": True},
        lambda t: exponential(t, staircase=True)),
    "piecewise": ({"class": "PiecewiseConstantDecay", "boundaries": [3, 7],
                   "values": [0.3, 0.2, 0.1]}, piecewise),
    "polynomial": ({"class": "PolynomialDecay", "initial_learning_rate": 0.2,
                    "decay_steps": 10, "end_learning_rate": 0.01, "power": 2.0},
                   polynomial),
    "inverse_time": ({"class": "InverseTimeDecay", "initial_learning_rate": 0.2,
                      "decay_steps": 5, "decay_rate": 0.5}, inverse_time),
    "cosine_warmup": ({"class": "CosineDecay", "initial_learning_rate": 0.0,
                       "warmup_target": 0.2, "warmup_steps": 5, "decay_steps": 10,
                       "alpha": 0.1}, cosine_warmup),
    "cosine_restarts": ({"class": "CosineDecayRestarts", "initial_learning_rate": 0.2,
                         "first_decay_steps": 4, "t_mul": 2.0, "m_mul": 0.5,
                         "alpha": 0.05}, cosine_restarts),
}
STEPS = 24  # Crosses every boundary, warm-up end, decay end and two restarts.


def _sgd_run(optimizer_config, steps=STEPS):
  """Rates applied at each step, read back from an SGD table with gradient 1."""
  spec = tee.EmbeddingSpec.from_dict({
      "optimizer": optimizer_config,
      "tables": {"t": {"vocabulary_size": 3, "dim": 1,
                       "initializer": {"type": "zeros"}}},
      "features": {"f": {"table": "t"}}})
  emb = tee.CPUEmbedding(spec)
  step = tf.function(lambda: _one_step(emb))
  rates = []
  for _ in range(steps):
    before = emb.variables["t"]["parameters"][1, 0].numpy()
    step()
    rates.append(before - emb.variables["t"]["parameters"][1, 0].numpy())
  return np.array(rates), emb


def _one_step(emb):
  emb.enqueue({"f": tf.constant([1], tf.int64)}, training=True)
  acts = emb.dequeue()
  emb.apply_gradients({"f": tf.ones_like(acts["f"])})


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_values_driven_by_the_engine_step(name):
  config, closed_form = SCHEDULES[name]
  rates, emb = _sgd_run({"type": "sgd", "learning_rate": config})
  np.testing.assert_allclose(rates, [closed_form(t) for t in range(STEPS)],
                             rtol=2e-5, atol=1e-7)
  assert int(emb.step.numpy()) == STEPS


def test_adam_bias_correction_rate():
  # One id, gradient 1: m_t = 1 - b1^(t+1), v_t = 1 - b2^(t+1); with the rate
  # lr * sqrt(1 - b2^(t+1)) / (1 - b1^(t+1)) every step moves w by lr / sqrt(1 + eps^2/v).
  rates, _ = _sgd_run({"type": "adam", "learning_rate": 0.01, "bias_correction": True,
                       "beta_1": 0.9, "beta_2": 0.99, "epsilon": 1e-6}, steps=10)
  t = np.arange(10) + 1
  v = 1 - 0.99 ** t
  np.testing.assert_allclose(rates, 0.01 / np.sqrt(1 + 1e-12 / v), rtol=1e-5)


def _tables_spec(n=26):
  inline = {"class": "ExponentialDecay", "initial_learning_rate": 0.1,
            "decay_steps": 100, "decay_rate": 0.9}
  tables = {}
  for i in range(n):
    t = {"vocabulary_size": 10, "dim": 2}
    if i in (3, 17):
      t["optimizer"] = {"learning_rate": dict(inline)}      # Written twice inline.
    elif i in (5, 6, 20):
      t["optimizer"] = {"learning_rate": "cos"}             # By name.
    elif i == 9:
      t["optimizer"] = {"type": "adam", "learning_rate": 0.001, "bias_correction": True}
    tables[f"t{i:02d}"] = t
  return tee.EmbeddingSpec.from_dict({
      "optimizer": {"type": "adagrad", "learning_rate": 0.05},
      "schedules": {"cos": {"class": "CosineDecay", "initial_learning_rate": 0.1,
                            "decay_steps": 1000}},
      "tables": tables, "features": {f"f{i:02d}": {"table": f"t{i:02d}"} for i in range(n)}})


def test_26_tables_3_distinct_rates_make_3_tags():
  plan = tee.plan(_tables_spec())
  expected = {name: None for name in plan.tags}
  expected.update({"t03": 0, "t17": 0, "t05": 1, "t06": 1, "t20": 1, "t09": 2})
  assert plan.tags == expected
  dynamic = {t.name: t.optimization_parameters.learning_rate.dynamic.tag
             for t in plan.config_proto().table_descriptor
             if t.optimization_parameters.learning_rate.HasField("dynamic")}
  assert dynamic == {k: v for k, v in expected.items() if v is not None}


def test_equal_schedules_are_one_value_and_one_callable():
  a = learning_rates.Schedule.from_config({"class": "ExponentialDecay",
                                           "initial_learning_rate": 0.1,
                                           "decay_steps": 10, "decay_rate": 0.5})
  b = learning_rates.parse_learning_rate(
      {"class_name": "ExponentialDecay",
       "config": {"initial_learning_rate": 0.1, "decay_steps": 10.0,
                  "decay_rate": 0.5, "name": "x"}}, {})
  assert a == b and hash(a) == hash(b)
  binder = rate_binding.RateBinder(tf.Variable(0, dtype=tf.int64))
  assert binder.rate(tee.SGD(learning_rate=a)) is binder.rate(tee.Adagrad(learning_rate=b))
  assert binder.rate(tee.SGD(learning_rate=0.3)) == 0.3


@pytest.mark.parametrize("tags,rates,message", [
    ({"a": 0, "b": 2}, {"a": "f", "b": "g"},
     "dynamic learning-rate tags must be 0..n-1 with none skipped, got [0, 2]."),
    ({"a": 0, "b": 0}, {"a": "f", "b": "g"},
     "tables 'a' and 'b' share tag 0 but not the learning rate"),
    ({"a": None}, {"a": "f"}, "table 'a' has a dynamic learning rate but no tag."),
    ({"a": 0}, {"a": 0.1}, "table 'a' has tag 0 but a constant rate 0.1."),
], ids=["gap", "shared_tag_two_rates", "missing_tag", "tag_on_constant"])
def test_tag_rule_violations_are_pinned(tags, rates, message):
  callables = {"f": lambda: 0.1, "g": lambda: 0.2}
  rates = {k: callables.get(v, v) for k, v in rates.items()}
  with pytest.raises(tee.ConfigError) as info:
    rate_tags.check_tag_rules(tags, rates)
  assert str(info.value).startswith(message)


def test_schedules_can_read_a_keras_optimizers_iterations():
  import keras
  spec = tee.EmbeddingSpec.from_dict({
      "optimizer": {"type": "adagrad", "learning_rate": SCHEDULES["piecewise"][0]},
      "tables": {"t": {"vocabulary_size": 3, "dim": 1}},
      "features": {"f": {"table": "t"}}})
  keras_opt = keras.optimizers.SGD()
  rate = spec.feature_config(step=keras_opt.iterations)["f"].table.optimizer.learning_rate
  seen = []
  for t in range(10):
    seen.append(float(rate()))
    keras_opt.iterations.assign_add(1)
  np.testing.assert_allclose(seen, [piecewise(t) for t in range(10)], rtol=1e-6)


@pytest.mark.parametrize("schedule,message", [
    (keras.optimizers.schedules.PiecewiseConstantDecay([10, 5], [0.1, 0.2, 0.3]),
     "PiecewiseConstantDecay boundaries must increase, got boundaries=[10, 5]"),
    (keras.optimizers.schedules.CosineDecayRestarts(0.1, 20, m_mul=-1.0),
     "CosineDecayRestarts gives the learning rate -0.1 at step 20;"),
    (keras.optimizers.schedules.InverseTimeDecay(0.1, 10, decay_rate=-0.5),
     "InverseTimeDecay gives the learning rate inf at step 20;"),
], ids=["unsorted_boundaries", "restarts_negative_m_mul", "inverse_time_pole"])
def test_python_schedules_are_checked_over_their_whole_range(schedule, message):
  # The same check as for a config file, for a Keras object given in Python.
  with pytest.raises(tee.ConfigError) as info:
    tee.EmbeddingSpec.from_dict({
        "optimizer": {"type": "sgd", "learning_rate": schedule},
        "tables": {"t": {"vocabulary_size": 4, "dim": 2}},
        "features": {"f": {"table": "t"}}})
  assert message in str(info.value), str(info.value)
  # A schedule that stays >= 0 (it reaches exactly 0) is accepted.
  tee.EmbeddingSpec.from_dict({
      "optimizer": {"type": "sgd", "learning_rate":
                    keras.optimizers.schedules.PolynomialDecay(0.1, 10, 0.0)},
      "tables": {"t": {"vocabulary_size": 4, "dim": 2}},
      "features": {"f": {"table": "t"}}})


# --- schedule arguments checked before Keras sees them ----------------------------

def _spec_with_rate(rate, optimizer="sgd"):
  return tee.EmbeddingSpec.from_dict({
      "optimizer": {"type": optimizer, "learning_rate": rate},
      "tables": {"t": {"vocabulary_size": 4, "dim": 2}},
      "features": {"f": {"table": "t"}}})


_EXP = {"class": "ExponentialDecay", "initial_learning_rate": 0.1, "decay_steps": 10,
        "decay_rate": 0.5}
_PWC = {"class": "PiecewiseConstantDecay", "boundaries": [3], "values": [0.2, 0.1]}
BAD_SCHEDULES = {
    # Before: "false" is a non-empty string, which Keras took as true.
    "staircase_string": (
        {**_EXP, "staircase": "false"}, tee.ConfigTypeError,
        "optimizer.learning_rate.staircase: ExponentialDecay staircase must be true "
        "or false, got str 'false'. Fix: write true or false (unquoted)."),
    "inverse_time_staircase_int": (
        {"class": "InverseTimeDecay", "initial_learning_rate": 0.1, "decay_steps": 10,
         "decay_rate": 0.5, "staircase": 1}, tee.ConfigTypeError,
        "optimizer.learning_rate.staircase: InverseTimeDecay staircase must be true "
        "or false, got int 1."),
    "polynomial_cycle_string": (
        {"class": "PolynomialDecay", "initial_learning_rate": 0.1, "decay_steps": 10,
         "cycle": "no"}, tee.ConfigTypeError,
        "optimizer.learning_rate.cycle: PolynomialDecay cycle must be true or false, "
        "got str 'no'."),
    # Before: IndexError from Keras at the first evaluation.
    "piecewise_no_boundaries": (
        {"class": "PiecewiseConstantDecay", "boundaries": [], "values": [0.1]},
        tee.ConfigError,
        "optimizer.learning_rate.boundaries: PiecewiseConstantDecay needs at least one "
        "boundary, got boundaries=[]. Fix: for a constant rate write the number "
        "(learning_rate: 0.1)"),
    "piecewise_string_boundary": (
        {**_PWC, "boundaries": ["3"]}, tee.ConfigTypeError,
        "optimizer.learning_rate.boundaries: PiecewiseConstantDecay boundaries must "
        "be a list of numbers, got ['3']."),
}


@pytest.mark.parametrize("name", sorted(BAD_SCHEDULES))
def test_bad_schedule_arguments_are_one_line(name):
  schedule, error, message = BAD_SCHEDULES[name]
  with pytest.raises(error) as info:
    _spec_with_rate(schedule)
  assert str(info.value).startswith(message), str(info.value)
  assert "\n" not in str(info.value)


def test_schedule_booleans_that_are_bools_still_work():
  """staircase: false/true give the numpy formula's rates (step 5 of 10)."""
  for staircase in (False, True):
    spec = _spec_with_rate({**_EXP, "staircase": staircase})
    rate = spec.optimizer_for("t").learning_rate
    want = 0.1 * 0.5 ** ((5 // 10) if staircase else 5 / 10)
    np.testing.assert_allclose(float(rate(5)), want, rtol=1e-6)


def test_piecewise_with_10000_boundaries_is_built_in_linear_work(monkeypatch):
  """Before: Keras's PiecewiseConstantDecay evaluates every boundary at every
  step, and the range check evaluated it at ~3n steps (1,000 boundaries ran
  past 600 s). Now no Keras evaluation and O(n) of ours, each O(log n)."""
  n = 10_000
  keras_calls, ours = [], []
  cls = keras.optimizers.schedules.PiecewiseConstantDecay
  monkeypatch.setattr(cls, "__call__", lambda self, step: keras_calls.append(step))
  at = learning_rates._Piecewise.at  # pylint: disable=protected-access
  monkeypatch.setattr(learning_rates._Piecewise, "at",  # pylint: disable=protected-access
                      lambda self, step: ours.append(step) or at(self, step))
  boundaries = list(range(10, 10 * n + 1, 10))
  values = [0.1 / (1 + i) for i in range(n + 1)]
  for optimizer in ("sgd", "ftrl", "adam"):
    spec = _spec_with_rate({"class": "PiecewiseConstantDecay",
                            "boundaries": boundaries, "values": values}, optimizer)
  assert not keras_calls
  assert len(ours) <= 3 * (3 * n + 60), len(ours)
  rate = spec.optimizer_for("t").learning_rate
  for t in (0, 10, 11, 55, 10 * n, 10 * n + 1):
    assert float(rate(t)) == np.float32(piecewise(t, boundaries, values)), t
  step = tf.Variable(55, dtype=tf.int64)
  assert float(rate(step)) == np.float32(values[5])


def test_piecewise_equals_keras_at_every_step_eagerly_and_in_tf_function():
  """Our O(log n) PiecewiseConstantDecay against Keras's own, as oracle."""
  boundaries, values = [0, 3, 4, 9, 20], [1.0, 0.5, 0.25, 0.125, 0.0625, 0.01]
  ours = _spec_with_rate({"class": "PiecewiseConstantDecay", "boundaries": boundaries,
                          "values": values}).optimizer_for("t").learning_rate
  theirs = keras.optimizers.schedules.PiecewiseConstantDecay(boundaries, values)
  step = tf.Variable(0, dtype=tf.int64)
  traced = tf.function(lambda: ours(step))
  for t in range(-2, 25):
    step.assign(t)
    want = float(theirs(tf.constant(t, tf.int64)))
    assert float(ours(t)) == want and float(ours(step)) == want, t
    assert float(traced()) == want, t


# --- the spec's schedule values, computed without Keras -------------------------

def test_schedule_arguments_are_the_keras_signatures():
  import inspect
  from tpu_embed_ext.spec import schedule_values
  for name, cls in learning_rates.schedule_classes().items():
    params = inspect.signature(cls.__init__).parameters
    keras_args = {p: params[p].default for p in params if p not in ("self", "name")}
    assert list(schedule_values.ARGUMENTS[name].items()) == list(keras_args.items()), name


_NUMPY_SCHEDULES = [
    {"class": "CosineDecay", "initial_learning_rate": 0.0, "warmup_target": 0.05,
     "warmup_steps": 1000, "decay_steps": 100000},
    {"class": "CosineDecay", "initial_learning_rate": 0.0, "warmup_target": 0.05,
     "warmup_steps": 100, "decay_steps": 1400, "alpha": 0.1},
    {"class": "CosineDecay", "initial_learning_rate": 0.1, "decay_steps": 77},
    {"class": "ExponentialDecay", "initial_learning_rate": 0.05, "decay_steps": 5000,
     "decay_rate": 0.9},
    # Decays below float32's normal range: TensorFlow's kernels flush it to 0.
    {"class": "ExponentialDecay", "initial_learning_rate": 0.1, "decay_steps": 3,
     "decay_rate": 0.97},
    {"class": "ExponentialDecay", "initial_learning_rate": 0.1, "decay_steps": 7,
     "decay_rate": 0.37, "staircase": True},
    {"class": "InverseTimeDecay", "initial_learning_rate": 0.1, "decay_steps": 13,
     "decay_rate": 0.3, "staircase": True},
    {"class": "PolynomialDecay", "initial_learning_rate": 0.1, "decay_steps": 100,
     "end_learning_rate": 0.001, "power": 0.5},
    {"class": "PolynomialDecay", "initial_learning_rate": 0.1, "decay_steps": 33,
     "end_learning_rate": 0.0, "power": 2.0, "cycle": True},
    {"class": "CosineDecayRestarts", "initial_learning_rate": 0.1, "first_decay_steps": 20},
    {"class": "CosineDecayRestarts", "initial_learning_rate": 0.1, "first_decay_steps": 17,
     "t_mul": 1.0, "m_mul": 0.9, "alpha": 0.01},
    {"class": "CosineDecayRestarts", "initial_learning_rate": 0.2,
     "first_decay_steps": 100, "t_mul": 1.5, "m_mul": 0.5, "alpha": 0.1},
]


@pytest.mark.parametrize("config", _NUMPY_SCHEDULES,
                         ids=lambda c: c["class"])
def test_numpy_schedule_values_are_keras_values(config):
  """Within one float32 ulp at every step the checks read and 300 more
  (TensorFlow's cos, log and pow are not correctly rounded), and exactly at
  the milestones: step 0, warm-up end, decay end, where rates reach 0."""
  from tpu_embed_ext.spec import schedule_values
  schedule = learning_rates.Schedule.from_config(config)
  assert schedule_values.supports(schedule.class_name, dict(schedule.config))
  theirs = schedule.keras()
  exact = set(learning_rates.milestones(schedule))
  for t in sorted(set(learning_rates.check_steps(schedule)) | set(range(300))):
    ours = np.float32(schedule.value(t))
    want = np.float32(tf.cast(theirs(t), tf.float32))
    if t in exact or want == 0:
      assert ours == want, (t, ours, want)
    else:
      assert abs(int(ours.view(np.int32)) - int(want.view(np.int32))) <= 1, (
          t, ours, want)


def test_configs_numpy_does_not_compute_are_left_to_keras():
  from tpu_embed_ext.spec import schedule_values
  # An integer initial rate: Keras computes in int32 (its verdict stands).
  assert not schedule_values.supports(
      "ExponentialDecay", {"initial_learning_rate": 1, "decay_steps": 10,
                           "decay_rate": 0.5})
  schedule = learning_rates.Schedule.from_config(
      {"class": "ExponentialDecay", "initial_learning_rate": 1,
       "decay_steps": 10, "decay_rate": 0.5})
  assert schedule.value(20) == float(tf.cast(schedule.keras()(20), tf.float32))
