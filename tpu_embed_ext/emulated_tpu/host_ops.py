"""Ops a TPU runs on its host inside ``strategy.run``: outside compilation.

``tf.tpu.outside_compilation(fn, *args)`` inside the function given to
``TPUStrategy.run`` builds ``fn``'s ops on the host, not in the program XLA
compiles: TensorFlow marks every op made in it with the
``_xla_outside_compilation`` attribute (``tpu_replication.py``,
``outside_compilation_impl``: in a ``FuncGraph`` it enters an
``OutsideCompilationV2Context``, whose ``AddOp`` sets the attribute), and
the TPU's rewrite moves the marked ops to the host, with sends and receives
to and from the program in their place. TensorFlow finds the TPU computation
by its ``TPUReplicateContext``; the emulated strategy (a ``MirroredStrategy``)
has none, and TensorFlow would only warn ("Outside compilation attempted
outside TPUReplicateContext scope") and run ``fn`` unmarked, so XLA's check
would take the host ops for TensorCore ops. Under the emulation,
``outside_compilation_impl`` (patched, ``patching.py``) marks them as
TensorFlow does on a TPU whenever it is called in a replica of the emulated
strategy in a graph; the ops run on the replica's CPU device as before.

With soft device placement on, a TPU moves ops that have no XLA kernel to the
host too ("automatic outside compilation", ``tpu.py``); ``xla_check`` passes
those ops here as ``extra`` so that the rest of the step is still compiled.

``strip_library`` takes the host ops out of the functions a program calls
(``tf.cond`` / ``tf.while_loop`` bodies, nested ``tf.function``s): the ops
go, and a value a host op hands to the program is replaced by an unknown
value of its dtype and static shape (``RandomUniform``, then ``Cast``), as a
TPU's program receives it from the host when it runs, not at compile time.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import tensorflow as tf
from tensorflow.core.framework import node_def_pb2
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.framework import func_graph, op_def_registry, ops
from tensorflow.python.tpu import tpu_replication

from tpu_embed_ext.emulated_tpu import patching, session

__all__ = ["ATTRIBUTE", "outside_compilation_impl", "is_marked", "strip_library",
           "HostValueError"]

ATTRIBUTE = "_xla_outside_compilation"  # tpu_replication._OUTSIDE_COMPILATION_ATTR
_counter = itertools.count()
_REAL = ("tensorflow.python.tpu.tpu_replication", "outside_compilation_impl")


def _in_emulated_replica() -> bool:
  """In a replica of a strategy of the active emulation (its extended holds it)."""
  if not distribute_lib.has_strategy() or distribute_lib.in_cross_replica_context():
    return False
  emulation = session.current()
  extended = distribute_lib.get_strategy().extended
  return emulation is not None and getattr(extended, "_emulation", None) is emulation


def outside_compilation_impl(is_map, computation, *args, **kwargs):
  """TensorFlow's, marking ``computation``'s ops as on a TPU in an emulated replica."""
  graph = ops.get_default_graph()
  if not isinstance(graph, func_graph.FuncGraph) or not _in_emulated_replica():
    return patching.original(*_REAL)(is_map, computation, *args, **kwargs)
  context = tpu_replication.OutsideCompilationV2Context(
      f"emulated.{next(_counter)}", is_map_outside_compilation=is_map)
  context.Enter()
  try:
    return computation(*args, **kwargs)
  finally:
    context.Exit()


_LOC = b"loc:@"


def is_marked(op) -> bool:
  """Whether ``op`` was made in ``tf.tpu.outside_compilation``, or is the
  gradient of such an op colocated with it (``gradients(...,
  colocate_gradients_with_ops=True)``: a TPU's context marks those too,
  ``TPUReplicateContext.EnterGradientColocation``)."""
  if ATTRIBUTE in op.node_def.attr:
    return True
  for group in op.node_def.attr["_class"].list.s if "_class" in op.node_def.attr else ():
    if group.startswith(_LOC):
      try:
        other = op.graph.get_operation_by_name(group[len(_LOC):].decode())
      except (KeyError, ValueError):
        continue
      if other is not op and ATTRIBUTE in other.node_def.attr:
        return True
  return False


class HostValueError(Exception):
  """A host op's value the program uses cannot be stood in for (no static
  shape, or a type a program does not hold)."""


def _output_offsets(node, op_def):
  """{output arg name: flat index of its first output} for a FunctionDef node."""
  offsets, at = {}, 0
  for arg in op_def.output_arg:
    offsets[arg.name] = at
    if arg.number_attr:
      at += node.attr[arg.number_attr].i
    elif arg.type_list_attr:
      at += len(node.attr[arg.type_list_attr].list.type)
    else:
      at += 1
  return offsets


def _stand_in(new_nodes, name, dtype, shape):
  """NodeDefs making an unknown value of ``dtype`` and ``shape``; its reference."""
  if dtype in (tf.resource, tf.variant, tf.string) or not shape.is_fully_defined():
    raise HostValueError(f"a value of {dtype.name} {shape} from the host")
  size = node_def_pb2.NodeDef(name=f"{name}_shape", op="Const")
  size.attr["dtype"].type = tf.int32.as_datatype_enum
  size.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(shape.as_list(), tf.int32))
  value = node_def_pb2.NodeDef(name=f"{name}_value", op="RandomUniform",
                               input=[f"{size.name}:output:0"])
  value.attr["T"].type = tf.int32.as_datatype_enum
  value.attr["dtype"].type = tf.float32.as_datatype_enum
  new_nodes += [size, value]
  if dtype == tf.float32:
    return f"{value.name}:output:0"
  cast = node_def_pb2.NodeDef(name=name, op="Cast", input=[f"{value.name}:output:0"])
  cast.attr["SrcT"].type = tf.float32.as_datatype_enum
  cast.attr["DstT"].type = dtype.as_datatype_enum
  new_nodes.append(cast)
  return f"{cast.name}:y:0"


def _strip_function(fdef, inner_graph, is_host):
  """Takes the host nodes out of one FunctionDef (in place); True if any."""
  host = {n.name: n for n in fdef.node_def if is_host(n, inner_graph)}
  if not host:
    return False
  stand_ins, new_nodes = {}, []

  def rewrite(reference):
    if reference.startswith("^"):
      return None if reference[1:] in host else reference
    parts = reference.split(":")
    if parts[0] not in host:
      return reference
    if reference not in stand_ins:
      node = host[parts[0]]
      index = _output_offsets(node, op_def_registry.get(node.op))[parts[1]] + int(parts[2])
      if inner_graph is None:
        raise HostValueError(f"the value of {node.name}, of unknown shape")
      tensor = inner_graph.get_operation_by_name(node.name).outputs[index]
      stand_ins[reference] = _stand_in(
          new_nodes, f"{node.name}_from_host_{index}", tensor.dtype, tensor.shape)
    return stand_ins[reference]

  kept = []
  for node in fdef.node_def:
    if node.name in host:
      continue
    copy = node_def_pb2.NodeDef()
    copy.CopyFrom(node)
    del copy.input[:]
    copy.input.extend(r for r in (rewrite(i) for i in node.input) if r is not None)
    kept.append(copy)
  for key in list(fdef.ret):
    fdef.ret[key] = rewrite(fdef.ret[key])
  for key in [k for k, v in fdef.control_ret.items() if v in host]:
    del fdef.control_ret[key]
  del fdef.node_def[:]
  fdef.node_def.extend(kept + new_nodes)
  return True


def _called(attr_values):
  """The function names attribute values name (func and list of func)."""
  for value in attr_values:
    if value.HasField("func"):
      yield value.func
    yield from value.list.func


def strip_library(library, function_graph: Callable[[str], Optional[object]],
                  nodes=(), extra=frozenset()) -> None:
  """Takes host ops out of every function of ``library`` (a FunctionDefLibrary).

  ``function_graph(name)``: the FuncGraph of a function (its ops' shapes);
  ``nodes``: the program's own NodeDefs, whose calls follow renamed
  functions; ``extra``: ``(function name, node name)`` of ops without an XLA
  kernel that soft placement puts on the host. A function whose body changes
  (or that calls one that does) gets a new name: the process already holds
  the original under its own. Raises ``HostValueError``.
  """
  changed = set()
  for fdef in library.function:
    fname = fdef.signature.name

    marked = {n.name for n in fdef.node_def if ATTRIBUTE in n.attr}

    def is_host(node, _graph, fname=fname, marked=marked):
      colocated = node.attr["_class"].list.s if "_class" in node.attr else ()
      return (node.name in marked or (fname, node.name) in extra or any(
          g.startswith(_LOC) and g[len(_LOC):].decode() in marked for g in colocated))
    if _strip_function(fdef, function_graph(fname), is_host):
      changed.add(fname)
  if not changed:
    return
  while True:  # callers of changed functions change too
    more = {f.signature.name for f in library.function
            if f.signature.name not in changed and any(
                ref.name in changed for n in f.node_def
                for ref in _called(n.attr.values()))}
    if not more:
      break
    changed |= more
  suffix = f"_tpu_program_{next(_counter)}"
  for node in list(nodes) + [n for f in library.function for n in f.node_def]:
    for ref in _called(node.attr.values()):
      if ref.name in changed:
        ref.name += suffix
  for fdef in library.function:
    if fdef.signature.name in changed:
      fdef.signature.name += suffix
