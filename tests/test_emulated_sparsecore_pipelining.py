"""TPUEmbeddingV2(pipeline_execution_with_tensor_core=True) under the emulated TPU.

On a TPU the compiler staggers a ``tf.while_loop`` of training steps so that
step ``i`` looks up the tables before step ``i-1``'s update (one step old);
updates stay in order and a loop's first step sees every earlier update
(tpu_embed_ext/emulated_tpu/pipelining.py). The numpy reference below is that
rule, written independently: two tables of different optimizers (SGD and
Adagrad, so two stacks), 2 replicas, several steps, gradients that depend on
the activations (so a stale lookup changes the result). Outside a loop, with
summaries recorded and inside ``SequentialEmbeddingContext`` the steps are
sequential (every lookup sees every earlier update).
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.tpu import embedding_context_utils as ecu
from tensorflow.python.tpu import tpu_embedding_v3 as tf_v3

import tpu_embed_ext as tee
from tests import references

api = tf.tpu.experimental.embedding
REPLICAS, PER_REPLICA, STEPS, DIM = 2, 4, 5, 3
VOCAB = {"a": 12, "b": 10}
SGD_LR, ADAGRAD_LR, INITIAL_ACCUMULATOR = 0.3, 0.5, 0.1


def _initial(name):
  return np.random.RandomState(len(name) + VOCAB[name]).uniform(
      -1, 1, (VOCAB[name], DIM)).astype(np.float32)


def _feature_config():
  optimizers = {"a": api.SGD(SGD_LR),
                "b": api.Adagrad(ADAGRAD_LR, initial_accumulator_value=INITIAL_ACCUMULATOR)}
  tables = {n: api.TableConfig(VOCAB[n], DIM, name=n, combiner="sum",
                               optimizer=optimizers[n],
                               initializer=tf.constant_initializer(_initial(n)))
            for n in VOCAB}
  return {n: api.FeatureConfig(tables[n], output_shape=[PER_REPLICA]) for n in VOCAB}


def _batches():
  """STEPS global batches of single-hot ids; ids repeat across steps."""
  rng = np.random.RandomState(3)
  return [{n: rng.randint(0, 4, REPLICAS * PER_REPLICA).astype(np.int32) for n in VOCAB}
          for _ in range(STEPS)]


def _fresh_state():
  params = {n: _initial(n).astype(np.float64) for n in VOCAB}
  acc = {n: np.full((VOCAB[n], DIM), INITIAL_ACCUMULATOR) for n in VOCAB}
  return params, acc


def _numpy_loop(params, acc, batches, pipelined):
  """One loop of steps, updating ``params`` / ``acc`` in place; a pipelined
  step looks up the tables before the previous step's update (a loop's first
  step sees the tables as the loop starts)."""
  before_previous = None
  for batch in batches:
    seen = before_previous if pipelined and before_previous is not None else params
    before_previous = {n: p.copy() for n, p in params.items()}
    for n in VOCAB:
      grad = np.zeros_like(params[n])
      for i in batch[n]:  # every replica's samples; gradient a - 1
        grad[i] += seen[n][i] - 1.0
      # In place: the caller's dicts hold the loop's state.
      if n == "a":
        params[n][:] = references.update("sgd", params[n], {}, grad, SGD_LR)[0]
      else:
        params[n][:], slots = references.update(
            "adagrad", params[n], {"accumulators": acc[n]}, grad, ADAGRAD_LR)
        acc[n][:] = slots["accumulators"]


def _numpy_reference(batches, pipelined):
  """Tables after the steps, in one loop."""
  params, acc = _fresh_state()
  _numpy_loop(params, acc, batches, pipelined)
  return params


def _strategy_and_embedding():
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
  tf.tpu.experimental.initialize_tpu_system(resolver)
  strategy = tf.distribute.TPUStrategy(resolver)
  with strategy.scope():
    embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(
        _feature_config(), pipeline_execution_with_tensor_core=True)
  return strategy, embedding


def _dataset(strategy, batches):
  data = {n: np.concatenate([b[n] for b in batches]) for n in VOCAB}
  dataset = tf.data.Dataset.from_tensor_slices(data).batch(REPLICAS * PER_REPLICA)
  return strategy.experimental_distribute_dataset(
      dataset, options=tf.distribute.InputOptions(experimental_fetch_to_device=False))


def _replica_step(embedding):
  def step(features):
    activations, preserved = embedding(features)
    embedding.apply_gradients(
        tf.nest.map_structure(lambda a: a - 1.0, activations), preserved)
  return step


def _tables(embedding):
  return {n: embedding.table_variables(n)["parameters"].numpy() for n in VOCAB}


def _loop_of_steps(batches):
  """Inside emulate_tpu: (embedding, iterator over ``batches``, a tf.function
  running STEPS steps in one tf.range loop, the pipelined form)."""
  strategy, embedding = _strategy_and_embedding()
  iterator = iter(_dataset(strategy, batches))
  step = _replica_step(embedding)

  @tf.function
  def train(iterator):
    for _ in tf.range(STEPS):
      strategy.run(step, args=(next(iterator),))

  return embedding, iterator, train


def _train_in_loop(summaries=False, sequential=False, tmp_path=None, record=True):
  """STEPS steps in one tf.function's tf.range loop (the pipelined form)."""
  batches = _batches()
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    embedding, iterator, train = _loop_of_steps(batches)
    if summaries:
      writer = tf.summary.create_file_writer(str(tmp_path))
      with writer.as_default(), tf.summary.record_if(record):
        train(iterator)
    elif sequential:
      with ecu.SequentialEmbeddingContext():
        train(iterator)
    else:
      train(iterator)
    return batches, _tables(embedding), train.get_concrete_function(iterator)


def _assert_tables(ours, reference):
  for n in VOCAB:
    np.testing.assert_allclose(ours[n], reference[n], rtol=2e-5, atol=1e-6)


def test_loop_steps_look_up_tables_one_step_old():
  batches, tables, _ = _train_in_loop()
  _assert_tables(tables, _numpy_reference(batches, pipelined=True))
  # The rule matters for these batches: the sequential result differs.
  sequential = _numpy_reference(batches, pipelined=False)
  assert not np.allclose(tables["b"], sequential["b"], atol=1e-4)


def test_a_second_loop_starts_from_every_update():
  """The TPU drains the pipeline at the end of a loop: the first step of the
  next call sees every update of the previous one."""
  batches = _batches()
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy, embedding = _strategy_and_embedding()
    iterator = iter(_dataset(strategy, batches))
    step = _replica_step(embedding)

    @tf.function
    def train(iterator, n):
      for _ in tf.range(n):
        strategy.run(step, args=(next(iterator),))

    train(iterator, tf.constant(2))
    train(iterator, tf.constant(STEPS - 2))
    tables = _tables(embedding)
  two_loops = _two_loop_reference(batches, 2)
  _assert_tables(tables, two_loops)
  # One loop of all the steps would differ.
  one_loop = _numpy_reference(batches, pipelined=True)
  assert not np.allclose(two_loops["b"], one_loop["b"], atol=1e-4)


def _two_loop_reference(batches, split):
  """Pipelined within each loop, the second loop starting fresh."""
  params, acc = _fresh_state()
  for part in (batches[:split], batches[split:]):
    _numpy_loop(params, acc, part, pipelined=True)
  return params


def test_steps_outside_a_loop_are_sequential():
  batches = _batches()
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    strategy, embedding = _strategy_and_embedding()
    iterator = iter(_dataset(strategy, batches))
    step = tf.function(lambda x: strategy.run(_replica_step(embedding), args=(x,)))
    for _ in range(STEPS):
      step(next(iterator))
    tables = _tables(embedding)
  _assert_tables(tables, _numpy_reference(batches, pipelined=False))


@pytest.mark.parametrize("how", ["summaries", "sequential_context"])
def test_tensorflow_turns_pipelining_off(how, tmp_path):
  batches, tables, _ = _train_in_loop(summaries=how == "summaries",
                                      sequential=how == "sequential_context",
                                      tmp_path=tmp_path)
  _assert_tables(tables, _numpy_reference(batches, pipelined=False))


def test_lookup_and_update_ops_carry_the_pipelining_attribute():
  _, _, concrete = _train_in_loop()
  while_op = next(op for op in concrete.graph.get_operations() if op.type == "While")
  name = while_op.get_attr("body").name
  body = next(f for f in concrete.graph._functions.values()  # pylint: disable=protected-access
              if f.name.decode() == name)
  modes = set()
  for op in body.graph.get_operations():
    try:
      modes.add(op.get_attr(tf_v3._PIPELINE_ATTRIBUTE))  # pylint: disable=protected-access
    except ValueError:
      pass
  assert modes == {b"forward", b"backward"}


def test_summaries_switched_off_keep_the_loop_pipelined(tmp_path):
  batches, tables, _ = _train_in_loop(summaries=True, record=False, tmp_path=tmp_path)
  _assert_tables(tables, _numpy_reference(batches, pipelined=True))


def test_a_writer_that_may_record_later_is_not_emulated(tmp_path):
  batches = _batches()
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    embedding, iterator, train = _loop_of_steps(batches)
    with tf.summary.create_file_writer(str(tmp_path)).as_default():
      with pytest.raises(tee.emulated_tpu.NotEmulatedError) as e:
        train(iterator)
    before = _tables(embedding)
  for n in VOCAB:  # refused while tracing: nothing ran
    np.testing.assert_array_equal(before[n], _initial(n))
  assert str(e.value) == (
      "TPUEmbeddingV2(pipeline_execution_with_tensor_core=True) traced a loop "
      "step with a default summary writer: a TPU runs the loop sequentially if "
      "the program writes any summary, and the emulation cannot see summaries "
      "written after this step is traced. Fix: trace it under "
      "tf.summary.record_if(False) (pipelined), under "
      "tf.summary.record_if(True) or SequentialEmbeddingContext (sequential), "
      "or without a default writer.")
