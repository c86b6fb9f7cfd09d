"""The emulated TPU's system: resolver, topology, start-up and the strategy.

How TensorFlow decides it is on a TPU, and what stands in for each step here
(TensorFlow 2.21 sources):

* ``TPUClusterResolver`` (``cluster_resolver/tpu/tpu_cluster_resolver.py``)
  asks the Cloud TPU client or the local TPU VM for its workers.
  ``EmulatedTPUClusterResolver`` answers for the emulated slice's hosts
  and cores (in this process), whatever ``tpu=`` names.
* ``connect_to_cluster`` (``eager/remote.py``) starts a gRPC server and
  resets the eager context to the cluster. The emulated TPU is local:
  connecting to its resolver does nothing (any other cluster is connected
  as before).
* ``initialize_tpu_system`` (``tpu/tpu_strategy_util.py``) runs the TPU's
  configuration op and returns the ``Topology`` it reports. Here it returns
  the topology of the emulated shape: one task per host, ``replicas`` chips
  of one core in a line (``mesh_shape [replicas, 1, 1, 1]``).
* ``TPUStrategy`` (``distribute/tpu_strategy.py``) replicates compiled
  functions over TPU cores. ``EmulatedTPUStrategy`` is a ``MirroredStrategy``
  over ``replicas`` logical CPU devices (the engine's replicas,
  ``emulation/replicas.py``) with the face of a ``TPUStrategy``.

Identity. The emulated classes subclass the real ones
(``EmulatedTPUStrategy(MirroredStrategy, TPUStrategyV2)``,
``EmulatedTPUClusterResolver(TPUClusterResolver)``), so
``isinstance(s, tf.distribute.TPUStrategy)`` holds both for the patched name
and for the real class that Keras, keras-rs or a module imported earlier may
hold. Their behaviour is the mirrored machinery's: each class overrides every
method the real class defines itself (``tests/test_emulated_tpu.py`` checks
that none is left to the real class), either with its CPU meaning or with a
``NotEmulatedError`` naming the method. The real ``__init__`` is never run
(it would look for a TPU). ``isinstance(s, MirroredStrategy)`` also holds,
which is how the engine (``replicas.check_strategy``) accepts it.

The name checks TensorFlow and Keras make (a class whose name, or a base's,
starts with ``TPUStrategy``: ``tpu_replication.is_tpu_strategy``, Keras's
``_is_tpu_strategy``) see the real base and read ``extended.num_hosts``
and ``extended._device_assignment`` (None), which the extended provides.
On a pod (``emulate_tpu(hosts=H)``) each host is one input worker
(``pod.py``).
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf.tpu import topology_pb2
from tensorflow.python.distribute import (distribute_lib, mirrored_strategy,
                                          tpu_strategy)
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.distribute.cluster_resolver.tpu import (
    tpu_cluster_resolver as tpu_resolver_lib)
from tensorflow.python.eager import context
from tensorflow.python.autograph.core import ag_ctx as autograph_ctx
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python.tpu import embedding_context_utils as ecu
from tensorflow.python.tpu import tpu_hardware_feature
from tensorflow.python.training import server_lib

from tpu_embed_ext.emulated_tpu import (device_datasets, embedding_memory,
                                        outer_jit, patching, pod, session,
                                        tpu_inputs, xla_check)
from tpu_embed_ext.emulated_tpu.devices import (configure_logical_devices,
                                                logical_devices)
from tpu_embed_ext.emulated_tpu.errors import EmulationError, NotEmulatedError

__all__ = ["configure_logical_devices", "logical_devices", "EmulatedTPUClusterResolver",
           "initialize_tpu_system", "shutdown_tpu_system", "connect_to_cluster",
           "device_assignment",
           "EmulatedTPUStrategy", "EmulatedExperimentalTPUStrategy",
           "TPUStrategyV1NotEmulated", "hardware_feature", "emulated_topology",
           "is_emulated_tpu_strategy"]

def _active(what: str) -> session.Emulation:
  emulation = session.current()
  if emulation is None:
    raise EmulationError(
        f"the emulated {what} was used outside emulate_tpu: it stands for a TPU "
        "only while the emulation is active. Fix: create it inside "
        "`with tpu_embed_ext.emulate_tpu(...)`.")
  return emulation


def _not_emulated(what: str, why: str = "") -> NotEmulatedError:
  return NotEmulatedError(
      f"{what} is not emulated: the emulated TPU runs each replica on one CPU "
      "device (no logical devices inside a replica, no model parallelism"
      f"{', ' + why if why else ''}). Fix: run this part on a TPU, or leave it "
      "out under emulate_tpu.")


# --- the TPU system ---------------------------------------------------------


def hardware_feature(emulation) -> tpu_hardware_feature.HardwareFeature:
  """What ``tpu_hardware_feature`` reports: SparseCore (V2) or V1 (v2-v5e)."""
  proto = topology_pb2.TPUHardwareFeature()
  if emulation.sparsecore:
    proto.embedding_feature = topology_pb2.TPUHardwareFeature.EmbeddingFeature.V2
    proto.num_embedding_devices_per_chip = emulation.topology.sparsecores_per_chip
  else:
    proto.embedding_feature = topology_pb2.TPUHardwareFeature.EmbeddingFeature.V1
  return tpu_hardware_feature.HardwareFeature(proto)


emulated_topology = pod.topology  # H tasks of R single-core chips in a line.
_metadata = pod.metadata


class EmulatedTPUClusterResolver(tpu_resolver_lib.TPUClusterResolver):
  """``TPUClusterResolver`` of the emulated TPU: one local host, any ``tpu=``."""

  def __init__(self, tpu=None, zone=None, project=None, job_name="worker",
               coordinator_name=None, coordinator_address=None,
               credentials="default", service=None, discovery_url=None):
    # The real __init__ contacts the Cloud TPU API or the TPU VM: not called.
    del zone, project, coordinator_name, credentials, service, discovery_url
    self._emulation = _active("TPUClusterResolver")
    self._tpu = "local" if tpu in (None, "", "local") else tpu
    self._coordinator_address = coordinator_address
    self._tpu_topology = None
    self.task_type = job_name
    self.task_id = 0
    self.rpc_layer = None

  @staticmethod
  def connect(tpu=None, zone=None, project=None):
    resolver = EmulatedTPUClusterResolver(tpu, zone, project)
    initialize_tpu_system(resolver)
    return resolver

  def __enter__(self):
    return self

  def __exit__(self, type, value, traceback):  # pylint: disable=redefined-builtin
    del type, value, traceback

  def master(self, task_type=None, task_id=None, rpc_layer=None):
    del task_type, task_id, rpc_layer
    return ""  # Local, as a TPU VM's own resolver.

  def get_master(self):
    return self.master()

  def get_job_name(self):
    return self.task_type

  def get_coordination_service_leader(self):
    return ""

  def get_tpu_system_metadata(self):
    return _metadata(self._emulation)

  def cluster_spec(self):
    return server_lib.ClusterSpec({})

  def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
    del task_type, task_id, config_proto
    return {"TPU": self._emulation.replicas_per_host}  # Per worker, as TF's.

  def set_tpu_topology(self, serialized_tpu_topology):
    self._tpu_topology = topology_pb2.TopologyProto()
    self._tpu_topology.ParseFromString(serialized_tpu_topology)

  @property
  def tpu_hardware_feature(self):
    return hardware_feature(self._emulation)

  @property
  def environment(self):
    return ""

  def _start_local_server(self):
    pass  # No server: the emulated TPU is in this process.

  def __deepcopy__(self, memo):
    del memo
    return self  # As the real one: it stands for one TPU system.


def initialize_tpu_system(cluster_resolver=None):
  """Returns the emulated ``Topology`` (serialized inside a ``tf.function``)."""
  del cluster_resolver
  topology = emulated_topology(_active("initialize_tpu_system"))
  embedding_memory.reset()  # As a TPU's: no TPUEmbedding configured.
  if not context.executing_eagerly():
    return tf.constant(topology.serialized())
  return topology


def shutdown_tpu_system(cluster_resolver=None):
  del cluster_resolver
  _active("shutdown_tpu_system")
  embedding_memory.reset()


def device_assignment(topology, computation_shape=None, computation_stride=None,
                      num_replicas=1, **kwargs):
  """``tpu.device_assignment``: TensorFlow's own.

  Several cores per replica (``computation_shape`` with more than one core)
  are model parallelism, which the emulated TPU (one CPU device per replica)
  does not have. Where the emulated topology (one core per chip) cannot even
  hold such an assignment, TensorFlow's ``ValueError`` about the topology
  would hide that: it becomes the one-line ``NotEmulatedError``. An
  assignment that fits is returned, and ``TPUStrategy`` refuses it.
  """
  real = patching.original("tensorflow.python.tpu.device_assignment",
                           "device_assignment")
  try:
    return real(topology, computation_shape, computation_stride, num_replicas,
                **kwargs)
  except ValueError:
    cores = (int(np.prod(computation_shape)) if computation_shape is not None
             else 1)
    if cores <= 1:
      raise
  raise _not_emulated(
      f"tpu.device_assignment(computation_shape={list(computation_shape)}) "
      f"({cores} cores per replica)")


def connect_to_cluster(cluster_spec_or_resolver, *args, **kwargs):
  """No-op for the emulated TPU's resolver; TensorFlow's for any other."""
  if isinstance(cluster_spec_or_resolver, EmulatedTPUClusterResolver):
    return None
  real = patching.original("tensorflow.python.eager.remote", "connect_to_cluster")
  return real(cluster_spec_or_resolver, *args, **kwargs)


# --- the strategy ------------------------------------------------------------


class EmulatedTPUExtended(mirrored_strategy.MirroredExtended):
  """``MirroredExtended`` over the emulated cores, with ``TPUExtended``'s facts."""

  def __init__(self, container_strategy, emulation, num_replicas=None):
    devices = emulation.devices[:num_replicas or emulation.replicas]
    super().__init__(container_strategy, devices=list(devices),
                     cross_device_ops=tf.distribute.ReductionToOneDevice())
    self._emulation = emulation
    # One input worker per host (pod.py); MirroredExtended builds its input
    # workers from these pairs, TPUExtended's names read them too.
    workers = pod.input_workers(emulation, self._devices)
    self._input_workers_devices = tuple((h, tuple(d)) for h, d in workers.items())
    self._device_input_worker_devices = workers
    self._host_input_worker_devices = collections.OrderedDict(
        (h, [h] * len(d)) for h, d in workers.items())
    # Read by tpu_replication.is_tpu_strategy's callers (outside compilation).
    self._device_assignment = None
    # TPUExtended's [replicas, logical cores per replica] array of device
    # names (one core per replica here); TPUEmbeddingV2 and its tests read it.
    self._tpu_devices = np.array([[d] for d in self.worker_devices], dtype=object)

  @property
  def tpu_hardware_feature(self):
    return hardware_feature(self._emulation)

  @property
  def num_hosts(self):
    return len(self._input_workers_devices)

  @property
  def num_replicas_per_host(self):
    return len(self._input_workers_devices[0][1])

  def _get_input_workers(self, options):
    return self._input_workers_with_options(options)

  def experimental_logical_device(self, logical_device_id):
    raise _not_emulated("TPUStrategy.extended.experimental_logical_device")

  def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
    """``all_reduce`` of a tensor every replica was given unchanged.

    ``ReplicaContext.all_reduce`` reduces each value to its own device
    (``distribute_lib._batch_reduce_destination``); a tensor passed to
    ``strategy.run`` as it is has none in a graph, and the mirrored machinery
    raises "destinations can not be empty". On a TPU it is a replicated input
    of each replica: here it is reduced as one value per replica.
    """
    pairs = []
    for value, destinations in value_destination_pairs:
      if isinstance(value, tf.Tensor) and destinations == "":
        copies = []
        for device in self.worker_devices:
          with tf.device(device):
            copies.append(tf.identity(value))
        value = destinations = values_lib.PerReplica(copies)
      pairs.append((value, destinations))
    return super()._batch_reduce_to(reduce_op, pairs, options)

  # Datasets: MirroredStrategy's, after TPUStrategy's checks (tpu_inputs),
  # without tf.data autotuning (device_datasets), read by HostIterator.
  def _experimental_distribute_dataset(self, dataset, options):
    tpu_inputs.check_distributed(options, dataset.element_spec, False)
    return pod.checked(super()._experimental_distribute_dataset(
        device_datasets.without_autotuning(dataset), options), self._emulation)

  def _distribute_datasets_from_function(self, dataset_fn, options):
    tpu_inputs.check_distributed(options, None, True)
    distributed = super()._distribute_datasets_from_function(
        lambda context: device_datasets.without_autotuning(dataset_fn(context)),
        options)
    tpu_inputs.check_distributed(options, distributed.element_spec, True)
    return pod.checked(distributed, self._emulation)


class _TPUFace:
  """What the emulated strategies add to ``MirroredStrategy``.

  Listed before the real TPU class in the bases, so these win over it; the
  rest resolves to ``MirroredStrategy`` / ``Strategy``.
  """

  def _start(self, resolver, device_assignment, what):
    emulation = _active(what)
    num_replicas = None
    if device_assignment is not None:
      if device_assignment.num_cores_per_replica != 1:
        raise _not_emulated(
            f"{what} with a device assignment of "
            f"num_cores_per_replica={device_assignment.num_cores_per_replica}")
      num_replicas = device_assignment.num_replicas
      if num_replicas > emulation.replicas:
        raise _not_emulated(
            f"{what} with a device assignment of {num_replicas} replicas on "
            f"{emulation.replicas} emulated cores",
            "nor more replicas than cores")
    extended = EmulatedTPUExtended(self, emulation, num_replicas)
    # Not MirroredStrategy.__init__: its super() call would reach the real
    # TPU class's __init__, which looks for a TPU.
    distribute_lib.Strategy.__init__(self, extended)
    self._tpu_cluster_resolver = resolver or EmulatedTPUClusterResolver()

  @property
  def cluster_resolver(self):
    return self._tpu_cluster_resolver

  def run(self, fn, args=(), kwargs=None, options=None):
    """``strategy.run``, which a TPU refuses to run eagerly (as here).

    In a graph, with XLA on, each replica's program is checked to compile
    as a TPU's must (``xla_check.py``); inside ``jit_compile=True`` the
    replicas are checked, not compiled together (``outer_jit.py``).
    """
    tpu_strategy.validate_run_function(fn)
    if tf.executing_eagerly() and outer_jit.is_jit_function(fn):
      return outer_jit.run_eagerly_in_a_graph(self, fn, args, kwargs, options)
    if not tf.executing_eagerly():  # the replicas' inputs are tensors, as on a TPU
      args, kwargs = _as_tensors(args), _as_tensors(kwargs)
    fn = _with_callers_embedding_state(outer_jit.replica_function(fn))
    # Recorded for TPUEmbedding.enqueue's TPU checks (tpu_inputs.py).
    with tpu_inputs.recorded_run(self, args, kwargs), \
        outer_jit.replicas_compiled_separately(), \
        xla_check.replica_program(self.extended._emulation, (args, kwargs)):  # pylint: disable=protected-access
      return distribute_lib.StrategyBase.run(self, fn, args, kwargs, options)


def _as_tensors(structure):
  """Python and numpy numbers in ``structure`` as tensors.

  A TPU's replicas receive every argument of ``strategy.run`` as a tensor:
  ``tpu.replicate`` converts each (``tpu.py``, ``split_compile_and_replicate``:
  ``ops.convert_to_tensor(x)``), so ``args=(25.0,)`` is a float32 input of the
  program, not a constant in it, and gradients can be taken with respect to
  it. Eager tensors are captured into the function here, likewise.
  """
  def convert(value):
    if isinstance(value, (bool, int, float, np.generic, np.ndarray)) or (
        isinstance(value, tf.Tensor) and hasattr(value, "numpy")):
      # An eager tensor is captured here, before the replicas run: an input,
      # not a constant of their program (FuncGraph captures small ones as Const).
      return tf.convert_to_tensor(value)
    return value
  return None if structure is None else tf.nest.map_structure(convert, structure)


def _with_callers_embedding_state(fn):
  """``fn`` seeing the caller's ``SequentialEmbeddingContext``.

  TensorFlow keeps it in a thread-local (``embedding_context_utils``); a TPU
  traces the replica function in the caller's thread, the mirrored machinery
  in one thread per replica, which would see pipelining enabled.
  """
  enabled = ecu.embedding_pipelining_state.enabled
  if enabled:
    return fn
  # Converted as StrategyBase.run converts it; the wrapper is left alone.
  fn = autograph.tf_convert(fn, autograph_ctx.control_status_ctx(),
                            convert_by_default=False)

  @autograph.do_not_convert
  def replica_fn(*args, **kwargs):
    previous = ecu.embedding_pipelining_state.enabled
    ecu.embedding_pipelining_state.enabled = enabled
    try:
      return fn(*args, **kwargs)
    finally:
      ecu.embedding_pipelining_state.enabled = previous
  return replica_fn


def is_emulated_tpu_strategy(strategy) -> bool:
  """Whether ``strategy`` is one of the emulated TPU strategies."""
  return isinstance(strategy, _TPUFace)


class EmulatedTPUStrategy(_TPUFace, mirrored_strategy.MirroredStrategy,
                          tpu_strategy.TPUStrategyV2):
  """``tf.distribute.TPUStrategy`` on the emulated TPU's logical CPU devices."""

  def __init__(self, tpu_cluster_resolver=None,
               experimental_device_assignment=None,
               experimental_spmd_xla_partitioning=False):
    if experimental_spmd_xla_partitioning:
      raise _not_emulated("TPUStrategy(experimental_spmd_xla_partitioning=True)",
                          "no XLA SPMD partitioning")
    self._start(tpu_cluster_resolver, experimental_device_assignment,
                "TPUStrategy")

  def experimental_assign_to_logical_device(self, tensor, logical_device_id):
    raise _not_emulated("TPUStrategy.experimental_assign_to_logical_device")

  def experimental_split_to_logical_devices(self, tensor, partition_dimensions):
    raise _not_emulated("TPUStrategy.experimental_split_to_logical_devices")

  def experimental_replicate_to_logical_devices(self, tensor):
    raise _not_emulated("TPUStrategy.experimental_replicate_to_logical_devices")


class EmulatedExperimentalTPUStrategy(_TPUFace, mirrored_strategy.MirroredStrategy,
                                      tpu_strategy.TPUStrategy):
  """``tf.distribute.experimental.TPUStrategy`` on the emulated TPU."""

  def __init__(self, tpu_cluster_resolver=None, device_assignment=None):
    self._start(tpu_cluster_resolver, device_assignment,
                "tf.distribute.experimental.TPUStrategy")


class TPUStrategyV1NotEmulated:
  """``tf.compat.v1.distribute.experimental.TPUStrategy``: refused."""

  def __init__(self, *args, **kwargs):
    del args, kwargs
    raise _not_emulated(
        "tf.compat.v1.distribute.experimental.TPUStrategy (TPUStrategyV1, for "
        "TF1 graph-mode programs)", "no TF1 sessions; use tf.distribute.TPUStrategy")
