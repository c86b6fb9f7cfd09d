"""What the emulated ``TPUEmbeddingV2.enqueue`` returns: the batch, per stacked table.

TensorFlow's ``enqueue`` returns ``{stacked table: (PartitionedCsrFormatTensor,
sizes)}``: the batch itself, preprocessed on the host, which ``dequeue`` and
``apply_gradients`` read. Programs may call ``enqueue`` in one ``tf.function``
and pass its output into ``strategy.run`` in another (TensorFlow's own
pipelining test does), so the output has to carry the batch. The emulation
cannot build SparseCore's CSR buffers (TensorFlow's CPU wheel has no kernels
for its preprocessing ops); each stack's value is a ``PartitionedBatch``
instead: the number of ids the stack received, and the engine's occurrence
tensors (ids, output rows, gains, rows of the output) of every feature on the
stack, which are exactly what the engine's lookup and update read.

``unpack`` rebuilds the engine's pending batch from such a dict when the batch
was enqueued where the reading code cannot see it (another ``tf.function``).
The batch's input checks ran where it was enqueued; their outcome travels
with it (``ok``, ``failure``, ``per_item_ok``), so a step that ``enqueue``
could not stop (XLA) still writes nothing.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import tensorflow as tf

from tpu_embed_ext.emulation import check_runner, lookups, protocol

__all__ = ["PartitionedBatch", "pack", "unpack"]


class PartitionedBatch(NamedTuple):
  """One stacked table's part of an enqueued batch (see the module doc)."""
  ids: tf.Tensor
  """int32 scalar: the ids the stack received."""
  features: tuple
  """Per feature on the stack, in flat feature order: (ids, rows, gains, num_rows)."""
  checks: Optional[tuple] = None
  """(ok, failure, per_item_ok) of the batch's input checks, or None."""


def pack(stacks: Sequence[str], feature_stacks: Sequence[str],
         pendings: Sequence[protocol.Pending]) -> Dict[str, PartitionedBatch]:
  """``{stack: PartitionedBatch}`` of the batches of ``pendings`` (one per
  replica just enqueued); the occurrences travel only for a single replica."""
  counts = {stack: [] for stack in stacks}
  for pending in pendings:
    for stack, occ in zip(feature_stacks, pending.occurrences):
      counts[stack].append(tf.size(occ.ids, tf.int32))
  single = pendings[0] if len(pendings) == 1 else None
  checks = None
  if single is not None and single.verdict is not None:
    v = single.verdict
    checks = (v.ok, v.failure, v.per_item_ok)
  out = {}
  for stack in stacks:
    features = ()
    if single is not None:
      features = tuple(
          (occ.ids, occ.rows, occ.gains, occ.num_rows)
          for s, occ in zip(feature_stacks, single.occurrences)
          if s == stack and occ.kept is None)
    out[stack] = PartitionedBatch(
        tf.add_n(counts[stack]) if counts[stack] else tf.zeros([], tf.int32),
        features, checks)
  return out


def unpack(partitioned: Dict[str, Any], feature_stacks: Sequence[str],
           shapes: Sequence[tf.TensorShape], feature_config) -> Optional[protocol.Pending]:
  """The pending training batch ``pack`` put in ``partitioned``, or None if
  it carries none (several replicas' batches, or not ``pack``'s output)."""
  per_stack: Dict[str, List[tuple]] = {}
  for stack, value in partitioned.items():
    if not isinstance(value, PartitionedBatch):
      return None
    per_stack[stack] = list(value.features)
  occurrences = []
  for stack, shape in zip(feature_stacks, shapes):
    if not per_stack.get(stack):
      return None
    ids, rows, gains, num_rows = per_stack[stack].pop(0)
    occurrences.append(lookups.Occurrences(ids, rows, gains, num_rows,
                                           shape.as_list()))
  if any(per_stack.values()):
    return None
  checks = next(iter(partitioned.values())).checks
  verdict = None
  if checks is not None:
    ok, failure, per_item_ok = checks
    verdict = check_runner.Verdict(ok, None, failure, per_item_ok)
  return protocol.Pending(feature_config, occurrences, verdict, True)
