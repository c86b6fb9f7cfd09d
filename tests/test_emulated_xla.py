"""XLA on the emulated TPU: each replica's step is checked to compile as a TPU's must.

A TPU places ops without XLA kernels on its host when soft device placement is
on (tpu.py, "Automatic outside compilation"), and refuses the step when it is
off (TensorFlow's default while a function is traced, context.py): the
refusals here turn it off (``no_soft_placement``), and one test turns it on
(runs, warns). Outside compilation, program inputs and Keras's
steps_per_execution are in test_emulated_xla_boundary.py.

With XLA on (``emulate_tpu(xla=True)``, the default) a ``strategy.run`` traced
in a ``tf.function`` whose replica function holds an op no TPU compiles
(``tf.py_function``, a string op, complex128) is refused when first traced, in
one line naming the op and the line that made it; with XLA off it runs.
Shapes that depend on the data are accepted: XLA compiles them (bounded
dynamic shapes). When every op passes, replica 0's TensorCore program
(activations in, gradients out, the engine and the optimizer's cross-replica
sum cut out) is compiled with XLA on CPU, not run: a size computed from the
data's values, which XLA needs as a compile-time constant, is refused then
(soft placement on or off), and runs with XLA off. A step that compiles trains as before: its tables equal a
numpy reference of the TPU's math (a dense layer too, through a Keras
optimizer's cross-replica sum).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.emulated_tpu import xla_check

api = tf.tpu.experimental.embedding
VOCAB, DIM, PER_REPLICA, LR, STEPS = 12, 3, 4, 0.1, 3


@pytest.fixture
def no_soft_placement():
  tf.config.set_soft_device_placement(False)
  try:
    yield
  finally:
    tf.config.set_soft_device_placement(True)


def _initial():
  return np.random.RandomState(5).uniform(-1, 1, (VOCAB, DIM)).astype(np.float32)


def _batches(replicas):
  rng = np.random.RandomState(11)
  return [rng.randint(0, VOCAB, replicas * PER_REPLICA).astype(np.int32)
          for _ in range(STEPS)]


def _program(replicas, extra=None, xla=True, jit=False, inner_jit=False):
  """A v1 TPUEmbedding loop with a dense weight; ``extra(activations)`` is
  added to the replica's loss. Returns (table, dense weight) after STEPS.
  ``jit``: the step is ``tf.function(jit_compile=True)``, enqueueing inside
  ``strategy.run`` (on the host it is refused, as on a TPU: below).
  ``inner_jit``: the function given to ``strategy.run`` is
  ``tf.function(jit_compile=True)`` (as Keras's ``model.compile(jit_compile=True)``)."""
  with tee.emulate_tpu(replicas=replicas, xla=xla):
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
    tf.tpu.experimental.initialize_tpu_system(resolver)
    strategy = tf.distribute.TPUStrategy(resolver)
    table = api.TableConfig(VOCAB, DIM, name="t", combiner="sum",
                            initializer=tf.constant_initializer(_initial()))
    with strategy.scope():
      embedding = api.TPUEmbedding({"f": api.FeatureConfig(table, name="f")},
                                   api.SGD(LR))
      weight = tf.Variable(np.ones(DIM, np.float32))
      optimizer = keras.optimizers.SGD(LR)
      optimizer.build([weight])
    embedding.build(PER_REPLICA)

    @tf.function(jit_compile=jit)
    def step(ids):
      if not jit:
        embedding.enqueue({"f": ids}, training=True)

      def replica_step(replica_ids):
        if jit:
          embedding.enqueue({"f": replica_ids}, training=True)
        activations = embedding.dequeue()
        with tf.GradientTape() as tape:
          tape.watch(activations)
          loss = tf.reduce_sum(activations["f"] * weight)
          if extra is not None:
            loss += extra(activations["f"])
        grads = tape.gradient(loss, [activations, weight])
        embedding.apply_gradients(grads[0])
        optimizer.apply_gradients([(grads[1], weight)])
        return loss
      run_fn = tf.function(replica_step, jit_compile=True) if inner_jit else replica_step
      return strategy.run(run_fn, args=(ids,))

    for batch in _batches(replicas):
      ids = strategy.experimental_distribute_values_from_function(
          lambda ctx, b=batch: tf.constant(
              b[ctx.replica_id_in_sync_group * PER_REPLICA:
                (ctx.replica_id_in_sync_group + 1) * PER_REPLICA]))
      step(ids)
    with strategy.scope():
      tables = embedding._variables["t"]["parameters"].numpy()  # pylint: disable=protected-access
    return tables, weight.numpy()


def _reference(replicas):
  """The TPU's math: per-id gradients (the dense weight) summed over every
  replica; the weight's gradient (its activations) summed over replicas."""
  table, weight = _initial().astype(np.float64), np.ones(DIM)
  for batch in _batches(replicas):
    g_table = np.zeros_like(table)
    for i in batch:
      g_table[i] += weight
    g_weight = table[batch].sum(axis=0)
    table -= LR * g_table
    weight = weight - LR * g_weight
  return table, weight


@pytest.mark.parametrize("replicas,jit", [(2, False), (8, False), (1, True),
                                          (2, True), (8, True)])
def test_a_step_that_compiles_trains_to_the_reference_with_xla_on(replicas, jit):
  """A Keras optimizer's cross-replica sum included; with jit_compile=True too."""
  table, weight = _program(replicas, jit=jit)
  want_table, want_weight = _reference(replicas)
  np.testing.assert_allclose(table, want_table, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(weight, want_weight, rtol=1e-5, atol=1e-5)


def _py_function(a):
  return tf.py_function(lambda x: tf.reduce_sum(x) * 0.0, [a], tf.float32)  # LINE:py


def _string_op(a):
  h = tf.strings.to_hash_bucket_fast(tf.strings.as_string(a), 3)  # LINE:string
  return tf.cast(tf.reduce_sum(h), tf.float32) * 0.0


def _data_dependent_shapes(a):
  kept = tf.boolean_mask(a, a > 0.0)
  unique = tf.unique(tf.reshape(tf.cast(a > 0.0, tf.int32), [-1]))[0]
  return (tf.reduce_sum(kept) + tf.cast(tf.reduce_sum(unique), tf.float32)) * 0.0


def _line(tag):
  with open(__file__) as f:
    for number, text in enumerate(f, 1):
      if text.rstrip().endswith(f"# LINE:{tag}") and "def _line" not in text:
        return f"test_emulated_xla.py:{number}"
  raise AssertionError(tag)


CASES = [  # (extra, op named in the message, tag of the user's line)
    (_py_function, "EagerPyFunc", "py"),
    (_string_op, "AsString", "string"),
]


@pytest.mark.parametrize("extra,op,tag", CASES, ids=[c[2] for c in CASES])
def test_a_step_no_tpu_compiles_is_refused_when_first_traced(extra, op, tag, no_soft_placement):
  with pytest.raises(xla_check.NotCompilableError) as caught:
    _program(2, extra)
  message = str(caught.value)
  assert "\n" not in message
  assert isinstance(caught.value, tf.errors.InvalidArgumentError)
  assert message.startswith(
      "Detected unsupported operations when trying to compile graph "
      f"(each replica's program) on XLA_TPU_JIT: {op} (")
  assert _line(tag) in message
  assert "Fix:" in message and "emulate_tpu(xla=False)" in message


@pytest.mark.parametrize("extra,op,tag", CASES, ids=[c[2] for c in CASES])
def test_with_soft_placement_on_it_runs_as_on_a_tpu_host_and_warns(extra, op, tag, caplog):
  tf.config.set_soft_device_placement(True)
  xla_check._warned.clear()  # pylint: disable=protected-access
  table, weight = _program(2, extra)
  np.testing.assert_allclose(table, _reference(2)[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(weight, _reference(2)[1], rtol=1e-5, atol=1e-5)
  warned = [r.getMessage() for r in caplog.records
            if r.name == "tpu_embed_ext.emulated_tpu.xla_check"]
  assert any(op in m and _line(tag) in m and "automatic outside compilation" in m
             for m in warned), warned


@pytest.mark.parametrize("extra,op,tag", CASES, ids=[c[2] for c in CASES])
def test_with_xla_off_the_same_step_runs(extra, op, tag, no_soft_placement):
  del op, tag
  table, weight = _program(2, extra, xla=False)
  want_table, want_weight = _reference(2)
  np.testing.assert_allclose(table, want_table, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(weight, want_weight, rtol=1e-5, atol=1e-5)


def test_shapes_that_depend_on_the_data_compile_as_xla_compiles_them():
  """XLA compiles tf.boolean_mask and tf.unique with bounded dynamic shapes
  (here on one CPU device); so the emulated TPU accepts them with XLA on."""
  compiled = tf.function(_data_dependent_shapes, jit_compile=True)
  assert float(compiled(tf.constant([[1.0, -2.0], [3.0, 0.5]]))) == 0.0
  table, weight = _program(2, _data_dependent_shapes)
  want_table, want_weight = _reference(2)
  np.testing.assert_allclose(table, want_table, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(weight, want_weight, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_jit_compile_function_given_to_strategy_run_trains(replicas, no_soft_placement):
  """MirroredStrategy would compile every replica's call in one XLA cluster
  (mirrored_run.call_for_each_replica); each replica is checked instead."""
  table, weight = _program(replicas, inner_jit=True)
  want_table, want_weight = _reference(replicas)
  np.testing.assert_allclose(table, want_table, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(weight, want_weight, rtol=1e-5, atol=1e-5)
  with pytest.raises(xla_check.NotCompilableError, match=r"EagerPyFunc"):
    _program(replicas, _py_function, inner_jit=True)


def test_a_refusal_is_the_same_under_jit_compile(no_soft_placement):
  with pytest.raises(xla_check.NotCompilableError, match=r"EagerPyFunc"):
    _program(2, _py_function, jit=True)
  table, _ = _program(2, _py_function, xla=False, jit=True)
  np.testing.assert_allclose(table, _reference(2)[0], rtol=1e-5, atol=1e-5)


def test_float64_compiles_on_a_tpu_and_complex128_does_not(no_soft_placement):
  """kTpuAllTypes (tensorflow/core/tpu/tpu_defs.h) holds DT_DOUBLE, not
  DT_COMPLEX128, which XLA on CPU compiles."""
  as64 = lambda a: tf.cast(tf.reduce_sum(tf.cast(a, tf.float64)) * 0.0, tf.float32)
  table, _ = _program(2, as64)
  np.testing.assert_allclose(table, _reference(2)[0], rtol=1e-5, atol=1e-5)
  c128 = lambda a: tf.math.real(tf.reduce_sum(tf.cast(a, tf.complex128)) * 0.0)  # LINE:c128
  with pytest.raises(xla_check.NotCompilableError,
                     match=r"type complex128, which a TPU does not compile"):
    _program(2, lambda a: tf.cast(c128(a), tf.float32))


def test_xla_must_be_a_bool():
  with pytest.raises(tee.errors.ConfigTypeError, match=r"xla must be True or False, got xla='no'"):
    with tee.emulate_tpu(replicas=2, xla="no"):
      pass


# --- tf.function(jit_compile=True) around the step ---------------------------

def _v1_jit_program(replicas, enqueue_inside):
  """The v1 loop above in one jit_compile=True function (no dense weight)."""
  with tee.emulate_tpu(replicas=replicas):
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    table = api.TableConfig(VOCAB, DIM, name="t", combiner="sum",
                            initializer=tf.constant_initializer(_initial()))
    with strategy.scope():
      embedding = api.TPUEmbedding({"f": api.FeatureConfig(table, name="f")},
                                   api.SGD(LR))
    embedding.build(PER_REPLICA)

    @tf.function(jit_compile=True)
    def step(ids):
      if not enqueue_inside:
        embedding.enqueue({"f": ids}, training=True)  # LINE:host-enqueue

      def replica_step(replica_ids):
        if enqueue_inside:
          embedding.enqueue({"f": replica_ids}, training=True)
        activations = embedding.dequeue()
        embedding.apply_gradients({"f": tf.ones_like(activations["f"])})
      return strategy.run(replica_step, args=(ids,))

    for batch in _batches(replicas):
      step(strategy.experimental_distribute_values_from_function(
          lambda ctx, b=batch: tf.constant(
              b[ctx.replica_id_in_sync_group * PER_REPLICA:
                (ctx.replica_id_in_sync_group + 1) * PER_REPLICA])))
    with strategy.scope():
      return embedding._variables["t"]["parameters"].numpy()  # pylint: disable=protected-access


def _v1_reference(replicas):
  table = _initial().astype(np.float64)
  for batch in _batches(replicas):
    np.subtract.at(table, batch, LR)  # gradient 1 per occurrence, summed
  return table


@pytest.mark.parametrize("replicas", [1, 2])
def test_v1_enqueue_on_the_host_inside_jit_compile_is_tensorflows_xla_error(replicas):
  """tpu_embedding_v2.py enqueue (outside a TPU context) builds
  EnqueueTPUEmbeddingArbitraryTensorBatch, a DEVICE_CPU-only kernel
  (tpu_embedding_enqueue_ops.cc): XLA refuses the jit_compile=True function."""
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"^Detected unsupported operations when trying to compile "
                     r"graph \S+ on XLA_CPU_JIT: EnqueueTPUEmbeddingArbitraryTensorBatch "
                     r"\(No registered 'EnqueueTPUEmbeddingArbitraryTensorBatch'"):
    _v1_jit_program(replicas, enqueue_inside=False)


@pytest.mark.parametrize("replicas", [1, 2])
def test_v1_enqueue_inside_strategy_run_under_jit_compile_trains(replicas):
  np.testing.assert_allclose(_v1_jit_program(replicas, enqueue_inside=True),
                             _v1_reference(replicas), rtol=1e-6, atol=1e-6)


# --- SparseCore (TPUEmbeddingV2) under jit_compile=True ----------------------

def _sparsecore_jit_program(replicas, xla=True):
  from tests import sparsecore_program as sc  # the same program's data
  # Samples per step, split over the replicas; each chip's batch splits
  # evenly over its 4 SparseCores.
  global_batch = max(16, 4 * replicas)
  per_replica = global_batch // replicas
  with tee.emulate_tpu(replicas=replicas, sparsecore=True, xla=xla):
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    with strategy.scope():
      embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(
          sc.feature_config(per_replica), None)

    @tf.function(jit_compile=True)
    def step(batch):
      def replica_step(features):
        activations, preserved = embedding.embedding_lookup(features)
        embedding.apply_gradients(sc.gradients(activations), preserved)
        return activations["user"]
      return strategy.run(replica_step, args=(batch,))

    batches = sc.global_batches(global_batch)
    for batch in batches:
      step(strategy.experimental_distribute_values_from_function(
          lambda ctx, b=batch: sc.as_tensors(
              b, ctx.replica_id_in_sync_group * per_replica,
              (ctx.replica_id_in_sync_group + 1) * per_replica)))
    tables = {n: embedding.table_variables(n)["parameters"].numpy()
              for n in sc.VOCAB}
  return tables, sc.numpy_reference(batches)[0]


@pytest.mark.parametrize("replicas", [1, 2, 8])
def test_sparsecore_step_under_jit_compile_trains_to_the_reference(replicas):
  tables, reference = _sparsecore_jit_program(replicas)
  for name, values in tables.items():
    np.testing.assert_allclose(values, reference[name], rtol=1e-5, atol=1e-5)


def test_strategy_run_of_a_jit_function_called_eagerly(no_soft_placement):
  """Eagerly, TPUStrategy.run takes a tf.function (tpu_strategy.validate_run_function)."""
  with tee.emulate_tpu(replicas=2):
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    with strategy.scope():
      weight = tf.Variable(1.5)

    @tf.function(jit_compile=True)
    def summed():
      context = tf.distribute.get_replica_context()
      return context.all_reduce("sum", weight * tf.cast(
          context.replica_id_in_sync_group + 1, tf.float32))

    results = strategy.experimental_local_results(strategy.run(summed))
    assert [float(r) for r in results] == [4.5, 4.5]  # 1.5 * (1 + 2)
    with pytest.raises(xla_check.NotCompilableError, match=r"EagerPyFunc"):
      strategy.run(tf.function(_py_function, jit_compile=True), args=(tf.ones([2]),))


def test_a_dense_id_tensor_of_the_wrong_size_gets_sparsecores_error():
  """sparse_core_preprocess_ops.cc ValidateInputs: a dense tensor holds one id
  per sample (what a TPU says when Keras builds a model of SparseTensor
  inputs on a dense placeholder)."""
  from tests import sparsecore_program as sc
  with tee.emulate_tpu(replicas=2, sparsecore=True):
    strategy = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    with strategy.scope():
      embedding = tf.tpu.experimental.embedding.TPUEmbeddingV2(sc.feature_config(4), None)
    features = {"user": tf.zeros([4], tf.int64), "item": tf.zeros([4, 3], tf.int64)}
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"^Dense tensor input should have values elements number the "
                       r"same as the sample count\. But got 12 elements for values and "
                       r"sample count as 4\. \(emulated TPUEmbeddingV2: feature 'item' "
                       r"\(table 'item'\).*Fix: ") as caught:
      embedding.embedding_lookup(features)
    assert isinstance(caught.value, tee.errors.InputError)


def _size_from_the_data(a):
  depth = tf.cast(tf.reduce_max(a), tf.int32) * 0 + 3
  return tf.reduce_sum(tf.one_hot(tf.constant([0, 1]), depth)) * 0.0  # LINE:constant


def test_xla_itself_refuses_a_size_from_the_data_when_compiling_for_unknown_values():
  """What a TPU compiles: the step's inputs are values it does not know yet
  (jit_compile on CPU, given a value, would compile once per value)."""
  compiled = tf.function(_size_from_the_data, jit_compile=True)
  with pytest.raises(ValueError, match=r"OneHot must be a compile-time constant"):
    compiled.experimental_get_compiler_ir(tf.TensorSpec([4, 3], tf.float32))(stage="hlo")


def test_a_size_from_the_data_is_refused_by_xla_when_first_traced():
  """Replica 0's TensorCore program is compiled (soft placement on, the
  default: an XLA compile error is refused all the same)."""
  with pytest.raises(xla_check.NotCompilableError) as caught:
    _program(2, _size_from_the_data)
  message = str(caught.value)
  assert "\n" not in message
  assert isinstance(caught.value, tf.errors.InvalidArgumentError)
  assert message == (
      "Input 1 to node `one_hot` with op OneHot must be a compile-time constant: "
      f"emulated TPU: made at {__file__.rsplit('/', 1)[0]}/{_line('constant')} in the "
      "function given to strategy.run (replica 0's TensorCore program, compiled "
      "with XLA on CPU at first trace). Fix: compute it from static values "
      "(Python numbers, tensor.shape), or pad to a fixed size: a TPU compiles the "
      "step before it sees the data, with strategy.run's arguments and the replica id "
      "as the program's inputs; or run with XLA off (emulate_tpu(xla=False), "
      "emulate --no-xla, pytest --emulate-tpu-no-xla).")


def test_a_size_from_the_data_runs_with_xla_off():
  table, weight = _program(2, _size_from_the_data, xla=False)
  want_table, want_weight = _reference(2)
  np.testing.assert_allclose(table, want_table, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(weight, want_weight, rtol=1e-5, atol=1e-5)


def test_replica_zeros_program_is_built_from_activations_to_gradients(monkeypatch):
  """The compiled program: the activations come in (the engine's lookup is
  not in it), the embedding gradient goes out, the Keras optimizer's
  cross-replica sum is cut out (its result comes in), and XLA compiles it."""
  from tests import xla_recording  # pylint: disable=g-import-not-at-top
  built, results = xla_recording.record(monkeypatch)
  _program(2)
  assert results == [None] and len(built) == 1
  program_ops, feeds, fetches, _ = built[0]
  assert not {op.type for op in program_ops} & {"TpuEmbedExtLookup", "AddN"}
  assert all("replica_1" not in op.name for op in program_ops)
  feed_ops = {t.op.type for t in feeds.values()}
  assert "Reshape" in feed_ops  # the activations, shaped by the engine
  assert "AddN" not in feed_ops and "Identity" in feed_ops  # the all-reduced gradient
  assert any(t.shape.as_list() == [PER_REPLICA, DIM] and
             any(c.type == "Reshape" for c in t.consumers()) for t in fetches)


def test_an_input_of_unknown_shape_is_not_compiled_and_says_so(caplog):
  """What the compile cannot stand for (an input whose shape is not fully
  known) is logged, not refused: only the op check has run for that step."""
  from tpu_embed_ext.emulated_tpu import xla_compile  # pylint: disable=g-import-not-at-top
  xla_compile._logged.clear()  # pylint: disable=protected-access
  with tee.emulate_tpu(replicas=2):
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
    tf.tpu.experimental.initialize_tpu_system(resolver)
    strategy = tf.distribute.TPUStrategy(resolver)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def step(x):
      return strategy.run(lambda v: v * 2.0 + 1.0, args=(x,))

    out = step(tf.constant([1.0, 2.0, 3.0]))
    assert [v.numpy().tolist() for v in out.values] == [[3.0, 5.0, 7.0]] * 2
  warned = [r.getMessage() for r in caplog.records
            if r.name == "tpu_embed_ext.emulated_tpu.xla_compile"]
  assert len(warned) == 1 and warned[0].startswith(
      "Replica 0's TensorCore program was not compiled with XLA (its input ")
  assert ("has shape (None,), not fully known): this step was NOT compiled; only its "
          "ops were checked") in warned[0]


def _cond(activations):
  """A tf.cond under the step's GradientTape: outside an XLA context cond_v2
  keeps its intermediates for the gradient in Optional ops, which a TPU's
  program (traced in an XLA context) never holds. Adds zero to the loss."""
  return tf.cond(tf.reduce_sum(activations) > 0, lambda: tf.reduce_max(activations),
                 lambda: tf.reduce_min(activations)) * 0.0


def test_a_cond_under_the_gradient_tape_compiles_and_trains(no_soft_placement):
  """Not refused (as it was: OptionalFromValue has no XLA kernel), even with
  soft placement off; the tables are the TPU's math."""
  table, weight = _program(2, _cond)
  want_table, want_weight = _reference(2)
  np.testing.assert_allclose(table, want_table, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(weight, want_weight, rtol=1e-5, atol=1e-6)
