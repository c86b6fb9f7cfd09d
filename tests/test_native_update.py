"""The native update (emulation/native/update_op.cc) against the TF-op path.

Two engines with the same tables, fed the same batches and gradients: one
runs the native op, one TensorFlow's ops. Their tables and slots must stay
bit-identical over 10 steps, for every optimizer, every input kind, one
device and MirroredStrategy(2), and every option; a rejected step must
change nothing in either and say the same thing. An independent numpy
reference checks a few cases over several steps.
"""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.spec import optimizers
from tpu_embed_ext.emulation import native
from tests.builders import engine_state, in_graph, mirrored_strategy
from tests import references

api = tf.tpu.experimental.embedding

pytestmark = pytest.mark.skipif(
    native.load() is None, reason="native kernels unavailable")

STEPS = 10
BATCH = 6


# --- a feature config with every input kind ------------------------------------

def _init(vocab, dim, seed):
  values = np.random.RandomState(seed).uniform(-1, 1, (vocab, dim)).astype(np.float32)
  return lambda shape, dtype=tf.float32: tf.constant(values, dtype)


def _every_input_kind_config():
  """single-hot, multi-hot (sum, mean, sqrtn), weights, sequence and
  high-dimensional features; small vocabularies so ids repeat, several
  features per table, dims that leave packet tails (3, 17)."""
  a = api.TableConfig(12, 3, initializer=_init(12, 3, 1), combiner="sum", name="a")
  m = api.TableConfig(9, 8, initializer=_init(9, 8, 2), combiner="mean", name="m")
  q = api.TableConfig(10, 17, initializer=_init(10, 17, 3), combiner="sqrtn", name="q")
  s = api.TableConfig(7, 5, initializer=_init(7, 5, 4), combiner="sum", name="s")
  return {
      "single": api.FeatureConfig(a, name="single"),
      "multi_sum": api.FeatureConfig(a, name="multi_sum"),
      "multi_mean": api.FeatureConfig(m, name="multi_mean"),
      "weighted": api.FeatureConfig(m, name="weighted"),
      "multi_sqrtn": api.FeatureConfig(q, name="multi_sqrtn"),
      "high": api.FeatureConfig(q, name="high", output_shape=[BATCH, 3]),
      "sequence": api.FeatureConfig(s, name="sequence", max_sequence_length=3),
  }


VOCAB = {"single": 12, "multi_sum": 12, "multi_mean": 9, "weighted": 9,
         "multi_sqrtn": 10, "high": 10, "sequence": 7}


def _ragged(rng, vocab, batch):
  lengths = rng.randint(0, 5, batch)
  return tf.RaggedTensor.from_row_lengths(
      rng.randint(0, vocab, lengths.sum()).astype(np.int64), lengths)


def _batch(rng, batch=BATCH):
  """Features and weights of one step (ids repeat within and across features)."""
  sparse = _ragged(rng, VOCAB["multi_sqrtn"], batch).to_sparse()
  weighted = _ragged(rng, VOCAB["weighted"], batch)
  features = {
      "single": tf.constant(rng.randint(0, 12, batch), tf.int64),
      "multi_sum": _ragged(rng, 12, batch),
      "multi_mean": _ragged(rng, 9, batch),
      "weighted": weighted,
      "multi_sqrtn": sparse,
      "high": tf.constant(rng.randint(0, 10, (batch, 3, 1)), tf.int64),
      "sequence": _ragged(rng, 7, batch),
  }
  weights = {k: None for k in features}
  weights["weighted"] = weighted.with_values(
      tf.constant(rng.uniform(0.1, 2.0, weighted.values.shape[0]), tf.float32))
  return features, weights


def _grads(rng, acts, scale=1.0):
  return {k: tf.constant(rng.normal(0, scale, a.shape).astype(np.float32))
          for k, a in acts.items()}


def _assert_same(native_state, tf_state, tolerance=None):
  assert native_state.keys() == tf_state.keys()
  for key in tf_state:
    if tolerance is None:
      np.testing.assert_array_equal(native_state[key], tf_state[key], err_msg=key)
    else:
      np.testing.assert_allclose(native_state[key], tf_state[key], err_msg=key,
                                 **tolerance)


def _engines(optimizer, strategy=None, config=_every_input_kind_config, **kwargs):
  scope = strategy.scope() if strategy is not None else _null()
  with scope:
    return [tee.CPUEmbedding(config(), optimizer, kernels=k, **kwargs)
            for k in ("native", "tf")]


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *args):
    return False


def _run_eager(emb, rng, steps=STEPS, scale=1.0, function=False, after=None):
  """``steps`` training steps; ``after()`` runs after each. With
  ``function``, one ``tf.function`` for all steps (traced once or twice, as
  a training loop does: tracing per step made this file slow)."""
  def step(features, weights, grads):
    emb.enqueue(features, weights, training=True)
    acts = emb.dequeue()
    emb.apply_gradients(grads)

  if function:
    step = tf.function(step, reduce_retracing=True)
  for _ in range(steps):
    features, weights = _batch(rng)
    acts = emb(features, weights)
    step(features, weights, _grads(rng, acts, scale))
    if after is not None:
      after()


def _run_mirrored(emb, strategy, seed, steps=STEPS):
  rng = np.random.RandomState(seed)
  batches = [[_batch(rng) for _ in range(2)] for _ in range(steps)]

  @tf.function
  def step(features, weights, seeds):
    emb.enqueue(features, weights, training=True)

    def replica(seed):
      acts = emb.dequeue()
      grads = {k: tf.random.stateless_normal(tf.shape(a), seed) for k, a in acts.items()}
      emb.apply_gradients(grads)
    strategy.run(replica, args=(seeds,))

  for i, per_replica in enumerate(batches):
    feats = strategy.experimental_distribute_values_from_function(
        lambda ctx, p=per_replica: p[ctx.replica_id_in_sync_group][0])
    weights = strategy.experimental_distribute_values_from_function(
        lambda ctx, p=per_replica: p[ctx.replica_id_in_sync_group][1])
    seeds = strategy.experimental_distribute_values_from_function(
        lambda ctx, i=i: tf.constant([i, ctx.replica_id_in_sync_group], tf.int32))
    step(feats, weights, seeds)


# --- every optimizer x every input kind x {1 device, MirroredStrategy(2)} ---------

OPTIMIZERS = {
    "sgd": lambda: optimizers.SGD(learning_rate=0.1),
    "adagrad": lambda: optimizers.Adagrad(learning_rate=0.1),
    "adagrad_momentum": lambda: optimizers.AdagradMomentum(
        learning_rate=0.05, momentum=0.9, use_nesterov=True, exponent=3.0,
        beta2=0.99, epsilon=1e-6),
    "adagrad_momentum_plain": lambda: optimizers.AdagradMomentum(
        learning_rate=0.05, momentum=0.5),
    "adam_lazy": lambda: optimizers.Adam(learning_rate=0.01),
    "adam_dense": lambda: optimizers.Adam(learning_rate=0.01, lazy_adam=False,
                                   sum_inside_sqrt=False),
    "ftrl": lambda: optimizers.FTRL(learning_rate=0.2, l1_regularization_strength=0.01,
                             l2_regularization_strength=0.02, beta=0.1,
                             learning_rate_power=-0.6),
    "ftrl_linear_times_lr": lambda: optimizers.FTRL(
        learning_rate=0.2, multiply_linear_by_learning_rate=True,
        l1_regularization_strength=0.01, l2_regularization_strength=0.02,
        beta=0.1),
    "ftrl_no_l1": lambda: optimizers.FTRL(learning_rate=0.2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_device_equals_tf_ops_bit_for_bit(name):
  ours, theirs = _engines(OPTIMIZERS[name]())
  assert (ours.kernels, theirs.kernels) == ("native", "tf")
  for emb in (ours, theirs):
    _run_eager(emb, np.random.RandomState(7))
  _assert_same(engine_state(ours), engine_state(theirs))
  assert int(ours.step.numpy()) == STEPS


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adagrad_momentum",
                                  "adam_lazy", "adam_dense", "ftrl"])
def test_mirrored_two_replicas_equals_tf_ops_bit_for_bit(name):
  strategy = mirrored_strategy(2)
  ours, theirs = _engines(OPTIMIZERS[name](), strategy)
  for emb in (ours, theirs):
    _run_mirrored(emb, strategy, seed=3)
  _assert_same(engine_state(ours), engine_state(theirs))
  assert int(ours.step.numpy()) == STEPS


# --- every option, eagerly and inside tf.function --------------------------------

_STEP = tf.Variable(0, dtype=tf.int64, trainable=False)  # drives dynamic rates


def _decayed(base):
  return lambda: tf.constant(base, tf.float32) / (1.0 + tf.cast(_STEP, tf.float32))


def _bias_corrected():
  from tpu_embed_ext.tf import rates
  spec = optimizers.Adam(learning_rate=0.01, bias_correction=True)
  return spec.replace(learning_rate=rates.RateBinder(_STEP).rate(spec),
                      bias_correction=False)


OPTIONS = {
    "clipvalue": lambda: optimizers.Adagrad(learning_rate=0.1, clipvalue=0.3),
    "clipvalue_one_sided": lambda: optimizers.SGD(learning_rate=0.1, clipvalue=(-0.2, None)),
    "clip_weights": lambda: optimizers.FTRL(learning_rate=0.2, clip_weight_min=-0.4,
                                     clip_weight_max=0.3),
    "weight_decay": lambda: optimizers.Adam(learning_rate=0.01, weight_decay_factor=0.05),
    "weight_decay_times_lr": lambda: optimizers.AdagradMomentum(
        learning_rate=0.05, momentum=0.9, weight_decay_factor=0.3,
        multiply_weight_decay_factor_by_learning_rate=True),
    "dynamic_lr": lambda: optimizers.FTRL(learning_rate=_decayed(0.3),
                                   l1_regularization_strength=0.01),
    "adam_bias_correction": _bias_corrected,
    "no_accumulation_sgd": lambda: optimizers.SGD(learning_rate=0.1,
                                           use_gradient_accumulation=False),
    "no_accumulation_adagrad": lambda: optimizers.Adagrad(
        learning_rate=0.1, use_gradient_accumulation=False, clip_weight_max=0.5),
    "no_accumulation_ftrl": lambda: optimizers.FTRL(
        learning_rate=0.2, use_gradient_accumulation=False,
        l1_regularization_strength=0.01, weight_decay_factor=0.01),
    # Grappler rewrites pow(x, c) inside tf.function for these c.
    "momentum_exponent_2": lambda: optimizers.AdagradMomentum(learning_rate=0.05,
                                                       momentum=0.9),
    "momentum_exponent_1": lambda: optimizers.AdagradMomentum(learning_rate=0.05,
                                                       exponent=1.0),
    "ftrl_power_1": lambda: optimizers.FTRL(learning_rate=0.2, learning_rate_power=-1.0),
    "ftrl_power_2": lambda: optimizers.FTRL(learning_rate=0.2, learning_rate_power=-2.0),
    "ftrl_power_3": lambda: optimizers.FTRL(learning_rate=0.2, learning_rate_power=-3.0),
}


# Inside tf.function the kernel mirrors Grappler's rewrites of the TF-op
# path (pow constants, rsqrt, 1 / lr) and the engine routes tables without
# accumulation to TF ops: these options run there too (every option runs
# eagerly). The others' graph step is the eager one (test_tf_function_*,
# the mirrored tests and the engine modules' [native] runs trace it).
GRAPH_OPTIONS = {"clip_weights", "weight_decay", "weight_decay_times_lr",
                 "dynamic_lr", "adam_bias_correction", "no_accumulation_ftrl",
                 "momentum_exponent_2", "momentum_exponent_1", "ftrl_power_1",
                 "ftrl_power_2", "ftrl_power_3"}
GRAPH_STEPS = 5  # a rewrite shows from the first step; 5 still moves rates


@pytest.mark.parametrize("name,mode", [(n, "eager") for n in sorted(OPTIONS)] + [
    (n, "tf_function") for n in sorted(GRAPH_OPTIONS)])
def test_option_equals_tf_ops_bit_for_bit(name, mode):
  _STEP.assign(0)
  ours, theirs = _engines(OPTIONS[name]())
  function = mode == "tf_function"
  for emb in (ours, theirs):
    _STEP.assign(0)
    _run_eager(emb, np.random.RandomState(11), function=function,
               steps=GRAPH_STEPS if function else STEPS,
               after=lambda: _STEP.assign_add(1))
  _assert_same(engine_state(ours), engine_state(theirs))


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("name", ["adam_lazy", "ftrl", "adagrad_momentum"])
def test_tf_function_equals_tf_ops_bit_for_bit(name, mode):
  ours, theirs = _engines(OPTIMIZERS[name]())
  for emb in (ours, theirs):
    _run_eager(emb, np.random.RandomState(5), function=mode == "tf_function")
  _assert_same(engine_state(ours), engine_state(theirs))


@pytest.mark.parametrize("name", ["adam_dense", "adagrad", "sgd"])
def test_sparsecore_engine_v2_equals_tf_ops(name):
  spec = OPTIMIZERS[name]().replace(clipvalue=0.1, clip_weight_max=0.0)
  ours, theirs = _engines(spec, config=_v2_config, engine="v2")
  for emb in (ours, theirs):
    rng = np.random.RandomState(2)
    for _ in range(STEPS):
      features = {"x": tf.constant(rng.randint(0, 9, BATCH), tf.int64),
                  "y": _ragged(rng, 9, BATCH)}
      emb.enqueue(features, training=True)
      acts = emb.dequeue()
      emb.apply_gradients(_grads(rng, acts))
  _assert_same(engine_state(ours), engine_state(theirs))


def _v2_config():
  t = api.TableConfig(9, 6, initializer=_init(9, 6, 5), combiner="mean", name="t")
  return {"x": api.FeatureConfig(t, name="x", output_shape=[BATCH]),
          "y": api.FeatureConfig(t, name="y", output_shape=[BATCH])}


# --- rejected steps: nothing changes, the same messages ---------------------------

def _two_tables():
  tables = [api.TableConfig(6, 2, initializer=tf.ones_initializer(), name=n)
            for n in ("a", "b")]
  return {"x": api.FeatureConfig(tables[0], name="x"),
          "y": api.FeatureConfig(tables[1], name="y")}


def _bad_step(emb, grad_b, ids_b=(3, 3), function=False):
  def step(grad_b):
    emb.enqueue({"x": tf.constant([1, 2], tf.int64),
                 "y": tf.constant(list(ids_b), tf.int64)}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"x": tf.ones_like(acts["x"]), "y": grad_b})
  return (tf.function(step) if function else step)(tf.constant(grad_b, tf.float32))


REJECTIONS = {
    # name: (optimizer, gradient of table b, the message's start). One
    # message in every mode: in a graph it is the assertion's.
    "nan_gradient": (lambda: optimizers.Adagrad(learning_rate=0.1), [[np.nan, 1.0], [1.0, 1.0]],
                     "table 'b': gradient has NaN or Inf values; no table, slot or "
                     "step was changed."),
    "overflowing_sum": (lambda: optimizers.Adagrad(learning_rate=0.1), [[3e38, 3e38]] * 2,
                        "table 'b': gradient has NaN or Inf values"),
    "sgd_parameters": (lambda: optimizers.SGD(learning_rate=1e6), [[1e33, 1e33]] * 2,
                       "table 'b': the update would write NaN or Inf into its "
                       "parameters; no table, slot or step was changed."),
    "adagrad_accumulators": (lambda: optimizers.Adagrad(learning_rate=0.1), [[1e20, 1e20]] * 2,
                             "table 'b': the update would write NaN or Inf into "
                             "its accumulators"),
}


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("name", sorted(REJECTIONS))
def test_rejected_step_changes_no_table_and_says_the_same(name, mode):
  optimizer, grad_b, message = REJECTIONS[name]
  messages = []
  for kernels in ("native", "tf"):
    emb = tee.CPUEmbedding(_two_tables(), optimizer(), kernels=kernels)
    _bad_step(emb, [[0.5, 0.5]] * 2)  # one good step first
    before = engine_state(emb)
    if mode == "eager":
      with pytest.raises(tee.InputError) as info:
        _bad_step(emb, grad_b)
      assert str(info.value).startswith(message), str(info.value)
      messages.append(str(info.value))
    else:
      with pytest.raises(tf.errors.InvalidArgumentError, match=in_graph(message)):
        _bad_step(emb, grad_b, function=True)
    after = engine_state(emb)
    for key in before:  # table 'a' was fine: unchanged too
      np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    assert int(emb.step.numpy()) == 1
  if mode == "eager":
    assert messages[0] == messages[1]


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_out_of_range_ids_rejected_with_the_same_message(mode):
  """Both kernel paths refuse the step with one message (its wording is pinned
  in tests/test_engine_input_checks.py) and change nothing."""
  messages = []
  for kernels in ("native", "tf"):
    emb = tee.CPUEmbedding(_two_tables(), optimizers.SGD(learning_rate=0.1), kernels=kernels)
    before = engine_state(emb)
    error = tee.InputError if mode == "eager" else tf.errors.InvalidArgumentError
    with pytest.raises(error) as info:
      _bad_step(emb, [[1.0, 1.0]] * 2, ids_b=(1, 6), function=mode == "tf_function")
    # The line naming the feature (in a graph, the assertion's line).
    messages.append(next(line for line in str(info.value).splitlines() if "(table " in line))
    after = engine_state(emb)
    for key in before:
      np.testing.assert_array_equal(after[key], before[key], err_msg=key)
  assert messages[0] == messages[1]


def test_kernel_checks_ids_itself_when_validation_is_off():
  """validate=False skips the engine's id check; the op still refuses the
  step with the engine's own message (pinned in test_engine_input_checks.py),
  before any write."""
  messages = []
  for validate in (True, False):
    emb = tee.CPUEmbedding(_two_tables(), optimizers.SGD(learning_rate=0.1),
                           kernels="native", validate=validate)
    before = engine_state(emb)
    with pytest.raises((tee.InputError, tf.errors.InvalidArgumentError)) as info:
      emb.enqueue({"x": tf.constant([1, 2], tf.int64),
                   "y": tf.constant([1, -4], tf.int64)}, training=True)
      emb.apply_gradients({"x": tf.ones([2, 2]), "y": tf.ones([2, 2])})
    messages.append(str(info.value))
  assert isinstance(info.value, tf.errors.InvalidArgumentError)  # the op's own check
  assert messages[0].splitlines()[0] in messages[1], messages
  after = engine_state(emb)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)


# --- an independent numpy reference -------------------------------------------

REFERENCE = {
    "sgd": lambda: optimizers.SGD(learning_rate=0.1),
    "adagrad": lambda: optimizers.Adagrad(learning_rate=0.1),
    "ftrl": lambda: optimizers.FTRL(learning_rate=0.2, l1_regularization_strength=0.01,
                                    l2_regularization_strength=0.02, beta=0.1),
}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_native_matches_numpy_reference_over_steps(name):
  spec = REFERENCE[name]()
  hparams = references.hparams_of(name, spec)
  table = api.TableConfig(8, 4, initializer=_init(8, 4, 9), combiner="mean", name="t")
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")}, spec,
                         kernels="native")
  w = emb.variables["t"]["parameters"].numpy().astype(np.float64)
  slots = references.initial_slots(name, (8, 4), **hparams)
  lr = 0.1 if name != "ftrl" else 0.2
  rng = np.random.RandomState(4)
  for _ in range(5):
    ids = _ragged(rng, 8, BATCH)
    grad = rng.normal(0, 1, (BATCH, 4)).astype(np.float32)
    emb.enqueue({"f": ids}, training=True)
    emb.dequeue()
    emb.apply_gradients({"f": tf.constant(grad)})
    lengths = ids.row_lengths().numpy()
    rows = np.repeat(np.arange(BATCH), lengths)
    # The mean combiner: occurrence k of sample r sends grad[r] / length.
    references.train_step(name, w, slots, ids.values.numpy(),
                          grad.astype(np.float64)[rows] / lengths[rows, None],
                          lr, **hparams)
  np.testing.assert_allclose(emb.variables["t"]["parameters"].numpy(), w,
                             rtol=2e-5, atol=1e-6)
  assert set(slots) == set(spec.slot_names)
  for s, value in slots.items():
    np.testing.assert_allclose(emb.variables["t"][s].numpy(), value, rtol=2e-5,
                               atol=1e-6)
