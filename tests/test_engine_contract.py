"""CPUEmbedding against a numpy reference written from docs/semantics.md.

One contract table runs every optimizer through the same checks: slot names,
shapes and initial values, then 10 training steps whose tables and slots must
equal the reference's. The batches have duplicate ids (inside a sample and
across samples), two features sharing a table, weights, all three combiners
and a sequence feature; options add gradient clipping, weight clipping,
weight decay and a learning rate that changes every step. Adding an optimizer
is adding one row to OPTIMIZERS.
"""

import dataclasses
from typing import Dict

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests import references

api = tf.tpu.experimental.embedding
STEPS = 10
BATCH = 4

# name: (vocabulary, dim, combiner)
TABLES = {"video": (10, 4, "sum"), "user": (8, 2, "mean"),
          "query": (6, 3, "sqrtn"), "clicks": (7, 2, "sum")}
# name: (table, max_sequence_length, layout)
FEATURES = {"watched": ("video", 0, "ragged"), "favorited": ("video", 0, "sparse"),
            "friends": ("user", 0, "ragged"), "terms": ("query", 0, "ragged"),
            "item": ("video", 0, "dense"), "history": ("clicks", 3, "ragged")}
WEIGHTED = {"watched", "friends", "terms"}


@dataclasses.dataclass
class Row:
  tf_class: type
  hparams: dict
  reference: str           # its rule in tests/references.py
  slots: Dict[str, float]  # slot name -> initial value


OPTIMIZERS = {
    "sgd": Row(api.SGD, {}, "sgd", {}),
    "adagrad": Row(api.Adagrad, {"initial_accumulator_value": 0.2}, "adagrad",
                   {"accumulators": 0.2}),
    "adagrad_momentum": Row(
        api.AdagradMomentum,
        {"momentum": 0.9, "use_nesterov": True, "exponent": 3.0, "beta2": 0.9,
         "epsilon": 0.1}, "adagrad_momentum",
        {"accumulators": 0.0, "momenta": 0.0}),
    "adagrad_momentum_plain": Row(
        api.AdagradMomentum,
        {"momentum": 0.5, "use_nesterov": False, "exponent": 2.0, "beta2": 1.0,
         "epsilon": 1e-3}, "adagrad_momentum",
        {"accumulators": 0.0, "momenta": 0.0}),
    "adam": Row(api.Adam, {"beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-3,
                           "sum_inside_sqrt": True}, "adam",
                {"momenta": 0.0, "velocities": 0.0}),
    "adam_eps_outside": Row(api.Adam, {"beta_1": 0.9, "beta_2": 0.99,
                                       "epsilon": 0.01, "sum_inside_sqrt": False},
                            "adam", {"momenta": 0.0, "velocities": 0.0}),
    "ftrl": Row(api.FTRL, {"learning_rate_power": -0.5, "l1_regularization_strength": 0.01,
                           "l2_regularization_strength": 0.02, "beta": 0.1,
                           "initial_accumulator_value": 0.1}, "ftrl",
                {"accumulators": 0.1, "linears": 0.0}),
    "ftrl_linear_times_lr": Row(
        api.FTRL, {"learning_rate_power": -0.3, "l1_regularization_strength": 0.0,
                   "l2_regularization_strength": 0.05, "beta": 0.0,
                   "initial_accumulator_value": 0.3,
                   "multiply_linear_by_learning_rate": True}, "ftrl",
        {"accumulators": 0.3, "linears": 0.0}),
}

OPTIONS = {
    "plain": {},
    "clipping": {"clipvalue": (-0.5, 0.8), "clip_weight_min": -1.2,
                 "clip_weight_max": 1.5},
    "decay": {"weight_decay_factor": 0.05},
    "decay_times_lr": {"weight_decay_factor": 0.2,
                       "multiply_weight_decay_factor_by_learning_rate": True},
}


def learning_rate(t):
  """Changes every step: checks the rate is read once per step, at step t."""
  return 0.1 + 0.02 * np.cos(t)


def initial_table(name):
  vocab, dim, _ = TABLES[name]
  return np.random.RandomState(len(name)).uniform(-1, 1, (vocab, dim))


def make_batch(step):
  """Random ids with duplicates; returns the TF inputs and the raw rows."""
  rng = np.random.RandomState(100 + step)
  raw, weights = {}, {}
  for name, (table, max_len, layout) in FEATURES.items():
    vocab = TABLES[table][0]
    if layout == "dense":
      raw[name] = [[int(i)] for i in rng.randint(0, vocab, BATCH)]
    else:
      lengths = rng.randint(0 if name != "watched" else 1, 6, BATCH)
      # Small id range: duplicates inside and across samples.
      raw[name] = [list(rng.randint(0, min(vocab, 4), n)) for n in lengths]
    weights[name] = [list(rng.uniform(0.5, 2.0, len(r))) for r in raw[name]]
  features, tf_weights = {}, {}
  for name, (_, _, layout) in FEATURES.items():
    if layout == "dense":
      features[name] = tf.constant([r[0] for r in raw[name]], tf.int64)
    else:
      ragged = tf.ragged.constant(raw[name], tf.int64, ragged_rank=1)
      features[name] = ragged.to_sparse() if layout == "sparse" else ragged
    if name in WEIGHTED:
      tf_weights[name] = tf.ragged.constant(weights[name], tf.float32,
                                            ragged_rank=1)
    else:
      tf_weights[name] = None
  return features, tf_weights, raw, weights


def reference_forward(E, raw, weights):
  """Activations plus each occurrence's (feature, row, id, gain)."""
  acts, occurrences = {}, []
  for name, (table, max_len, layout) in FEATURES.items():
    _, dim, combiner = TABLES[table]
    if max_len:
      out = np.zeros((BATCH, max_len, dim))
      for b, ids in enumerate(raw[name]):
        for k, i in enumerate(ids[:max_len]):
          out[b, k] += E[table][i]
          occurrences.append((name, (b, k), table, i, 1.0))
      acts[name] = out
      continue
    out = np.zeros((BATCH, dim))
    for b, ids in enumerate(raw[name]):
      w = np.array(weights[name][b]) if name in WEIGHTED else np.ones(len(ids))
      if layout == "dense" or combiner == "sum":
        gains = w
      elif combiner == "mean":
        gains = w / w.sum() if w.sum() else 0 * w
      else:
        gains = w / np.sqrt((w ** 2).sum()) if len(w) else w
      for i, gain in zip(ids, gains):
        out[b] += gain * E[table][i]
        occurrences.append((name, (b,), table, i, gain))
    acts[name] = out
  return acts, occurrences


def upstream_gradient(acts, step):
  """dL/dact for L = sum(act^2) / 2 + sum(C * act): depends on the forward."""
  rng = np.random.RandomState(500 + step)
  return {n: a + rng.uniform(-1, 1, a.shape) for n, a in acts.items()}


def reference_run(row, options):
  o = references.hparams(row.reference, **row.hparams)
  E = {t: initial_table(t) for t in TABLES}
  S = {t: {s: np.full(E[t].shape, v) for s, v in row.slots.items()} for t in TABLES}
  for step in range(STEPS):
    _, _, raw, weights = make_batch(step)
    acts, occurrences = reference_forward(E, raw, weights)
    grads = upstream_gradient(acts, step)
    per_id = {t: {} for t in TABLES}
    for name, index, table, i, gain in occurrences:
      per_id[table][i] = per_id[table].get(i, 0) + gain * grads[name][index]
    lr = learning_rate(step)
    for table, gs in per_id.items():
      for i, g in gs.items():
        w, slots = references.apply(
            row.reference, E[table][i], {s: S[table][s][i] for s in row.slots},
            g, lr, o, **options)
        E[table][i] = w
        for s, v in slots.items():
          S[table][s][i] = v
  return E, S


def build_engine(row, options):
  holder = {}
  optimizer = row.tf_class(
      learning_rate=lambda: 0.1 + 0.02 * tf.cos(
          tf.cast(holder["engine"].step, tf.float32)),
      **row.hparams, **options)
  tables = {
      t: api.TableConfig(v, d, combiner=c, name=t,
                         initializer=tf.constant_initializer(initial_table(t)))
      for t, (v, d, c) in TABLES.items()}
  config = {n: api.FeatureConfig(tables[t], max_sequence_length=m, name=n)
            for n, (t, m, _) in FEATURES.items()}
  engine = tee.CPUEmbedding(config, optimizer)
  holder["engine"] = engine
  engine.build()
  return engine


def train_dequeued(engine, constant):
  """dequeue, L = sum(act^2) / 2 + sum(C * act), apply_gradients."""
  with tf.GradientTape() as tape:
    acts = engine.dequeue()
    tape.watch(acts)
    loss = tf.add_n([tf.reduce_sum(a * a) / 2 + tf.reduce_sum(constant[n] * a)
                     for n, a in acts.items()])
  engine.apply_gradients(tape.gradient(loss, acts))


def train(engine, use_function):
  def step_fn(features, weights, constant):
    engine.enqueue(features, weights, training=True)
    train_dequeued(engine, constant)

  # reduce_retracing, as Keras compiles its train step: one trace of exact
  # shapes, then one of relaxed shapes serves every later batch.
  run = tf.function(step_fn, reduce_retracing=True) if use_function else step_fn
  for step in range(STEPS):
    features, weights, raw, w = make_batch(step)
    # The same C as upstream_gradient: draw it for the activation shapes.
    acts_shape = {n: ((BATCH, m, TABLES[t][1]) if m else (BATCH, TABLES[t][1]))
                  for n, (t, m, _) in FEATURES.items()}
    rng = np.random.RandomState(500 + step)
    constant = {n: tf.constant(rng.uniform(-1, 1, acts_shape[n]), tf.float32)
                for n in FEATURES}
    run(features, weights, constant)


@pytest.mark.parametrize("options_name", sorted(OPTIONS))
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "tf_function"])
def test_training_matches_reference(optimizer_name, options_name, use_function):
  row, options = OPTIMIZERS[optimizer_name], OPTIONS[options_name]
  engine = build_engine(row, options)

  # Slots: names (TF order), shapes and initial values.
  for table, (vocab, dim, _) in TABLES.items():
    variables = engine.variables[table]
    assert set(variables) == {"parameters", *row.slots}
    for slot, initial in row.slots.items():
      assert variables[slot].shape == (vocab, dim)
      np.testing.assert_array_equal(variables[slot].numpy(), np.float32(initial))

  train(engine, use_function)
  assert_matches_reference(engine, row, options)


def assert_matches_reference(engine, row, options, atol=2e-6):
  """Every table and slot of ``engine`` after STEPS steps equals the reference."""
  want_tables, want_slots = reference_run(row, options)
  assert int(engine.step.numpy()) == STEPS
  for table in TABLES:
    np.testing.assert_allclose(
        engine.variables[table]["parameters"].numpy(), want_tables[table],
        rtol=2e-5, atol=atol, err_msg=f"{table}/parameters")
    for slot in row.slots:
      np.testing.assert_allclose(
          engine.variables[table][slot].numpy(), want_slots[table][slot],
          rtol=2e-5, atol=atol, err_msg=f"{table}/{slot}")
