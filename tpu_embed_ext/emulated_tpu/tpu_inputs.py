"""What ``TPUEmbedding.enqueue`` refuses on a TPU, refused on the emulated one.

TensorFlow 2.21's ``tpu_embedding_v2.py`` checks every ``enqueue`` before it
builds the enqueue ops; each check has a CPU counterpart here:

* ``_raise_error_for_incorrect_control_flow_context``: inside
  ``strategy.run`` the enqueue is lifted out of the TPU computation (outside
  compilation), which works only from the graph that holds the
  ``TPUReplicateContext``; from a nested ``tf.function``, a ``tf.cond`` or a
  loop body TensorFlow raises ``RuntimeError``. Here ``strategy.run``
  records the graph it runs the replica function in (``recorded_run``), and
  an ``enqueue`` inside the replica function from any other graph is refused
  alike (``check_control_flow``).
* ``_raise_error_for_non_direct_inputs``: inside ``strategy.run`` every
  component tensor of the features must come straight from the arguments of
  ``strategy.run`` (on a TPU the op carries ``_tpu_input_identity``), or be a
  function argument (``Placeholder``). Here: one of the component tensors of
  the recorded arguments, or a ``Placeholder`` (``check_direct_inputs``).
* ``_raise_error_for_inputs_not_on_cpu``: every input tensor must be on the
  host, not on a TPU device, i.e. read from a distributed dataset with
  ``InputOptions(experimental_fetch_to_device=False)``. The emulated TPU's
  cores are the logical CPU devices ``strategy.extended.worker_devices``;
  each host is its first core's device (``/device:CPU:0`` on one host; on a
  pod host k's is ``CPU:k*R``). A tensor placed on any other core's device
  is refused (``check_inputs_on_host``). With one replica per host, or for
  a host's first core, host and core are one device, so that refusal cannot
  be seen; every other core's part shows it.
"""

from __future__ import annotations

import contextlib
from typing import List, NamedTuple, Optional

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib, values
from tensorflow.python.framework import ops
from tensorflow.python.util import nest

from tpu_embed_ext import errors
from tpu_embed_ext.emulated_tpu.errors import TPURuntimeError

__all__ = ["recorded_run", "current_run", "check_control_flow",
           "check_direct_inputs", "check_inputs_on_host"]


class _Run(NamedTuple):
  """One ``strategy.run`` in progress: its graph (None eagerly) and the
  component tensors of its arguments (by ``Tensor.ref()``)."""
  graph: Optional[object]
  direct: Optional[frozenset]


@contextlib.contextmanager
def recorded_run(strategy, args, kwargs):
  """Records ``strategy.run``'s graph and arguments while it runs."""
  graph = None if tf.executing_eagerly() else ops.get_default_graph()
  try:
    components = nest.flatten((args, kwargs or {}), expand_composites=True)
    direct = frozenset(t.ref() for t in components if isinstance(t, tf.Tensor))
  except (TypeError, ValueError):  # Arguments nest cannot walk: no check.
    direct = None
  runs = strategy.__dict__.setdefault("_emulated_tpu_runs", [])
  runs.append(_Run(graph, direct))
  try:
    yield
  finally:
    runs.pop()


def current_run(strategy) -> Optional[_Run]:
  """The innermost ``strategy.run`` of ``strategy`` in progress, or None."""
  runs = getattr(strategy, "_emulated_tpu_runs", None)
  return runs[-1] if runs else None


def check_control_flow(strategy) -> bool:
  """Whether this ``enqueue`` is inside ``strategy.run`` (TensorFlow's
  ``in_tpu_context``); ``TPURuntimeError`` from a nested graph."""
  context = tf.distribute.get_replica_context()
  run = current_run(strategy)
  if run is None or context is None or context.strategy is not strategy:
    return False
  graph = ops.get_default_graph()
  if run.graph is not None and graph is run.graph:
    return True
  raise TPURuntimeError(
      f"Current graph {graph} does not match graph which contains "
      f"TPUReplicateContext {run.graph}. This is most likely due to the fact "
      "that enqueueing embedding data is called inside control flow or a "
      "tf.function inside `strategy.run`. TPUEmbedding.enqueue inside "
      "strategy.run was called from a nested graph (a tf.function, tf.cond or "
      "loop body inside the replica function), which a TPU refuses. Fix: call "
      "enqueue directly in the function given to strategy.run, or outside "
      "strategy.run with the distributed values.")


def check_direct_inputs(strategy, features) -> None:
  """``ValueError`` (``InputError``) unless every component tensor of
  ``features`` is an argument of the running ``strategy.run``."""
  run = current_run(strategy)
  if run is None or run.direct is None or tf.executing_eagerly():
    return
  for path, tensor in nest.flatten_with_joined_string_paths(
      features, expand_composites=True):
    if not isinstance(tensor, tf.Tensor):
      continue
    if tensor.op.type == "Placeholder" or tensor.ref() in run.direct:
      continue
    raise errors.InputError(
        f"Received input tensor {path} which is the output of op "
        f"{tensor.op.name} (type {tensor.op.type}) which does not have the "
        "`_tpu_input_identity` attr. Please ensure that the inputs to this "
        "layer are taken directly from the arguments of the function called by "
        f"strategy.run. Feature {path}: enqueue inside strategy.run takes the "
        "replica function's arguments unchanged, as a TPU does. Fix: compute "
        "the ids in the input pipeline (dataset.map) or outside strategy.run, "
        "and pass them to strategy.run as they are.")


def _devices(strategy) -> List[tf.DeviceSpec]:
  return [tf.DeviceSpec.from_string(d) for d in strategy.extended.worker_devices]


def _same(a: tf.DeviceSpec, b: tf.DeviceSpec) -> bool:
  return (a.device_type == b.device_type and a.device_index == b.device_index
          and a.task in (None, b.task) and a.job in (None, b.job))


def check_inputs_on_host(strategy, flat_inputs, flat_paths) -> None:
  """``ValueError`` (``InputError``) for an input on a core's device (a
  host's CPU is its first core's device: not a core here; an input on another
  host's CPU is legal on a pod, only slow)."""
  hosts = {d for d, _ in strategy.extended._input_workers_devices}  # pylint: disable=protected-access
  cores = [c for c in _devices(strategy) if c.to_string() not in hosts]
  for value, path in zip(flat_inputs, flat_paths):
    for tensor in nest.flatten(value, expand_composites=True):
      device = getattr(tensor, "device", "") or ""
      if not device:
        continue
      spec = tf.DeviceSpec.from_string(device)
      if any(_same(spec, core) for core in cores):
        raise errors.InputError(
            f"Received input tensor {path} which is on a TPU input device "
            f"{device}. Input tensors for TPU embeddings must be placed on the "
            "CPU. Please ensure that your dataset is prefetching tensors to the "
            "host by setting the 'experimental_fetch_to_device' option of the "
            f"dataset distribution function. Feature {path}: its ids were "
            "prefetched to a TPU core's device. Fix: "
            "distribute the dataset with options=tf.distribute.InputOptions("
            "experimental_fetch_to_device=False).")


def check_distributed(options, element_spec, from_function: bool) -> None:
  """What ``TPUStrategy`` refuses when it distributes a dataset
  (``TPUExtended._experimental_distribute_dataset``,
  ``_distribute_datasets_from_function``, ``_check_spec``): per-replica
  input replication (``NotImplementedError``), and a sparse or ragged
  ``element_spec`` prefetched to the cores (``ValueError``: a TPU's infeed
  takes dense tensors). TensorFlow's words first."""
  if (options is not None and options.experimental_replication_mode
      == distribute_lib.InputReplicationMode.PER_REPLICA):
    raise NotImplementedError(
        "InputReplicationMode.PER_REPLICA is only supported in "
        + (" `experimental_distribute_datasets_from_function` of "
           "tf.distribute.MirroredStrategy" if from_function else
           "`experimental_distribute_datasets_from_function`.")
        + " (TPUStrategy feeds each host's cores from one input pipeline per "
        "host.) Fix: drop experimental_replication_mode (PER_WORKER, the "
        "default), and shard by input_context.input_pipeline_id.")
  if element_spec is None or (options is not None
                              and not options.experimental_fetch_to_device):
    return
  if isinstance(element_spec, values.PerReplicaSpec):
    element_spec = element_spec._component_specs  # pylint: disable=protected-access
  for path, spec in nest.flatten_with_joined_string_paths(element_spec):
    if isinstance(spec, (tf.SparseTensorSpec, tf.RaggedTensorSpec)):
      raise errors.InputError(
          f"Found tensor {path} with spec {type(spec)}. TPUStrategy does not "
          "support distributed datasets with device prefetch when using sparse "
          "or ragged tensors. If you intend to use sparse or ragged tensors, "
          "please pass a tf.distribute.InputOptions object with "
          "experimental_fetch_to_device set to False to your dataset "
          "distribution function. Fix: options=tf.distribute.InputOptions("
          "experimental_fetch_to_device=False), as TPU embedding programs "
          "distribute their ids.")
