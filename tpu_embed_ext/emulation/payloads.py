"""A training step's inputs: what each replica's ``apply_gradients`` hands on,
and the step run once from the payloads of every replica.

A payload is the replica's batch verdict (``check_runner.status``) plus,
for the TF-op back end (``OpsPayload``), per table the occurrence ids and
gradients of every feature on it (``lookups.occurrence_gradients``), or, for
the native kernel (``NativePayload``), its per-feature segments
(``native.update.segment``). Both are ``NamedTuple``s, so nest structures:
``replicas.Replicas.merge`` gathers them through ``merge_call`` (and the
all-gather across workers) as they are, and ``apply`` picks the back end by
their type. Both paths give the same results (docs/native_kernels.md).
"""

from __future__ import annotations

from typing import List, NamedTuple, Sequence, Tuple, Union

import tensorflow as tf

from tpu_embed_ext.emulation import (check_runner, lookups, native, step_pipeline,
                                     structure_checks, updates)
from tpu_embed_ext.emulation.rules import EngineRules

__all__ = ["OpsPayload", "NativePayload", "Payload", "uses_native", "build",
           "apply"]


class OpsPayload(NamedTuple):
  """One replica's step for the TF-op back end (``updates.compute``)."""
  status: tf.Tensor          # check_runner.status of the batch's verdict
  ids: List[tf.Tensor]       # per table: every occurrence's id (-1: none)
  grads: List[tf.Tensor]     # per table: ``[len(ids), dim]`` gradients


class NativePayload(NamedTuple):
  """One replica's step for the native kernel (``native.update.kernel``)."""
  status: tf.Tensor
  segments: List[Tuple[tf.Tensor, ...]]  # per feature: native.update.segment


Payload = Union[OpsPayload, NativePayload]


def uses_native(native_step: bool, rules: EngineRules, tables,
                num_workers: int) -> bool:
  """Whether this step's payload is the native kernel's.

  Across workers the payloads are all-gathered by concatenation, which keeps
  occurrence-form (ids, grads) whole but not the native op's per-replica row
  indices: there the update runs TensorFlow ops. So it does in graphs for
  tables without gradient accumulation: Grappler rewrites the TF-op path's
  rounds (a while loop) otherwise than the straight-line step the kernel
  mirrors (FTRL differed by 2 ulp).
  """
  rounds = rules.accumulation_optional and any(
      not t.optimizer.use_gradient_accumulation for t in tables)
  return (native_step and num_workers == 1
          and not (rounds and not tf.executing_eagerly()))


def build(pending, gradients, tables, features, *, native_update: bool
          ) -> Payload:
  """One replica's payload for its ``pending`` batch and ``gradients``
  (flattened in feature order; None is a zero gradient)."""
  per_table: List[list] = [[] for _ in tables]
  segments = []  # the native update's inputs, one per feature
  for feature, occ, grad in zip(features, pending.occurrences, gradients):
    dim = tables[feature.table].config.dim
    if grad is not None:
      structure_checks.check_gradient(feature.where, grad, list(occ.shape) + [dim])
    if native_update:
      segments.append(native.update.segment(occ, grad, dim))
    else:
      per_table[feature.table].append(lookups.occurrence_gradients(occ, grad, dim))
  status = check_runner.status(pending.verdict)
  if native_update:
    return NativePayload(status, segments)
  return OpsPayload(
      status, [tf.concat([ids for ids, _ in parts], 0) for parts in per_table],
      [tf.concat([g for _, g in parts], 0) for parts in per_table])


def apply(payloads: Sequence[Payload], tables, features, variables, *,
          rules: EngineRules, validate: bool, step: tf.Variable,
          failure: tf.Variable):
  """The step, once, from the payloads of every replica: one pipeline, on
  the native kernel or TF ops (the payloads' type)."""
  step_tables = [
      step_pipeline.Table(t.name, t.optimizer,
                          [variables[t.name][s]
                           for s in ("parameters", *t.optimizer.slot_names)],
                          t.config.vocabulary_size) for t in tables]
  if isinstance(payloads[0], NativePayload):
    backend = native.update.kernel([f.table for f in features],
                                   [f.where for f in features])
  else:
    backend = updates.compute
  return step_pipeline.apply_step(payloads, step_tables, backend, rules=rules,
                                  validate=validate, step=step, failure=failure)
