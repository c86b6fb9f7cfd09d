"""Where the XLA check's program begins and ends, as a TPU's (issue 42).

* Outside compilation: ops made in ``tf.compat.v1.tpu.outside_compilation``
  inside ``strategy.run`` run on the host, and are not in the compiled program
  (``tpu_replication.py`` marks them ``_xla_outside_compilation``): no warning,
  no refusal, at either soft-placement setting; the rest is compiled.
* Inputs: every argument of ``strategy.run`` (a ``tf.constant``, a Python
  number) and ``replica_id_in_sync_group`` are inputs of the compiled program
  (``tpu_strategy.py`` ``tpu_function`` passes them to ``tpu.replicate``), so a
  size computed from them is refused as on a TPU; a static size is not.
* Soft placement moves only the ops without an XLA kernel to the host: the
  rest of the step is still compiled, and what XLA refuses there is refused.
"""


import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.tpu import tpu_replication

import tpu_embed_ext as tee
from tests import xla_recording
from tpu_embed_ext.emulated_tpu import xla_check

outside_compilation = tpu_replication.outside_compilation  # tf.compat.v1.tpu's
_LOGGERS = ("tpu_embed_ext.emulated_tpu.xla_check", "tpu_embed_ext.emulated_tpu.xla_compile")


@pytest.fixture(params=[False, True], ids=["soft-off", "soft-on"])
def soft_placement(request):
  tf.config.set_soft_device_placement(request.param)
  try:
    yield request.param
  finally:
    tf.config.set_soft_device_placement(True)


@pytest.fixture
def soft_on():
  tf.config.set_soft_device_placement(True)
  yield


@pytest.fixture
def compiled(monkeypatch):
  """(built, results) of each compiled program (tests/xla_recording.py)."""
  return xla_recording.record(monkeypatch)


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if r.name in _LOGGERS or "outside TPUReplicateContext" in r.getMessage()]


def _run(step, *args, replicas=2):
  """``strategy.run(step, args)`` in a tf.function; each replica's result."""
  with tee.emulate_tpu(replicas=replicas):
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    run = tf.function(lambda: strategy.run(step, args=args))
    return [np.asarray(v) for v in strategy.experimental_local_results(run())]


# --- outside compilation -----------------------------------------------------

def _host_print_and_py_function(x):
  tf.print("on the host", x)
  return tf.py_function(lambda v: v * 2.0, [x], tf.float32) + 1.0


def _summary(x):
  tf.summary.scalar("x", x, step=0)
  return x * 2.0


def test_outside_compilation_runs_on_the_host_uncompiled_and_unwarned(
    soft_placement, compiled, caplog, tmp_path):
  del soft_placement
  logdir = str(tmp_path)
  writer = tf.summary.create_file_writer(logdir)

  def step(x):
    y = x + 1.0  # 3
    y = outside_compilation(_host_print_and_py_function, y)  # 7
    y.set_shape([])
    if y > 5.0:  # a tf.cond whose branch holds host ops
      y = outside_compilation(_summary, y)  # 14
    for _ in tf.range(2):  # a tf.while_loop whose body holds host ops
      y = outside_compilation(lambda v: tf.py_function(
          lambda w: w + 1.0, [v], tf.float32), y)  # 16
      y.set_shape([])
    return y

  with writer.as_default():
    assert [float(v) for v in _run(step, 2.0)] == [16.0, 16.0]
  writer.flush()
  built, results = compiled
  assert results == [None] and len(built) == 1  # compiled, and XLA took it
  assert not built[0][3] & {"PrintV2", "EagerPyFunc", "WriteScalarSummary"}
  assert not _warnings(caplog)
  assert tf.io.gfile.listdir(logdir)  # the summary was written on the host


def test_a_gradient_across_outside_compilation(soft_placement, compiled, caplog):
  del soft_placement

  def step(x, y):
    with tf.GradientTape() as tape:
      tape.watch(x)
      b = outside_compilation(lambda a: a * a * a, x + 1.0)  # (x + 1)^3
      c = b * y
    return tape.gradient(c, x)  # 3 (x + 1)^2 y

  assert [float(v) for v in _run(step, 2.0, 5.0)] == [135.0, 135.0]
  assert compiled[1] == [None] and not _warnings(caplog)


def test_a_gradient_colocated_with_a_host_op_is_the_hosts(soft_placement, compiled, caplog):
  """gradients(colocate_gradients_with_ops=True) of a py_function in
  outside_compilation: its gradient (another EagerPyFunc) is colocated with
  it, which a TPU's context marks as the host's too."""
  del soft_placement

  def step(x):
    y = outside_compilation(lambda v: tf.py_function(lambda w: w * w, [v], tf.float32), x)
    y.set_shape([])
    return tf.compat.v1.gradients(y * 3.0, [x], colocate_gradients_with_ops=True)[0]  # 6 x

  assert [float(v) for v in _run(step, 2.0)] == [12.0, 12.0]
  assert compiled[1] == [None] and not _warnings(caplog)


# --- the program's inputs ----------------------------------------------------

def _sized(n):  # LINE:sized
  return tf.reduce_sum(tf.zeros(tf.reshape(n, [1])))


CONSTANT_SIZES = {  # a size a TPU cannot know when it compiles the step
    "from an argument": (lambda ids: _sized(tf.reduce_max(ids)), (tf.constant([1, 4, 2]),)),
    "a Python number": (lambda n: _sized(tf.cast(n, tf.int32) + 1), (3,)),
    "a one_hot depth": (lambda n: tf.reduce_sum(tf.one_hot([0, 1], n * 2)), (3,)),
    "the replica id": (lambda: _sized(
        tf.distribute.get_replica_context().replica_id_in_sync_group + 2), ()),
}


@pytest.mark.parametrize("name", list(CONSTANT_SIZES))
def test_a_size_from_the_programs_inputs_is_refused(name, soft_on):
  step, args = CONSTANT_SIZES[name]
  with pytest.raises(xla_check.NotCompilableError, match=r"must be a compile-time constant: "
                     r"emulated TPU: made at .*test_emulated_xla_boundary\.py:\d+ in the function "
                     r"given to strategy\.run .*with strategy\.run's arguments and the replica "
                     r"id as the program's inputs"):
    _run(step, *args)


def test_the_same_sizes_from_static_values_compile(soft_on, compiled):
  static = 3
  assert [float(v) for v in _run(lambda ids: _sized(tf.constant(static) + 1) + tf.cast(
      tf.reduce_sum(ids), tf.float32), tf.constant([1, 4, 2]))] == [7.0, 7.0]
  assert [float(v) for v in _run(lambda x: tf.reduce_sum(tf.one_hot([0, 1], static)) * x,
                                 2.0)] == [4.0, 4.0]
  assert compiled[1] == [None, None]


def test_a_constant_of_the_enclosing_function_stays_a_constant(soft_on, compiled):
  """Only strategy.run's arguments are the program's inputs: a constant the
  replica function closes over is not refused (not a false refusal)."""
  with tee.emulate_tpu(replicas=2):
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))

    @tf.function
    def outer():
      n = tf.constant(3)
      return strategy.run(lambda: _sized(n + 1) + 1.0)

    assert [float(v) for v in strategy.experimental_local_results(outer())] == [1.0, 1.0]
  assert compiled[1] == [None]


def test_all_reduce_of_an_argument_passed_unchanged_is_the_sum(compiled):
  def step(x):
    return tf.distribute.get_replica_context().all_reduce("sum", x)

  assert [float(v) for v in _run(step, tf.constant(3.0))] == [6.0, 6.0]
  assert [v.tolist() for v in _run(step, tf.constant([1.0, 2.0]), replicas=4)] == [[4.0, 8.0]] * 4
  assert [float(v) for v in _run(step, 2.5)] == [5.0, 5.0]


# --- soft placement ----------------------------------------------------------

def test_with_soft_placement_one_host_op_does_not_switch_the_compile_off(soft_on, caplog):
  def step(ids):
    tf.print("step", ids)
    return _sized(tf.reduce_max(ids))

  with pytest.raises(xla_check.NotCompilableError, match=r"must be a compile-time constant"):
    _run(step, tf.constant([1, 4, 2]))
  warned = _warnings(caplog)
  assert any("no XLA kernel for op PrintV2" in m and "automatic outside compilation" in m
             and "compiles the rest of the step" in m for m in warned), warned


def test_with_soft_placement_a_host_op_runs_and_the_rest_is_compiled(soft_on, compiled, caplog):
  def step(x):
    y = tf.py_function(lambda v: v + 1.0, [x * 2.0], tf.float32)
    y.set_shape([])  # as a TPU needs for a value coming back from its host
    return y * 3.0

  assert [float(v) for v in _run(step, 2.0)] == [15.0, 15.0]
  assert compiled[1] == [None] and "EagerPyFunc" not in compiled[0][0][3]
  assert [m for m in _warnings(caplog) if "not compiled" in m] == []


def test_a_refusal_offers_the_tpus_own_fixes_first():
  tf.config.set_soft_device_placement(False)
  try:
    with pytest.raises(xla_check.NotCompilableError) as caught:
      _run(lambda x: tf.py_function(lambda v: v, [x], tf.float32), 1.0)
  finally:
    tf.config.set_soft_device_placement(True)
  fix = str(caught.value).split("Fix: ", 1)[1]
  assert fix.startswith("run it on the TPU's host with tf.compat.v1.tpu.outside_compilation(fn, "
                        "...) inside the step, or let TensorFlow place it there with "
                        "tf.config.set_soft_device_placement(True); or compute it with "
                        "TensorFlow ops")
  assert "test_emulated_xla_boundary.py:" in str(caught.value)


def test_the_soft_placement_default_inside_a_function_is_off():
  """context.py: unset, allow_soft_placement is executing_eagerly(): on
  eagerly, off while a tf.function is traced (where a TPU step is)."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  saved = context.context()._soft_device_placement  # pylint: disable=protected-access
  context.context()._soft_device_placement = None  # pylint: disable=protected-access
  try:
    assert tf.config.get_soft_device_placement() is True
    assert tf.function(lambda: tf.constant(tf.config.get_soft_device_placement()))().numpy() \
        == False  # noqa: E712
  finally:
    context.context()._soft_device_placement = saved  # pylint: disable=protected-access


# --- Keras steps_per_execution > 1 -------------------------------------------

class _SizedFromData(keras.layers.Layer):
  def call(self, x):
    n = tf.cast(tf.reduce_max(x) * 0.0, tf.int32) + 2  # LINE:keras
    return x + tf.reduce_sum(tf.zeros([n]))


def _fit(spe, extra=None):
  with tee.emulate_tpu(replicas=2):
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    with strategy.scope():
      layers = [keras.Input((4,)), keras.layers.Dense(
          1, kernel_initializer="ones", bias_initializer="zeros")]
      model = keras.Sequential(layers + ([extra] if extra is not None else []))
      model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse",
                    steps_per_execution=spe)
    x = np.random.RandomState(3).rand(64, 4).astype(np.float32)
    history = model.fit(x, x.sum(1, keepdims=True) * 2.0, batch_size=16, epochs=2,
                        verbose=0, shuffle=False)
    return history.history["loss"], model.get_weights()


def test_keras_steps_per_execution_8_is_compiled_and_trains(soft_on, compiled, caplog):
  losses, weights = _fit(8)
  assert compiled[1] == [None] and not _warnings(caplog)
  one_losses, one_weights = _fit(1)  # the same training, one step per call
  np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
  np.testing.assert_allclose(weights[0], one_weights[0], rtol=1e-5)
  assert losses[1] < losses[0]


def test_keras_steps_per_execution_8_refuses_a_size_from_the_data(soft_on):
  with pytest.raises(xla_check.NotCompilableError,
                     match=r"must be a compile-time constant: emulated TPU: made at "
                     r".*test_emulated_xla_boundary\.py:\d+ in the function given to "
                     r"strategy\.run"):
    _fit(8, _SizedFromData())


# --- SparseCore: the batch's layout, refused when traced ---------------------

def test_a_sparsecore_batch_not_split_evenly_is_refused_when_traced():
  """Shapes are static: the error comes when the step is traced, as
  TensorFlow's InputError, not from inside a numpy_function when it runs."""
  from tests import sparsecore_program as sc  # pylint: disable=g-import-not-at-top
  per_replica = 6  # 2 chips x 6 = 12 samples, not a multiple of 2 x 4 SparseCores
  with tee.emulate_tpu(replicas=2, sparsecore=True):
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    with strategy.scope():
      embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(
          sc.feature_config(per_replica), None)
    step = tf.function(lambda batch: strategy.run(
        lambda f: embedding.embedding_lookup(f)[0]["user"], args=(batch,)))
    batch = sc.global_batches(2 * per_replica)[0]
    inputs = strategy.experimental_distribute_values_from_function(
        lambda ctx: sc.as_tensors(batch, ctx.replica_id_in_sync_group * per_replica,
                                  (ctx.replica_id_in_sync_group + 1) * per_replica))
    with pytest.raises(tee.errors.InputError,
                       match=r"^feature 'item' \(table 'item'\) has 12 samples, not a multiple "
                       r"of 2 chips x 4 SparseCores per chip.*Fix: use a batch size divisible "
                       r"by 8\.$") as caught:
      step.get_concrete_function(inputs)
    assert "PyFunc" not in str(caught.value)


# --- what CPU raises and XLA on a TPU does not -------------------------------

@pytest.mark.parametrize("step,error", [
    (lambda ids: tf.gather(tf.constant([1.0, 2.0]), ids), r"indices\[0\] = 5 is not in \[0, 2\)"),
    (lambda ids: tf.math.floordiv(ids, ids - 5), r"Integer division by zero"),
], ids=["gather-out-of-range", "integer-division-by-zero"])
def test_out_of_range_gathers_and_integer_division_by_zero_raise_on_cpu(step, error):
  """XLA clamps gather indices and gives an implementation-defined value for
  an integer division by zero (its operation semantics); the emulated step
  runs as TensorFlow ops on CPU, which raise (docs/guides/tpu-on-cpu.md)."""
  with pytest.raises(tf.errors.InvalidArgumentError, match=error):
    _run(step, tf.constant([5]))


def test_a_summary_placed_on_the_host_is_attributed_to_its_caller(soft_on, compiled, caplog,
                                                                   tmp_path):
  """tf.summary.scalar is tensorboard's (summary_v2.py): the warning names
  the caller's line, not tensorboard's file."""
  def step(x):
    tf.summary.scalar("x", x, step=0)  # LINE:summary
    return x * 2.0

  with tf.summary.create_file_writer(str(tmp_path)).as_default():
    assert [float(v) for v in _run(step, 2.0)] == [4.0, 4.0]
  warned = [m for m in _warnings(caplog) if "automatic outside compilation" in m]
  assert warned and all("test_emulated_xla_boundary.py:" in m and "tensorboard" not in m
                        for m in warned), warned
  assert compiled[1] == [None]
