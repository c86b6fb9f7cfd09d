"""``TPUEmbeddingV2(pipeline_execution_with_tensor_core=True)`` on the emulated TPU.

What a TPU does (TensorFlow 2.21). ``TPUEmbeddingV2`` tags the ops of its
lookups (``forward``) and of ``apply_gradients`` (``backward``) with the
attribute ``_embedding_pipelining`` (``EmbeddingPipeliningContext`` in
``tpu_embedding_v3.py``). The TPU compiler's ``EmbeddingPipeliningPass``
(``tensorflow/compiler/mlir/tensorflow/transforms/embedding_pipelining.cc``)
then splits the body of the ``tf.while_loop`` that holds them into the
SparseCore forward pass, the TensorCore step and the SparseCore backward pass,
and staggers them: iteration ``i`` runs ``backward(i-2)``, ``core(i-1)``,
``forward(i)``. So the lookups of step ``i`` of a loop see the tables after
steps ``0..i-2``: before the previous step's update (one step old). Updates
themselves stay in order; after the loop the last two steps are finished
(drained), so a loop's first step sees every earlier update. TensorFlow runs
the step sequentially instead when summaries are recorded while the step is
traced (``tf.summary.record_if`` with a default writer), inside
``embedding_context_utils.SequentialEmbeddingContext``, or when the program
writes summaries (``WriteSummary`` ops: ``UseEmbeddingPipelining`` in the
pass).

What the emulation does. The lookups and updates get the same attribute,
set by TensorFlow's own ``EmbeddingPipeliningContext``. In a graph, a lookup
inside a ``tf.while_loop`` body (``for _ in tf.range(n)`` in a
``tf.function``, Keras ``steps_per_execution``) reads the tables through
``Lag``: each pipelined ``apply_gradients`` records, per table, the rows it is
about to change with their values before the change, and the next iteration's
lookups use those values for those rows. The record is emptied before every
run of the loop (an op placed before the ``While`` op), so the first step of a
loop sees every earlier update, as after the TPU's drain. Lookups outside a
loop (eager steps, one step per ``tf.function`` call) see every earlier update:
the pass pipelines a loop's iterations and nothing else. Sequential steps
(the three conditions above, seen when the lookup or ``apply_gradients`` is
traced) record nothing. A pipelined loop step traced with a default summary
writer while recording is not switched off raises ``NotEmulatedError``: a
``tf.summary`` call later in the program would make the TPU run the loop
sequentially, and the emulation cannot see it while tracing the step.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Optional

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_v2_func_graphs, summary_ops_v2
from tensorflow.python.tpu import embedding_context_utils as ecu
from tensorflow.python.tpu import tpu_embedding_v3 as tf_v3

from tpu_embed_ext.emulated_tpu.errors import NotEmulatedError
from tpu_embed_ext.emulation import lookups

__all__ = ["Lag", "PipelinedSteps", "tagged", "while_body", "sequential_reason",
           "check_summaries_known"]

FORWARD = tf_v3._PIPELINE_MODE_FORWARD  # pylint: disable=protected-access
BACKWARD = tf_v3._PIPELINE_MODE_BACKWARD  # pylint: disable=protected-access


@contextlib.contextmanager
def tagged(mode: str, enable: bool):
  """Ops made inside carry ``_embedding_pipelining`` as TensorFlow's would."""
  if not enable or tf.executing_eagerly():
    yield
    return
  context = tf_v3.EmbeddingPipeliningContext(mode, enable)
  context.Enter()
  try:
    yield
  finally:
    context.Exit()


def while_body():
  """The innermost ``tf.while_loop`` body graph being traced, or None."""
  if tf.executing_eagerly():
    return None
  graph = ops.get_default_graph()
  while graph is not None:
    if isinstance(graph, control_flow_v2_func_graphs.WhileBodyFuncGraph):
      return graph
    graph = getattr(graph, "outer_graph", None)
  return None


def _writes_summaries(graph) -> bool:
  while graph is not None:
    if any(op.type in ("WriteSummary", "WriteScalarSummary",
                       "WriteHistogramSummary", "WriteImageSummary",
                       "WriteAudioSummary", "WriteRawProtoSummary")
           for op in graph.get_operations()):
      return True
    graph = getattr(graph, "outer_graph", None)
  return False


def sequential_reason() -> Optional[str]:
  """Why TensorFlow runs the step being traced sequentially, or None."""
  recording = summary_ops_v2.is_recording_summaries()
  if isinstance(recording, bool) and recording:
    return "summaries are recorded"
  if not ecu.embedding_pipelining_state.enabled:
    return "SequentialEmbeddingContext"
  if _writes_summaries(ops.get_default_graph()):
    return "the program writes summaries"
  return None


def check_summaries_known() -> None:
  """NotEmulatedError when the program may write summaries later in its trace.

  Called for a pipelined step once ``sequential_reason`` found none: with a
  default writer and recording not switched off, a ``tf.summary`` call made
  after this point (later in the loop body, or after the loop) adds the
  ``WriteSummary`` op that makes the TPU compiler run the loop sequentially,
  which the emulation cannot know while it traces the step.
  """
  recording = summary_ops_v2._summary_state.is_recording  # pylint: disable=protected-access
  if summary_ops_v2.has_default_writer() and recording is not False:
    raise NotEmulatedError(
        "TPUEmbeddingV2(pipeline_execution_with_tensor_core=True) traced a loop "
        "step with a default summary writer: a TPU runs the loop sequentially if "
        "the program writes any summary, and the emulation cannot see summaries "
        "written after this step is traced. Fix: trace it under "
        "tf.summary.record_if(False) (pipelined), under "
        "tf.summary.record_if(True) or SequentialEmbeddingContext (sequential), "
        "or without a default writer.")


class Lag:
  """Per table, the rows the previous pipelined step changed, before it.

  ``ids[t]`` (sorted, unique, int64) and ``rows[t]`` (``[len(ids), dim]``)
  are variables of any length, one copy on the host device.
  """

  def __init__(self, dims: Dict[str, int], variable_scope):
    # Loop bodies whose loop empties the record first (weak: a new graph may
    # reuse a collected one's id).
    self._reset_in = weakref.WeakSet()
    with tf.init_scope(), variable_scope():
      self.ids = {t: tf.Variable(tf.zeros([0], tf.int64), trainable=False,
                                 shape=tf.TensorShape([None]), name=f"{t}_lag_ids")
                  for t in dims}
      self.rows = {t: tf.Variable(tf.zeros([0, d], tf.float32), trainable=False,
                                  shape=tf.TensorShape([None, d]),
                                  name=f"{t}_lag_rows")
                   for t, d in dims.items()}

  def _clear_ops(self):
    return [v.assign(tf.zeros([0] + v.shape.as_list()[1:], v.dtype))
            for v in (*self.ids.values(), *self.rows.values())]

  def reset_before(self, body) -> None:
    """Empties the record before every run of ``body``'s loop (once per trace)."""
    if body in self._reset_in:
      return
    self._reset_in.add(body)
    outer = body.outer_graph
    # Made in the graph that holds the While op, before it exists: automatic
    # control dependencies run it first (the loop captures these variables).
    with outer.as_default(), ops.control_dependencies(None):
      self._clear_ops()

  def clear(self):
    return tf.group(self._clear_ops())

  def record(self, table: str, params, touched_ids):
    """Saves ``params``' rows of ``touched_ids`` (-1: none) before they change."""
    ids = tf.boolean_mask(touched_ids, touched_ids >= 0)
    ids = tf.sort(tf.unique(ids)[0])
    return tf.group(self.ids[table].assign(ids),
                    self.rows[table].assign(tf.gather(params, ids)))

  def rows_for(self, table: str, params, ids, check=None):
    """``(rows, index)``: ``rows[index]`` are ``params``' rows of ``ids`` as
    the previous step left them to this step (``params`` before its update)."""
    unique, index = tf.unique(ids, out_idx=tf.int64)
    with tf.control_dependencies([check] if check is not None else []):
      current = tf.gather(params, unique)
    lag_ids = self.ids[table].read_value()
    lag_rows = self.rows[table].read_value()
    at = tf.searchsorted(lag_ids, unique, out_type=tf.int64)  # in [0, len]
    # A sentinel entry at the end keeps every gather in range.
    padded_ids = tf.concat([lag_ids, [-1]], 0)
    padded_rows = tf.concat(
        [lag_rows, tf.zeros([1] + lag_rows.shape.as_list()[1:], lag_rows.dtype)], 0)
    found = tf.equal(tf.gather(padded_ids, at), unique)
    old = tf.gather(padded_rows, at)
    return tf.where(found[:, None], tf.cast(old, current.dtype), current), index


class PipelinedSteps:
  """Mixin for the emulated ``TPUEmbeddingV2`` (before ``CPUEmbedding`` in
  the bases): lookups and updates as pipelined on a TPU (module doc)."""

  def _init_pipelining(self, enable: bool):
    object.__setattr__(self, "_pipelining", bool(enable))
    object.__setattr__(self, "_lag", None)
    object.__setattr__(self, "_lag_mode", None)  # "read" / "record" / "clear"
    object.__setattr__(self, "_sequential_bodies", weakref.WeakSet())
    if enable:
      object.__setattr__(self, "_lag", Lag(
          {t.name: t.config.dim for t in self._tables},
          self._replicas.single_copy_variables))

  @contextlib.contextmanager
  def _pipelined(self, mode: str):
    """Tags the ops made inside; sets how they use the ``Lag``."""
    body = while_body() if self._pipelining else None
    lag_mode = None
    if body is not None:
      sequential = sequential_reason() is not None
      if not sequential:
        check_summaries_known()
      if mode == FORWARD:
        self._lag.reset_before(body)
        if sequential:
          self._sequential_bodies.add(body)
        else:
          lag_mode = "read"
      else:
        lag_mode = ("clear" if sequential or body in self._sequential_bodies
                    else "record")
    previous = self._lag_mode
    object.__setattr__(self, "_lag_mode", lag_mode)
    try:
      with tagged(mode, self._pipelining):
        yield
    finally:
      object.__setattr__(self, "_lag_mode", previous)

  def _native_step(self) -> bool:
    # A recording step reads the TF-op payload's ids; both paths give the
    # same results (docs/native_kernels.md).
    return self._lag_mode is None and super()._native_step()

  def _table_lookup(self, table, occ, gate=None):
    if self._lag_mode != "read":
      return super()._table_lookup(table, occ, gate)
    # The table's rows as the previous step left them: one step old.
    rows, index = self._lag.rows_for(
        table.name, self._table_vars[table.name]["parameters"], occ.ids, gate)
    return lookups.activation(rows, occ._replace(ids=index), table.config)

  def _apply_payloads(self, replica_payloads):
    if self._lag_mode == "clear":
      with tf.control_dependencies([self._lag.clear()]):
        return super()._apply_payloads(replica_payloads)
    if self._lag_mode != "record":
      return super()._apply_payloads(replica_payloads)
    # Recording steps build TF-op payloads (_native_step): ids per table.
    saved = []
    for k, table in enumerate(self._tables):
      ids = tf.concat([p.ids[k] for p in replica_payloads], 0)
      saved.append(self._lag.record(
          table.name, self._table_vars[table.name]["parameters"], ids))
    with tf.control_dependencies(saved):
      return super()._apply_payloads(replica_payloads)
