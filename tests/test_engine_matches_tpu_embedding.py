"""CPUEmbedding against TPUEmbedding's contract.

The scenarios come from TensorFlow's own input tests of the TPU embedding
mid-level API (tensorflow/python/tpu/tests/tpu_embedding_v2_*_test.py:
valid_input, invalid_input, hd_valid_input, hd_invalid_input,
correctness_dense_lookup, optimizer, enqueue_mode), re-expressed for one
replica holding the whole batch. Each case checks the exception class that
TPUEmbedding raises, eagerly and inside tf.function, and activation shapes
equal to the shapes upstream's tests expect. Values are checked against numpy
lookups written here from the tables' initial values.
"""

import numpy as np
import pytest
import keras
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.spec import optimizers
from tpu_embed_ext.keras import serving
from tpu_embed_ext.tf import optimizers as tf_optimizers
from tests import references
from tests.builders import (SCENARIO_IDS, SCENARIO_USER, SCENARIO_VIDEO, scenario_features,
                            scenario_tables)

api = tf.tpu.experimental.embedding
BATCH = 4


def _scenario_engine(optimizer=None, **feature_kwargs):
  return tee.CPUEmbedding(scenario_features(**feature_kwargs), optimizer or api.SGD(0.1))


# Upstream's sparse data set (tpu_embedding_base_test.py), one replica.
WATCHED, FAVORITED, FRIENDS = (SCENARIO_IDS[k] for k in ("watched", "favorited", "friends"))


def _ragged():
  return tuple(tf.ragged.constant(x, tf.int64) for x in (WATCHED, FAVORITED, FRIENDS))


def _sparse():
  """Static dense shapes, as a batched data set gives them."""
  out = []
  for rows in (WATCHED, FAVORITED, FRIENDS):
    indices = [[r, c] for r, row in enumerate(rows) for c in range(len(row))]
    out.append(tf.SparseTensor(indices, tf.constant(sum(rows, []), tf.int64),
                               [len(rows), max(map(len, rows))]))
  return tuple(out)


def _modes():
  """Eager and traced calls of the same function."""
  return [pytest.param(lambda f: f, id="eager"),
          pytest.param(tf.function, id="tf_function")]


MODES = _modes()


def _lookup(emb, features, weights=None):
  emb.enqueue(features, weights, training=False)
  return emb.dequeue()


# --- shapes: TPUEmbedding's, not TPUEmbeddingForServing's ------------------------

def _hd_dense():
  ids = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [7, 6, 5, 4], [3, 2, 1, 0]])
  return ids, ids % 8, ids % 16


SHAPE_CASES = {
    # _get_input_shape_for_tensor: rank 1 kept, a trailing 1 dropped.
    "dense_rank1": (lambda: tuple(tf.constant([0, 1, 2, 3]) for _ in range(3)),
                    {}, [[4], [4], [4]]),
    "dense_b_1": (lambda: tuple(tf.constant([[0], [1], [2], [3]]) for _ in range(3)),
                  {}, [[4], [4], [4]]),
    # correctness_dense_lookup_test (is_high_dimensional): [B, D, 1] -> [B, D, dim].
    "dense_b_4_1": (lambda: tuple(tf.constant(x[..., None]) for x in _hd_dense()),
                    {}, [[4, 4], [4, 4], [4, 4]]),
    # _get_input_shape_for_sparse_tensor / _ragged_tensor: the ids dimension goes.
    "sparse": (_sparse, {}, [[4], [4], [4]]),
    "ragged": (_ragged, {}, [[4], [4], [4]]),
    # A sequence feature (no output_shape): max_sequence_length is inserted.
    "ragged_sequence": (_ragged, {"max_sequence_length": 3}, [[4, 3], [4, 3], [4, 3]]),
    "sparse_sequence": (_sparse, {"max_sequence_length": 2}, [[4, 2], [4, 2], [4, 2]]),
    # hd sparse [B, D, L]: [B, D]; max_sequence_length is ignored above rank 2.
    "sparse_rank3": (lambda: tuple(tf.sparse.reshape(s, [2, 2, -1]) for s in _sparse()),
                     {"max_sequence_length": 5}, [[2, 2], [2, 2], [2, 2]]),
    # output_shape with more dimensions than the input: rank-1 incoming shapes
    # are not compared (_check_output_shapes), the activation takes output_shape.
    "ragged_output_shape": (_ragged, {"output_shape": [2, 2]}, [[2, 2]] * 3),
    "dense_output_shape": (lambda: tuple(tf.constant([0, 1, 2, 3]) for _ in range(3)),
                           {"output_shape": [2, 2]}, [[2, 2]] * 3),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_activation_shapes_are_tpu_embeddings(case, mode):
  make, kwargs, shapes = SHAPE_CASES[case]
  emb = _scenario_engine(**kwargs)
  acts = mode(lambda: _lookup(emb, make()))()
  dims = [4, 4, 2]
  assert [a.shape.as_list() for a in acts] == [s + [d] for s, d in zip(shapes, dims)]
  # __call__ (our lookup) gives the same shapes.
  assert [a.shape.as_list() for a in emb(make())] == [s + [d] for s, d in zip(shapes, dims)]


@pytest.mark.parametrize("mode", MODES)
def test_dense_values_drop_the_trailing_dimension(mode):
  """correctness_dense_lookup_test: rows of the ids, trailing 1 dropped."""
  emb = _scenario_engine()
  ids = _hd_dense()
  acts = mode(lambda: _lookup(emb, tuple(tf.constant(x[..., None]) for x in ids)))()
  for act, x, table in zip(acts, ids, (SCENARIO_VIDEO, SCENARIO_VIDEO, SCENARIO_USER)):
    np.testing.assert_array_equal(act, table[x])
  flat = mode(lambda: _lookup(emb, tuple(tf.constant(x[:, :1]) for x in ids)))
  # [B, 1] after [B, 4, 1]: _check_output_shapes does not compare a rank-1
  # shape with a larger one, but 4 ids cannot fill [4, 4].
  with pytest.raises(ValueError, match="4 ids cannot fill the activation shape "
                                       "\\[4, 4\\] \\(16 rows\\)"):
    flat()


def test_recorded_output_shapes_follow_the_first_batch():
  """hd_valid_input_test.test_different_input_shapes."""
  emb = _scenario_engine()
  dense = tf.zeros([1, 3, 1], tf.int32)
  sparse = tf.sparse.reshape(_sparse()[1], [2, 2, -1])
  emb.enqueue((dense, sparse, tf.sparse.reshape(_sparse()[2], [2, 2, -1])),
              training=False)
  assert emb._output_shapes == [tf.TensorShape([1, 3]), tf.TensorShape([2, 2]),
                                tf.TensorShape([2, 2])]
  assert [a.shape.as_list() for a in emb.dequeue()] == [[1, 3, 4], [2, 2, 4], [2, 2, 2]]


def test_build_shapes_are_honoured_and_output_shape_has_priority():
  """hd_valid_input_test: build shapes; output_shape wins over them."""
  emb = _scenario_engine()
  emb.build([tf.TensorShape([4, 4, 1]), tf.TensorShape([4, 4, 2]),
             tf.TensorShape([4, 4, 3])])
  assert emb._output_shapes == [tf.TensorShape([4, 4])] * 3
  acts = _lookup(emb, tuple(tf.constant(x[..., None]) for x in _hd_dense()))
  assert [a.shape.as_list() for a in acts] == [[4, 4, 4], [4, 4, 4], [4, 4, 2]]

  emb = _scenario_engine(output_shape=[2, 4])
  emb.build([tf.TensorShape([2, None, None])] * 3)
  assert emb._output_shapes == [tf.TensorShape([2, 4])] * 3
  # A batch size, as an int or per_replica_batch_size (the deprecated forms).
  for kwargs in ({"per_replica_input_shapes": 4}, {"per_replica_batch_size": 4}):
    emb = _scenario_engine(max_sequence_length=3)
    emb.build(**kwargs)
    assert emb._output_shapes == [tf.TensorShape([4, 3])] * 3


def test_zero_padded_dense_multi_hot_ids_are_rejected_with_the_fix():
  """[B, L] zero-padded multi-hot ids: the TPU refuses them; so do we."""
  video = api.TableConfig(8, 4, combiner="sum", name="video")
  emb = tee.CPUEmbedding({"history": api.FeatureConfig(video, name="history")},
                         api.SGD(0.1))
  padded = tf.constant([[3, 5, 0], [1, 0, 0]], tf.int64)
  for call in (lambda: emb({"history": padded}),
               lambda: emb.enqueue({"history": padded}),
               tf.function(lambda: emb.enqueue({"history": padded}))):
    with pytest.raises(ValueError) as info:
      call()
    assert str(info.value) == (
        "feature 'history' (table 'video'): dense ids of shape [2, 3] have a last "
        "dimension of 3, but TPUEmbedding needs dense ids of rank >= 2 to end in a "
        "dimension of 1, which it drops ([batch, 1] -> [batch, dim]); it does not "
        "combine several dense ids per row, and padding ids would be looked up as "
        "ids. Fix: for zero-padded multi-hot ids pass a RaggedTensor or "
        "SparseTensor (tf.RaggedTensor.from_tensor(ids, padding=0) or "
        "tf.sparse.from_dense(ids)); for one id per row pass [batch] or [batch, 1] "
        "ids.")
    assert isinstance(info.value, tee.InputError)
  # The fix it names works: the padding is gone, each row is combined.
  acts = emb({"history": tf.RaggedTensor.from_tensor(padded, padding=0)})
  table = emb.variables["video"]["parameters"].numpy()
  np.testing.assert_allclose(acts["history"], [table[3] + table[5], table[1]])


# --- rejections: upstream's exception classes, eagerly and traced ----------------

def _ids(n=BATCH):
  return tf.constant(list(range(n)))


REJECTED_ENQUEUES = {
    # name: (feature kwargs, features, weights, upstream class, our message start)
    "dense_rank0": ({}, lambda: (tf.constant(1), _ids(), _ids()), None, ValueError,
                    "feature '0' (table 'video'): dense ids must have rank >= 1"),
    "dense_last_dim_2": ({}, lambda: (tf.zeros([4, 2], tf.int32), _ids(), _ids()),
                         None, ValueError,
                         "feature '0' (table 'video'): dense ids of shape [4, 2]"),
    "sparse_rank1": ({}, lambda: (tf.sparse.from_dense(_ids()), _ids(), _ids()), None,
                     ValueError,
                     "feature '0' (table 'video'): sparse ids must have rank >= 2"),
    "ragged_rank3": ({}, lambda: (tf.ragged.constant([[[1]], [[2, 3]]]), _ids(2), _ids(2)),
                     None, ValueError,
                     "feature '0' (table 'video'): ragged ids must have rank 2"),
    # invalid_input_test.test_enqueue_weight_for_dense_tensor
    "weight_for_dense": ({}, lambda: (_ids(), _ids(), _ids()),
                         lambda: (tf.ones([4]), None, None), ValueError,
                         "Weight specified for dense input 0, which is not allowed. Weight "
                         "will always be 1 in this case. feature '0' (table 'video'): "
                         "weights were given for a dense"),
    # ..._wrong_weight_type_for_sparse_and_ragged_tensor
    "ragged_weight_for_sparse": ({}, _sparse,
                                 lambda: (tf.ragged.constant([[1.0]] * 4), None, None),
                                 ValueError,
                                 "Weight for 0 is type <class 'tensorflow.python.ops."
                                 "ragged.ragged_tensor.RaggedTensor'> which does not match "
                                 "type input which is SparseTensor. "
                                 "feature '0' (table 'video'): weights are a RaggedTensor "
                                 "but ids a SparseTensor"),
    "sparse_weight_for_ragged": ({}, _ragged, lambda: (_sparse()[0], None, None),
                                 ValueError,
                                 "Weight for 0 is type <class 'tensorflow.python.framework."
                                 "sparse_tensor.SparseTensor'> which does not match type "
                                 "input which is RaggedTensor. "
                                 "feature '0' (table 'video'): weights are a SparseTensor "
                                 "but ids a RaggedTensor"),
    # ..._incorrect_structure_for_features_and_weights
    "missing_feature": ({}, lambda: _ragged()[:1], None, ValueError,
                        "The two structures don't have the same nested structure. "
                        "features do not match the feature config's structure: missing "
                        "['1', '2'], unexpected []."),
    "missing_weight": ({}, _ragged, lambda: (None,), ValueError,
                       "The two structures don't have the same nested structure. "
                       "weights do not match the feature config's structure: missing "
                       "['1', '2'], unexpected []."),
    "list_for_tuple": ({}, lambda: list(_ragged()), None, TypeError,
                       "The two structures don't have the same nested structure. "
                       "features do not match the feature config's structure: the "
                       "feature config is a tuple, features a list."),
    # TPUEmbedding passes them on, with an effect the TPU does not document.
    "weight_for_sequence": ({"max_sequence_length": 2}, _ragged,
                            lambda: (tf.ragged.constant([[1.0]] + [[1.0, 1.0]] * 2 + [[1.0]]),
                                     None, None), ValueError,
                            "feature '0' (table 'video'): weights were given for a sequence "
                            "feature (max_sequence_length=2); what the TPU does with them is "
                            "not documented, so they are not emulated. Fix: drop them."),
    "numpy_ids": ({}, lambda: (np.arange(4), _ids(), _ids()), None, ValueError,
                  "feature '0' (table 'video'): ids are of type ndarray; TPUEmbedding takes "
                  "only a tf.Tensor"),
    # hd_invalid_input_test.test_enqueue_incorrect_shape_feature
    "output_shape_mismatch": ({"output_shape": [1, 1]},
                              lambda: tuple(tf.sparse.reshape(s, [2, 2, -1])
                                            for s in _sparse()), None, ValueError,
                              "Inconsistent shape founded for input feature 0, Output "
                              "shape is set to be (1, 1), But got incoming output shape "
                              "(2, 2). feature '0' (table 'video'): the input gives "
                              "activations of shape [2, 2], but the feature's output "
                              "shape is [1, 1]"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(REJECTED_ENQUEUES))
def test_rejected_enqueue(case, mode):
  kwargs, features, weights, cls, message = REJECTED_ENQUEUES[case]
  emb = _scenario_engine(**kwargs)
  emb.build()
  before = {k: v.numpy().copy() for k, v in emb.variables["video"].items()}
  call = mode(lambda: emb.enqueue(features(), weights() if weights else None))
  with pytest.raises(cls) as info:
    call()
  assert isinstance(info.value, tee.InputError)
  assert str(info.value).startswith(message), str(info.value)
  assert emb._output_shapes == [tf.TensorShape(kwargs.get("output_shape"))] * 3
  for key, value in emb.variables["video"].items():
    np.testing.assert_array_equal(value, before[key])


@pytest.mark.parametrize("mode", MODES)
def test_batch_shape_must_stay_the_one_the_feature_was_built_with(mode):
  emb = _scenario_engine()
  _lookup(emb, _ragged())
  smaller = tuple(x[:2] for x in _ragged())
  with pytest.raises(ValueError) as info:
    mode(lambda: emb.enqueue(smaller))()
  assert str(info.value).startswith(
      "Inconsistent shape founded for input feature 0, Output shape is set to be "
      "(4,), But got incoming output shape (2,). "
      "feature '0' (table 'video'): the input gives activations of shape [2], but "
      "the feature's output shape is [4]")


def test_unknown_batch_dimension_is_rejected_by_enqueue_but_not_by_lookups():
  """The TPU compiles fully defined shapes (_check_output_shapes_fully_defined)."""
  emb = _scenario_engine()
  spec = (tf.TensorSpec([None], tf.int32),) * 3
  enqueue = tf.function(lambda f: emb.enqueue(f), input_signature=[spec])
  with pytest.raises(ValueError) as info:
    enqueue.get_concrete_function()
  assert str(info.value).startswith(
      "Input Feature 0 has output shape set as (None,) which is not fully defined. "
      "feature '0' (table 'video'): output shape [None] is not fully defined; the "
      "TPU compiles every activation shape. Fix: give static shapes")
  # __call__, our lookup with no TPU counterpart, reads the batch when it runs
  # (Keras builds models on such inputs) and records no shape.
  lookup = tf.function(lambda f: emb(f), input_signature=[spec])
  acts = lookup((tf.constant([1, 2]),) * 3)
  np.testing.assert_array_equal(acts[0], SCENARIO_VIDEO[[1, 2]])
  assert emb._output_shapes == [tf.TensorShape(None)] * 3
  # After a static batch fixed the shapes, a last smaller batch still looks up
  # (enqueue would refuse it, as TPUEmbedding does).
  _lookup(emb, (_ids(),) * 3)
  acts = lookup((tf.constant([5, 6, 7]),) * 3)
  assert acts[0].shape == (3, 4)
  np.testing.assert_array_equal(acts[2], SCENARIO_USER[[5, 6, 7]])
  acts = emb((tf.constant([[5], [6]]),) * 3)
  np.testing.assert_array_equal(acts[1], SCENARIO_VIDEO[[5, 6]])
  with pytest.raises(ValueError, match="output shape is \\[4\\]"):
    emb.enqueue((tf.constant([5, 6]),) * 3)


REJECTED_BUILDS = {
    # hd_invalid_input_test.test_build_incorrect_output_shapes
    "inconsistent": ({"output_shape": [2, 4]}, [tf.TensorShape([1, 1, 1])] * 3,
                     "Inconsistent shape founded for input feature 0, Output shape is "
                     "set to be (2, 4), But got incoming output shape (1, 1). "
                     "feature '0' (table 'video'): the input gives activations of "
                     "shape [1, 1], but the feature's output shape is [2, 4]"),
    # ..._not_fully_defined_output_shapes_for_build
    "not_fully_defined": ({}, [tf.TensorShape([1, None, None])] * 3,
                          "Input Feature 0 has output shape set as (1, None) which is "
                          "not fully defined. feature '0' (table 'video'): output shape "
                          "[1, None] is not fully defined"),
    "rank0": ({}, [tf.TensorShape([])] * 3,
              "feature '0' (table 'video'): input shape [] must have rank >= 1."),
    "count": ({}, [tf.TensorShape([4])] * 2,
              "The two structures don't have the same nested structure. "
              "per_replica_input_shapes do not match the feature config's structure"),
}


@pytest.mark.parametrize("case", sorted(REJECTED_BUILDS))
def test_rejected_build(case):
  kwargs, shapes, message = REJECTED_BUILDS[case]
  emb = _scenario_engine(**kwargs)
  with pytest.raises(ValueError) as info:
    emb.build(shapes)
  assert str(info.value).startswith(message), str(info.value)
  assert emb._variables is None  # Nothing was built.


def test_partial_output_shape_in_feature_config_is_rejected_at_build():
  """hd_invalid_input_test.test_not_fully_defined_output_shapes_in_feature_config."""
  emb = _scenario_engine(output_shape=[None, 4])
  with pytest.raises(ValueError) as info:
    emb.build()
  assert str(info.value).startswith(
      "Input Feature 0 has output shape set as (None, 4) which is not fully defined. "
      "feature '0' (table 'video'): output shape [None, 4] is not fully defined")


GRADIENT_CASES = {
    # invalid_input_test.test_pass_non_tensor_to_apply_gradients
    "non_tensor": (lambda acts: (1, 2, 3), ValueError,
                   "found non-tensor type: <class 'int'> at path 0. "
                   "feature '0' (table 'video'): gradient is a int, not a tf.Tensor."),
    "list_for_tuple": (lambda acts: list(acts), TypeError,
                       "The two structures don't have the same nested structure. "
                       "gradients do not match the feature config's structure: the "
                       "feature config is a tuple, gradients a list."),
    "missing": (lambda acts: acts[:2], ValueError,
                "The two structures don't have the same nested structure. "
                "gradients do not match the feature config's structure: missing ['2']"),
    "shape": (lambda acts: (acts[0][:2], acts[1], acts[2]), ValueError,
              "feature '0' (table 'video'): gradient shape [2, 4] does not match its "
              "activation shape [4, 4]."),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(GRADIENT_CASES))
def test_rejected_gradients(case, mode):
  make, cls, message = GRADIENT_CASES[case]
  emb = _scenario_engine()

  def step():
    emb.enqueue(_ragged(), training=True)
    emb.apply_gradients(make(emb.dequeue()))
  emb.build()
  before = emb.variables["video"]["parameters"].numpy()
  with pytest.raises(cls) as info:
    mode(step)()
  assert isinstance(info.value, tee.InputError)
  assert str(info.value).startswith(message), str(info.value)
  np.testing.assert_array_equal(emb.variables["video"]["parameters"], before)
  assert int(emb.step) == 0


# --- construction ------------------------------------------------------------------

def test_unsupported_optimizer_class_is_a_value_error():
  """optimizer_test.test_unsupported_optimizer (a v1 AdagradParameters there)."""
  class AdagradParameters:  # The shape of a TPUEstimator-era parameter object.
    learning_rate = 0.1
  for bad in (AdagradParameters(), "adagrad", tf.keras.optimizers.SGD(0.1)):
    with pytest.raises(ValueError) as info:
      _scenario_engine(bad)
    assert isinstance(info.value, tee.ConfigError)
    assert str(info.value).startswith(
        f"table 'video': {type(bad).__name__} is an unsupported optimizer class. Fix: "
        "pass one of tf.tpu.experimental.embedding's SGD, Adagrad, AdagradMomentum, "
        "Adam or FTRL")


def test_tables_with_the_same_name():
  video = api.TableConfig(4, 2, name="table")
  other = api.TableConfig(4, 2, name="table")
  with pytest.raises(ValueError, match="^Tables must have unique names. Multiple tables "
                                       "with name table found. Tables must have unique "
                                       "names; found \\['table'\\] more than once"):
    tee.CPUEmbedding((api.FeatureConfig(video), api.FeatureConfig(other)), api.SGD(0.1))


def test_variables_of_an_unnamed_table_config():
  table = api.TableConfig(6, 2, initializer=tf.constant_initializer(3.0))
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(table)}, api.Adagrad(0.1))
  assert table.name is None  # Never written into the user's object.
  assert emb.table_name(table) == "table_0"
  variables = emb.table_variables(table)
  assert variables is emb.variables["table_0"] is emb.table_variables("table_0")
  assert sorted(variables) == ["accumulators", "parameters"]
  assert emb.embedding_tables[table] is variables["parameters"]
  with pytest.raises(TypeError) as info:
    emb.table_variables(api.TableConfig(6, 2))
  assert str(info.value).startswith("TableConfig(") and "is not a TableConfig of this " \
      "engine's feature config." in str(info.value)
  with pytest.raises(ValueError, match="no table named 'table_1'. Fix: use one of "
                                       "\\['table_0'\\]."):
    emb.table_variables("table_1")


# --- training scenarios with TPUEmbedding's shapes ---------------------------------

def test_dynamic_learning_rate_with_dense_b_1_ids():
  """optimizer_test.test_variable_learning_rate: [1, 1] ids, 10 SGD steps."""
  step = tf.Variable(0.0)
  lr = lambda: tf.maximum(0.5, 1.0 - 0.5 * step / 10.0)
  table = api.TableConfig(1, 4, initializer=tf.zeros_initializer(), name="table")
  emb = tee.CPUEmbedding({"feature": api.FeatureConfig(table, name="feature")},
                         api.SGD(learning_rate=lr))

  @tf.function
  def train():
    emb.enqueue({"feature": tf.constant([[0]])}, training=True)
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(acts["feature"])
    emb.apply_gradients(tape.gradient(loss, acts))
    return acts["feature"]

  results = []
  for _ in range(10):
    results.append(train().numpy())
    step.assign_add(1.0)
  rates = [1.0 - 0.05 * j for j in range(10)]
  want = [[[-sum(rates[:j])] * 4] for j in range(10)]
  np.testing.assert_allclose(results, want, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_none_gradients_and_ones_over_steps(mode):
  """valid_input_test.test_pass_none_to_apply_gradients, enqueue_mode_test's
  all-ones gradient: three SGD steps against numpy."""
  emb = _scenario_engine(api.SGD(0.1))
  emb.build([tf.TensorShape([4, 2]), tf.TensorShape([4, 2]), tf.TensorShape([4, 3])])

  def step(gradients):
    emb.enqueue(_sparse(), training=True)
    acts = emb.dequeue()
    emb.apply_gradients(gradients(acts))
    return acts

  video, user = SCENARIO_VIDEO.copy(), SCENARIO_USER.copy()
  none_then_ones = lambda acts: (None, None, tf.ones_like(acts[2]))
  all_ones = lambda acts: tuple(tf.ones_like(a) for a in acts)
  for gradients in (none_then_ones, all_ones, all_ones):
    acts = mode(lambda: step(gradients))()
    np.testing.assert_allclose(acts[0], [video[r].sum(0) for r in WATCHED], rtol=1e-6)
    np.testing.assert_allclose(acts[2], [user[r].mean(0) for r in FRIENDS], rtol=1e-6)
    # Per-id sums of the occurrences' gradients, then one SGD update.
    user_grad, video_grad = np.zeros_like(user), np.zeros_like(video)
    for rows in FRIENDS:  # mean combiner: 1/len(row) to each id.
      for i in rows:
        user_grad[i] += 1.0 / len(rows)
    if gradients is all_ones:
      for rows in WATCHED + FAVORITED:
        for i in rows:
          video_grad[i] += 1.0
    user -= np.float32(0.1) * user_grad
    video -= np.float32(0.1) * video_grad
  np.testing.assert_allclose(emb.variables["video"]["parameters"], video, rtol=1e-6)
  np.testing.assert_allclose(emb.variables["user"]["parameters"], user, rtol=1e-6)


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "sparse"])
def test_weights_and_missing_samples(ragged):
  """valid_input_test: test_enqueue_with_weights and test_missing_feature."""
  emb = _scenario_engine()
  features = _ragged() if ragged else _sparse()
  half = lambda x: (tf.ragged.map_flat_values(lambda v: 0.5 + 0 * tf.cast(v, tf.float32), x)
                    if ragged else tf.SparseTensor(x.indices, 0.5 + 0 * tf.cast(
                        x.values, tf.float32), x.dense_shape))
  plain = _lookup(emb, features)
  weighted = _lookup(emb, features, (half(features[0]), None, half(features[2])))
  # video sums: scaled by 0.5; no weights: unchanged; user means: unchanged.
  for got, want, w in zip(weighted, plain, (0.5, 1.0, 1.0)):
    np.testing.assert_allclose(got, want.numpy() * w)
  missing = tf.ragged.constant([[0], [0, 1], [0, 1], []], tf.int64)
  missing = missing if ragged else missing.to_sparse()
  acts = _lookup(emb, (missing,) + features[1:])
  np.testing.assert_array_equal(acts[0][3], np.zeros(4))


# --- errors keep their class inside tf.function ------------------------------------

def test_our_errors_are_not_staging_errors_inside_tf_function():
  """autograph turns unknown exception types into StagingError; ours pass through."""
  emb = _scenario_engine()

  @tf.function
  def bad():
    return emb((tf.zeros([4, 2], tf.int32), _ids(), _ids()))

  try:
    bad()
  except ValueError as e:  # What TPU code catches.
    caught = e
  assert type(caught) is tee.InputError
  assert str(caught).startswith("feature '0' (table 'video'): dense ids of shape [4, 2]")
  with pytest.raises(tee.ConfigError):
    tf.function(lambda: tee.SGD(learning_rate=-1.0))()


# --- TPUEstimator-era clip_gradient_min / clip_gradient_max -------------------------

def test_v1_gradient_clipping_fields():
  assert tee.Adagrad(clip_gradient_min=-1.0, clip_gradient_max=2.0) == tee.Adagrad(
      clipvalue=(-1.0, 2.0))
  assert tee.SGD(clip_gradient_max=0.5).clipvalue == (None, 0.5)
  assert optimizers.from_dict({"type": "adam", "clip_gradient_min": -3}).clipvalue == (
      -3.0, None)
  tf_opt = tf_optimizers.to_tf(tee.FTRL(clip_gradient_min=-0.25))
  assert (tf_opt.clip_gradient_min, tf_opt.clip_gradient_max) == (-0.25, None)
  with pytest.raises(tee.ConfigError) as info:
    optimizers.from_dict({"type": "sgd", "clipvalue": 1.0, "clip_gradient_max": 2.0})
  assert str(info.value) == (
      "clip_gradient_max: clipvalue=1.0 and clip_gradient_min=None / "
      "clip_gradient_max=2.0 both set gradient clipping. Fix: keep one form: "
      "clipvalue=(min, max), or the TPUEstimator-era clip_gradient_min / "
      "clip_gradient_max.")
  with pytest.raises(tee.ConfigTypeError) as info:
    tee.SGD(clip_gradient_min="low")
  assert str(info.value) == (
      "clip_gradient_min: clip_gradient_min must be a number or None, got str 'low'. "
      "Fix: write a number such as 1.0.")
  with pytest.raises(tee.ConfigError, match="clipvalue=\\(-1.0, None\\) needs gradient "
                                            "accumulation"):
    tee.Adagrad(clip_gradient_min=-1.0, use_gradient_accumulation=False)


def test_v1_gradient_clipping_in_specs_and_its_precedence():
  base = {"optimizer": {"type": "sgd", "learning_rate": 0.1, "clipvalue": 1.0},
          "tables": {"a": {"vocabulary_size": 4, "dim": 2},
                     "b": {"vocabulary_size": 4, "dim": 2,
                           "optimizer": {"clip_gradient_max": 0.5}},
                     "c": {"vocabulary_size": 4, "dim": 2,
                           "optimizer": {"clip_gradient_min": -1.0,
                                         "clipvalue": 2.0}}},
          "features": {t: {"table": t} for t in "abc"}}
  with pytest.raises(tee.ConfigError) as info:
    tee.EmbeddingSpec.from_dict(base)
  assert str(info.value).startswith(
      "tables.c.optimizer.clip_gradient_min: clipvalue=2.0 and clip_gradient_min=-1.0")
  del base["tables"]["c"], base["features"]["c"]
  spec = tee.EmbeddingSpec.from_dict(base)
  assert spec.optimizer_for("a").clipvalue == (-1.0, 1.0)
  # A table's v1 bound replaces the inherited clipvalue, as a clipvalue would.
  assert spec.optimizer_for("b").clipvalue == (None, 0.5)
  assert tee.EmbeddingSpec.from_dict(spec.to_dict()) == spec


def test_v1_gradient_clipping_trains_like_clipvalue():
  """Three Adagrad steps with clip_gradient_min/max against numpy."""
  table = api.TableConfig(4, 2, initializer=tf.constant_initializer(0.5), name="t")
  emb = tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")},
                         tee.Adagrad(learning_rate=0.1, clip_gradient_min=-0.3,
                                     clip_gradient_max=0.2))
  w, acc = np.full((4, 2), 0.5), np.full((4, 2), 0.1)
  grads = [np.array([[1.0, -1.0]]), np.array([[0.1, -0.05]]), np.array([[-2.0, 0.15]])]
  for g in grads:
    emb.enqueue({"f": tf.constant([[1]])}, training=True)
    emb.dequeue()
    emb.apply_gradients({"f": tf.constant(g, tf.float32)})
    w[1], slots = references.apply("adagrad", w[1], {"accumulators": acc[1]}, g[0],
                                   0.1, references.hparams("adagrad"),
                                   clipvalue=(-0.3, 0.2))
    acc[1] = slots["accumulators"]
  np.testing.assert_allclose(emb.variables["t"]["parameters"], w, rtol=1e-6)
  np.testing.assert_allclose(emb.variables["t"]["accumulators"], acc, rtol=1e-6)


# --- serving keeps training's shapes -------------------------------------------

class LookupModel(keras.Model):
  def __init__(self):
    super().__init__()
    table = api.TableConfig(6, 2, initializer=tf.constant_initializer(
        np.arange(12).reshape(6, 2)), combiner="sum", name="t")
    self.embedding = tee.EmbeddingLayer({"f": api.FeatureConfig(table, name="f")},
                                        api.SGD(0.1))

  def call(self, features):
    return self.embedding(features)["f"]


def test_serving_export_keeps_training_shapes(tmp_path):
  model = LookupModel()
  ids = tf.constant([[1], [4]], tf.int64)
  want = model({"f": ids})
  assert want.shape == (2, 2)  # TPUEmbedding: [B, 1] -> [B, dim].
  signature = {"f": tf.TensorSpec([None, 1], tf.int64, name="f")}
  # Dense [B, 1] ids straight to serving_embedding_lookup: [B, 1, dim].
  with pytest.raises(tee.ConfigError) as info:
    serving.export_for_serving(model, str(tmp_path / "a"), signature,
                               preprocess=lambda x: x)
  assert str(info.value).startswith(
      "serving output 'outputs' has shape [None, 1, 2], but the model computes "
      "[None, 2]: serving lookups shape dense ids of rank >= 2 as "
      "TPUEmbeddingForServing does")
  assert not (tmp_path / "a").exists()
  # The default preprocess makes [B, n] ids ragged: training's shapes and values.
  serving.export_for_serving(model, str(tmp_path / "b"), signature)
  out = tf.saved_model.load(str(tmp_path / "b")).signatures["serving_default"](f=ids)
  np.testing.assert_array_equal(out["outputs"], [[2, 3], [8, 9]])
  np.testing.assert_array_equal(want, [[2, 3], [8, 9]])


# --- engine="v2": TPUEmbeddingV2's rules where they differ -------------------------

def _v2(output_shape, combiner="sum", **kwargs):
  table = api.TableConfig(8, 4, initializer=tf.constant_initializer(SCENARIO_VIDEO),
                          combiner=combiner, name="video")
  return tee.CPUEmbedding(
      {"f": api.FeatureConfig(table, name="f", output_shape=output_shape, **kwargs)},
      api.SGD(0.1), engine="v2")


def test_v2_needs_output_shape_at_construction():
  """tpu_embedding_v3.py counts samples as prod(output_shape) when created."""
  for shape in (None, [None, 2]):
    with pytest.raises(ValueError) as info:
      _v2(shape)
    assert isinstance(info.value, tee.ConfigError)
    assert str(info.value).startswith(
        "feature 'f' (table 'video'): TPUEmbeddingV2 (SparseCore) needs a fully "
        "defined FeatureConfig.output_shape")


@pytest.mark.parametrize("mode", MODES)
def test_v2_shapes_come_from_output_shape(mode):
  ids = np.array([[1, 2], [3, 4]])
  emb = _v2([2, 2])  # Dense [B, k]: k samples per row, no trailing-1 rule.
  acts = mode(lambda: _lookup(emb, {"f": tf.constant(ids)}))()
  np.testing.assert_array_equal(acts["f"], SCENARIO_VIDEO[ids])
  # Weighted dense ids (v1 refuses them); a sequence length plays no part.
  for combiner, gain in (("sum", [0.5, 2.0]), ("mean", [1.0, 1.0]),
                         ("sqrtn", [1.0, 1.0])):
    emb = _v2([2], combiner, max_sequence_length=3)
    acts = mode(lambda: _lookup(emb, {"f": tf.constant([5, 6])},
                                {"f": tf.constant([0.5, 2.0])}))()
    np.testing.assert_allclose(acts["f"], SCENARIO_VIDEO[[5, 6]] * np.array(gain)[:, None])
    ragged = tf.ragged.constant([[1, 2], [3]], tf.int64)
    acts = mode(lambda: _lookup(emb, {"f": ragged}))()
    want = [SCENARIO_VIDEO[[1, 2]].sum(0), SCENARIO_VIDEO[3]]
    if combiner != "sum":
      want[0] = want[0] / (2 if combiner == "mean" else np.sqrt(2))
    np.testing.assert_allclose(acts["f"], want, rtol=1e-6)
  with pytest.raises(ValueError) as info:
    mode(lambda: _lookup(_v2([4]), {"f": tf.ragged.constant([[1], [2]], tf.int64)}))()
  assert str(info.value).startswith(
      "feature 'f' (table 'video'): 2 rows of ragged ids cannot fill the activation "
      "shape [4] (4 rows).")


# --- structure before the batch, optimizer=None ------------------------------------

STRUCTURE_FIRST = {
    # invalid_input_test.test_pass_different_structure_to_apply_gradients:
    # nothing enqueued, the structure is checked first (a TypeError).
    "list_for_tuple": (lambda emb: emb.apply_gradients([1, 2, 3]), TypeError,
                       "The two structures don't have the same nested structure. "
                       "gradients do not match the feature config's structure: the "
                       "feature config is a tuple, gradients a list."),
    # invalid_input_test.test_pass_non_tensor_to_apply_gradients (build(64) only).
    "non_tensor": (lambda emb: emb.apply_gradients((1, 2, 3)), ValueError,
                   "found non-tensor type: <class 'int'> at path 0. "
                   "feature '0' (table 'video'): gradient is a int, not a tf.Tensor."),
    # The built shapes are checked before the missing batch too.
    "shape": (lambda emb: emb.apply_gradients(
        (tf.ones([2, 4]), tf.ones([64, 4]), tf.ones([64, 2]))), ValueError,
              "feature '0' (table 'video'): gradient shape [2, 4] does not match its "
              "activation shape [64, 4]."),
    # A well-formed call with nothing enqueued names the missing batch.
    "no_batch": (lambda emb: emb.apply_gradients(
        (tf.ones([64, 4]), tf.ones([64, 4]), tf.ones([64, 2]))), ValueError,
                 "apply_gradients() called before enqueue()."),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(STRUCTURE_FIRST))
def test_apply_gradients_checks_the_structure_before_the_batch(case, mode):
  call, cls, message = STRUCTURE_FIRST[case]
  emb = _scenario_engine()
  emb.build(64)
  before = emb.variables["video"]["parameters"].numpy()
  with pytest.raises(cls) as info:
    mode(lambda: call(emb))()
  assert isinstance(info.value, tee.InputError)
  assert str(info.value).startswith(message), str(info.value)
  np.testing.assert_array_equal(emb.variables["video"]["parameters"], before)
  assert int(emb.step) == 0


LOOKUP_ONLY = (
    "{call} trains the tables, but table(s) {tables} have no optimizer (optimizer=None "
    "and no TableConfig.optimizer): the engine was made for lookups only, as "
    "TPUEmbeddingForServing, and TPUEmbedding under a TPUStrategy refuses to be "
    "created so. Fix: pass optimizer= to CPUEmbedding (or set TableConfig.optimizer "
    "of those tables), or enqueue with training=False for lookups.")


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_none_is_for_lookups_only(mode, tmp_path):
  """tpu_embedding_v2.py: off a TPU, optimizer=None creates no slots; the
  TPU refuses it. Lookups equal numpy; training calls say why and the fix."""
  trained = _scenario_engine(api.Adagrad(0.1))
  for _ in range(2):
    trained.enqueue(_ragged(), training=True)
    trained.apply_gradients(tuple(tf.ones_like(a) for a in trained.dequeue()))
  path = tf.train.Checkpoint(embedding=trained).save(str(tmp_path / "ckpt"))
  emb = tee.CPUEmbedding(scenario_features(), None)
  assert {k: sorted(v) for k, v in emb.variables.items()} == {
      "video": ["parameters"], "user": ["parameters"]}
  tf.train.Checkpoint(embedding=emb).restore(path).expect_partial()  # no slots
  video = trained.variables["video"]["parameters"].numpy()
  user = trained.variables["user"]["parameters"].numpy()
  np.testing.assert_array_equal(emb.variables["video"]["parameters"], video)
  acts = mode(lambda: _lookup(emb, _ragged()))()
  np.testing.assert_allclose(acts[0], [video[r].sum(0) for r in WATCHED], rtol=1e-6)
  np.testing.assert_allclose(acts[2], [user[r].mean(0) for r in FRIENDS], rtol=1e-6)
  np.testing.assert_allclose(mode(lambda: emb(_ragged()))()[1],
                             [video[r].sum(0) for r in FAVORITED], rtol=1e-6)
  with pytest.raises(ValueError) as info:
    mode(lambda: emb.enqueue(_ragged(), training=True))()
  assert str(info.value) == LOOKUP_ONLY.format(call="enqueue(training=True)",
                                               tables="['video', 'user']")
  with pytest.raises(ValueError) as info:
    mode(lambda: emb.apply_gradients(tuple(tf.ones([4, d]) for d in (4, 4, 2))))()
  assert str(info.value) == LOOKUP_ONLY.format(call="apply_gradients()",
                                               tables="['video', 'user']")
  np.testing.assert_array_equal(emb.variables["video"]["parameters"], video)
  assert int(emb.step) == 0


def test_optimizer_none_with_per_table_optimizers():
  """TPUEmbedding gives tables without an optimizer the global one (None): on a
  TPU every table must have one. Tables with their own train as numpy SGD; one
  table without makes the engine lookup-only, naming that table."""
  video, user = scenario_tables()
  video.optimizer = api.SGD(0.1)
  mixed = tee.CPUEmbedding((api.FeatureConfig(video), api.FeatureConfig(user)), None)
  assert sorted(mixed.variables["video"]) == ["parameters"]
  with pytest.raises(ValueError) as info:
    mixed.enqueue((tf.constant([0]), tf.constant([1])), training=True)
  assert str(info.value) == LOOKUP_ONLY.format(call="enqueue(training=True)",
                                               tables="['user']")
  user.optimizer = api.SGD(0.5)
  emb = tee.CPUEmbedding((api.FeatureConfig(video), api.FeatureConfig(user)), None)
  want_video, want_user = SCENARIO_VIDEO.copy(), SCENARIO_USER.copy()
  for step in range(3):
    ids = ([step % 8, (step + 2) % 8], [step, 15 - step])
    emb.enqueue(tuple(tf.constant(i) for i in ids), training=True)
    acts = emb.dequeue()
    np.testing.assert_allclose(acts[0], want_video[ids[0]], rtol=1e-6)
    emb.apply_gradients((tf.ones([2, 4]), tf.fill([2, 2], 2.0)))
    for i in ids[0]:
      want_video[i] -= 0.1
    for i in ids[1]:
      want_user[i] -= 0.5 * 2.0
  np.testing.assert_allclose(emb.variables["video"]["parameters"], want_video, rtol=1e-6)
  np.testing.assert_allclose(emb.variables["user"]["parameters"], want_user, rtol=1e-6)
