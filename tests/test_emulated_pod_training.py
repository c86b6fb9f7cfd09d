"""TPU embedding programs on an emulated pod slice (issue 45): 2 hosts of 2 cores.

A TPU program's input function shards its examples by ``input_pipeline_id``
and batches each host's share per replica; under ``emulate_tpu(replicas=4,
hosts=2)`` it trains ``TPUEmbedding`` (V1) and ``TPUEmbeddingV2``
(SparseCore) to the TPU's math written here in numpy over the same global
batches, formed as TensorFlow deals them: replica ``k*R + j`` (host ``k``,
``R`` = 2 cores per host) gets host ``k``'s element ``s*R + j`` at step ``s``.
Each host's pipeline is called once, with its own ``InputContext``.

The pod's checkpoints are one host's: the same keys and bytes as the program
trained on one host of 4 cores over the same global batches, restored on one
host and on CPU (TensorFlow's ``TPUEmbeddingForServing``), and back. On a pod
TensorFlow's ``TPUEmbedding`` initialises each table once per host shard
(``make_sharded_variable_creator``): the tables here use a sharding-aware
initializer, and a full-table ``tf.constant_initializer`` is refused on the
pod as TensorFlow refuses it.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.emulated_tpu import mid_level, pod
from tests import references
from tests import sparsecore_program as sc
from tests.builders import checkpoint_values
from tpu_embed_ext.sparsecore import checkpoint_layouts

api = tf.tpu.experimental.embedding
REPLICAS, HOSTS, PER_REPLICA, STEPS = 4, 2, 2, 3
GLOBAL = REPLICAS * PER_REPLICA
EXAMPLES = STEPS * GLOBAL
VIDEO, USER = (10, 4), (7, 2)  # (rows, dim): 7 rows split 4 + 3 over 2 hosts
SGD_LR, ADAGRAD_LR, ADAGRAD_INIT = 0.05, 0.1, 0.1
SC_PER_REPLICA = 4  # one example per SparseCore of a chip (4 per chip)
SC_GLOBAL = REPLICAS * SC_PER_REPLICA
SC_EXAMPLES = STEPS * SC_GLOBAL
NO_PREFETCH = tf.distribute.InputOptions(experimental_fetch_to_device=False)


def pod_order(hosts=HOSTS, per_replica=PER_REPLICA):
  """Dataset indices in the order of the global batches the pod trains on
  (``STEPS`` of ``per_replica`` examples per replica): host ``k`` reads
  examples ``k, k+H, ...`` (``shard``), replica ``k*R+j`` gets its element
  ``s*R+j`` at step ``s``."""
  n, per_host = STEPS * REPLICAS * per_replica, REPLICAS // hosts
  shard = [list(range(k, n, hosts)) for k in range(hosts)]
  element = lambda k, e: shard[k][e * per_replica:(e + 1) * per_replica]
  return [i for s in range(STEPS) for k in range(hosts) for j in range(per_host)
          for i in element(k, s * per_host + j)]


def test_pod_order_deals_hosts_shards_to_their_replicas():
  assert pod_order()[:GLOBAL] == [0, 2, 4, 6, 1, 3, 5, 7]
  assert pod_order()[GLOBAL:2 * GLOBAL] == [8, 10, 12, 14, 9, 11, 13, 15]
  assert pod_order(hosts=1) == list(range(EXAMPLES))
  assert pod_order(per_replica=SC_PER_REPLICA)[:8] == [0, 2, 4, 6, 8, 10, 12, 14]


def input_fn(dataset, contexts, global_batch=GLOBAL):
  """The TPU program's input function: its host's shard, per-replica batches."""
  def fn(ctx):
    contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id,
                     ctx.num_replicas_in_sync))
    return dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(
        ctx.get_per_replica_batch_size(global_batch), drop_remainder=True)
  return fn


def tpu_strategy():
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  return tf.distribute.TPUStrategy(resolver)


# --- TPUEmbedding (V1) ---------------------------------------------------------------

def _watched(e):
  return [(5 * e + 3 * j) % VIDEO[0] for j in range(1 + e % 3)]


def _friend(e):
  return (3 * e) % USER[0]


def _label(e):
  return (e % 4 - 1.5) / 2


INITIAL = {"video": 0.01 * (np.arange(VIDEO[0])[:, None] + 1)
                    - 0.02 * np.arange(VIDEO[1])[None, :],
           "user": 0.03 * (np.arange(USER[0])[:, None] % 5)
                   + 0.01 * np.arange(USER[1])[None, :]}


def sharded_initializer(full, shards):
  """A sharding-aware initializer (it takes ``shard_info``), as a pod needs:
  the rows of ``full`` a shard covers; records each shard's (offset, shape)."""
  def initializer(shape, dtype=None, shard_info=None):
    if shard_info is None:
      return tf.constant(full, dtype, shape)
    shards.append((shard_info.offset[0], tuple(shard_info.shape)))
    lo = shard_info.offset[0]
    return tf.constant(full[lo:lo + shard_info.shape[0]], dtype)
  return initializer


def v1_feature_config(shards=None, video_initializer=None):
  shards = [] if shards is None else shards
  video = api.TableConfig(
      VIDEO[0], VIDEO[1], name="video",
      initializer=video_initializer or sharded_initializer(INITIAL["video"], shards),
      optimizer=api.Adagrad(ADAGRAD_LR, initial_accumulator_value=ADAGRAD_INIT))
  user = api.TableConfig(USER[0], USER[1], name="user",
                         initializer=sharded_initializer(INITIAL["user"], shards))
  return {"watched": api.FeatureConfig(video, name="watched"),
          "friend": api.FeatureConfig(user, name="friend")}


def v1_dataset(order):
  """(features, label) per example, in the order ``order``."""
  return tf.data.Dataset.from_tensor_slices((
      {"watched": tf.ragged.constant([_watched(e) for e in order], tf.int64),
       "friend": tf.constant([_friend(e) for e in order], tf.int64)},
      (tf.constant([_label(e) for e in order], tf.float32),
       tf.constant(order, tf.int64))))


def v1_reference(order):
  """The TPU's math over the global batches of ``order``: per replica loss
  ``0.5 * sum((a - y)^2)`` per feature; each id's gradient summed over the
  global batch (video: mean combiner, each id gets ``(a - y) / n``); then
  one Adagrad step of video and one SGD step of user per step."""
  w = {n: t.astype(np.float64) for n, t in INITIAL.items()}
  acc = np.full(VIDEO, ADAGRAD_INIT)
  for s in range(len(order) // GLOBAL):
    g = {n: np.zeros_like(t) for n, t in w.items()}
    for e in order[s * GLOBAL:(s + 1) * GLOBAL]:
      ids, y = _watched(e), _label(e)
      a = w["video"][ids].mean(axis=0)
      for i in ids:
        g["video"][i] += (a - y) / len(ids)
      g["user"][_friend(e)] += w["user"][_friend(e)] - y
    w["video"], slots = references.update("adagrad", w["video"],
                                          {"accumulators": acc}, g["video"], ADAGRAD_LR)
    acc = slots["accumulators"]
    w["user"], _ = references.update("sgd", w["user"], {}, g["user"], SGD_LR)
  return w, acc


def v1_embedding(shards=None):
  return tf.tpu.experimental.embedding.TPUEmbedding(
      v1_feature_config(shards), optimizer=api.SGD(SGD_LR))


def v1_train(order, prefix, shards=None):
  """The mid-level loop on the active emulation over ``order``; writes a
  checkpoint at ``prefix``; returns (its path, the contexts, the embedding,
  the examples each step dealt to the replicas, in replica order)."""
  contexts, dealt = [], []
  strategy = tpu_strategy()
  with strategy.scope():
    embedding = v1_embedding(shards)
  iterator = iter(strategy.distribute_datasets_from_function(
      input_fn(v1_dataset(order), contexts), options=NO_PREFETCH))

  @tf.function
  def step(iterator):
    def tpu_step(labels, examples):
      with tf.GradientTape() as tape:
        activations = embedding.dequeue()
        tape.watch(activations)
        loss = sum(0.5 * tf.reduce_sum(tf.square(a - labels[:, None]))
                   for a in tf.nest.flatten(activations))
      embedding.apply_gradients(tape.gradient(loss, activations))
      return examples
    features, (labels, examples) = next(iterator)
    embedding.enqueue(features, training=True)
    return strategy.run(tpu_step, args=(labels, examples))

  for _ in range(STEPS):
    dealt.extend(np.concatenate([t.numpy() for t in strategy.experimental_local_results(
        step(iterator))]).tolist())
  return (tf.train.Checkpoint(embedding=embedding).write(prefix), contexts, embedding,
          dealt)


@pytest.fixture(scope="module")
def v1_pod(tmp_path_factory):
  """The program trained on the pod, its contexts, initializer shards and
  config proto's host counts, and the same program on one host of 4 cores."""
  out = tmp_path_factory.mktemp("v1")
  shards = []
  with tee.emulate_tpu(replicas=REPLICAS, hosts=HOSTS), warnings.catch_warnings(
      record=True) as caught:
    warnings.simplefilter("always", pod.DuplicateInputWarning)
    saved, contexts, embedding, dealt = v1_train(list(range(EXAMPLES)),
                                                 str(out / "pod"), shards)
    proto = embedding._create_config_proto()  # pylint: disable=protected-access
    hosts = (proto.num_hosts, proto.num_tensor_cores)
  with tee.emulate_tpu(replicas=REPLICAS, hosts=1):
    one_host, one_contexts, _, one_dealt = v1_train(pod_order(), str(out / "one"))
  return dict(saved=saved, contexts=contexts, shards=shards, hosts=hosts,
              duplicates=[w for w in caught
                          if issubclass(w.category, pod.DuplicateInputWarning)],
              dealt=dealt, one_dealt=one_dealt,
              one_host=one_host, one_contexts=one_contexts, dir=out)


def served_v1(path):
  """The tables of checkpoint ``path`` in TensorFlow's TPUEmbeddingForServing."""
  serving = api.TPUEmbeddingForServing(v1_feature_config(), api.SGD(SGD_LR))
  tf.train.Checkpoint(embedding=serving).restore(path).expect_partial()
  return {t.name: v.numpy() for t, v in serving.embedding_tables.items()}


def test_v1_program_on_a_pod_trains_to_the_reference(v1_pod):
  assert v1_pod["contexts"] == [(2, 0, 4), (2, 1, 4)]
  assert v1_pod["one_contexts"] == [(1, 0, 4)]
  assert not v1_pod["duplicates"]  # each host reads its own shard
  # Replica k*R+j got host k's element s*R+j: the pod's global batches.
  assert v1_pod["dealt"] == pod_order()
  assert v1_pod["one_dealt"] == pod_order()
  # TensorFlow's configuration of the engine counts the hosts.
  assert v1_pod["hosts"] == (HOSTS, REPLICAS)
  # Each table (and slot) initialised per host shard: 10 rows 5 + 5, 7 rows 4 + 3.
  assert sorted(set(v1_pod["shards"])) == [(0, (4, 2)), (0, (5, 4)),
                                           (4, (3, 2)), (5, (5, 4))]
  w, acc = v1_reference(pod_order())
  tables = served_v1(v1_pod["saved"])
  for name in w:
    assert not np.allclose(w[name], INITIAL[name]), name
    np.testing.assert_allclose(tables[name], w[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)
  np.testing.assert_allclose(
      checkpoint_values(v1_pod["saved"])[
          "embedding/video.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"],
      acc, rtol=1e-5)


def _assert_same_checkpoints(a, b):
  ours, theirs = checkpoint_values(a), checkpoint_values(b)
  assert sorted(ours) == sorted(theirs)
  for key in ours:
    assert np.asarray(ours[key]).tobytes() == np.asarray(theirs[key]).tobytes(), key


def test_v1_pod_checkpoint_is_one_hosts_and_restores_both_ways(v1_pod):
  out = v1_pod["dir"]
  # The same keys and bytes as one host trained on the same global batches.
  _assert_same_checkpoints(v1_pod["saved"], v1_pod["one_host"])
  assert "embedding/video/.ATTRIBUTES/VARIABLE_VALUE" in checkpoint_values(
      v1_pod["saved"])
  # Pod -> one host (restored before build), then one host -> pod.
  for hosts, source, name in ((1, v1_pod["saved"], "pod_on_one"),
                              (HOSTS, v1_pod["one_host"], "one_on_pod")):
    with tee.emulate_tpu(replicas=REPLICAS, hosts=hosts, xla=False):
      strategy = tpu_strategy()
      with strategy.scope():
        embedding = v1_embedding()
      tf.train.Checkpoint(embedding=embedding).restore(source)
      embedding.build(per_replica_batch_size=PER_REPLICA)
      written = tf.train.Checkpoint(embedding=embedding).write(str(out / name))
    _assert_same_checkpoints(written, source)


def test_host_rows_split_as_tensorflow_shards_a_table():
  # make_sharded_variable_creator: the first rows % H hosts one row more.
  assert mid_level.host_rows(7, 2) == [4, 3]
  assert mid_level.host_rows(10, 4) == [3, 3, 2, 2]
  assert mid_level.host_rows(1, 2) == [1, 0]  # host 1 holds no shard


def test_the_specs_initializers_make_one_hosts_table_on_a_pod():
  """tee.feature_config's initializers, called per host shard as a pod calls
  them (shard_info), give the rows of the table one host (or the CPU) makes
  from the same seed; a random initializer called per shard would not."""
  spec = tee.EmbeddingSpec.from_dict({
      "optimizer": {"type": "sgd", "learning_rate": 0.1},
      "tables": {"t": {"vocabulary_size": 7, "dim": 3}},
      "features": {"f": {"table": "t"}}})
  init = tee.feature_config(spec)["f"].table.initializer
  tf.random.set_seed(3)
  whole = init((7, 3), dtype=tf.float32).numpy()
  tf.random.set_seed(3)
  shards = [init((7, 3), dtype=tf.float32,
                 shard_info=trackable_base.ShardInfo((rows, 3), (offset, 0))).numpy()
            for rows, offset in ((4, 0), (3, 4))]
  np.testing.assert_array_equal(np.concatenate(shards), whole)
  assert np.std(whole) > 0 and not np.array_equal(shards[0][:3], shards[1])


def test_v1_full_table_constant_initializer_is_refused_on_a_pod_only():
  video = tf.constant_initializer(INITIAL["video"])  # not sharding aware
  with tee.emulate_tpu(replicas=REPLICAS, hosts=HOSTS, xla=False):
    strategy = tpu_strategy()
    with strategy.scope():
      embedding = api.TPUEmbedding(v1_feature_config(video_initializer=video),
                                   optimizer=api.SGD(SGD_LR))
    with pytest.raises(TypeError) as e:
      embedding.build(per_replica_batch_size=PER_REPLICA)
  assert isinstance(e.value, errors.ConfigTypeError)
  message = str(e.value)
  assert message.startswith("Eager execution of tf.constant with unsupported shape.")
  assert message.endswith(
      "has 40 elements, but got `shape` (5, 4) with 20 elements). (TPUEmbedding "
      "on a pod of 2 hosts creates table 'video' as one shard per host, rows "
      "[5, 5] of 10, and calls its initializer with each shard's shape, (5, 4) "
      "here: tpu_embedding_v2.make_sharded_variable_creator; one host calls it "
      "once with the whole shape.) Fix: an initializer for any shape (a scalar "
      "or random one), or one taking shard_info: def init(shape, dtype=None, "
      "shard_info=None) returning the rows shard_info.offset[0] to "
      "shard_info.offset[0] + shard_info.shape[0] of the table when shard_info "
      "is given.")
  with tee.emulate_tpu(replicas=REPLICAS, hosts=1, xla=False):
    strategy = tpu_strategy()
    with strategy.scope():
      embedding = api.TPUEmbedding(v1_feature_config(video_initializer=video),
                                   optimizer=api.SGD(SGD_LR))
    embedding.build(per_replica_batch_size=PER_REPLICA)
    np.testing.assert_allclose(embedding.variables["video"]["parameters"].numpy(),
                               INITIAL["video"], rtol=1e-6)


# --- TPUEmbeddingV2 (SparseCore) ----------------------------------------------------

def sc_examples():
  """Per example: a user id and 1-3 item ids (tests/sparsecore_program's tables)."""
  rng = np.random.RandomState(11)
  lengths = rng.randint(1, 4, SC_EXAMPLES)
  items = rng.randint(0, sc.VOCAB["item"], lengths.sum())
  starts = np.concatenate([[0], np.cumsum(lengths)])
  return (rng.randint(0, sc.VOCAB["user"], SC_EXAMPLES),
          [items[starts[e]:starts[e + 1]].tolist() for e in range(SC_EXAMPLES)])


def sc_dataset(order):
  users, items = sc_examples()
  return tf.data.Dataset.from_tensor_slices(
      {"user": tf.constant(users[order], tf.int64),
       "item": tf.ragged.constant([items[e] for e in order], tf.int64)})


def sc_global_batches(order):
  """``sparsecore_program``'s global batches (one per step) of ``order``."""
  users, items = sc_examples()
  out = []
  for s in range(len(order) // SC_GLOBAL):
    batch = order[s * SC_GLOBAL:(s + 1) * SC_GLOBAL]
    out.append({"user": users[batch],
                "item": (np.array([i for e in batch for i in items[e]], np.int64),
                         np.array([len(items[e]) for e in batch]))})
  return out


def sc_embedding():
  return api.TPUEmbeddingV2(sc.feature_config(SC_PER_REPLICA), None)


def sc_train(order, prefix):
  """A SparseCore loop on the active emulation over ``order``; returns (the
  checkpoint written at ``prefix``, the contexts, strategy, embedding)."""
  contexts = []
  strategy = tpu_strategy()
  with strategy.scope():
    embedding = sc_embedding()
  iterator = iter(strategy.distribute_datasets_from_function(
      input_fn(sc_dataset(order), contexts, SC_GLOBAL), options=NO_PREFETCH))

  @tf.function
  def step(iterator):
    def replica_step(features):
      activations, preserved = embedding.embedding_lookup(features)
      embedding.apply_gradients(sc.gradients(activations), preserved)
    strategy.run(replica_step, args=(next(iterator),))

  for _ in range(STEPS):
    step(iterator)
  return (tf.train.Checkpoint(embedding=embedding).write(prefix), contexts,
          strategy, embedding)


@pytest.fixture(scope="module")
def sc_pod(tmp_path_factory):
  """The SparseCore program on the 2x2 pod and on one host of 4 chips."""
  out = tmp_path_factory.mktemp("sparsecore")
  with tee.emulate_tpu(replicas=REPLICAS, hosts=HOSTS, sparsecore=True) as emulation:
    saved, contexts, strategy, embedding = sc_train(list(range(SC_EXAMPLES)),
                                                    str(out / "pod"))
    pod = dict(topology=emulation.topology.name, num_hosts=strategy.extended.num_hosts,
               per_chip=embedding._num_sc_per_chip,  # pylint: disable=protected-access
               tables={n: {s: v.numpy() for s, v in embedding.table_variables(n).items()}
                       for n in sc.VOCAB})
  with tee.emulate_tpu(replicas=REPLICAS, sparsecore=True):
    one_host, one_contexts, _, _ = sc_train(pod_order(per_replica=SC_PER_REPLICA), str(out / "one"))
  return dict(pod, saved=saved, contexts=contexts, one_host=one_host,
              one_contexts=one_contexts, dir=out)


def test_sparsecore_program_on_a_pod_trains_to_the_reference(sc_pod):
  assert sc_pod["contexts"] == [(2, 0, 4), (2, 1, 4)]
  assert sc_pod["one_contexts"] == [(1, 0, 4)]
  assert (sc_pod["topology"], sc_pod["num_hosts"], sc_pod["per_chip"]) == (
      f"v5p:{REPLICAS}", HOSTS, 4)
  params, acc = sc.numpy_reference(sc_global_batches(pod_order(per_replica=SC_PER_REPLICA)))
  for name in sc.VOCAB:
    assert not np.allclose(params[name], sc.initial(name)), name
    np.testing.assert_allclose(sc_pod["tables"][name]["parameters"], params[name],
                               rtol=2e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(sc_pod["tables"][name]["accumulators"], acc[name],
                               rtol=2e-5, err_msg=name)
  # On CPU: TensorFlow's TPUEmbeddingForServing reads the stacked checkpoint.
  serving = api.TPUEmbeddingForServing(sc.feature_config(SC_PER_REPLICA), api.Adagrad(sc.LR))
  tf.train.Checkpoint(embedding=serving).restore(sc_pod["saved"])
  serving.build()
  for table, var in serving.embedding_tables.items():
    np.testing.assert_array_equal(var.numpy(), sc_pod["tables"][table.name]["parameters"])


def test_sparsecore_pod_checkpoint_is_one_hosts_and_restores_both_ways(sc_pod):
  # Stacked over every SparseCore of every chip of both hosts: 4 chips x 4,
  # the layout and bytes of one host of 4 chips on the same global batches.
  layouts = checkpoint_layouts(sc_pod["saved"])
  assert {l.stack for l in layouts} == {"item_user"}
  assert {l.num_sparse_cores for l in layouts} == {REPLICAS * 4}
  assert layouts == checkpoint_layouts(sc_pod["one_host"])
  _assert_same_checkpoints(sc_pod["saved"], sc_pod["one_host"])
  for hosts, source, name in ((1, sc_pod["saved"], "pod_on_one"),
                              (HOSTS, sc_pod["one_host"], "one_on_pod")):
    with tee.emulate_tpu(replicas=REPLICAS, hosts=hosts, sparsecore=True, xla=False):
      strategy = tpu_strategy()
      with strategy.scope():
        embedding = sc_embedding()
      tf.train.Checkpoint(embedding=embedding).restore(source)
      embedding.build()
      written = tf.train.Checkpoint(embedding=embedding).write(str(sc_pod["dir"] / name))
    _assert_same_checkpoints(written, source)
