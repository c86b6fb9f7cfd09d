"""The enqueue / dequeue / apply_gradients protocol: pending batches.

``TPUEmbedding`` feeds the TPU through a queue: ``enqueue`` sends a batch,
``dequeue`` (inside the TPU step) receives its activations, and
``apply_gradients`` sends the gradients of a batch enqueued with
``training=True`` (``tpu_embedding_v2.py``). How many batches the TPU's queue
holds is not documented, so the emulator holds one batch per replica and
says so instead of losing one:

* ``enqueue`` while the replica's previous batch was neither dequeued nor
  handed to ``apply_gradients`` is an ``InputError`` (the first batch would
  be lost); a batch that was dequeued is replaced (a training batch whose
  gradients were not applied is dropped, and ``step`` does not advance: a
  loop can skip a step that ``apply_gradients`` rejected);
* ``dequeue`` returns the activations of the replica's pending batch, once:
  a second ``dequeue`` of the same batch is an ``InputError`` (on a TPU it
  would wait for the next batch);
* ``apply_gradients`` applies the pending batch (dequeued or not: the
  emulator's own ``EmbeddingLayer`` looks up with ``__call__`` and enqueues
  in the backward pass) and consumes it only once the step was accepted: a
  rejected call (wrong structure, shape, a non-finite gradient) leaves the
  batch pending, so a corrected retry applies it.

A batch belongs to where it was enqueued: eagerly, or the graph a
``tf.function`` traces (and the graphs nested in it, ``tf.cond`` branches and
loop bodies). A batch of another trace or of eager code is invisible there:
its tensors cannot be used, and a trace that failed half way leaves nothing
that blocks the next one.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional

import tensorflow as tf
from tensorflow.python.framework import ops

from tpu_embed_ext import errors
from tpu_embed_ext.emulation import check_runner, lookups

__all__ = ["Pending", "Batches", "route"]


class Pending(NamedTuple):
  """One replica's enqueued batch."""
  features: Any
  occurrences: List[lookups.Occurrences]
  verdict: Optional[check_runner.Verdict]  # the input checks (None when eager)
  training: bool
  graph: Any = None        # where it was enqueued (None: eagerly)
  delivered: bool = False  # dequeued, or handed to apply_gradients


def _current_graph():
  return None if tf.executing_eagerly() else ops.get_default_graph()


def _visible(graph) -> bool:
  """Whether a batch enqueued in ``graph`` can be used here."""
  current = _current_graph()
  if graph is None or current is None:
    return graph is current
  while current is not None:
    if current is graph:
      return True
    current = getattr(current, "outer_graph", None)
  return False


class Batches:
  """The pending batch of every local replica (see the module doc)."""

  def __init__(self):
    self._pending: Dict[int, Pending] = {}

  def put(self, replica: int, pending: Pending, num_local: int):
    """Records ``pending`` as ``replica``'s batch, or raises (nothing changed)."""
    old = self._pending.get(replica)
    if old is not None and _visible(old.graph) and not old.delivered:
      where = f" (replica {replica})" if num_local > 1 else ""
      raise errors.InputError(
          f"enqueue() was called again{where} before the batch enqueued before "
          "it was dequeued: a TPU queues batches, the emulator holds one per "
          "replica and would lose the first. Fix: call dequeue() (and "
          "apply_gradients() when training=True) after each enqueue().")
    self._pending[replica] = pending._replace(graph=_current_graph())

  def visible(self, replica: int) -> bool:
    """Whether ``replica`` has a pending batch that can be used here."""
    pending = self._pending.get(replica)
    return pending is not None and _visible(pending.graph)

  def recorded(self, replica: int) -> Pending:
    """``replica``'s batch as ``put`` recorded it, without ``get``'s checks
    (``TPUEmbeddingV2.enqueue`` returns the batch it just recorded)."""
    return self._pending[replica]

  def check_free(self, replicas: List[int], num_local: int):
    """``put``'s check for several replicas, before any is recorded."""
    for replica in replicas:
      old = self._pending.get(replica)
      if old is not None and _visible(old.graph) and not old.delivered:
        self.put(replica, old, num_local)  # raises

  def get(self, replica: int, what: str) -> Pending:
    """``replica``'s pending batch for ``what`` ("dequeue()", ...), or raises."""
    pending = self._pending.get(replica)
    if pending is None or not _visible(pending.graph):
      elsewhere = (" in this tf.function (a batch enqueued eagerly or in "
                   "another tf.function cannot be used here)"
                   if pending is not None else "")
      raise errors.InputError(
          f"{what} called before enqueue(){elsewhere}. Fix: call "
          "enqueue(features) first, once per step, in the same function as "
          f"{what}.")
    if what == "dequeue()" and pending.delivered:
      raise errors.InputError(
          "dequeue() was called twice for one enqueued batch: on a TPU the "
          "second call waits for the next enqueue(). Fix: enqueue a batch "
          "before each dequeue(), or reuse the activations of the first call.")
    return pending

  def deliver(self, replica: int):
    """Marks ``replica``'s batch as dequeued (or handed to apply_gradients)."""
    self._pending[replica] = self._pending[replica]._replace(delivered=True)

  def consume(self, replica: int):
    """Drops ``replica``'s batch: its step was accepted."""
    self._pending.pop(replica, None)


def route(reps, features, weights, device: Optional[str]) -> Dict[int, Any]:
  """``{replica: (features, weights)}`` of one ``enqueue`` call.

  Inside ``strategy.run`` the batch is the calling replica's; outside it,
  distributed values are split over the local replicas, and one replica's
  values go to the replica whose device ``device`` names (``TPUEmbedding``'s
  per-device feeding); without a strategy, to the one replica.
  """
  if reps.in_replica_fn():
    replica = reps.local_replica()
    if device is not None and reps.replica_of_device(device) != replica:
      raise errors.InputError(
          f"enqueue(device={device!r}) inside strategy.run of replica "
          f"{replica} names replica {reps.replica_of_device(device)}'s device. "
          "Fix: drop device= inside strategy.run (each replica enqueues its "
          "own batch).")
    return {replica: (features, weights)}
  parts = reps.split(features)
  if device is not None:
    if len(parts) > 1 or len(reps.split(weights)) > 1:
      raise errors.InputError(
          f"enqueue(device={device!r}) was given distributed values. Fix: "
          "pass one replica's values with device= "
          "(strategy.experimental_local_results(x)[i]), or distributed "
          "values without device=.")
    return {reps.replica_of_device(device): (features, weights)}
  if len(parts) == 1 and reps.num_local == 1:
    return {0: (parts[0], weights)}
  if len(parts) != reps.num_local:
    raise errors.InputError(
        f"enqueue() outside strategy.run got {len(parts)} batch(es) for "
        f"{reps.num_local} replicas. Fix: pass distributed values "
        "(strategy.experimental_distribute_dataset(...)), one replica's "
        "values with device=strategy.extended.worker_devices[i], or call "
        "enqueue inside strategy.run with each replica's batch.")
  weight_parts = (reps.split(weights) if weights is not None
                  else [None] * len(parts))
  if len(weight_parts) == 1:
    weight_parts = weight_parts * len(parts)
  return dict(enumerate(zip(parts, weight_parts)))
