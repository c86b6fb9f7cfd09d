"""The emulated pod's inputs (``emulate_tpu(hosts=H)``, issue 45) against
TensorFlow's own ``input_lib``.

The oracle is built outside any emulation, from TensorFlow's pieces alone:
``input_lib.InputWorkers`` with the emulation's (host, cores) pairs, a plain
``MirroredStrategy`` over the same logical CPU devices, and
``input_util.get_distributed_dataset`` /
``get_distributed_datasets_from_function``, which clone, rebatch and
auto-shard (or call the input function with each host's ``InputContext``).
Each host's resulting dataset (``_cloned_datasets[k]`` / ``_datasets[k]``)
is read with a plain ``for`` loop, never through a ``MultiDeviceIterator``,
and element j of host k is dealt to replica k*R + j % R, as TensorFlow's
``MultiDeviceIterator`` deals; a replica without an element gets
``input_lib._dummy_tensor_fn``'s empty batch while any replica has data
(partial batch handling, when ``input_lib`` enables it for that dataset).
Outside the emulation nothing is patched (no ``HostIterator``, TensorFlow's
``get_host_for_device``), so the reference shares no code with what it
checks: the emulated ``TPUStrategy`` (``device_datasets.HostIterator``,
``pod.py``) must give every replica the same values, step by step, to the
end of the data. Eagerly, each value must also be on its replica's core (or
its host's CPU without fetching to the device); a ``tf.function``'s outputs
carry the call's device, so only values are compared there. (The emulated
host datasets run without tf.data autotuning: the same elements, in order.)

Conftest gives the session 8 logical CPU devices; each test enters its own
``emulate_tpu`` over the first ``replicas`` of them.
"""

import itertools
import warnings

import pytest
import tensorflow as tf
from tensorflow.python.distribute import (device_util, distribute_lib, input_lib,
                                          input_util)

from tpu_embed_ext import errors
from tpu_embed_ext.emulated_tpu import pod, session
from tpu_embed_ext.emulated_tpu import strategy as strategy_lib

emulate_tpu = session.emulate_tpu
Policy = tf.data.experimental.AutoShardPolicy
SHAPES = [(2, 2), (2, 4)]  # (hosts, replicas per host)


@pytest.fixture(autouse=True)
def _own_emulations():
  if session.is_active():
    pytest.skip("enters its own emulate_tpu(replicas=..., hosts=...) shapes; "
                "run without --emulate-tpu")


def _devices(replicas):
  return [device_util.canonicalize(d) for d in strategy_lib.logical_devices(replicas)]


def _pairs(hosts, replicas):
  """Host k: CPU k*R, feeding cores k*R .. k*R+R-1 (the emulation's layout)."""
  devices, per_host = _devices(replicas), replicas // hosts
  return [(devices[k * per_host], tuple(devices[k * per_host:(k + 1) * per_host]))
          for k in range(hosts)]


def _tpu_strategy():
  return tf.distribute.TPUStrategy(
      tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))


def _plain(element):
  return tuple((t.dtype.name, tuple(t.shape), t.numpy().tolist())
               for t in tf.nest.flatten(element, expand_composites=True))


# --- the pipelines: (how, make(replicas, tmp_path) -> dataset or input fn, options)

def _with_policy(dataset, policy):
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = policy
  return dataset.with_options(options)


def _slices(replicas, _):
  """AUTO on from_tensor_slices (no files: DATA); 5 * N + 3 examples in
  global batches of N + N // 2 + 1 (not divisible by N): a partial last."""
  n = 5 * replicas + 3
  return tf.data.Dataset.from_tensor_slices(
      {"x": tf.range(n, dtype=tf.int64), "y": tf.range(n, dtype=tf.float32) / 2}
  ).batch(replicas + replicas // 2 + 1)


def _ranges(policy):
  def make(replicas, _):
    return _with_policy(tf.data.Dataset.range(4 * replicas + 1).map(
        lambda x: {"x": x}).batch(2 * replicas - 1), policy)
  return make


def _files(static):
  """FILE: 4 TFRecord files (each host reads its own), in global batches of
  N + 2 (partial), or ``static``: of 2N, drop_remainder, host 0's files
  longer (statically shaped: no partial batch handling, the steps end with
  the first replica's data)."""
  def make(replicas, tmp_path):
    paths = [str(tmp_path / f"part-{f}.tfrecord") for f in range(4)]
    for f, path in enumerate(paths):
      with tf.io.TFRecordWriter(path) as writer:
        for i in range(3 * replicas // 2 + 1 + (replicas * (f % 2 == 0) if static else 0)):
          writer.write(str(f * 100 + i).encode())
    dataset = tf.data.TFRecordDataset(paths).map(
        lambda r: {"x": tf.strings.to_number(r, tf.int64)})
    return _with_policy(dataset.batch(2 * replicas if static else replicas + 2,
                                      drop_remainder=static), Policy.FILE)
  return make


def _input_fn(replicas, _):
  def fn(context):
    return tf.data.Dataset.range(6 * replicas + 3).shard(
        context.num_input_pipelines, context.input_pipeline_id).map(
            lambda x: {"x": x}).batch(context.get_per_replica_batch_size(2 * replicas))
  return fn


NO_FETCH = tf.distribute.InputOptions(experimental_fetch_to_device=False)
CASES = {
    "auto": ("dataset", _slices, None),
    "data": ("dataset", _ranges(Policy.DATA), None),
    "off": ("dataset", _ranges(Policy.OFF), None),
    "file": ("dataset", _files(False), None),
    "static": ("dataset", _files(True), None),
    "function": ("function", _input_fn, None),
    "no_fetch": ("dataset", _slices, NO_FETCH),
}


def _distributed(strategy, how, made, options):
  if how == "dataset":
    return strategy.experimental_distribute_dataset(made, options=options)
  return strategy.distribute_datasets_from_function(made, options=options)


def _oracle(hosts, replicas, case, tmp_path):
  """Per step, per replica: (value, device) by TensorFlow's input_lib (module
  docstring), outside the emulation."""
  assert not session.is_active()
  how, make, options = CASES[case]
  pairs = _pairs(hosts, replicas)
  mirrored = tf.distribute.MirroredStrategy(
      [d for _, cores in pairs for d in cores],
      cross_device_ops=tf.distribute.ReductionToOneDevice())
  workers, made = input_lib.InputWorkers(pairs), make(replicas, tmp_path)
  if how == "dataset":
    distributed = input_util.get_distributed_dataset(
        made, workers, mirrored, num_replicas_in_sync=replicas, options=options)
    datasets = distributed._cloned_datasets  # pylint: disable=protected-access
  else:
    distributed = input_util.get_distributed_datasets_from_function(
        made, workers, [distribute_lib.InputContext(hosts, k, replicas)
                        for k in range(hosts)], mirrored, options=options)
    datasets = distributed._datasets  # pylint: disable=protected-access
  per_host = replicas // hosts
  fed = [[] for _ in range(replicas)]
  for k, dataset in enumerate(datasets):
    for j, element in enumerate(dataset):  # A plain iterator: no dealing by TF.
      fed[k * per_host + j % per_host].append(_plain(element))
  empty = [_plain(input_lib._dummy_tensor_fn(d.element_spec)) for d in datasets]  # pylint: disable=protected-access
  partial = distributed._enable_get_next_as_optional  # pylint: disable=protected-access
  steps = max(map(len, fed)) if partial else min(map(len, fed))
  fetch = options is None or options.experimental_fetch_to_device
  return [[(fed[r][s] if s < len(fed[r]) else empty[r // per_host],
            pairs[r // per_host][1][r % per_host] if fetch else pairs[r // per_host][0])
           for r in range(replicas)] for s in range(steps)]


def _emulated(hosts, replicas, case, tmp_path, read):
  """The emulated TPUStrategy's steps to the end of the data: ``read``
  "eager" (next), "function" (next in a tf.function) or "optional"
  (get_next_as_optional in a tf.function)."""
  how, make, options = CASES[case]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", pod.DuplicateInputWarning)  # "off": tested below.
    with emulate_tpu(replicas=replicas, hosts=hosts, xla=False):
      strategy = _tpu_strategy()
      iterator = iter(_distributed(strategy, how, make(replicas, tmp_path), options))
      step = tf.function(lambda it: next(it))
      optional = tf.function(lambda it: it.get_next_as_optional())
      seen = []
      while True:
        try:
          if read == "eager":
            value = next(iterator)
          elif read == "function":
            value = step(iterator)
          else:
            value = optional(iterator)
            if not value.has_value():
              break
            value = value.get_value()
        except (StopIteration, tf.errors.OutOfRangeError):
          break
        seen.append([(_plain(v), _device(v) if read == "eager" else None)
                     for v in _per_replica(strategy, value)])
      if read == "eager":
        with pytest.raises(StopIteration):  # And stays at the end.
          next(iterator)
  return seen


def _device(value):
  devices = {device_util.canonicalize(t.device)
             for t in tf.nest.flatten(value, expand_composites=True)}
  return devices.pop() if len(devices) == 1 else tuple(sorted(devices))


def _per_replica(strategy, value):
  """Replica r's whole element (every component)."""
  flat = [strategy.experimental_local_results(v)
          for v in tf.nest.flatten(value, expand_composites=False)]
  return [tf.nest.pack_sequence_as(value, [f[r] for f in flat])
          for r in range(len(flat[0]))]


@pytest.mark.parametrize("hosts, per_host, case", [
    (h, r, case) for h, r in SHAPES for case in CASES] + [
        (1, 4, case) for case in ("auto", "function", "no_fetch")])
def test_each_replica_gets_what_input_lib_deals_it(hosts, per_host, case, tmp_path):
  """Eagerly, to StopIteration: values and devices as TensorFlow's input_lib."""
  replicas = hosts * per_host
  expected = _oracle(hosts, replicas, case, tmp_path)
  assert _emulated(hosts, replicas, case, tmp_path, "eager") == expected
  xs = [x for step in expected for (value, _) in step for x in value[0][2]]
  assert len(xs) >= 2 * replicas  # Not vacuous: data reached the replicas,
  assert len(xs) == len(set(xs)) * (2 if case == "off" else 1)  # once (OFF: per host),
  if case == "static":  # and a static shape's steps end with the first host's data.
    assert len(xs) < 4 * (3 * replicas // 2 + 1) + 2 * replicas


@pytest.mark.parametrize("hosts, per_host", SHAPES)
@pytest.mark.parametrize("read", ["function", "optional"])
@pytest.mark.parametrize("case", ["auto", "function"])
def test_in_a_function_each_replica_gets_what_input_lib_deals_it(
    hosts, per_host, read, case, tmp_path):
  """next(iterator) and get_next_as_optional inside a tf.function, to the
  end of the data (OutOfRangeError / an empty optional)."""
  replicas = hosts * per_host
  expected = [[(value, None) for value, _ in step]
              for step in _oracle(hosts, replicas, case, tmp_path)]
  assert any(v[0][1][0] == 0 for step in expected for v, _ in step)  # A partial step.
  assert _emulated(hosts, replicas, case, tmp_path, read) == expected


@pytest.mark.parametrize("hosts, per_host", SHAPES)
def test_a_for_loop_in_a_function_reads_what_input_lib_deals(hosts, per_host, tmp_path):
  """``for x in distributed`` inside a tf.function (autograph's loop over
  the iterator made in the function): every replica's sum and the steps."""
  replicas = hosts * per_host
  expected = _oracle(hosts, replicas, "function", tmp_path)
  with emulate_tpu(replicas=replicas, hosts=hosts, xla=False):
    strategy = _tpu_strategy()
    distributed = strategy.distribute_datasets_from_function(
        _input_fn(replicas, tmp_path))

    @tf.function
    def loop():
      total, steps = tf.zeros([replicas], tf.int64), tf.constant(0)
      for x in distributed:
        total += tf.stack([tf.reduce_sum(v) for v in
                           strategy.experimental_local_results(x["x"])])
        steps += 1
      return total, steps

    total, steps = loop()
  assert int(steps) == len(expected)
  assert total.numpy().tolist() == [
      sum(sum(step[r][0][0][2]) for step in expected) for r in range(replicas)]


# --- facts of the pod ------------------------------------------------------------------

@pytest.mark.parametrize("hosts, per_host", SHAPES + [(1, 4)])
def test_a_pod_is_hosts_of_input_workers(hosts, per_host):
  """H input workers of R cores each, as TPUStrategy on a pod slice; at one
  host (hosts not given) what it was before pods: one worker of all."""
  replicas = hosts * per_host
  devices = _devices(replicas)
  cpus = [devices[k * per_host] for k in range(hosts)]
  contexts = []

  def fn(context):
    contexts.append((context.num_input_pipelines, context.input_pipeline_id,
                     context.num_replicas_in_sync))
    return tf.data.Dataset.range(8 * replicas).shard(
        context.num_input_pipelines, context.input_pipeline_id).batch(2)

  with emulate_tpu(replicas=replicas, hosts=None if hosts == 1 else hosts,
                   xla=False) as emulation:
    assert (emulation.hosts, emulation.replicas_per_host) == (hosts, per_host)
    assert list(emulation.host_devices) == cpus
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
    tf.config.experimental_connect_to_cluster(resolver)
    topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    assert (topology.num_tasks, topology.num_tpus_per_task) == (hosts, per_host)
    assert [(topology.task_ordinal_at_coordinates([r, 0, 0, 0]),
             topology.tpu_device_ordinal_at_coordinates([r, 0, 0, 0]))
            for r in range(replicas)] == [divmod(r, per_host) for r in range(replicas)]
    metadata = resolver.get_tpu_system_metadata()
    assert (metadata.num_cores, metadata.num_hosts,
            metadata.num_of_cores_per_host) == (replicas, hosts, per_host)
    assert resolver.num_accelerators() == {"TPU": per_host}
    strategy = tf.distribute.TPUStrategy(resolver)
    extended = strategy.extended
    assert strategy.num_replicas_in_sync == replicas
    assert (extended.num_hosts, extended.num_replicas_per_host) == (hosts, per_host)
    workers = extended._input_workers  # pylint: disable=protected-access
    assert workers.num_workers == hosts and list(workers.worker_devices) == cpus
    assert [list(workers.compute_devices_for_worker(k)) for k in range(hosts)] == [
        devices[k * per_host:(k + 1) * per_host] for k in range(hosts)]
    assert [device_util.get_host_for_device(d) for d in extended.worker_devices] == [
        cpus[r // per_host] for r in range(replicas)]
    from_fn = strategy.distribute_datasets_from_function(fn)
    assert contexts == [(hosts, k, replicas) for k in range(hosts)]
    assert [device_util.canonicalize(d._variant_tensor.device)  # pylint: disable=protected-access
            for d in from_fn._datasets] == cpus  # pylint: disable=protected-access
    cloned = strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(8 * replicas).batch(2 * replicas))
    assert [device_util.canonicalize(d._variant_tensor.device)  # pylint: disable=protected-access
            for d in cloned._cloned_datasets] == cpus  # pylint: disable=protected-access
  # Outside the emulation, TensorFlow's answer: the task's CPU:0.
  assert device_util.get_host_for_device(devices[-1]) == devices[0]


def test_hosts_1_is_the_default():
  with emulate_tpu(replicas=4, hosts=1, xla=False) as emulation:
    assert (emulation.hosts, emulation.replicas_per_host) == (1, 4)
    assert emulation.host_devices == (_devices(4)[0],)
    extended = _tpu_strategy().extended
    assert (extended.num_hosts, extended.num_replicas_per_host) == (1, 4)
    assert extended._input_workers_devices == ((_devices(4)[0], tuple(_devices(4))),)  # pylint: disable=protected-access


# --- TensorFlow's errors -------------------------------------------------------------

def test_a_global_batch_not_divisible_by_the_replicas_is_tensorflows_error():
  words = "The `global_batch_size` 10 is not divisible by `num_replicas_in_sync` 8 "
  with pytest.raises(ValueError) as tensorflows:
    distribute_lib.InputContext(2, 0, 8).get_per_replica_batch_size(10)
  assert str(tensorflows.value) == words
  with emulate_tpu(replicas=8, hosts=2, xla=False):
    strategy = _tpu_strategy()
    with pytest.raises(ValueError) as e:
      strategy.distribute_datasets_from_function(
          lambda c: tf.data.Dataset.range(40).batch(c.get_per_replica_batch_size(10)))
  assert str(e.value) == words


def test_replicas_not_a_multiple_of_hosts_is_refused_in_tensorflows_words():
  tensorflows = ("tf.distribute expects every worker to have the same number of "
                 "replicas. However, encountered `num_replicas_in_sync` (6) that "
                 "cannot be divided by `num_workers` (4)")
  with pytest.raises(ValueError) as e:  # TensorFlow's own, for its workers.
    input_lib.DistributedDataset._make_rebatch_fn(  # pylint: disable=protected-access
        None, tf.data.Dataset.range(8).batch(6), 4, 6)
  assert str(e.value) == tensorflows
  with pytest.raises(errors.ConfigError) as e:
    with emulate_tpu(replicas=6, hosts=4):
      pass
  assert str(e.value) == tensorflows + (
      ". (emulate_tpu(replicas=6, hosts=4): a pod's hosts feed as many cores "
      "each.) Fix: replicas a multiple of hosts, e.g. replicas=4 with hosts=4.")
  assert not session.is_active()


def test_hosts_other_than_the_topologys_are_refused_naming_both():
  with pytest.raises(errors.ConfigError) as e:
    with emulate_tpu(topology="v5p:8", hosts=1):
      pass
  assert str(e.value) == (
      "emulate_tpu topology 'v5p:8' has 2 hosts (4 replicas each, as Cloud "
      "TPU's VMs hold them) but hosts=1. Fix: leave hosts out (the topology "
      "implies 2), or give replicas=8 and hosts=1 without a topology.")
  assert not session.is_active()


# --- hosts reading the same examples -------------------------------------------------

def _duplicate_warnings(distribute):
  """The DuplicateInputWarnings of ``distribute(strategy)`` at 2 hosts x 2,
  and its first step's values per replica."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with emulate_tpu(replicas=4, hosts=2, xla=False):
      strategy = _tpu_strategy()
      distributed = distribute(strategy)
      first = [v.numpy().tolist() for v in strategy.experimental_local_results(
          next(iter(distributed)))]
  return [w for w in caught if issubclass(w.category, pod.DuplicateInputWarning)], first


def test_an_input_fn_ignoring_its_context_is_warned_once_naming_the_hosts():
  caught, first = _duplicate_warnings(lambda s: s.distribute_datasets_from_function(
      lambda context: tf.data.Dataset.range(32).batch(2)))
  assert first == [[0, 1], [2, 3], [0, 1], [2, 3]]  # What a pod would train on.
  assert len(caught) == 1
  assert caught[0].filename == __file__  # The caller's line.
  devices = _devices(4)
  assert str(caught[0].message) == (
      f"host 0 ({devices[0]}) and host 1 ({devices[2]}) of 2 input pipelines "
      "yield the same first batch: every host reads the same examples, which a "
      "TPU pod trains on silently (each example counted once per host). Fix: "
      "shard by the input context in the input function, e.g. dataset.shard("
      "input_context.num_input_pipelines, input_context.input_pipeline_id), or "
      "give each host its own files.")


def test_a_sharded_input_fn_is_not_warned():
  caught, first = _duplicate_warnings(lambda s: s.distribute_datasets_from_function(
      lambda c: tf.data.Dataset.range(32).shard(
          c.num_input_pipelines, c.input_pipeline_id).batch(2)))
  assert caught == [] and first == [[0, 2], [4, 6], [1, 3], [5, 7]]


@pytest.mark.parametrize("policy, warned", [(Policy.OFF, True), (Policy.DATA, False)])
def test_a_distributed_dataset_is_warned_when_not_sharded(policy, warned):
  caught, first = _duplicate_warnings(lambda s: s.experimental_distribute_dataset(
      _with_policy(tf.data.Dataset.range(32).batch(8), policy)))
  assert len(caught) == int(warned)
  if warned:
    assert caught[0].filename == __file__
  assert first == ([[0, 1], [2, 3], [0, 1], [2, 3]] if warned
                   else [[0, 1], [4, 5], [2, 3], [6, 7]])


def test_a_generator_is_not_read_ahead():
  """A Python generator's dataset is not peeked: reading it would advance
  the generator, and replica 0 would not get its first element."""
  counter = itertools.count()

  def generator():
    while True:
      yield [next(counter)]

  caught, first = _duplicate_warnings(lambda s: s.distribute_datasets_from_function(
      lambda context: tf.data.Dataset.from_generator(
          generator, output_signature=tf.TensorSpec([1], tf.int64))))
  assert caught == []
  assert first[0] == [0]
  assert sorted(first) == [[0], [1], [2], [3]]
