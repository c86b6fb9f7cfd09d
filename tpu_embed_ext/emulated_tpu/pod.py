"""The emulated TPU's hosts: a pod slice's TPU VMs in this one process.

On a pod slice, ``TPUStrategy`` is one client driving every host's cores
(TensorFlow 2.21 ``tpu_strategy.py``, ``TPUExtended.__init__``):

* ``tpu_system_metadata`` groups the cores by worker task: ``num_hosts`` and
  ``num_of_cores_per_host``, the cores sorted host-major;
* each host is one input worker (``_device_input_worker_devices``: host CPU
  -> that host's cores), so ``distribute_datasets_from_function`` calls the
  input function once per host with ``InputContext(num_input_pipelines=H,
  input_pipeline_id=k, num_replicas_in_sync=N)``, and
  ``experimental_distribute_dataset`` clones the dataset to every host,
  rebatches it and auto-shards it by host (``input_lib``);
* the host of a core is ``device_util.get_host_for_device(core)``, which
  ``input_lib`` (each host's iterator), ``tpu_embedding_v2_utils.
  get_list_of_hosts`` and ``tpu_embedding_v3`` read.

Here the H hosts are input workers over the logical CPU devices: host k's
cores are ``devices[k*R:(k+1)*R]`` and its CPU is its first core's device
(``session.Emulation.host_devices``). ``EmulatedTPUExtended`` gives
``MirroredExtended`` these input workers, so TensorFlow's own ``input_lib``
builds the per-host contexts, clones, rebatching, auto-sharding and
iterators; ``get_host_for_device`` is patched (``patching.PATCHES``) to name
an emulated core's host. Nothing of the network is emulated: no second
process, no DCN (``docs/guides/tpu-on-cpu.md``, "Pods").
"""

from __future__ import annotations

import collections
import os
import sys
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.data.ops import options as options_lib
from tensorflow.python.tpu import tpu_system_metadata

from tpu_embed_ext.emulated_tpu import patching, session
from tpu_embed_ext.emulated_tpu.errors import DuplicateInputWarning

__all__ = ["get_host_for_device", "input_workers", "topology", "metadata",
           "checked", "warn_if_hosts_read_the_same", "DuplicateInputWarning"]


def get_host_for_device(device, device_index=0):
  """``device_util.get_host_for_device``: an emulated core's host on a pod."""
  emulation = session.current()
  if emulation is not None and emulation.hosts > 1 and device_index == 0:
    host = emulation.host_of(device)
    if host is not None:
      return host
  real = patching.original("tensorflow.python.distribute.device_util",
                           "get_host_for_device")
  return real(device, device_index)


def input_workers(emulation, devices) -> "collections.OrderedDict":
  """Host device -> its cores among ``devices`` (the strategy's), in order."""
  workers = collections.OrderedDict()
  for device in devices:
    workers.setdefault(emulation.host_of(device) or devices[0], []).append(device)
  return workers


def topology(emulation) -> "tf.tpu.experimental.Topology":
  """H tasks of R single-core chips (``num_tasks`` H, ``num_tpus_per_task``
  R), the chips in a line (``mesh_shape [replicas, 1, 1, 1]``)."""
  hosts, per_host = emulation.hosts, emulation.replicas_per_host
  coordinates = np.zeros((hosts, per_host, 4), dtype=np.int32)
  coordinates[:, :, 0] = np.arange(emulation.replicas).reshape(hosts, per_host)
  return tf.tpu.experimental.Topology(mesh_shape=[emulation.replicas, 1, 1, 1],
                                      device_coordinates=coordinates)


def metadata(emulation) -> tpu_system_metadata.TPUSystemMetadata:
  """What ``get_tpu_system_metadata`` reports for the emulated slice."""
  devices = [tf.config.LogicalDevice(name, "TPU") for name in emulation.devices]
  return tpu_system_metadata.TPUSystemMetadata(
      num_cores=emulation.replicas, num_hosts=emulation.hosts,
      num_of_cores_per_host=emulation.replicas_per_host,
      topology=topology(emulation), devices=devices)


# Datasets whose first element cannot be read twice without a side effect
# (a Python generator or function): not peeked.
_STATEFUL_OPS = frozenset(("GeneratorDataset", "PyFunc", "EagerPyFunc",
                           "PyFuncStateless"))


def _peekable(dataset) -> bool:
  """Whether reading ``dataset``'s first element on another iterator has no
  side effect: no op of its graph or functions runs Python."""
  try:
    serialized = dataset._as_serialized_graph(  # pylint: disable=protected-access
        external_state_policy=options_lib.ExternalStatePolicy.IGNORE)
  except (tf.errors.OpError, ValueError, TypeError):
    return False
  graph = graph_pb2.GraphDef.FromString(serialized.numpy())
  nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
  return not any(node.op in _STATEFUL_OPS for node in nodes)


def _first(dataset):
  """The flattened first element of ``dataset`` as numpy, or None."""
  try:
    element = next(iter(dataset.take(1)))
  except (StopIteration, tf.errors.OutOfRangeError):
    return None
  return [np.asarray(t) for t in tf.nest.flatten(element, expand_composites=True)]


def checked(distributed, emulation):
  """``distributed`` (a distributed dataset), after warning if its hosts'
  datasets yield the same first batch (``warn_if_hosts_read_the_same``)."""
  if emulation.hosts > 1:
    host_datasets = (getattr(distributed, "_datasets", None)
                     or getattr(distributed, "_cloned_datasets", None) or ())
    warn_if_hosts_read_the_same(list(host_datasets), emulation.host_devices)
  return distributed


# Frames of TensorFlow and of the emulated TPU: a warning names the first
# frame outside them (the program's call that distributed the dataset).
_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             os.path.dirname(os.path.abspath(tf.__file__)) + os.sep)


def _caller_stacklevel() -> int:
  """``stacklevel`` for a ``warnings.warn`` in this module's caller: its
  first frame outside TensorFlow and the emulated TPU."""
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  while frame is not None and os.path.abspath(
      frame.f_code.co_filename).startswith(_INTERNAL):
    frame, level = frame.f_back, level + 1
  return level


def warn_if_hosts_read_the_same(host_datasets, hosts) -> None:
  """One ``DuplicateInputWarning`` naming the hosts (``hosts``: their
  devices) whose ``host_datasets`` (one per host) yield the same first
  element. A TPU pod trains on such duplicates silently.

  Read eagerly, on a separate iterator of each host's dataset; skipped for a
  dataset of a Python generator or function (reading would advance it), an
  empty one, or inside a ``tf.function``."""
  if len(host_datasets) < 2 or not tf.executing_eagerly():
    return
  if not all(_peekable(d) for d in host_datasets):
    return
  firsts = []
  for k, dataset in enumerate(host_datasets):
    with tf.device(hosts[k]):
      first = _first(dataset)
    if first is None or not any(a.size for a in first):
      return
    firsts.append(first)
  groups = collections.OrderedDict()
  for k, first in enumerate(firsts):
    for key in groups:
      other = firsts[key]
      if len(other) == len(first) and all(
          a.shape == b.shape and np.array_equal(a, b) for a, b in zip(other, first)):
        groups[key].append(k)
        break
    else:
      groups[k] = [k]
  same = [members for members in groups.values() if len(members) > 1]
  if not same:
    return
  named = "; ".join(
      " and ".join(f"host {k} ({hosts[k]})" for k in members) for members in same)
  warnings.warn(DuplicateInputWarning(
      f"{named} of {len(hosts)} input pipelines yield the same first batch: "
      "every host reads the same examples, which a TPU pod trains on silently "
      "(each example counted once per host). Fix: shard by the input context "
      "in the input function, e.g. dataset.shard(input_context."
      "num_input_pipelines, input_context.input_pipeline_id), or give each "
      "host its own files."), stacklevel=_caller_stacklevel())
