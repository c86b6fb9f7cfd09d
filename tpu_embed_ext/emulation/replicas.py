"""Replica handling: a TPU step over R replicas, on CPU under tf.distribute.

A TPU program runs R replicas; each enqueues and dequeues its own batch, and
the TPU sums the per-id gradients of all replicas and updates every touched
id once, on one copy of each table (docs/semantics.md, section 0). The
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

__all__ = ["check_strategy", "single_copy_variables", "local_replica",
           "local_values", "num_local_replicas", "num_workers",
           "is_distributed", "merge"]

_SUPPORTED = ("the default strategy, OneDeviceStrategy, MirroredStrategy or "
              "MultiWorkerMirroredStrategy over CPU devices")


def _strategy_kinds():
  from tensorflow.python.distribute import (collective_all_reduce_strategy,
                                            mirrored_strategy,
                                            one_device_strategy)
  return (mirrored_strategy.MirroredStrategy,
          collective_all_reduce_strategy.CollectiveAllReduceStrategy,
          one_device_strategy.OneDeviceStrategy)


def check_strategy():
  """ConfigError unless the strategy in scope is one the emulator runs."""
  strategy = tf.distribute.get_strategy()
  if not tf.distribute.has_strategy() or isinstance(strategy, _strategy_kinds()):
    return
  raise errors.ConfigError(
      f"CPUEmbedding cannot emulate the TPU engine under "
      f"{type(strategy).__name__}: its variables are not kept on the replicas "
      f"that look them up. Supported: {_SUPPORTED}. Under a TPUStrategy use "
      "tpu_embed_ext.create_embedding, which picks TPUEmbedding.")


@contextlib.contextmanager
def single_copy_variables():
  """Variables created inside are plain, one copy, whatever strategy is in scope."""
  def creator(next_creator, **kwargs):
    del next_creator  # The strategy's creator would mirror the variable.
    for key in ("distribute_strategy", "experimental_batch_ndims"):
      kwargs.pop(key, None)
    return resource_variable_ops.ResourceVariable(**kwargs)

  strategy = tf.distribute.get_strategy()
  device = (strategy.extended.worker_devices[0] if tf.distribute.has_strategy()
            else None)
  with tf.variable_creator_scope(creator), tf.device(device):
    yield


def is_distributed() -> bool:
  return tf.distribute.has_strategy()


def num_local_replicas() -> int:
  strategy = tf.distribute.get_strategy()
  return len(strategy.extended.worker_devices) if is_distributed() else 1


def num_workers() -> int:
  strategy = tf.distribute.get_strategy()
  return max(1, strategy.num_replicas_in_sync // num_local_replicas())


def local_replica() -> int:
  """This replica's index among the local replicas (0 in cross-replica context)."""
  if tf.distribute.in_cross_replica_context():
    return 0
  replica = values_util.get_current_replica_id_as_int()
  return 0 if replica is None else int(replica)


def local_values(value) -> List[Any]:
  """The per-replica parts of a (nested) value: distributed values split.

  A structure without distributed values belongs to every replica alike
  (returned once).
  """
  flat = tf.nest.flatten(value, expand_composites=False)
  if not any(isinstance(v, distribute_lib.DistributedValues) for v in flat):
    return [value]
  strategy = tf.distribute.get_strategy()
  parts = [strategy.experimental_local_results(v)
           if isinstance(v, distribute_lib.DistributedValues) else None
           for v in flat]
  count = max(len(p) for p in parts if p is not None)
  return [tf.nest.pack_sequence_as(
      value, [v if p is None else p[i] for v, p in zip(flat, parts)],
      expand_composites=False) for i in range(count)]


def merge(fn, payload):
  """Runs ``fn(list of every replica's payload)`` once per step.

  In replica context under a strategy with several replicas this is a
  ``merge_call``: ``fn`` runs in cross-replica context and receives the
  payload of every replica, workers included (in global replica order, so
  every worker applies the same update). Otherwise ``fn([payload])``.
  """
  if not is_distributed() or tf.distribute.in_cross_replica_context():
    return fn([payload])
  context = tf.distribute.get_replica_context()
  return context.merge_call(_merged(fn), args=(payload,))


def _merged(fn):
  def merge_fn(strategy, per_replica):
    flat = tf.nest.flatten(per_replica, expand_composites=False)
    local = [strategy.experimental_local_results(v) for v in flat]
    if num_workers() > 1:
      # Every worker needs the payload of every replica, in the same order.
      local = [[_all_gather(strategy, v)] for v in flat]
    count = len(local[0])
    return fn([tf.nest.pack_sequence_as(
        per_replica, [parts[i] for parts in local], expand_composites=False)
        for i in range(count)])
  return merge_fn


def _all_gather(strategy, value):
  """Concatenation over all replicas of all workers (sizes may differ)."""
  return strategy.gather(value, axis=0)
