"""``tf.function(jit_compile=True)`` around an emulated TPU step.

On a TPU, ``strategy.run``'s function is the program XLA compiles, one per
replica; the embedding engine's work is outside it (``TPUEmbedding`` and
``TPUEmbeddingV2`` enqueue inside ``strategy.run`` through outside
compilation, ``tpu_embedding_v2.py`` ``enqueue`` and
``tpu_embedding_v3.py``), and programs such as keras-rs's ``*_jit`` tests
wrap ``strategy.run`` in ``tf.function(jit_compile=True)``.

XLA on CPU compiles a function for one device, and the emulated replicas are
``MirroredStrategy`` replicas on several CPU devices: compiled whole, the
function reads the other replicas' variables, which TensorFlow refuses
("Trying to access resource ... located in device CPU:1 from device
CPU:0"). It cannot be compiled per replica either. ``MirroredStrategy``
compiles a replica function with XLA only on GPUs, where it sums across
replicas with collectives instead of ``merge_call``
(``mirrored_strategy.py`` ``_use_merge_call``); forced on CPU devices (as
TensorFlow's own tests force it), dense all-reduces pass, but updating an
``ONLY_FIRST_REPLICA`` variable (a Keras optimizer's iteration count) is
still a ``merge_call`` (``values.py`` ``apply_aggregation_replica_context``),
and so is the engine's cross-replica sum of gradients; TensorFlow refuses a
``merge_call`` inside a function ("`merge_call` called while defining a new
graph or a tf.function"). And the engine's SparseCore input checks are host code
(``tf.numpy_function``), which a TPU runs outside its program and XLA on CPU
cannot call. So, as the TPU's ``TPUStrategy`` takes over compilation of
``strategy.run``, the emulated one does: traced inside a ``jit_compile=True``
function, ``strategy.run`` makes that function run as TensorFlow ops, and
each replica's program is checked to compile as a TPU's must
(``xla_check.py``, with XLA on). The results are those without
``jit_compile`` (the same ops), on 1, 2 or 8 replicas.

What a TPU does not accept stays refused: ``TPUEmbedding.enqueue`` called on
the host (outside ``strategy.run``) inside a ``jit_compile=True`` function
builds ``EnqueueTPUEmbeddingArbitraryTensorBatch`` (``tpu_embedding_v2.py``,
``enqueue``, the branch outside a TPU context, ``_generate_enqueue_op``),
a host op whose kernel is registered for ``DEVICE_CPU`` only
(``tensorflow/core/tpu/kernels/tpu_embedding_enqueue_ops.cc``), so XLA
refuses the function ("Detected unsupported operations when trying to
compile graph ... on XLA_CPU_JIT: EnqueueTPUEmbeddingArbitraryTensorBatch").
``check_host_enqueue`` raises that error when such an ``enqueue`` is traced.
(Read from TensorFlow's sources; no TPU was run.)
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import tensorflow as tf
from tensorflow.python.framework import ops

from tpu_embed_ext.emulated_tpu import xla_check
from tpu_embed_ext.emulation import check_runner

__all__ = ["replicas_compiled_separately", "replica_function", "check_host_enqueue"]

# tensorflow/python/eager/polymorphic_function/attributes.py XLA_COMPILE.
_XLA_COMPILE = "_XlaMustCompile"


def _graphs(graph):
  while graph is not None:
    yield graph
    graph = getattr(graph, "outer_graph", None)


def _tracing_options(graph):
  """The tracing options of the ``jit_compile=True`` function being traced
  around ``graph`` (its ``FunctionDef`` attributes are read from them once
  tracing ends: ``tracing_compilation._create_concrete_function``)."""
  around = {id(g) for g in _graphs(graph)}
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    if (frame.f_code.co_name == "_create_concrete_function"
        and "tracing_compilation" in frame.f_code.co_filename):
      options = frame.f_locals.get("tracing_options")
      func_graph = frame.f_locals.get("func_graph")
      attributes = getattr(options, "attributes", None)
      if (attributes and attributes.get(_XLA_COMPILE)
          and id(func_graph) in around):
        yield attributes
    frame = frame.f_back


@contextlib.contextmanager
def replicas_compiled_separately():
  """Inside ``jit_compile=True``: the function runs as ops, replicas checked.

  Turns off the must-compile attribute of every enclosing ``jit_compile=True``
  function being traced, and leaves XLA's control-flow context while
  ``strategy.run`` is traced (the engine then takes its non-XLA path).
  """
  if tf.executing_eagerly() or not check_runner.in_xla_context():
    yield
    return
  graph = ops.get_default_graph()
  for attributes in _tracing_options(graph):
    attributes[_XLA_COMPILE] = False
  saved = []
  for g in _graphs(graph):
    context = g._get_control_flow_context()  # pylint: disable=protected-access
    if context is not None and context.IsXLAContext():
      saved.append((g, context))
      g._set_control_flow_context(None)  # pylint: disable=protected-access
  try:
    yield
  finally:
    for g, context in saved:
      g._set_control_flow_context(context)  # pylint: disable=protected-access


_unjitted = weakref.WeakKeyDictionary()


def is_jit_function(fn) -> bool:
  return (isinstance(fn, tf.types.experimental.PolymorphicFunction)
          and bool(getattr(fn, "_jit_compile", None)))


def replica_function(fn):
  """In a graph: ``fn``, or its Python function if it is a ``jit_compile=True``
  ``tf.function``.

  ``strategy.run(tf.function(step, jit_compile=True))`` (as Keras's
  ``model.compile(jit_compile=True)`` builds it): ``MirroredStrategy`` would
  wrap every replica's call in one such function and compile them together
  (``mirrored_run.call_for_each_replica``). The replicas run the Python
  function instead (autograph converts it, as any function given to
  ``strategy.run``), each checked as a TPU compiles it.
  """
  return fn.python_function if is_jit_function(fn) else fn


def run_eagerly_in_a_graph(strategy, fn, args, kwargs, options):
  """``strategy.run(jit function)`` called eagerly: run inside a (cached)
  ``tf.function`` without ``jit_compile``, where ``replica_function`` applies."""
  cache = _unjitted.setdefault(fn, {})
  if id(strategy) not in cache:
    cache[id(strategy)] = tf.function(
        lambda a, k: strategy.run(fn, a, k, options), autograph=False)
  return cache[id(strategy)](args, kwargs or {})


def check_host_enqueue(replicas):
  """TensorFlow's XLA error for a host-side ``TPUEmbedding.enqueue`` under XLA."""
  if tf.executing_eagerly() or not check_runner.in_xla_context():
    return
  if replicas.in_replica_fn():
    return  # Inside strategy.run: outside compilation on a TPU.
  graph = ops.get_default_graph()
  raise xla_check.NotCompilableError(
      "Detected unsupported operations when trying to compile graph "
      f"{graph.name} on XLA_CPU_JIT: EnqueueTPUEmbeddingArbitraryTensorBatch "
      "(No registered 'EnqueueTPUEmbeddingArbitraryTensorBatch' OpKernel for "
      "XLA_CPU_JIT devices compatible with node {{node "
      "EnqueueTPUEmbeddingArbitraryTensorBatch}}): emulated TPU: "
      "TPUEmbedding.enqueue outside strategy.run is host work, and this "
      "function has jit_compile=True (TensorFlow's TPUEmbedding builds a host "
      "enqueue op with no XLA kernel there: tpu_embedding_v2.py, enqueue). "
      "Fix: call enqueue in a function without jit_compile=True and "
      "strategy.run in another, or enqueue inside strategy.run (the TPU "
      "compiles strategy.run's function anyway).")
