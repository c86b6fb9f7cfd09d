"""Replica handling: a TPU step over R replicas, on CPU under tf.distribute.

A TPU program runs R replicas; each enqueues and dequeues its own batch, and
the TPU sums the per-id gradients of all replicas and updates every touched
id once, on one copy of each table (docs/semantics.md, replicas). The
emulator does the same under the strategies that run on CPU:

* the default strategy and ``OneDeviceStrategy``: one replica;
* ``MirroredStrategy`` over N (logical) CPU devices: N replicas in one
  process;
* ``MultiWorkerMirroredStrategy``: replicas in several processes.

Tables and slots are plain variables created outside the strategy's variable
creator (never mirrored copies that could drift apart). ``apply_gradients``
called by every replica hands its per-id gradients to a ``merge_call``: in
cross-replica context the gradients of all local replicas are concatenated
(across workers, all-gathered, so every worker applies the same update to its
own copy) and the update runs once.
"""

from __future__ import annotations

import contextlib
from typing import Any, List

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib, values_util
from tensorflow.python.ops import resource_variable_ops

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import check_runner

__all__ = ["Replicas", "check_strategy"]

_SUPPORTED = ("the default strategy, OneDeviceStrategy, MirroredStrategy or "
              "MultiWorkerMirroredStrategy over CPU devices")


def _strategy_kinds():
  from tensorflow.python.distribute import (collective_all_reduce_strategy,
                                            mirrored_strategy,
                                            one_device_strategy)
  return (mirrored_strategy.MirroredStrategy,
          collective_all_reduce_strategy.CollectiveAllReduceStrategy,
          one_device_strategy.OneDeviceStrategy)


def check_strategy(strategy):
  """ConfigError unless ``strategy`` is one the emulator runs under."""
  if strategy is _default() or isinstance(strategy, _strategy_kinds()):
    return
  raise errors.ConfigError(
      f"CPUEmbedding cannot emulate the TPU engine under "
      f"{type(strategy).__name__}: its variables are not kept on the replicas "
      f"that look them up. Supported: {_SUPPORTED}. Under a TPUStrategy use "
      "tpu_embed_ext.create_embedding, which picks TPUEmbedding.")


def _default():
  return distribute_lib._get_default_strategy()  # pylint: disable=protected-access


class Replicas:
  """The replicas of the strategy an engine was created under."""

  def __init__(self):
    self.strategy = tf.distribute.get_strategy()
    check_strategy(self.strategy)
    self.distributed = self.strategy is not _default()
    self.num_local = (len(self.strategy.extended.worker_devices)
                      if self.distributed else 1)
    self.num_workers = max(1, self.strategy.num_replicas_in_sync // self.num_local)

  @contextlib.contextmanager
  def single_copy_variables(self):
    """Variables created inside are plain, one copy, on the host device."""
    def creator(next_creator, **kwargs):
      del next_creator  # The strategy's creator would mirror the variable.
      kwargs.pop("distribute_strategy", None)
      return resource_variable_ops.ResourceVariable(**kwargs)

    device = self.strategy.extended.worker_devices[0] if self.distributed else None
    with tf.variable_creator_scope(creator), tf.device(device):
      yield

  def check_not_compiled_across_devices(self):
    """ConfigError for XLA over several local replicas (TensorFlow cannot).

    XLA compiles one device; a ``jit_compile=True`` function around
    ``strategy.run`` over several CPU devices reads variables of the other
    devices, which TensorFlow rejects at run time with a message about
    resource devices (plain Keras models fail the same way). Said here
    first, with the fix.
    """
    if self.num_local > 1 and check_runner.in_xla_context():
      raise errors.ConfigError(
          f"XLA (jit_compile=True) around {self.num_local} "
          f"{type(self.strategy).__name__} replicas cannot run on CPU: XLA "
          "compiles one device, and TensorFlow refuses the other replicas' "
          "variables in it (a plain Keras model fails the same way). Fix: "
          "emulate the replicas with jit_compile=False, or compile one device "
          "with jit_compile=True; on a TPU, TPUStrategy compiles every replica.")

  def in_replica_fn(self) -> bool:
    """Inside ``strategy.run`` of this engine's strategy."""
    if not self.distributed:
      return True
    context = tf.distribute.get_replica_context()
    return context is not None and context.strategy is self.strategy

  def local_replica(self) -> int:
    """This replica's index among the local replicas (0 outside a replica fn)."""
    if not (self.distributed and self.in_replica_fn()):
      return 0
    return int(values_util.get_current_replica_id_as_int() or 0)

  def replica_of_device(self, device: str) -> int:
    """The local replica whose device ``device`` names (``enqueue(device=)``).

    ``TPUEmbedding.enqueue(..., device=d)`` sends one device's batch to the
    TPU core ``d`` (``strategy.extended.worker_devices[i]`` is replica
    ``i``'s); here ``d`` names one of the strategy's (CPU) worker devices.
    """
    try:
      spec = tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError) as e:
      raise errors.InputError(
          f"enqueue(device={device!r}) is not a device name ({e}). Fix: pass "
          "one of strategy.extended.worker_devices.") from e
    devices = (list(self.strategy.extended.worker_devices) if self.distributed
               else ["/job:localhost/replica:0/task:0/device:CPU:0"])
    for i, name in enumerate(devices):
      if _same_device(spec, tf.DeviceSpec.from_string(name)):
        return i
    raise errors.InputError(
        f"enqueue(device={device!r}) names no replica of "
        f"{type(self.strategy).__name__}: its replicas' devices are {devices}. "
        "Fix: pass strategy.extended.worker_devices[i] for replica i's batch, "
        "or distributed values without device=.")

  def split(self, value) -> List[Any]:
    """The per-replica parts of a (nested) value: distributed values split.

    A structure without distributed values is returned whole, once.
    """
    flat = tf.nest.flatten(value, expand_composites=False)
    if not any(isinstance(v, tf.distribute.DistributedValues) for v in flat):
      return [value]
    parts = [self.strategy.experimental_local_results(v)
             if isinstance(v, tf.distribute.DistributedValues) else None
             for v in flat]
    count = max(len(p) for p in parts if p is not None)
    return [tf.nest.pack_sequence_as(
        value, [v if p is None else p[i] for v, p in zip(flat, parts)],
        expand_composites=False) for i in range(count)]

  def merge(self, fn, payload):
    """Runs ``fn(list of every replica's payload)`` once per step.

    Inside a replica fn of a strategy this is a ``merge_call``: ``fn`` runs in
    cross-replica context with the payload of every replica, workers included
    (all-gathered in global replica order, so every worker applies the same
    update to its own copy). Otherwise ``fn([payload])``.
    """
    if not (self.distributed and self.in_replica_fn()):
      return fn([payload])
    return tf.distribute.get_replica_context().merge_call(
        self._merge_fn(fn), args=(payload,))

  def _merge_fn(self, fn):
    def merge_fn(strategy, per_replica):
      flat = tf.nest.flatten(per_replica, expand_composites=False)
      if self.num_workers > 1:
        local = [[strategy.gather(v, axis=0)] for v in flat]
      else:
        local = [strategy.experimental_local_results(v) for v in flat]
        # A tensor every replica passed as the same object (a replicated
        # input, e.g. a batch enqueued once for all) is regrouped into one
        # value: it is every replica's.
        count = max(len(parts) for parts in local)
        local = [tuple(parts) * count if len(parts) == 1 else parts
                 for parts in local]
      return fn([tf.nest.pack_sequence_as(
          per_replica, [parts[i] for parts in local], expand_composites=False)
          for i in range(len(local[0]))])
    return merge_fn


def _same_device(given: tf.DeviceSpec, worker: tf.DeviceSpec) -> bool:
  """``given`` names ``worker``: its unset fields match anything."""
  for field in ("job", "replica", "task"):
    value = getattr(given, field)
    if value is not None and value != getattr(worker, field):
      return False
  return (str(given.device_type or "").upper() == str(worker.device_type).upper()
          and (given.device_index or 0) == worker.device_index)
