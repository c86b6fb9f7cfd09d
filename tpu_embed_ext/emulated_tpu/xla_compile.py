"""Replica 0's TensorCore program, compiled with XLA (not run) when first traced.

``xla_check.py`` reads each op of a traced ``strategy.run``; what only XLA's
compiler finds (an argument that must be a compile-time constant but comes
from the data, a shape it cannot bound) needs a real compilation. A TPU
compiles the TensorCore program of a replica with the embedding engine
outside it: activations are its inputs (``RecvTPUEmbeddingActivations``),
gradients its outputs (``SendTPUEmbeddingGradients``). This module builds
that program from the traced graph and compiles it with XLA on CPU without
running it, with every input an unknown value of its static shape (as
TPUCompile sees it), so a shape computed from the data is refused as on a
TPU (``jit_compile=True`` on CPU would instead compile once per value).

The program is replica 0's ops (replicas are identical), minus:

* the embedding engine's ops (made in ``emulation/``, ``sparsecore/``,
  ``emulated_tpu/sparsecore.py`` / ``mid_level.py``): their outputs, the
  activations, are the program's inputs; what the program hands them, the
  gradients, are its outputs;
* cross-replica reductions made in ``merge_call`` (a Keras optimizer's
  all-reduce, ``cross_device_ops.py``): the reduced value is an input, the
  per-replica value an output. A TPU compiles them as an all-reduce in the
  program; here the reduction itself is not compiled (it is a sum);
* ops not placed on a replica's device (the reads of variables the strategy
  makes outside the replica): their values are inputs.

The replica's inputs and variables enter as parameters (variables as
variables of the same dtype and shape); ops of nested functions,
``tf.cond`` and ``tf.while_loop`` bodies are compiled with the op calling them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from typing import Dict, List, Optional

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.eager import wrap_function
from tensorflow.python.framework import ops
from tensorflow.python.ops import handle_data_util, resource_variable_ops

from tpu_embed_ext.emulated_tpu import device_datasets, host_ops


__all__ = ["replica_zero_ops", "compile_replica_program", "failing_op", "not_compiled",
           "warn_once"]

_MERGE_FILES = ("cross_device_ops.py", "cross_device_utils.py")
_SKIPPED_DTYPES = (tf.resource, tf.variant)


def _is_merge(frames) -> bool:
  return any(f.filename.endswith(_MERGE_FILES) for f in frames)


@functools.lru_cache(maxsize=64)
def _replica_index(device: str):
  """The CPU device index of a device string (None: no index or not a CPU)."""
  spec = tf.DeviceSpec.from_string(device)
  return spec.device_index if (spec.device_type or "CPU") == "CPU" else -1


def _on_replica_zero(op) -> bool:
  return bool(op.device) and _replica_index(op.device) in (0, None)


def on_another_replica(op) -> bool:
  """Made on another replica's device than replica 0's: the same function's ops
  again (every replica traces ``strategy.run``'s function), checked once."""
  return bool(op.device) and (_replica_index(op.device) or 0) > 0


# op -> its traceback's frames, for the check of one step (``frames_checked``):
# reading an op's traceback costs a frame object per Python frame, and the
# check and the compile read each op's more than once.
_frame_cache = {}


def frames(op):
  cached = _frame_cache.get(op)
  if cached is None:
    try:
      cached = list(op.traceback)
    except Exception:  # pylint: disable=broad-except
      cached = []
    _frame_cache[op] = cached
  return cached


_frames = frames


@contextlib.contextmanager
def frames_checked():
  """Keeps each op's frames while one step is checked, then lets them go."""
  _frame_cache.clear()
  try:
    yield
  finally:
    _frame_cache.clear()


def _is_replica_id(op, frames) -> bool:
  """``replica_id_in_sync_group``'s constant (``distribute_lib.py``): on a TPU
  an input of the program (``tpu_strategy.py`` ``tpu_function`` passes
  ``constant_op.constant(i)`` per replica to ``tpu.replicate``)."""
  return op.type == "Const" and any(
      f.name == "replica_id_in_sync_group" and f.filename.endswith("distribute_lib.py")
      for f in frames)


def replica_zero_ops(op_list, is_engine, on_host=frozenset(), inputs=frozenset()) -> List:
  """Replica 0's TensorCore ops among those ``strategy.run`` made.

  ``is_engine(frames)``: whether an op made there is the engine's
  (``xla_check``'s rule, passed in: that module calls this one). Ops made in
  ``tf.tpu.outside_compilation`` and ``on_host`` (``(None, op name)``: placed
  on the host by soft placement) are the host's: their values are inputs.
  ``inputs``: names of the ops giving ``strategy.run``'s arguments.
  """
  kept = []
  for op in op_list:
    if (op.type == "Placeholder" or not _on_replica_zero(op)
        or host_ops.is_marked(op) or (None, op.name) in on_host):
      continue
    frames = _frames(op)
    if is_engine(frames) or _is_merge(frames) or _is_replica_id(op, frames):
      continue
    kept.append(op)
  # Constants the program uses, wherever placed (colocated with a variable,
  # made by the engine or in the enclosing function): constants in the
  # program, so that a shape argument they give stays a compile-time
  # constant. Except strategy.run's arguments and the replica id: inputs, as
  # on a TPU (tpu_strategy.py tpu_function passes them to tpu.replicate).
  names = {op.name for op in kept}
  for op in list(kept):
    for t in op.inputs:
      if (t.op.type == "Const" and t.op.name not in names and t.op.name not in inputs
          and not host_ops.is_marked(t.op) and not _is_replica_id(t.op, _frames(t.op))):
        names.add(t.op.name)
        kept.append(t.op)
  order = {op.name: i for i, op in enumerate(op_list)}
  return sorted(kept, key=lambda op: order.get(op.name, -1))


def _tensor_name(t) -> str:
  return t.op.name if t.value_index == 0 else f"{t.op.name}:{t.value_index}"


def _program_graph_def(program_ops, graph, on_host=frozenset()):
  """(GraphDef, feeds, fetches): the ops, outside inputs as placeholders."""
  inside = {op.name for op in program_ops}
  gdef = graph_pb2.GraphDef()
  feeds: Dict[str, tf.Tensor] = {}
  feed_of: Dict[str, str] = {}
  fetches = []
  for op in program_ops:
    node = gdef.node.add()
    node.CopyFrom(op.node_def)
    node.device = ""
    if "_class" in node.attr:  # colocation with ops left out
      del node.attr["_class"]
    del node.input[:]
    for t in op.inputs:
      if t.op.name in inside:
        node.input.append(_tensor_name(t))
      else:
        if t.name not in feed_of:  # one input per outside tensor
          feed_of[t.name] = f"tee_feed_{len(feeds)}"
          feeds[feed_of[t.name]] = t
        node.input.append(feed_of[t.name])
    for c in op.control_inputs:
      if c.name in inside:
        node.input.append("^" + c.name)
    for t in op.outputs:
      if t.dtype in _SKIPPED_DTYPES or t.dtype == tf.string:
        continue  # handles and strings are not a TPU program's outputs
      if not all(c.name in inside for c in t.consumers()) or not t.consumers():
        fetches.append(t)
  for name, t in feeds.items():
    node = gdef.node.add()
    node.name, node.op = name, "Placeholder"
    node.attr["dtype"].type = t.dtype.as_datatype_enum
    if t.dtype != tf.resource:
      node.attr["shape"].shape.CopyFrom(t.shape.as_proto())
  gdef.library.CopyFrom(graph.as_graph_def().library)
  try:  # host ops inside tf.cond / tf.while_loop bodies and nested functions
    host_ops.strip_library(gdef.library, lambda name: getattr(
        graph._get_function(name), "graph", None), gdef.node, on_host)  # pylint: disable=protected-access
  except host_ops.HostValueError as error:
    raise _NotCompiled(f"it receives {error}, which a TPU's program cannot "
                       "stand for here") from None
  gdef.versions.CopyFrom(graph.graph_def_versions)
  return gdef, feeds, fetches


_variables = {}


def _stand_in_variable(t):
  """A variable of the dtype and shape of resource tensor ``t`` (or None)."""
  dtype = shape = None
  try:
    handle_data = handle_data_util.get_resource_handle_data(t)
    if handle_data is not None and handle_data.shape_and_type:
      dtype = tf.as_dtype(handle_data.shape_and_type[0].dtype)
      shape = tf.TensorShape(handle_data.shape_and_type[0].shape)
  except Exception:  # pylint: disable=broad-except
    pass
  if dtype is None:  # what the variable's reads say
    reads = [c for c in t.consumers() if c.type == "ReadVariableOp"]
    if not reads:
      return None
    dtype, shape = reads[0].outputs[0].dtype, reads[0].outputs[0].shape
  if not shape.is_fully_defined() or dtype in _SKIPPED_DTYPES:
    return None
  return _stand_in_variable_of(dtype, shape)


def _only_into_functions(t, program_ops) -> bool:
  """Whether the program's ops take ``t`` only into a function they call."""
  inside = {op.name for op in program_ops}
  users = [c for c in t.consumers() if c.name in inside]
  return bool(users) and all(
      any(v.HasField("func") or v.list.func for v in c.node_def.attr.values())
      for c in users)


def _stand_in_variable_of(dtype, shape):
  key = (dtype, tuple(shape.as_list()))
  if key not in _variables:
    with ops.init_scope():
      _variables[key] = resource_variable_ops.ResourceVariable(
          tf.zeros(shape, dtype), trainable=False)
  return _variables[key]


class _NotCompiled(Exception):
  """Why replica 0's program cannot be built for XLA here (not the user's error)."""


_logged = set()


def compile_replica_program(op_list, graph, is_engine, on_host=frozenset(),
                            inputs=frozenset()) -> Optional[str]:
  """Compiles replica 0's program; returns XLA's error text, or None.

  Where the program cannot be built (an input of unknown shape, a resource
  of unknown type), it is not compiled: one warning says so, and only the
  op check (``xla_check.py``) has run.
  """
  try:
    return _compile(op_list, graph, is_engine, on_host, inputs)
  except _NotCompiled as reason:
    not_compiled(str(reason))
    return None


def warn_once(seen: set, key, logger_name: str, message: str, *args) -> None:
  """Logs ``message`` once per ``key`` (kept in ``seen``)."""
  if key not in seen:
    seen.add(key)
    logging.getLogger(logger_name).warning(message, *args)


def not_compiled(reason: str) -> None:
  """One warning per reason: the program was not compiled, only checked."""
  warn_once(_logged, reason, __name__,
            "Replica 0's TensorCore program was not compiled with XLA (%s): this "
            "step was NOT compiled; only its ops were checked for XLA kernels, so "
            "what only XLA's compiler refuses (a size computed from the data) "
            "passes here and may fail on a TPU.", reason)


def _compile(op_list, graph, is_engine, on_host, inputs) -> Optional[str]:
  program_ops = replica_zero_ops(op_list, is_engine, on_host, inputs)
  if not program_ops:
    return None
  gdef, feeds, fetches = _program_graph_def(program_ops, graph, on_host)
  if not fetches:
    return None
  args, variables = [], {}
  for name, t in feeds.items():
    if t.dtype == tf.resource:
      variable = _stand_in_variable(t)
      if variable is None and _only_into_functions(t, program_ops):
        # A host resource (a summary writer) handed to a tf.cond or loop
        # whose host ops use it, which are out of the program.
        variable = _stand_in_variable_of(tf.float32, tf.TensorShape([]))
      if variable is None:
        raise _NotCompiled(f"the variable of {t.name} has no known dtype and shape")
      variables[name] = variable
    elif t.dtype in (tf.variant, tf.string):
      raise _NotCompiled(f"its input {t.name} is a {t.dtype.name}")
    elif not t.shape.is_fully_defined():
      # A batch read through get_next_as_optional (Keras's
      # steps_per_execution > 1): compiled for the shape the step runs with.
      shape = device_datasets.batch_shape(t.dtype, t.shape)
      if shape is None:
        raise _NotCompiled(f"its input {t.name} has shape {t.shape}, not fully known")
      args.append((name, tf.TensorSpec(shape, t.dtype)))
    else:
      args.append((name, tf.TensorSpec(t.shape, t.dtype)))
  fetch_names = [t.name for t in fetches]
  # Ops with no outputs (variable updates): kept as the program's effects.
  effect_names = [op.name for op in program_ops
                  if not op.outputs and op.type != "NoOp"]
  feed_names = [name for name, _ in args] + list(variables)

  with ops.init_scope():
    try:
      imported = wrap_function.wrap_function(
          lambda: tf.graph_util.import_graph_def(gdef, name=""), [])
      pruned = imported.prune(
          feeds=[imported.graph.get_tensor_by_name(n + ":0") for n in feed_names],
          fetches=([imported.graph.get_tensor_by_name(n) for n in fetch_names] +
                   [imported.graph.get_operation_by_name(n) for n in effect_names]))
    except Exception as error:  # pylint: disable=broad-except
      raise _NotCompiled(f"its graph could not be rebuilt: "
                         f"{type(error).__name__}: {str(error).splitlines()[0]}") from error

  def program(*values):
    graph_now = ops.get_default_graph()  # the variables, captured as such
    return pruned(*values, *[graph_now.capture(v.handle) for v in variables.values()])

  with ops.init_scope():
    compiled = tf.function(program, jit_compile=True, autograph=False)
    specs = [s for _, s in args]
    try:  # tracing the rebuilt program is ours; only XLA's refusal is the user's
      compiled.get_concrete_function(*specs)
    except Exception as error:  # pylint: disable=broad-except
      raise _NotCompiled(f"its rebuilt program could not be traced: "
                         f"{type(error).__name__}: {str(error).splitlines()[0]}") from error
    try:
      compiled.experimental_get_compiler_ir(*specs)(
          stage="hlo", platform_name="CPU")
    except (ValueError, tf.errors.OpError) as error:
      # The program runs as one call: its node names carry the call's scope.
      return re.sub(r"\b(Stateful)?PartitionedCall/", "",
                    str(getattr(error, "message", error)))
  return None


_NODE = re.compile(r"node `?\{?\{?(?:node )?([^`}\s]+)")


def failing_op(error: str, program_ops, graph):
  """The op XLA's error names (searched in nested functions too), or None."""
  by_name = {op.name: op for op in program_ops}
  for name in _NODE.findall(error):
    if name in by_name:
      return by_name[name]
  for name in _NODE.findall(error):
    for function in graph._functions.values():  # pylint: disable=protected-access
      inner = getattr(function, "graph", None)
      if inner is not None:
        try:
          return inner.get_operation_by_name(name)
        except (KeyError, ValueError):
          continue
  return None
