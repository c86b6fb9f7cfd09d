"""Each replica's step, checked when first traced to compile with XLA as a TPU's must.

A TPU compiles the program of every replica (``strategy.run``'s function)
with XLA; the embedding engine's work (lookups, the cross-replica sum of
gradients, the table update) is not in that program: it runs on the
embedding engine or SparseCore, and the program receives activations and
sends gradients. The emulated TPU runs the steps as TensorFlow ops on CPU
devices, so a program no TPU could compile would pass silently. With XLA on
(``emulate_tpu(xla=True)``, the default), when ``strategy.run`` is traced in
a ``tf.function`` every op the replica function made (nested functions,
``tf.cond`` / ``tf.while_loop`` bodies included), except the engine's, is
checked against these rules, except ops made in
``tf.compat.v1.tpu.outside_compilation`` (the host's: ``host_ops.py``). The
first op that fails raises ``NotCompilableError`` (a
``tf.errors.InvalidArgumentError`` with XLA's phrase first) naming the op,
the user's line and the fix, the TPU's own first, when soft device placement
is off (TensorFlow's default while a function is traced: ``context.py`` sets
``allow_soft_placement = executing_eagerly()`` unless it was set); when it is
on a TPU places such ops on its host CPU ("Automatic outside compilation is
enabled. Ops without XLA kernels will be automatically placed on CPU.",
``tpu.py``) and compiles the rest, and the emulated TPU runs them too,
logging one warning per op and line, and compiles the rest without them:

* the op has an XLA kernel: TensorFlow's ``tf2xla`` registrations for
  ``XLA_CPU_JIT`` (read from TensorFlow's kernel registry, where they appear
  once XLA has initialised), with the op's types among those the kernel
  accepts. ``tf.py_function`` / ``tf.numpy_function`` (``EagerPyFunc``,
  ``PyFunc``) and string ops have none;
* every type is one a TPU compiles: ``kTpuAllTypes`` in TensorFlow's
  ``tensorflow/core/tpu/tpu_defs.h`` (the types ``REGISTER_XLA_BACKEND(
  DEVICE_TPU_XLA_JIT, kTpuAllTypes, TpuOpFilter)`` gives every TPU kernel;
  ``TpuOpFilter`` allows strings in ``Const`` and ``Assert`` only). It holds
  ``DT_DOUBLE``: float64 compiles on a TPU (slowly) and is not refused. It
  lacks ``complex128``, which XLA on CPU compiles: refused, as on a TPU;
* shapes that depend on the data are not refused here: XLA compiles them,
  on CPU as on a TPU, with bounded dynamic dimensions (``tf.boolean_mask``,
  ``tf.unique``, ``tf.where(x)``, ``RaggedTensor.from_tensor``; tf2xla
  registers its kernels for every XLA device, and ``tpu.py`` turns the TPU's
  dynamic padder on by default).

Then replica 0's TensorCore program is compiled with XLA on CPU, not run
(``xla_compile.py``: the engine's ops, the host's and ``merge_call``'s
cross-replica sums are cut out, their values the program's inputs and
outputs; ``strategy.run``'s arguments and the replica id are inputs, as
``tpu_strategy.py`` passes them to ``tpu.replicate``). What only XLA's
compiler finds (an argument that must be a compile-time constant but
is computed from the data's values, as in ``tf.zeros([tf.reduce_max(x)])``)
is refused then, whatever the soft placement, with XLA's words first
(``compile_program``).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Iterable, List, Optional, Set

import tensorflow as tf
from tensorflow.python.framework import kernels, ops

from tpu_embed_ext.emulated_tpu import host_ops, xla_compile
from tpu_embed_ext.emulated_tpu.errors import EmulationError

__all__ = ["NotCompilableError", "replica_program", "check_ops", "first_problem"]


class NotCompilableError(EmulationError, tf.errors.InvalidArgumentError):
  """A replica's step no TPU could compile with XLA.

  TensorFlow's class for XLA's refusal (``InvalidArgumentError``), its phrase
  first ("Detected unsupported operations when trying to compile graph ...
  on XLA_TPU_JIT"), so tests written against a TPU match it.
  """

  def __init__(self, message: str):
    tf.errors.InvalidArgumentError.__init__(self, None, None, message)

  def __str__(self):
    return self.message


# tensorflow/core/tpu/tpu_defs.h, kTpuAllTypes (TensorFlow 2.21).
TPU_TYPES = frozenset(tf.as_dtype(t).as_datatype_enum for t in (
    tf.int32, tf.uint32, tf.float16, tf.bfloat16, tf.float32, tf.float64,
    tf.bool, tf.complex64, tf.int64, tf.uint64, tf.qint8, tf.quint8,
    tf.qint32, tf.int8, tf.uint8, tf.int16, tf.uint16)) | frozenset(
        getattr(tf.dtypes, name).as_datatype_enum
        for name in ("float8_e4m3fn", "float8_e5m2", "int4", "uint4",
                     "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2fnuz")
        if hasattr(tf.dtypes, name))
_STRING = tf.string.as_datatype_enum
# TpuOpFilter (tensorflow/core/tpu/tpu_node_device_util.cc) adds DT_STRING to
# these two kernels only (string messages of asserts, dropped by XLA).
_TPU_STRING_OPS = frozenset(["Const", "Assert"])

# Files whose ops are the embedding engine's (outside the TPU program) or
# this package's machinery, not the user's program.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENGINE_DIRS = tuple(os.path.join(_PACKAGE, d) + os.sep
                     for d in ("emulation", "sparsecore"))
_ENGINE_FILES = tuple(os.path.join(_PACKAGE, "emulated_tpu", f)
                      for f in ("sparsecore.py", "mid_level.py"))
_LIBRARY_MARKERS = (os.sep + "tensorflow" + os.sep, os.sep + "keras" + os.sep,
                    os.sep + "keras_rs" + os.sep, os.sep + "tf_keras" + os.sep,
                    os.sep + "tensorboard" + os.sep,
                    _PACKAGE + os.sep)

_FIX = {
    "EagerPyFunc": "compute it with TensorFlow ops, or outside strategy.run "
                   "(in the input pipeline)",
    "PyFunc": "compute it with TensorFlow ops, or outside strategy.run (in "
              "the input pipeline)",
    "PyFuncStateless": "compute it with TensorFlow ops, or outside "
                       "strategy.run (in the input pipeline)",
}
_FIX_STRING = ("turn strings into numbers in the input pipeline (tf.data), "
               "outside strategy.run")
_FIX_KERNEL = "replace it with ops XLA compiles, or move it outside strategy.run"
# A TPU's own ways to run such an op in a step (tpu_replication.py, tpu.py).
_FIX_HOST = ("run it on the TPU's host with tf.compat.v1.tpu.outside_compilation(fn, ...) "
             "inside the step, or let TensorFlow place it there with "
             "tf.config.set_soft_device_placement(True); or ")
_FIX_TYPE = "cast to a type a TPU has (float32, bfloat16, int32...)"
_OFF = "; or run with XLA off (emulate_tpu(xla=False), emulate --no-xla, pytest --emulate-tpu-no-xla)"

# A function's inputs and captures: the compiled program's parameters.
_PROGRAM_INPUTS = frozenset(["Placeholder"])

_REPLICA_GRAPH = "(each replica's program)"

_xla_initialised = False


def _ensure_xla_kernels():
  """XLA registers its kernels (``XLA_CPU_JIT``) when it first compiles."""
  global _xla_initialised
  if not _xla_initialised:
    with ops.init_scope():
      tf.function(lambda x: x + 1, jit_compile=True)(tf.constant(0))
    _xla_initialised = True


_kernel_cache = {}


def _xla_kernels(op_type: str):
  if op_type not in _kernel_cache:
    _kernel_cache[op_type] = [
        k for k in kernels.get_registered_kernels_for_op(op_type).kernel
        if k.device_type == "XLA_CPU_JIT"]
  return _kernel_cache[op_type]


def _attr_types(op, name) -> List[int]:
  value = op.node_def.attr.get(name)
  if value is None:
    return []
  if value.HasField("type"):
    return [value.type]
  return list(value.list.type)


def _all_types(op) -> Set[int]:
  types = {t.dtype.base_dtype.as_datatype_enum for t in list(op.inputs) + op.outputs}
  return types - {tf.resource.as_datatype_enum, tf.variant.as_datatype_enum}


def _kernel_problem(op) -> Optional[str]:
  """Why ``op`` has no XLA kernel a TPU has (None if it has one)."""
  defs = _xla_kernels(op.type)
  if not defs:
    return f"no XLA kernel for op {op.type}"
  for kernel in defs:
    if all(all(t in c.allowed_values.list.type for t in _attr_types(op, c.name))
           for c in kernel.constraint):
      break
  else:
    names = sorted({tf.as_dtype(t).name for c in defs[0].constraint
                    for t in _attr_types(op, c.name)})
    return f"no XLA kernel for op {op.type} on {', '.join(names)}"
  for t in sorted(_all_types(op)):
    if t not in TPU_TYPES and not (t == _STRING and op.type in _TPU_STRING_OPS):
      return f"op {op.type} has type {tf.as_dtype(t).name}, which a TPU does not compile"
  return None


_frames = xla_compile.frames


def _is_engine(frames) -> bool:
  return any(f.filename.startswith(_ENGINE_DIRS) or f.filename in _ENGINE_FILES
             for f in frames)


def _autograph_origin(filename: str, lineno: int):
  """The user's (file, line) of a line of autograph's generated code, or None.

  Autograph keeps, per converted function, the generated module and its
  source map (``pyct/transpiler.py``); TensorFlow's own error messages are
  mapped back the same way (``autograph/impl/api.py``).
  """
  try:
    from tensorflow.python.autograph.impl import api  # pylint: disable=g-import-not-at-top
    from tensorflow.python.autograph.pyct import origin_info  # pylint: disable=g-import-not-at-top
    for per_key in list(api._TRANSPILER._cache._cache.values()):  # pylint: disable=protected-access
      for factory in list(per_key.values()):
        if getattr(getattr(factory, "module", None), "__file__", None) != filename:
          continue
        origin = factory.source_map.get(origin_info.LineLocation(filename, lineno))
        if origin is not None:
          return origin.loc.filename, origin.loc.lineno
  except Exception:  # pylint: disable=broad-except
    return None
  return None


def _user_line(frames) -> str:
  for f in reversed(frames):
    filename, lineno = f.filename, f.lineno
    if "__autograph_generated_file" in filename:
      filename, lineno = _autograph_origin(filename, lineno) or (filename, lineno)
    name = os.path.abspath(filename)
    if not any(m in name for m in _LIBRARY_MARKERS) and not filename.startswith("<"):
      return f"{filename}:{lineno}"
  return "(no line outside TensorFlow and Keras)"


def _function_graphs(op, graph) -> Iterable:
  """The graphs of the functions ``op`` calls (nested tf.function, cond, while)."""
  for value in op.node_def.attr.values():
    names = ([value.func.name] if value.HasField("func") else
             [f.name for f in value.list.func])
    for name in names:
      if not name:
        continue
      function = graph._get_function(name)  # pylint: disable=protected-access
      inner = getattr(function, "graph", None) if function is not None else None
      if inner is not None:
        yield name, inner


# cond_v2 / while_v2 keep a branch's intermediates for the gradient in
# Optional variants only outside an XLA context
# (control_flow_util.GraphOrParentsInXlaContext); a TPU traces the replica
# function inside one, so these ops are never in its program.
_CONTROL_FLOW_FILES = ("cond_v2.py", "while_v2.py", "control_flow_util_v2.py")


def _control_flow_plumbing(op, frames) -> bool:
  return op.type.startswith("Optional") and any(
      f.filename.replace("\\", "/").endswith(
          tuple(f"tensorflow/python/ops/{n}" for n in _CONTROL_FLOW_FILES))
      for f in frames)


def problems(op_list, graph, function=None, seen=None, first=False):
  """[(op, problem, frames, function name or None)] of ops no TPU compiles.

  Ops made in ``tf.tpu.outside_compilation`` are the host's, not checked
  (``host_ops.py``); ``first``: stop at the first problem.
  """
  seen = set() if seen is None else seen
  found = []
  for op in op_list:
    if op.type in _PROGRAM_INPUTS or host_ops.is_marked(op):
      continue
    frames = _frames(op)
    if _is_engine(frames) or _control_flow_plumbing(op, frames):
      continue
    problem = _kernel_problem(op)
    if problem is not None:
      found.append((op, problem, frames, function))
      if first:
        return found
      continue
    for name, inner in _function_graphs(op, graph):
      if id(inner) in seen:
        continue
      seen.add(id(inner))
      found += problems(inner.get_operations(), inner, name, seen, first)
      if first and found:
        return found
  return found


def first_problem(op_list, graph):
  """(op, problem, frames) of the first op no TPU compiles, or None."""
  found = problems(op_list, graph, first=True)
  return found[0][:3] if found else None


def _message(op, problem, frames) -> str:
  fix = (_FIX.get(op.type) or
         (_FIX_STRING if tf.string.as_datatype_enum in _all_types(op) else
          _FIX_TYPE if "which a TPU does not compile" in problem else _FIX_KERNEL))
  if problem.startswith("no XLA kernel"):
    # TensorFlow's own words for it (tf2xla, compile_util / xla_compiler).
    head = (f"{op.type} (No registered '{op.type}' OpKernel for XLA_TPU_JIT "
            f"devices compatible with node {{{{node {op.name}}}}})")
  else:
    head = f"{op.type} ({problem}; node {op.name})"
  host = "" if "which a TPU does not compile" in problem else _FIX_HOST
  return ("Detected unsupported operations when trying to compile graph "
          f"{_REPLICA_GRAPH} on XLA_TPU_JIT: {head}: emulated TPU: made at "
          f"{_user_line(frames)} in the function given to strategy.run. "
          f"Fix: {host}{fix}{_OFF}.")


_warned = set()


def check_ops(op_list, graph):
  """The ops a TPU places on its host; raises ``NotCompilableError`` for the
  first op no TPU compiles unless soft device placement is on.

  With soft placement on a TPU places ops without XLA kernels on its host
  CPU ("Automatic outside compilation", ``tpu.py``
  ``split_compile_and_replicate``: ``allow_soft_placement =
  config.get_soft_device_placement()``, read while the step is traced, where
  ``context.py`` makes it False unless set) and compiles the rest; so does the
  emulated TPU, with one warning per op and line. Returns
  ``{(function name or None, op name)}`` of those ops.
  """
  _ensure_xla_kernels()
  soft = tf.config.get_soft_device_placement()
  found = problems(op_list, graph, first=not soft)
  if not found:
    return frozenset()
  if not soft:
    raise NotCompilableError(_message(*found[0][:3]))
  for op, problem, frames, _ in found:
    line = _user_line(frames)
    xla_compile.warn_once(
        _warned, (op.type, line), __name__,
        "%s (%s, made at %s) in the function given to strategy.run: a TPU runs "
        "it on its host CPU (automatic outside compilation, as soft device "
        "placement is on), a host round trip per step, and compiles the rest "
        "of the step (compiled here too); with soft placement off it refuses "
        "the step. To place it on the host yourself, wrap it in "
        "tf.compat.v1.tpu.outside_compilation.", problem, op.name, line)
  return frozenset((function, op.name) for op, _, _, function in found)


_FIX_CONSTANT = ("compute it from static values (Python numbers, tensor.shape), "
                 "or pad to a fixed size: a TPU compiles the step before it "
                 "sees the data, with strategy.run's arguments and the replica "
                 "id as the program's inputs")
_FIX_COMPILE = ("move it to the host with tf.compat.v1.tpu.outside_compilation, or change "
                "the op or its arguments so that XLA compiles it")


def compile_message(error: str, op) -> str:
  """XLA's refusal, its words first, with the user's line and the fix."""
  head = error.strip().splitlines()[0].strip() if error.strip() else "XLA compilation failed"
  head = head.removeprefix("Failed getting HLO text: ").strip("'\" ")
  line = (_user_line(_frames(op)) if op is not None else
          "(a line XLA did not name; the node is named above)")
  fix = _FIX_CONSTANT if "compile-time constant" in error else _FIX_COMPILE
  return (f"{head.rstrip('.')}: emulated TPU: made at {line} in the function given to "
          f"strategy.run (replica 0's TensorCore program, compiled with XLA "
          f"on CPU at first trace). Fix: {fix}{_OFF}.")


_OUR_PLUMBING = re.compile(r"input \S+ is not found|duplicate function|Function \S+ is not defined")


def compile_program(op_list, graph, on_host=frozenset(), inputs=frozenset()):
  """Compiles replica 0's TensorCore program; raises what XLA refuses."""
  error = xla_compile.compile_replica_program(op_list, graph, _is_engine, on_host, inputs)
  if error is None:
    return
  op = xla_compile.failing_op(
      error, xla_compile.replica_zero_ops(op_list, _is_engine, on_host, inputs), graph)
  if _OUR_PLUMBING.search(error):
    # The rebuilt program is ours (xla_compile.py): its faults are not the user's.
    xla_compile.not_compiled(f"the rebuilt program did not load: {error.splitlines()[0]}")
    return
  if (op is not None and _control_flow_plumbing(op, _frames(op))) or (
      op is None and re.search(r"No registered 'Optional\w+' OpKernel", error)):
    # Traced outside an XLA context, cond_v2 / while_v2 kept intermediates
    # in Optionals that a TPU's program never holds: not the user's error.
    xla_compile.not_compiled(f"{op.type if op is not None else 'an Optional op'} "
                             "of tf.cond / tf.while_loop's gradient plumbing, "
                             "which a TPU's XLA context does not make")
    return
  raise NotCompilableError(compile_message(error, op))


@contextlib.contextmanager
def replica_program(emulation, arguments=()):
  """Checks the ops ``strategy.run`` makes in a graph (not eagerly, not off).

  ``arguments``: ``strategy.run``'s (args, kwargs), the program's inputs.
  """
  if not getattr(emulation, "xla", False) or tf.executing_eagerly():
    yield
    return
  graph = ops.get_default_graph()
  start = len(graph.get_operations())
  yield
  new_ops = graph.get_operations()[start:]
  inputs = frozenset(t.op.name for t in tf.nest.flatten(arguments, expand_composites=True)
                     if isinstance(t, tf.Tensor) and not hasattr(t, "numpy"))
  with xla_compile.frames_checked():
    # Every replica traced the same function: its ops are checked once, on
    # replica 0's (and those on no replica's device).
    on_host = check_ops([op for op in new_ops if not xla_compile.on_another_replica(op)],
                        graph)
    compile_program(new_ops, graph, on_host, inputs)
