"""What a TPU refuses of ``TPUEmbedding`` (TensorFlow 2.21), refused on the emulated TPU.

Found by running TensorFlow's own ``tpu_embedding_v2_*_test.py`` files under
``emulate --replicas 8``. Each refusal starts with TensorFlow's
own words (users' tests written against a TPU match them), then ours; every
refused call leaves the tables as they were. Values are checked against
numpy.
"""

import google.protobuf
import numpy as np
import pytest
import tensorflow as tf

from tpu_embed_ext import emulated_tpu, errors
from tests.builders import emulated_tpu_strategy

emulate_tpu = emulated_tpu.emulate_tpu
_EMB = tf.tpu.experimental.embedding
TABLE = np.arange(16, dtype=np.float32).reshape(8, 2)
IDS = np.array([1, 2, 3, 1, 1, 5, 2, 7], np.int64)  # A global batch of 8.


def _feature_config(name="t", value=TABLE, output_shape=None, lr=0.5):
  table = _EMB.TableConfig(vocabulary_size=value.shape[0], dim=value.shape[1],
                           name=name, initializer=tf.constant_initializer(value),
                           optimizer=_EMB.SGD(lr))
  return {"a": _EMB.FeatureConfig(table=table, name="a", output_shape=output_shape)}


def _strategy_and_embedding():
  """Inside emulate_tpu: the strategy and a TPUEmbedding of _feature_config()
  made in its scope (the tables' own SGD optimizers)."""
  strategy = emulated_tpu_strategy()
  with strategy.scope():
    embedding = _EMB.TPUEmbedding(_feature_config(), None)
  return strategy, embedding


def _iterator(strategy, fetch_to_device=False):
  data = tf.data.Dataset.from_tensor_slices({"a": IDS}).batch(
      8, drop_remainder=True).repeat()
  return iter(strategy.experimental_distribute_dataset(
      data, options=tf.distribute.InputOptions(
          experimental_fetch_to_device=fetch_to_device)))


def _parameters(embedding):
  return embedding._variables["t"]["parameters"].numpy()  # pylint: disable=protected-access


def _unchanged(embedding):
  """Nothing built yet, or the tables as they were."""
  return embedding._variables is None or np.array_equal(  # pylint: disable=protected-access
      _parameters(embedding), TABLE)


def _sgd(table, ids, lr, grad):
  """numpy SGD: ``grad`` per id occurrence (a sum combiner, one id per row)."""
  table = table.copy()
  for i in ids:
    table[i] -= lr * grad(table, i)
  return table


# --- one TPUEmbedding per TPU ---------------------------------------------------

def test_a_second_tpu_embedding_is_refused_until_the_tpu_is_reset():
  """initialization_test.test_multiple_creation: the second build raises
  TensorFlow's RuntimeError; initialize_tpu_system frees the engine."""
  with emulate_tpu(replicas=2):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      first = _EMB.TPUEmbedding(_feature_config(), None)
      second = _EMB.TPUEmbedding(_feature_config(), None)
    first.build(4)
    with pytest.raises(RuntimeError, match=(
        r"^TPU is already initialized for embeddings. This may be caused by "
        r"using multiple TPUEmbedding instances in a TPU scope which is "
        r"unsupported. A TPUEmbedding \(tables \['t'\]\) was built on a TPU .*"
        r"Fix: put every table in one TPUEmbedding")) as info:
      second.build(4)
    assert isinstance(info.value, emulated_tpu.TPURuntimeError)
    assert second._variables is None  # pylint: disable=protected-access
    tf.tpu.experimental.initialize_tpu_system()
    second.build(4)
    np.testing.assert_array_equal(_parameters(second), TABLE)


def test_two_embedding_layers_in_one_model_are_refused():
  """Two EmbeddingLayers under a TPUStrategy: two TPUEmbeddings on one TPU;
  the second builds at its first lookup, and is refused there."""
  import tpu_embed_ext as tee  # pylint: disable=import-outside-toplevel
  with emulate_tpu(replicas=2):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      users = tee.EmbeddingLayer(_feature_config(), name="users")
      items = tee.EmbeddingLayer(_feature_config("u"), name="items")
    iterator = _iterator(strategy)

    @tf.function
    def step(features):
      return strategy.run(lambda f: (users(f), items(f)), args=(features,))

    # Keras prefixes "Exception encountered when calling EmbeddingLayer.call()".
    with pytest.raises(RuntimeError, match="TPU is already initialized for "
                       "embeddings. .*two EmbeddingLayers in one model"):
      step(next(iterator))


def test_a_stale_tpu_embedding_saves_and_loads_the_tpus_tables(tmp_path):
  """checkpoint_test.test_checkpoint_save_retrieves: after initialize_tpu_system
  and a second TPUEmbedding, saving the first retrieves the TPU's tables (the
  second's); restoring into the first loads onto them. Other tables: refused."""
  with emulate_tpu(replicas=2):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      first = _EMB.TPUEmbedding(_feature_config(value=np.ones((8, 2), np.float32)), None)
    first.build(4)
    before = tf.train.Checkpoint(model=first).save(str(tmp_path / "before"))
    tf.tpu.experimental.initialize_tpu_system()
    with strategy.scope():
      second = _EMB.TPUEmbedding(_feature_config(value=2 * np.ones((8, 2), np.float32)),
                                 None)
    second.build(4)
    tf.train.Checkpoint(model=first).save(str(tmp_path / "after"))
    after = tf.train.load_checkpoint(str(tmp_path / "after-1"))
    keys = [k for k, shape in after.get_variable_to_shape_map().items()
            if shape == [8, 2]]
    assert len(keys) == 1, after.get_variable_to_shape_map()
    np.testing.assert_array_equal(after.get_tensor(keys[0]), 2 * np.ones((8, 2)))
    # Restoring the ones into the stale object loads them onto the TPU.
    tf.train.Checkpoint(model=first).restore(before).assert_consumed()
    np.testing.assert_array_equal(_parameters(second), np.ones((8, 2)))
    tf.tpu.experimental.initialize_tpu_system()
    with strategy.scope():
      third = _EMB.TPUEmbedding(_feature_config(value=np.ones((4, 2), np.float32)), None)
    third.build(4)
    with pytest.raises(RuntimeError, match=(
        r"^saving \(retrieving the tables from the TPU\): this TPUEmbedding "
        r"\(tables \{'t': \(\('parameters', \(8, 2\)\),\)\}\) was built before "
        r"initialize_tpu_system reset the TPU, which now holds tables "
        r"\{'t': \(\('parameters', \(4, 2\)\),\)\}")):
      tf.train.Checkpoint(model=first).save(str(tmp_path / "other"))


# --- enqueue: inputs a TPU refuses ------------------------------------------------

@pytest.mark.parametrize("inside_run", [False, True], ids=["enqueue", "in_run"])
def test_enqueue_refuses_inputs_on_a_cores_device(inside_run):
  """invalid_input_test.test_enqueue_cpu_tensor(_with_outside_compilation):
  ids prefetched to the cores (experimental_fetch_to_device=True, the default)
  are refused; from the host they train, as numpy says."""
  with emulate_tpu(replicas=2):
    strategy, embedding = _strategy_and_embedding()

    def step(iterator):
      # next() inside the function, the iterator captured (as upstream's test
      # does; an iterator passed as an argument gives its tensors no device
      # in the graph, and TensorFlow's device check sees nothing there).
      @tf.function
      def run():
        features = next(iterator)
        if inside_run:
          return strategy.run(lambda f: _train_step(embedding, f),
                              args=(features,))
        embedding.enqueue(features, training=True)
        return strategy.run(lambda: _train_step(embedding, None))
      return run()

    on_cores = _iterator(strategy, fetch_to_device=True)
    with pytest.raises(ValueError, match=(
        r"^Received input tensor a which is on a TPU input device "
        r"/job:localhost/replica:0/task:0/device:CPU:1. Input tensors for TPU "
        r"embeddings must be placed on the CPU. .* Fix: distribute the dataset "
        r"with options=tf.distribute.InputOptions\("
        r"experimental_fetch_to_device=False\)")):
      step(on_cores)
    assert _unchanged(embedding)
    step(_iterator(strategy))
  # Gradient 2 * activation per row; both replicas' rows applied once.
  want = _sgd(TABLE, IDS, 0.5, lambda t, i: 2 * TABLE[i])
  np.testing.assert_allclose(_parameters(embedding), want, rtol=1e-6)


def _train_step(embedding, features):
  if features is not None:
    embedding.enqueue(features, training=True)
  activations = embedding.dequeue()
  embedding.apply_gradients({"a": 2 * activations["a"]})
  return activations["a"]


def test_enqueue_refuses_ids_computed_inside_strategy_run():
  """enqueue_mode_test.test_enqueue_with_outside_compilation_non_direct_input."""
  with emulate_tpu(replicas=2):
    strategy, embedding = _strategy_and_embedding()

    @tf.function
    def step(features):
      return strategy.run(lambda f: _train_step(embedding, {"a": f["a"] + 0}),
                          args=(features,))

    with pytest.raises(ValueError, match=(
        r"^Received input tensor a which is the output of op .*add.* \(type "
        r"AddV2\) which does not have the `_tpu_input_identity` attr. .*Fix: "
        r"compute the ids in the input pipeline")):
      step(next(_iterator(strategy)))
    assert _unchanged(embedding)


def test_enqueue_in_a_nested_function_inside_strategy_run_is_refused():
  """enqueue_mode_test.test_enqueue_with_outside_compilation_in_control_flow."""
  with emulate_tpu(replicas=2):
    strategy, embedding = _strategy_and_embedding()

    @tf.function
    def enqueue(features):
      embedding.enqueue(features, training=False)

    @tf.function
    def step(features):
      def fn(f):
        enqueue(f)
        return embedding.dequeue()
      return strategy.run(fn, args=(features,))

    with pytest.raises(RuntimeError, match=(
        r"^Current graph FuncGraph\(name=enqueue.* does not match graph which "
        r"contains TPUReplicateContext FuncGraph\(name=step.*\)\. This is most "
        r"likely due to the fact that enqueueing embedding data is called inside "
        r"control flow or a tf.function inside `strategy.run`. .*Fix: call "
        r"enqueue directly in the function given to strategy.run")):
      step(next(_iterator(strategy)))


# --- build and apply_gradients ------------------------------------------------------

def test_build_without_shapes_needs_fully_defined_output_shapes():
  """hd_invalid_input_test.test_not_fully_defined_output_shapes_in_feature_config:
  build() with no shapes on a TPU needs every output shape fully defined."""
  with emulate_tpu(replicas=2):
    strategy, embedding = _strategy_and_embedding()
    with pytest.raises(ValueError, match=(
        r"^Input Feature a has output shape set as <unknown> which is not fully "
        r"defined. feature 'a' \(table 't'\): output shape <unknown> is not fully "
        r"defined; the TPU compiles every activation shape.")):
      embedding.build()
    assert embedding._variables is None  # pylint: disable=protected-access
    tf.tpu.experimental.initialize_tpu_system()
    with strategy.scope():
      shaped = _EMB.TPUEmbedding(_feature_config(output_shape=[4]), None)
    shaped.build()
    assert shaped._output_shapes == [tf.TensorShape([4])]  # pylint: disable=protected-access


@pytest.mark.parametrize("dtype", [tf.float64, tf.float16, tf.bfloat16])
def test_gradients_must_be_float32(dtype):
  """SendTPUEmbeddingGradients takes float32 only; TensorFlow casts nothing
  (apply_gradients passes the gradients to the op as they are)."""
  with emulate_tpu(replicas=2):
    strategy, embedding = _strategy_and_embedding()

    @tf.function
    def step(features):
      embedding.enqueue(features, training=True)

      def fn():
        activations = embedding.dequeue()
        embedding.apply_gradients({"a": tf.cast(activations["a"], dtype)})
      return strategy.run(fn)

    with pytest.raises(TypeError, match=(
        rf"^Tensors in list passed to 'inputs' of 'SendTPUEmbeddingGradients' Op "
        rf"have types \[{dtype.name}\] that do not match expected type float32. "
        rf"feature 'a' \(table 't'\): gradient dtype {dtype.name}; the TPU takes "
        rf"float32 gradients only")):
      step(next(_iterator(strategy)))
    np.testing.assert_array_equal(_parameters(embedding), TABLE)


def test_create_config_proto_is_tensorflows():
  """valid_input_test / initialization_test: ``_create_config_proto`` is
  TensorFlow's own, on our tables. TensorFlow 2.21's writes the bool
  ``low_dimensional_packing_status`` into an enum field, which protobuf 7
  refuses (protobuf 6 stores 0): setup.py pins protobuf < 7, so it works."""
  with emulate_tpu(replicas=2):
    strategy = emulated_tpu_strategy()
    table = _EMB.TableConfig(vocabulary_size=8, dim=2)  # Unnamed: table_0.
    features = {"a": _EMB.FeatureConfig(table=table, name="a")}
    with strategy.scope():
      embedding = _EMB.TPUEmbedding(features, _EMB.Adagrad(lambda: 0.5))
    embedding._output_shapes = [tf.TensorShape([128])]  # pylint: disable=protected-access
    proto = embedding._create_config_proto()  # pylint: disable=protected-access
  assert table.name is None  # The user's TableConfig is not renamed.
  assert [t.name for t in proto.table_descriptor] == ["table_0"]
  assert proto.table_descriptor[0].dimension == 2
  assert proto.table_descriptor[0].optimization_parameters.learning_rate.dynamic.tag == 0
  assert list(proto.feature_descriptor[0].input_shape) == [128]
  assert proto.num_tensor_cores == 2 and proto.num_hosts == 1


class _Protobuf7Parameters:
  """``OptimizationParameters`` as protobuf 7 has it: a bool into an enum raises."""

  def __setattr__(self, name, value):
    if isinstance(value, bool):
      raise TypeError(f"Field tensorflow.tpu.OptimizationParameters.{name}: "
                      "Expected an int, got a boolean.")


def test_build_refuses_a_protobuf_that_tensorflows_tpu_config_cannot_use(monkeypatch):
  """With protobuf 7, TensorFlow 2.21's ``TPUEmbedding.build`` fails on a TPU
  (``_create_config_proto``); the emulated build fails first, in one line."""
  from tensorflow.core.protobuf.tpu import optimization_parameters_pb2  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(optimization_parameters_pb2, "OptimizationParameters",
                      _Protobuf7Parameters)
  with emulate_tpu(replicas=2):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      embedding = _EMB.TPUEmbedding(_feature_config(), _EMB.SGD(0.5))
    with pytest.raises(errors.ConfigTypeError) as caught:
      embedding.build(per_replica_batch_size=4)
  assert str(caught.value) == (
      "Field tensorflow.tpu.OptimizationParameters.low_dimensional_packing_status: "
      f"Expected an int, got a boolean. (TensorFlow {tf.__version__}'s "
      "TPUEmbedding.build writes this bool into its TPU configuration for every "
      f"table, and protobuf {google.protobuf.__version__} refuses it: on a TPU, "
      "TPUEmbedding cannot build with this install). Fix: pip install 'protobuf<7'.")
  assert embedding._variables is None  # pylint: disable=protected-access


def test_model_parallel_device_assignment_is_not_emulated():
  """mp_strategy_test: two cores per replica is model parallelism, refused in
  one line; one core per replica is TensorFlow's own assignment."""
  from tensorflow.python.tpu import device_assignment as device_lib  # pylint: disable=import-outside-toplevel
  with emulate_tpu(replicas=2):
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
    topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    with pytest.raises(emulated_tpu.NotEmulatedError, match=(
        r"^tpu.device_assignment\(computation_shape=\[1, 1, 1, 2\]\) \(2 cores "
        r"per replica\) is not emulated: the emulated TPU runs each replica on "
        r"one CPU device")) as info:
      device_lib.device_assignment(topology, computation_shape=[1, 1, 1, 2],
                                   num_replicas=1)
    assert "\n" not in str(info.value)
    single = device_lib.device_assignment(topology, num_replicas=2)
    assert single.num_replicas == 2 and single.num_cores_per_replica == 1
    assert tf.distribute.TPUStrategy(
        resolver, experimental_device_assignment=single).num_replicas_in_sync == 2
