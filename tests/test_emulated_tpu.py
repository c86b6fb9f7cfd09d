"""The emulated TPU (tpu_embed_ext/emulated_tpu/): patching, system, strategy.

The session has 8 logical CPU devices (conftest.py); each test enters its own
``emulate_tpu`` over the first ``replicas`` of them.
"""

import importlib
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import device_util, tpu_strategy
from tensorflow.python.distribute.cluster_resolver.tpu import (
    tpu_cluster_resolver as real_resolver_lib)

from tpu_embed_ext import emulated_tpu, errors
from tpu_embed_ext.emulated_tpu import patching
from tpu_embed_ext.emulated_tpu import strategy as strategy_lib
from tests import references

emulate_tpu = emulated_tpu.emulate_tpu


def _originals():
  return {key: getattr(importlib.import_module(module), attribute)
          for key, (module, attribute) in patching.ORIGINALS.items()}


def _current(row):
  return getattr(importlib.import_module(row.module), row.attribute)


def _assert_unpatched():
  originals = _originals()
  for row in patching.PATCHES:
    assert _current(row) is originals[row.original], row


# --- patching ------------------------------------------------------------------

def test_nothing_is_patched_unless_asked():
  _assert_unpatched()
  assert not emulated_tpu.is_active() and emulated_tpu.current() is None


def test_patch_table_covers_every_alias():
  """No module under tensorflow holds a TPU entry point the table misses."""
  import tensorflow.python.tpu.tpu_embedding_v3  # pylint: disable=unused-import
  wanted = {id(obj): key for key, obj in _originals().items()}
  table = {(row.module, row.attribute) for row in patching.PATCHES}
  found = set()
  for name, module in list(sys.modules.items()):
    if not name.startswith("tensorflow") or module is None:
      continue
    for attribute, value in list(vars(module).items()):
      if id(value) in wanted:
        found.add((name, attribute))
  assert found - table == set()
  assert table - found == set()


def test_inside_every_name_is_the_emulations_and_restored_by_identity():
  originals = _originals()
  with emulate_tpu(replicas=2) as emulation:
    assert emulated_tpu.current() is emulation and emulated_tpu.is_active()
    for row in patching.PATCHES:
      assert _current(row) is not originals[row.original], row
    assert tf.distribute.TPUStrategy is strategy_lib.EmulatedTPUStrategy
    assert (tf.distribute.experimental.TPUStrategy
            is strategy_lib.EmulatedExperimentalTPUStrategy)
    from tensorflow.python.distribute.cluster_resolver import tpu_cluster_resolver
    assert (tpu_cluster_resolver.TPUClusterResolver
            is tf.distribute.cluster_resolver.TPUClusterResolver
            is real_resolver_lib.TPUClusterResolver
            is strategy_lib.EmulatedTPUClusterResolver)
  _assert_unpatched()
  assert emulated_tpu.current() is None


def test_restored_on_exception():
  with pytest.raises(KeyError, match="inside"):
    with emulate_tpu(replicas=2):
      raise KeyError("inside")
  _assert_unpatched()
  with emulate_tpu(replicas=1):  # And it can be entered again.
    pass


def test_a_failed_entry_patches_nothing(monkeypatch):
  broken = patching.Patch("tpu_embed_ext.no_such_module", "X",
                          "strategy:EmulatedTPUStrategy", "TPUStrategyV2")
  monkeypatch.setattr(patching, "PATCHES", patching.PATCHES + (broken,))
  with pytest.raises(ModuleNotFoundError, match="no_such_module"):
    with emulate_tpu(replicas=2):
      pass
  monkeypatch.undo()
  _assert_unpatched()
  assert not emulated_tpu.is_active()
  assert patching._saved == {}  # pylint: disable=protected-access


def test_nested_entry_refused():
  with emulate_tpu(replicas=2):
    with pytest.raises(emulated_tpu.EmulationError) as e:
      with emulate_tpu(replicas=4):
        pass
    assert str(e.value) == (
        "emulate_tpu(replicas=4) entered while emulate_tpu(replicas=2) is active: "
        "nested or concurrent emulations are refused, as the patched TensorFlow "
        "names are shared by the whole process. Fix: leave the first emulate_tpu "
        "before entering another.")
    assert tf.distribute.TPUStrategy is strategy_lib.EmulatedTPUStrategy
  _assert_unpatched()


def test_concurrent_entry_refused():
  refused = []

  def enter():
    try:
      with emulate_tpu(replicas=1):
        pass
    except emulated_tpu.EmulationError as e:
      refused.append(e)

  with emulate_tpu(replicas=2):
    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert tf.distribute.TPUStrategy is strategy_lib.EmulatedTPUStrategy
  assert len(refused) == 1 and "nested or concurrent" in str(refused[0])
  _assert_unpatched()


def test_too_few_logical_devices():
  with pytest.raises(emulated_tpu.EmulationError) as e:
    with emulate_tpu(replicas=9):
      pass
  assert str(e.value) == (
      "emulate_tpu(replicas=9) needs 9 logical CPU devices, but TensorFlow is "
      "already initialised with 8 and cannot add more. Fix: enter emulate_tpu "
      "before any TensorFlow op runs, or run the program with `python -m "
      "tpu_embed_ext emulate --replicas 9 SCRIPT`, or its tests with `pytest "
      "--emulate-tpu=9`, which set the devices up first.")
  _assert_unpatched()
  assert not emulated_tpu.is_active()


@pytest.mark.parametrize("kwargs, message", [
    ({"replicas": 0}, "emulate_tpu needs a positive integer replicas, got "
     "replicas=0. Fix: e.g. replicas=8 (one per TPU core)."),
    ({"replicas": 2, "sparsecore": "yes"},
     "emulate_tpu sparsecore must be True or False, got sparsecore='yes'."),
    ({"replicas": 2, "topology": "v5p:4"},
     "emulate_tpu topology 'v5p:4' has 4 chips but replicas=2: a TPU runs one "
     "replica per chip. Fix: replicas=4, or a topology of 2 chips."),
])
def test_bad_arguments(kwargs, message):
  with pytest.raises(errors.ConfigError) as e:
    with emulate_tpu(**kwargs):
      pass
  assert str(e.value) == message
  _assert_unpatched()


def test_used_outside_the_emulation():
  with pytest.raises(emulated_tpu.EmulationError,
                     match=r"^the emulated TPUStrategy was used outside "
                     r"emulate_tpu: .* Fix: create it inside"):
    strategy_lib.EmulatedTPUStrategy()


def test_importing_the_package_is_cheap():
  code = ("import sys, tpu_embed_ext\n"
          "from tpu_embed_ext import emulated_tpu\n"
          "assert tpu_embed_ext.emulate_tpu is emulated_tpu.emulate_tpu\n"
          "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=False)
  assert out.returncode == 0, out.stderr


# --- the TPU system ----------------------------------------------------------------

def test_resolver_initialize_and_topology():
  with emulate_tpu(replicas=4):
    from tensorflow.python.eager import remote
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="my-tpu")
    assert isinstance(resolver, real_resolver_lib.TPUClusterResolver)
    assert tf.config.experimental_connect_to_cluster(resolver) is None
    assert remote.connect_to_cluster(resolver) is None
    topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    assert isinstance(topology, tf.tpu.experimental.Topology)
    assert (topology.num_tasks, topology.num_tpus_per_task) == (1, 4)
    assert topology.mesh_shape.tolist() == [4, 1, 1, 1]
    assert [(topology.task_ordinal_at_coordinates([i, 0, 0, 0]),
             topology.tpu_device_ordinal_at_coordinates([i, 0, 0, 0]))
            for i in range(4)] == [(0, i) for i in range(4)]
    assert resolver.num_accelerators() == {"TPU": 4}
    assert resolver.master() == "" and resolver.cluster_spec().as_dict() == {}
    metadata = resolver.get_tpu_system_metadata()
    assert (metadata.num_cores, metadata.num_hosts,
            metadata.num_of_cores_per_host) == (4, 1, 4)
    assert (resolver.tpu_hardware_feature.embedding_feature
            == tf.tpu.experimental.HardwareFeature.EmbeddingFeature.V1)
    from tensorflow.python.distribute.cluster_resolver import tpu_cluster_resolver
    tpu_cluster_resolver.initialize_tpu_system(resolver)
    tf.tpu.experimental.shutdown_tpu_system(resolver)
    tpu_cluster_resolver.shutdown_tpu_system()
    connected = tf.distribute.cluster_resolver.TPUClusterResolver.connect()
    assert connected.num_accelerators() == {"TPU": 4}


def test_hardware_feature_reports_sparsecore():
  from tpu_embed_ext.emulation import dispatch
  from tpu_embed_ext.sparsecore import topology
  with_sc = emulated_tpu.Emulation(2, True, topology.parse_topology("v6e:2"), ())
  feature = strategy_lib.hardware_feature(with_sc)
  assert feature.embedding_feature == feature.EmbeddingFeature.V2
  assert feature.num_embedding_devices_per_chip == 2
  without = strategy_lib.hardware_feature(emulated_tpu.Emulation(2, False, None, ()))
  assert without.embedding_feature == feature.EmbeddingFeature.V1

  class Extended:
    tpu_hardware_feature = feature

  class Strategy:
    extended = Extended()

  assert dispatch._sparsecore(Strategy())  # pylint: disable=protected-access


# --- the strategy ------------------------------------------------------------------

def _connected_tpu_strategy(cls_name="TPUStrategy"):
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  if cls_name == "experimental":
    return tf.distribute.experimental.TPUStrategy(resolver)
  return tf.distribute.TPUStrategy(resolver)


@pytest.mark.parametrize("kind", ["TPUStrategy", "experimental"])
def test_strategy_is_a_tpu_strategy_over_logical_cpus(kind):
  real = {"TPUStrategy": tpu_strategy.TPUStrategyV2,
          "experimental": tpu_strategy.TPUStrategy}[kind]
  with emulate_tpu(replicas=2):
    strategy = _connected_tpu_strategy(kind)
    patched = (tf.distribute.TPUStrategy if kind == "TPUStrategy"
               else tf.distribute.experimental.TPUStrategy)
    assert isinstance(strategy, patched) and isinstance(strategy, real)
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 2
    assert list(strategy.extended.worker_devices) == [
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)]
    assert strategy.extended.num_hosts == 1
    assert strategy.extended.num_replicas_per_host == 2
    assert isinstance(strategy.cluster_resolver, real_resolver_lib.TPUClusterResolver)


def test_strategy_runs_replicas_as_a_tpu_does():
  with emulate_tpu(replicas=4):
    strategy = _connected_tpu_strategy()
    data = tf.data.Dataset.range(16).batch(8, drop_remainder=True)
    options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
    distributed = strategy.experimental_distribute_dataset(data, options=options)

    @tf.function
    def step(x):
      def fn(x):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.reduce_sum(x) * 10 + tf.cast(replica, tf.int64)
      return strategy.run(fn, args=(x,))

    sums, gathered = [], []
    for x in distributed:
      per_replica = step(x)
      sums.append(int(strategy.reduce("SUM", per_replica, axis=None)))
      gathered.append(strategy.gather(x, axis=0).numpy().tolist())
    batches = np.arange(16).reshape(2, 4, 2)  # step, replica, example
    assert sums == [int(b.sum() * 10 + 0 + 1 + 2 + 3) for b in batches]
    assert gathered == [list(range(8)), list(range(8, 16))]

    def dataset_fn(context):
      assert context.num_replicas_in_sync == 4
      return tf.data.Dataset.from_tensors(
          tf.constant([1, 2], tf.int64)).repeat()
    from_fn = iter(strategy.distribute_datasets_from_function(dataset_fn))
    first = strategy.experimental_local_results(next(from_fn))
    assert [t.numpy().tolist() for t in first] == [[1, 2]] * 4


def test_strategy_run_refuses_eager_functions_as_a_tpu():
  with emulate_tpu(replicas=2):
    strategy = _connected_tpu_strategy()
    with pytest.raises(NotImplementedError,
                       match=r"TPUStrategy.run\(fn, ...\) does not support pure "
                       "eager execution"):
      strategy.run(lambda: 1)


@pytest.mark.parametrize("method, args", [
    ("experimental_assign_to_logical_device", (1, 0)),
    ("experimental_split_to_logical_devices", (1, [1, 2])),
    ("experimental_replicate_to_logical_devices", (1,)),
])
def test_tpu_only_methods_raise_naming_them(method, args):
  with emulate_tpu(replicas=2):
    strategy = _connected_tpu_strategy()
    with pytest.raises(emulated_tpu.NotEmulatedError) as e:
      getattr(strategy, method)(*args)
  assert str(e.value) == (
      f"TPUStrategy.{method} is not emulated: the emulated TPU runs each replica "
      "on one CPU device (no logical devices inside a replica, no model "
      "parallelism). Fix: run this part on a TPU, or leave it out under "
      "emulate_tpu.")


def test_tpu_only_constructions_raise_naming_them():
  with emulate_tpu(replicas=2):
    with pytest.raises(emulated_tpu.NotEmulatedError,
                       match=r"^TPUStrategy\(experimental_spmd_xla_partitioning=True\)"
                       " is not emulated: .*no XLA SPMD partitioning"):
      tf.distribute.TPUStrategy(experimental_spmd_xla_partitioning=True)
    with pytest.raises(emulated_tpu.NotEmulatedError,
                       match=r"^tf.compat.v1.distribute.experimental.TPUStrategy "
                       r"\(TPUStrategyV1"):
      tf.compat.v1.distribute.experimental.TPUStrategy()
    with pytest.raises(emulated_tpu.NotEmulatedError,
                       match=r"^TPUStrategy.extended.experimental_logical_device "
                       "is not emulated"):
      _connected_tpu_strategy().extended.experimental_logical_device(1)
    topology = tf.tpu.experimental.initialize_tpu_system()
    model_parallel = tf.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=[2, 1, 1, 1], num_replicas=1)
    with pytest.raises(emulated_tpu.NotEmulatedError,
                       match=r"^TPUStrategy with a device assignment of "
                       "num_cores_per_replica=2 is not emulated"):
      tf.distribute.TPUStrategy(experimental_device_assignment=model_parallel)
    one_replica = tf.tpu.experimental.DeviceAssignment.build(
        topology, num_replicas=1)
    assert tf.distribute.TPUStrategy(
        experimental_device_assignment=one_replica).num_replicas_in_sync == 1


@pytest.mark.parametrize("real, ours", [
    (tpu_strategy.TPUStrategyV2, strategy_lib.EmulatedTPUStrategy),
    (tpu_strategy.TPUStrategy, strategy_lib.EmulatedExperimentalTPUStrategy),
    (real_resolver_lib.TPUClusterResolver, strategy_lib.EmulatedTPUClusterResolver),
], ids=["TPUStrategyV2", "TPUStrategy", "TPUClusterResolver"])
def test_no_method_of_the_real_tpu_class_is_reachable(real, ours):
  """Each method the real class defines is overridden (it would need a TPU)."""
  helpers = {"_get_device_dict_and_cores", "_verify_and_return_same_core_count"}
  for name, value in vars(real).items():
    if not callable(value) and not isinstance(value, (property, staticmethod)):
      continue
    if name in helpers or name.startswith("__") and name not in (
        "__init__", "__enter__", "__exit__", "__deepcopy__"):
      continue
    owner = next(c for c in ours.__mro__ if name in vars(c))
    assert owner is not real, f"{real.__name__}.{name} is not overridden"


# --- the runner, in this process ---------------------------------------------------

from tpu_embed_ext.emulated_tpu import runner  # pylint: disable=g-import-not-at-top,wrong-import-position

_SCRIPT = """
import sys
import tensorflow as tf
from tpu_embed_ext import emulated_tpu
print("name", __name__)
print("argv", sys.argv[1:])
print("path0", sys.path[0])
print("replicas", emulated_tpu.current().replicas,
      tf.distribute.TPUStrategy().num_replicas_in_sync)
how = sys.argv[1]
if how == "exit3":
  sys.exit(3)
if how == "message":
  sys.exit("goodbye")
if how == "raise":
  raise KeyError("from the script")
"""


@pytest.mark.parametrize("how, code", [
    ("return", 0), ("exit3", 3), ("message", 1), ("raise", 1)])
def test_runner_runs_the_script_as_python_would(how, code, tmp_path, capsys):
  script = tmp_path / "prog.py"
  script.write_text(_SCRIPT)
  argv, path0 = list(sys.argv), sys.path[0]
  assert runner.main(["--replicas", "2", str(script), how, "--flag=x"]) == code
  out, err = capsys.readouterr()
  assert out.splitlines() == ["name __main__", f"argv ['{how}', '--flag=x']",
                              f"path0 {tmp_path}", "replicas 2 2"]
  assert (sys.argv, sys.path[0]) == (argv, path0)
  _assert_unpatched()
  if how == "message":
    assert err == "goodbye\n"
  elif how == "raise":
    assert "Traceback (most recent call last)" in err
    assert "runpy" not in err and "runner.py" not in err  # As python shows it.
    assert err.rstrip().endswith("KeyError: 'from the script'")
  else:
    assert err == ""


def test_runner_bad_replicas_is_one_line(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "prog.py").write_text("raise SystemExit(7)\n")
  assert runner.main(["--replicas", "0", "prog.py"]) == 2
  assert capsys.readouterr().err == (
      "error: emulate: emulate_tpu needs a positive integer replicas, got "
      "replicas=0. Fix: e.g. replicas=8 (one per TPU core).\n")
  _assert_unpatched()


# --- distributed datasets: MirroredStrategy's batches per replica --------------------


def _pipeline(size, batch=12):
  """Shuffled (seeded), mapped with AUTOTUNE, ragged: what autotuning could
  touch; ``size`` not a multiple of ``batch``: a partial last batch."""
  data = tf.data.Dataset.range(size).shuffle(50, seed=7).map(
      lambda x: {"ids": tf.range(x % 4 + 1) + x, "y": tf.cast(x, tf.float32)},
      num_parallel_calls=tf.data.AUTOTUNE)
  return data.ragged_batch(batch).prefetch(tf.data.AUTOTUNE)


def _as_lists(value):
  return (value["ids"].to_list(), value["y"].numpy().tolist())


def _steps(strategy, how, size=193, steps=4, fetch_to_device=True):
  """Per step, per replica: the values a step sees, alternately eagerly and
  in a tf.function; to the end of the data when ``steps`` is None."""
  options = tf.distribute.InputOptions(experimental_fetch_to_device=fetch_to_device)
  if how == "dataset":
    iterator = iter(strategy.experimental_distribute_dataset(_pipeline(size),
                                                             options=options))
  else:
    iterator = iter(strategy.distribute_datasets_from_function(
        lambda context: _pipeline(size).rebatch(12 // context.num_replicas_in_sync),
        options=options))

  @tf.function
  def step(iterator):
    return iterator.get_next_as_optional()

  seen = []
  for i in range(steps or 1000):
    optional = step(iterator) if i % 2 else iterator.get_next_as_optional()
    if not optional.has_value():
      break
    seen.append([(_as_lists(value), value["y"].device)
                 for value in strategy.experimental_local_results(optional.get_value())])
  return seen


def _mirrored(replicas):
  return tf.distribute.MirroredStrategy(
      list(strategy_lib.logical_devices(replicas)),
      cross_device_ops=tf.distribute.ReductionToOneDevice())


@pytest.mark.parametrize("how", ["dataset", "function"])
@pytest.mark.parametrize("replicas", [2, 4, 8])
def test_distributed_batches_are_mirrored_strategys(how, replicas):
  """The emulated strategy's distributed datasets (one host iterator,
  device_datasets.py) give each replica what MirroredStrategy gives it, on
  the same device, to the end of the data: the last global batch (193 = 16
  x 12 + 1) leaves all replicas but one an empty batch."""
  # A TPU refuses a dataset of ragged tensors prefetched to its cores
  # (test_ragged_datasets_prefetched_to_the_cores_are_refused); a function's
  # per-replica specs pass TensorFlow's check (_check_spec), as here.
  fetch = how == "function"
  expected = _steps(_mirrored(replicas), how, steps=None, fetch_to_device=fetch)
  with emulate_tpu(replicas=replicas):
    emulated = tf.distribute.TPUStrategy(
        tf.distribute.cluster_resolver.TPUClusterResolver(tpu=""))
    assert _steps(emulated, how, steps=None, fetch_to_device=fetch) == expected
  ys = [y for step in expected for (_, replica_ys), _ in step for y in replica_ys]
  assert sorted(ys) == list(range(193))  # Each element once, to one replica.
  assert [] in [ids for step in expected for (ids, _), _ in step]  # An empty batch.


@pytest.mark.parametrize("fetch_to_device", [True, False])
def test_distributed_iterator_with_next_in_a_function(fetch_to_device):
  """``next(iterator)`` inside a tf.function (no partial-batch handling, an
  infinite dataset), in the devices' order, eagerly and traced, with and
  without fetching to the replicas' devices."""
  data = tf.data.Dataset.range(10 ** 6).map(lambda x: tf.fill([x % 3 + 1], x))
  data = data.ragged_batch(16, drop_remainder=True)
  if fetch_to_device:  # A TPU prefetches dense tensors only (TPUStrategy._check_spec).
    data = data.map(lambda v: tf.RaggedTensor.to_tensor(v))

  def run(strategy):
    options = tf.distribute.InputOptions(experimental_fetch_to_device=fetch_to_device)
    iterator = iter(strategy.experimental_distribute_dataset(data, options=options))
    step = tf.function(lambda it: next(it))
    return [[(v.numpy().tolist(), v.device) if fetch_to_device else
             (v.to_list(), v.flat_values.device)
             for v in strategy.experimental_local_results(
                 step(iterator) if i % 2 else next(iterator))] for i in range(5)]

  expected = run(_mirrored(8))
  with emulate_tpu(replicas=8):
    assert run(tf.distribute.TPUStrategy()) == expected
  devices = [device_util.canonicalize(device) for _, device in expected[0]]
  assert devices == ([device_util.canonicalize(d) for d in strategy_lib.logical_devices(8)]
                     if fetch_to_device else [devices[0]] * 8)


def test_ragged_datasets_prefetched_to_the_cores_are_refused():
  """What TPUStrategy refuses when it distributes a dataset, in TensorFlow's
  words (tpu_strategy.py: _check_spec, PER_REPLICA): a sparse or ragged
  dataset prefetched to the cores, and per-replica input pipelines."""
  data = tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [2, 3], [4], [5]]))
  with emulate_tpu(replicas=2):
    strategy = tf.distribute.TPUStrategy()
    with pytest.raises(ValueError) as e:
      strategy.experimental_distribute_dataset(data.batch(2))
    assert str(e.value) == (
        "Found tensor  with spec <class 'tensorflow.python.ops.ragged.ragged_tensor."
        "RaggedTensorSpec'>. TPUStrategy does not support distributed datasets with "
        "device prefetch when using sparse or ragged tensors. If you intend to use "
        "sparse or ragged tensors, please pass a tf.distribute.InputOptions object "
        "with experimental_fetch_to_device set to False to your dataset distribution "
        "function. Fix: options=tf.distribute.InputOptions("
        "experimental_fetch_to_device=False), as TPU embedding programs distribute "
        "their ids.")
    with pytest.raises(ValueError, match="^Found tensor 0 with spec"):
      strategy.distribute_datasets_from_function(lambda context: data.batch(1))
    no_fetch = tf.distribute.InputOptions(experimental_fetch_to_device=False)
    assert next(iter(strategy.experimental_distribute_dataset(
        data.batch(2), options=no_fetch))) is not None
    per_replica = tf.distribute.InputOptions(
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError) as e:
      strategy.distribute_datasets_from_function(lambda context: data, per_replica)
    assert str(e.value) == (
        "InputReplicationMode.PER_REPLICA is only supported in  "
        "`experimental_distribute_datasets_from_function` of "
        "tf.distribute.MirroredStrategy (TPUStrategy feeds each host's cores from "
        "one input pipeline per host.) Fix: drop experimental_replication_mode "
        "(PER_WORKER, the default), and shard by input_context.input_pipeline_id.")


@pytest.mark.parametrize("read", ["IteratorGetNext", "IteratorGetNextAsOptional"])
def test_distributed_iterator_reads_in_program_order(read):
  """In a traced step, each replica's read waits for the previous one's
  (one iterator resource: TensorFlow orders its ops as written); with a
  partial last batch, reads are optionals."""
  data = tf.data.Dataset.range(64).batch(8, drop_remainder=read == "IteratorGetNext")
  with emulate_tpu(replicas=4):
    strategy = tf.distribute.TPUStrategy()
    iterator = iter(strategy.experimental_distribute_dataset(data))
    graph = tf.function(lambda it: next(it)).get_concrete_function(iterator).graph
  reads = [op for op in graph.get_operations() if op.type == read]
  assert len(reads) == 4
  for before, after in zip(reads, reads[1:]):
    assert before in after.control_inputs


def test_one_devices_read_is_not_emulated():
  """TensorFlow's per-device read (``OwnedMultiDeviceIterator.get_next(device)``,
  which ``input_lib`` does not call) would take an element out of turn."""
  with emulate_tpu(replicas=2):
    strategy = tf.distribute.TPUStrategy()
    iterator = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(8).batch(4)))
    host = iterator._iterators[0]._iterator  # pylint: disable=protected-access
    with pytest.raises(emulated_tpu.NotEmulatedError) as e:
      host.get_next(strategy.extended.worker_devices[1])
    assert [v.numpy().tolist() for v in strategy.experimental_local_results(
        next(iterator))] == [[0, 1], [2, 3]]  # Nothing was read.
  assert str(e.value) == (
      "OwnedMultiDeviceIterator.get_next(device) is not emulated: the emulated "
      "TPU deals each step's elements to all replicas at once. Fix: call "
      "get_next() and take the device's entry.")


def test_iterator_from_before_the_emulation_is_refused_in_a_function():
  strategy = _mirrored(2)
  iterator = iter(strategy.experimental_distribute_dataset(
      tf.data.Dataset.range(8).batch(4)))
  with emulate_tpu(replicas=2):
    with pytest.raises(emulated_tpu.EmulationError) as e:
      tf.function(lambda it: next(it))(iterator)
  assert str(e.value) == (
      "a distributed iterator made before emulate_tpu started was passed to a "
      "tf.function inside it; the emulated TPU reads its datasets through its "
      "own iterators. Fix: make the iterator (iter(...) of the distributed "
      "dataset) inside the emulation.")


# --- the pytest plugin's fixture ------------------------------------------------------

def test_fixture_gives_the_test_its_own_tpu(emulated_tpu):
  assert emulated_tpu.replicas == 8 and not emulated_tpu.sparsecore
  assert tf.distribute.TPUStrategy().num_replicas_in_sync == 8


@pytest.mark.emulate_tpu(replicas=2)
def test_fixture_takes_the_marker(emulated_tpu):
  assert emulated_tpu.replicas == 2
  assert tf.distribute.TPUStrategy().num_replicas_in_sync == 2


def test_fixture_leaves_nothing_patched():
  _assert_unpatched()


# --- TPUEmbedding on the emulated TPU (mid_level.py) -------------------------------

from tensorflow.python.tpu import tpu_embedding_v2  # pylint: disable=g-import-not-at-top,wrong-import-position

from tpu_embed_ext.emulated_tpu import mid_level  # pylint: disable=g-import-not-at-top,wrong-import-position

_EMB = tf.tpu.experimental.embedding


def _feature_config(optimizer=None):
  table = _EMB.TableConfig(vocabulary_size=8, dim=2, name="t", optimizer=optimizer,
                           initializer=tf.constant_initializer(
                               np.arange(16, dtype=np.float32).reshape(8, 2)))
  return {"a": _EMB.FeatureConfig(table=table, name="a")}


def test_tpu_embedding_is_the_adapter_under_the_strategy():
  real = tpu_embedding_v2.TPUEmbedding
  with emulate_tpu(replicas=2):
    strategy = _connected_tpu_strategy()
    with strategy.scope():
      embedding = _EMB.TPUEmbedding(_feature_config(), _EMB.SGD(0.1))
    assert type(embedding) is mid_level.TPUEmbedding
    assert isinstance(embedding, tpu_embedding_v2.TPUEmbedding)
    assert not isinstance(embedding, real)
    from tpu_embed_ext.keras import adapters
    assert type(adapters.for_engine(embedding, "e")) is adapters.TPUEmbeddingAdapter
    with strategy.scope():
      created = tee_create_embedding(_feature_config(), _EMB.SGD(0.1))
    assert type(created) is mid_level.TPUEmbedding


def tee_create_embedding(*args):
  import tpu_embed_ext as tee  # pylint: disable=g-import-not-at-top
  return tee.create_embedding(*args)


def test_tpu_embedding_outside_the_strategy_is_tensorflows_cpu_mode():
  real = tpu_embedding_v2.TPUEmbedding
  with emulate_tpu(replicas=2):
    embedding = _EMB.TPUEmbedding(_feature_config(), _EMB.SGD(0.1))
    assert type(embedding) is real
    np.testing.assert_array_equal(
        next(iter(embedding.embedding_tables.values())).numpy(),
        np.arange(16).reshape(8, 2))
    with pytest.raises(RuntimeError, match="enqueue is not valid when "
                       "TPUEmbedding object is not created under a TPUStrategy"):
      embedding.enqueue({"a": tf.constant([1], tf.int64)})


def test_tpu_embedding_refuses_what_a_tpu_refuses():
  with emulate_tpu(replicas=2):
    strategy = _connected_tpu_strategy()
    with strategy.scope():
      with pytest.raises(errors.ConfigTypeError) as e:
        _EMB.TPUEmbedding(_feature_config(), None)
      assert str(e.value) == (
          "<class 'NoneType'> is an unsupported optimizer class. Please pass an "
          "instance of one of the optimizer classes under "
          "tf.tpu.experimental.embedding. "
          "table 't': TPUEmbedding under a TPUStrategy needs one of "
          "tf.tpu.experimental.embedding's optimizers, got None. Fix: pass "
          "optimizer= (e.g. tf.tpu.experimental.embedding.SGD(0.1)) or set "
          "TableConfig.optimizer; for our optimizer specs use "
          "tpu_embed_ext.create_embedding.")
      with pytest.raises(emulated_tpu.NotEmulatedError,
                         match=r"^TPUEmbedding\(pipeline_execution_with_tensor_core"
                         r"=True\) is not emulated: a TPU then looks ids up in "
                         "tables one step old"):
        _EMB.TPUEmbedding(_feature_config(), _EMB.SGD(0.1),
                          pipeline_execution_with_tensor_core=True)
      embedding = _EMB.TPUEmbedding(_feature_config(_EMB.Adagrad(0.1)), None)
    with pytest.raises(RuntimeError, match="^Unable to retrieve embedding tables "
                       "when using a TPU strategy. If you need access, save your "
                       "model, create this object under a CPU strategy and "
                       "restore.$"):
      embedding.embedding_tables  # pylint: disable=pointless-statement
    with pytest.raises(errors.InputTypeError,
                       match="^TPUEmbedding is not callable, on a TPU either"):
      embedding({"a": tf.constant([1], tf.int64)})
    with pytest.raises(emulated_tpu.NotEmulatedError,
                       match="^TPUEmbeddingV2 needs SparseCore"):
      _EMB.TPUEmbeddingV2(_feature_config(), _EMB.SGD(0.1))


def test_tpu_embedding_private_state_programs_touch():
  with emulate_tpu(replicas=2):
    strategy = _connected_tpu_strategy()
    with strategy.scope():
      embedding = _EMB.TPUEmbedding(_feature_config(), _EMB.SGD(0.5))
    embedding._output_shapes = [tf.TensorShape([3])]  # pylint: disable=protected-access
    embedding.build()
    embedding._load_variables()  # pylint: disable=protected-access
    parameters = embedding._variables["t"]["parameters"]  # pylint: disable=protected-access
    assert parameters.variables[0] is parameters
    # Values made on the host, as a TPU wants them (on a core's device a TPU
    # refuses them: test_enqueue_refuses_inputs_on_a_cores_device).
    host = "/job:localhost/replica:0/task:0/device:CPU:0"

    def on_host(make):
      def value(ctx):
        with tf.device(host):
          return make(ctx)
      return strategy.experimental_distribute_values_from_function(value)

    with pytest.raises(errors.InputError,
                       match=r"^Inconsistent shape founded for input feature a, "
                       r".*feature 'a' \(table 't'\): .*\[3\]"):
      embedding.enqueue(on_host(lambda _: {"a": tf.constant([1, 2], tf.int64)}))

    @tf.function
    def step(features):
      embedding.enqueue(features, training=True)

      def fn():
        activations = embedding.dequeue()
        embedding.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
        return activations["a"]
      return strategy.run(fn)

    per_replica = on_host(lambda ctx: {"a": tf.constant([1, 1, 2], tf.int64)
                                       + ctx.replica_id_in_sync_group})
    activations = step(per_replica)
    embedding._retrieve_variables()  # pylint: disable=protected-access
    assert [a.shape.as_list() for a in strategy.experimental_local_results(
        activations)] == [[3, 2], [3, 2]]
    table = np.arange(16, dtype=np.float32).reshape(8, 2)
    counts = np.bincount([1, 1, 2, 2, 2, 3], minlength=8)  # Both replicas' ids.
    np.testing.assert_allclose(parameters.variables[0].numpy(),
                               table - 0.5 * counts[:, None])


def test_tpu_embedding_tables_in_a_saved_model(tmp_path):
  """As on a TPU, ``embedding_tables`` works while a SavedModel is written."""
  with emulate_tpu(replicas=2):
    strategy = _connected_tpu_strategy()
    with strategy.scope():
      embedding = _EMB.TPUEmbedding(_feature_config(), _EMB.SGD(0.5))
      embedding.build(per_replica_batch_size=2)

    class Served(tf.Module):

      def __init__(self):
        super().__init__()
        self.embedding = embedding

      @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
      def lookup(self, ids):
        table = next(iter(self.embedding.embedding_tables.values()))
        return tf.gather(table, ids)

    tf.saved_model.save(Served(), str(tmp_path))
  loaded = tf.saved_model.load(str(tmp_path))
  np.testing.assert_array_equal(loaded.lookup(tf.constant([3], tf.int64)).numpy(),
                                [[6, 7]])


def test_enqueue_inside_strategy_run_in_a_device_loop():
  """Each replica enqueues its own batch inside ``strategy.run``, in a tf.range
  loop (the steps-per-execution style): one update per step, gradients
  summed over both replicas."""
  with emulate_tpu(replicas=2):
    strategy = _connected_tpu_strategy()
    with strategy.scope():
      embedding = _EMB.TPUEmbedding(_feature_config(), _EMB.Adagrad(0.5))
    ids = tf.constant([1, 2, 3, 1, 1, 5, 2, 7], tf.int64)
    data = tf.data.Dataset.from_tensor_slices({"a": ids}).batch(
        4, drop_remainder=True).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(
        data, options=tf.distribute.InputOptions(experimental_fetch_to_device=False)))

    @tf.function
    def train(iterator, steps):
      def step(features):
        embedding.enqueue(features, training=True)
        activations = embedding.dequeue()
        embedding.apply_gradients({"a": 2 * activations["a"]})
      for _ in tf.range(steps):
        strategy.run(step, args=(next(iterator),))

    train(iterator, tf.constant(3))
  w = np.arange(16, dtype=np.float64).reshape(8, 2)
  slots = references.initial_slots("adagrad", w.shape)
  for step in range(3):  # A global batch of 4: two ids per replica.
    g = np.zeros_like(w)
    for i in ids.numpy()[4 * (step % 2):4 * (step % 2) + 4]:
      g[i] += 2 * w[i]
    w, slots = references.update("adagrad", w, slots, g, 0.5)  # g = 0: no change
  np.testing.assert_allclose(embedding.variables["t"]["parameters"].numpy(), w,
                             rtol=1e-5)
