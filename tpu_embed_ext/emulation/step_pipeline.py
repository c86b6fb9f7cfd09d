"""A training step's update, once, from every replica's payload: one
pipeline, two back ends.

The pipeline: the id check of every replica (``status``), this step's
learning rate of every table and its range check, then a back end gathers
each table's touched rows, sums the gradients of duplicate ids (or keeps
them apart: rounds; or sums into every row: non-lazy Adam), applies the
optimizer's rule (optimizer_rows.py) and computes the rows to write; then
the checks of what is applied and what is written, with one message each
(``finite_verdicts``, rows of checks.py), and the write, gated so that the tables,
slots and ``step`` change together or not at all.

The back ends (``payloads.apply`` picks one):
- ``updates.compute``: TensorFlow ops; returns the rows and a ``write`` to
  run once the checks passed (under XLA, gated by their verdicts);
- ``native.update.kernel(...)``: one op (update_op.cc) that does all of
  the above and writes, or writes nothing and says which check failed; the
  checks here then only raise the message. Same float32 operations in the
  same order, so the same numbers bit for bit (docs/native_kernels.md).
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from tpu_embed_ext.spec import schedules as rates_lib
from tpu_embed_ext.emulation import check_runner, checks
from tpu_embed_ext.emulation.rules import EngineRules

__all__ = ["Table", "Computed", "apply_step", "finite_verdicts", "learning_rate",
           "learning_rates"]


class Table(NamedTuple):
  """One table of the step."""
  name: str
  optimizer: Any       # the resolved optimizer spec
  variables: list      # parameters, then slots in ``optimizer.slot_names`` order
  vocabulary_size: int


class Computed(NamedTuple):
  """What a back end computed. ``checked()`` gives what the checks read:
  per table, what its rule is applied to (``grads``, a list) and the rows it
  writes, per variable (``values``); or, from the native kernel, a stand-in
  of each that is non-finite where the kernel's check failed (made only
  when a check failed, off the kernel's fast path).

  ``write(accept)`` (TF ops) scatters the rows and returns the ops (none
  eagerly); ``accept``, a scalar bool tensor or None, gates it without
  control flow (XLA cannot branch around the dynamic shapes of a step).
  ``write`` None: the kernel has run, and ``accepted`` says whether it
  wrote the step.
  """
  checked: Callable[[], Tuple[List[List[tf.Tensor]], List[List[tf.Tensor]]]]
  write: Optional[Callable[..., List[tf.Operation]]] = None
  accepted: Optional[tf.Tensor] = None


def apply_step(payloads, tables: Sequence[Table], backend: Callable[..., Computed],
               *, rules: EngineRules, validate: bool, step: tf.Variable,
               failure: tf.Variable):
  """The step from every replica's payload (``CPUEmbedding``'s merge):
  ``backend(payloads, tables, status, rates, rate_verdict, rules=,
  validate=)`` computes it (``payloads``: ``payloads.OpsPayload``s or
  ``NativePayload``s, each with its ``status``). Returns the step's op in a graph from the
  native kernel, None from TensorFlow ops (as each did before they shared
  this pipeline)."""
  status = tf.concat([p.status for p in payloads], 0)
  names = [t.name for t in tables]
  rates, rate_verdict = learning_rates(names, [t.optimizer for t in tables])
  computed = backend(payloads, tables, status, rates, rate_verdict,
                     rules=rules, validate=validate)

  def checks(after=None):
    """What each table applies, then what it writes; each assertion runs
    after the one before, so the first failure's message is the one raised
    (a rate of 1e30 also overflows the update)."""
    grads, values = computed.checked()
    return finite_verdicts(names, grads, values,
                           [t.optimizer.slot_names for t in tables], after)

  if computed.write is None:
    return _after_kernel(computed.accepted, checks, step)
  verdicts = [rate_verdict] if rate_verdict is not None else []
  if validate:
    verdicts += checks(rate_verdict.assertion if rate_verdict is not None else None)
  _write(computed.write, status, verdicts, step, failure)
  return None


def _write(write, status, verdicts, step, failure) -> None:
  """The TF-op back end's rows written after every check, or not at all."""
  def commit(accept=None):
    with tf.control_dependencies(write(accept)):
      if accept is None:
        return step.assign_add(1)
      return step.assign_add(tf.cast(accept, tf.int64))

  if tf.executing_eagerly():
    commit()  # every check has raised or passed
    return
  if verdicts and verdicts[0].assertion is None:
    # XLA: no assertion can stop the step, so it is gated instead, and the
    # first failure (ids, gradients, new values) recorded for
    # raise_if_failed.
    accept = tf.reduce_all(status[:, 0] > 0)
    first = tf.gather(status, tf.argmin(status[:, 0]))[1:]
    for verdict in verdicts:
      first = tf.where(accept, verdict.failure, first)
      accept = tf.logical_and(accept, verdict.ok)
    with tf.control_dependencies([commit(accept)]):
      failure.assign(tf.where(accept, failure, first))
    return
  with tf.control_dependencies([status] + [v.assertion for v in verdicts]):
    commit()


def _after_kernel(accepted, checks, step):
  """The kernel wrote the step or nothing; the checks, on its verdicts,
  raise the usual message: ``InputError`` eagerly, the failed assertion in
  a graph. The step counter advances only after the kernel accepted."""
  if tf.executing_eagerly():
    if not bool(accepted):
      checks()  # raises InputError
    step.assign_add(1)
    return None

  def rejected():
    with tf.control_dependencies([v.assertion for v in checks() if v is not None]):
      return tf.constant(False)

  done = tf.cond(accepted, lambda: tf.constant(True), rejected)
  with tf.control_dependencies([done]):
    return step.assign_add(1)


def finite_verdicts(names, grads, values, slot_names, after=None):
  """Verdicts (None eagerly, where they raise) that what every table applies
  (``grads[i]``, a list: per-id sums, so an overflowing sum is caught too)
  and the rows it would write into its parameters and each of its
  ``slot_names`` (``values[i]``) are finite. Each assertion runs after the
  one before (the first after ``after``): the first failure's message is
  the one raised."""
  applied = check_runner.run(checks.GRADIENT_FINITE, [
      check_runner.Item(g, names={"table": n}, at=i)
      for i, (n, gs) in enumerate(zip(names, grads)) for g in gs], after=after)
  variables = [(n, v, x) for n, vs, slots in zip(names, values, slot_names)
               for v, x in zip(("parameters", *slots), vs)]
  written = check_runner.run(checks.UPDATE_FINITE, [
      check_runner.Item(x, names={"table": n, "variable": v}, at=i)
      for i, (n, v, x) in enumerate(variables)],
      after=applied.assertion if applied is not None else None)
  return [applied, written]


def learning_rates(names, specs):
  """``(rates, verdict)``: this step's rate of every table, and the check
  that every user's callable rate is in range (``checks.RATE_IN_RANGE``:
  eagerly it raises, naming the table, before anything is computed or
  written)."""
  cache = {}
  rates = [learning_rate(spec, cache) for spec in specs]
  verdict = check_runner.run(checks.RATE_IN_RANGE, [
      check_runner.Item(tf.cast(r, tf.float32), names={"table": n}, at=i)
      for i, (n, s, r) in enumerate(zip(names, specs, rates))
      if _unchecked_callable(s.learning_rate)])
  return rates, verdict


def _unchecked_callable(lr) -> bool:
  """A user's callable rate: constants and schedules (``learning_rates``'s
  bound callables carry theirs as ``.schedule``) were checked over their
  whole range when the spec was made. Under Adam's bias correction a user's
  callable is checked times the correction factor, the rate applied."""
  return callable(lr) and not isinstance(getattr(lr, "schedule", None),
                                         rates_lib.Schedule)


def learning_rate(spec, cache: dict) -> tf.Tensor:
  """This step's learning rate; one evaluation per distinct callable (tag)."""
  lr = spec.learning_rate
  if not callable(lr):
    return tf.constant(lr, tf.float32)
  if id(lr) not in cache:
    cache[id(lr)] = tf.cast(lr(), tf.float32)
  return cache[id(lr)]
