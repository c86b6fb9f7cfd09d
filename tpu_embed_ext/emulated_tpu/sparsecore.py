"""``TPUEmbeddingV2`` (SparseCore) under the emulated TPU, on ``CPUEmbedding``.

Inside ``emulate_tpu(sparsecore=True)``, ``tpu_embedding_v3.TPUEmbeddingV2``
(and ``tf.tpu.experimental.embedding.TPUEmbeddingV2``) is this class: the
engine ``CPUEmbedding(engine="v2", topology=...)`` with ``TPUEmbeddingV2``'s
contract under a ``TPUStrategy`` (``tensorflow/python/tpu/tpu_embedding_v3.py``,
TF 2.21):

* ``embedding_lookup(features, weights)`` / ``__call__``, inside
  ``strategy.run``, returns ``(activations, preserved_outputs)``;
  ``apply_gradients(gradients, preserved_outputs)`` applies that batch's
  gradients (a ``None`` gradient is a zero gradient);
* ``enqueue(features, weights, device)`` / ``dequeue(partitioned)``: the two
  halves of ``embedding_lookup`` (``partitioned.py``); ``apply_gradients`` may follow ``enqueue``
  directly, through ``_copy_tensors_to_device`` (as TensorFlow's tests train);
  ``enqueue(device=...)`` of distributed values is refused with TensorFlow's
  ``ValueError`` phrase ("Input of unknown type ...");
* the topology is the strategy's: ``num_replicas_in_sync`` chips of
  ``tpu_hardware_feature.num_embedding_devices_per_chip`` SparseCores (4 when
  it reports none, as upstream): tables are stacked for it, each replica's
  ids are checked against ``SparseCoreEmbeddingConfig``'s limits as its
  chip's (dropped with ``allow_id_dropping``), and checkpoints hold the
  stacked variables and ``_sparse_core_table_layouts``;
* the first step of each batch shape is refused, before it reads or writes
  anything, where SparseCore's compiler refuses it: OpenXLA's E3001 (a stacked
  table's ids do not fit the scratchpad at its ``max_ids_per_table``) or
  E3000 (the HBM stack), as ``SparseCoreCompileError``, a
  ``tf.errors.ResourceExhaustedError`` (``sparsecore/scratchpad.py``);
* ``TPUEmbeddingV2.compute_sparse_core_stats`` profiles one chip's batch with
  the counts those limits are checked against (``sparsecore_stats.py``);
* ``pipeline_execution_with_tensor_core=True``: a step inside a
  ``tf.while_loop`` looks up the tables before the previous step's update,
  as the TPU compiler staggers the loop; steps outside a loop, with summaries
  recorded, or in ``SequentialEmbeddingContext`` are sequential; lookups and
  updates carry TensorFlow's ``_embedding_pipelining`` attribute
  (``pipelining.py``);
* ``embedding_tables`` / ``variables`` / ``_variables`` are keyed by stacked
  table name, as upstream's; their values are read-only views of the stacked
  layout, instances of TensorFlow's ``TPUEmbeddingShardedVariable``
  (``sharded_views.StackedTable``: ``.values`` is one shard per replica). The
  engine keeps its variables per table, in ``_table_vars``;
* ``build`` calls ``_batch_initialize_tables()`` as upstream does (once, no
  arguments, unless a restore waiting for the build fills every stacked
  variable); a replaced hook's shards are written into the tables, so
  TensorFlow's ``tpu_embedding_v3_checkpoint_test.py`` passes unmodified.

What is not SparseCore's: ``preserved_outputs`` (and ``enqueue``'s output) is
a dict keyed by stacked table name, as upstream's, but its values are
``partitioned.PartitionedBatch``es (the ids each stack received and the
engine's occurrence tensors), not SparseCore's CSR buffers (TensorFlow's CPU
wheel has no kernels for SparseCore's preprocessing ops): pass them on
unchanged, as programs do. Like upstream's, they carry the batch, so
``dequeue`` / ``apply_gradients`` may be traced in another ``tf.function``
than ``enqueue``; passed to ``strategy.run``, every replica reads that batch.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import tensorflow as tf
from tensorflow.python.util import nest

from tpu_embed_ext import errors
from tpu_embed_ext.emulated_tpu import (hbm_check, partitioned, pipelining,
                                        sharded_views, sparsecore_inputs,
                                        sparsecore_stats)
from tpu_embed_ext.emulated_tpu.sharded_views import StackedTable
from tpu_embed_ext.emulation import engine as engine_lib
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore import topology as sc_topology

__all__ = ["TPUEmbeddingV2", "StackedTable", "topology_of"]

# Library code, left alone by autograph (as the engine's own methods are).
_library_code = tf.autograph.experimental.do_not_convert

# TPUEmbeddingV2's fallback when the TPU reports no SparseCores per chip.
_DEFAULT_SPARSECORES_PER_CHIP = 4


def _tpu_strategy_classes():
  # Looked up when called: inside the emulation these names are its strategy.
  from tensorflow.python.distribute import tpu_strategy  # pylint: disable=g-import-not-at-top
  return (tpu_strategy.TPUStrategy, tpu_strategy.TPUStrategyV2)


def topology_of(strategy) -> sc_topology.Topology:
  """The SparseCore topology a ``TPUEmbeddingV2`` under ``strategy`` shards over."""
  per_chip = (strategy.extended.tpu_hardware_feature.num_embedding_devices_per_chip
              or _DEFAULT_SPARSECORES_PER_CHIP)
  return sc_topology.Topology(strategy.num_replicas_in_sync, int(per_chip),
                              name=f"emulated {strategy.num_replicas_in_sync}x{per_chip}")


class TPUEmbeddingV2(pipelining.PipelinedSteps, engine_lib.CPUEmbedding):
  """``TPUEmbeddingV2`` under the emulated ``TPUStrategy`` (see the module doc)."""

  DEFAULT_MAX_IDS_PER_TABLE = 256
  DEFAULT_MAX_UNIQUE_IDS_PER_TABLE = 256

  def __init__(self, feature_config, optimizer=None,
               pipeline_execution_with_tensor_core: bool = False,
               sparse_core_embedding_config=None):
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, _tpu_strategy_classes()):
      # Upstream's check and message (RuntimeError), on the emulated classes.
      raise RuntimeError(
          f"TPUEmbeddingV2 should be created under TPUStrategy but found {strategy}.")
    _check_weight_decay(feature_config, optimizer)
    topology = topology_of(strategy)
    super().__init__(feature_config, optimizer, engine="v2", topology=topology,
                     sparse_core_config=sparse_core_embedding_config)
    stack_of = {l.table: l.stack for l in self._sparsecore.layouts}
    object.__setattr__(self, "_topology", topology)
    object.__setattr__(self, "_feature_stacks",
                       [stack_of[self._tables[f.table].name] for f in self._features])
    object.__setattr__(self, "_stacks", sorted(set(stack_of.values())))
    self._init_pipelining(pipeline_execution_with_tensor_core)

  compute_sparse_core_stats = classmethod(
      lambda cls, *args, **kwargs: sparsecore_stats.compute_sparse_core_stats(
          *args, **kwargs))
  compute_sparse_core_stats.__doc__ = sparsecore_stats.__doc__

  @property
  def _num_sc_per_chip(self) -> int:
    """SparseCores per chip, as upstream's attribute (its tests read it)."""
    return self._topology.sparsecores_per_chip

  # --- tables --------------------------------------------------------------

  @property
  def embedding_tables(self) -> Dict[str, StackedTable]:
    """``{stacked table name: StackedTable}`` (parameters only), as upstream."""
    return {stack: slots["parameters"] for stack, slots in self.variables.items()}

  @property
  def _variables(self) -> Optional[Dict[str, Dict[str, StackedTable]]]:
    """Upstream's private ``_variables``: the stacked
    ``TPUEmbeddingShardedVariable`` views (None before ``build``). The
    engine's per-table variables are ``_table_vars``."""
    return None if self._table_vars is None else sharded_views.stacked_views(self)

  @property
  def variables(self) -> Dict[str, Dict[str, StackedTable]]:
    """``{stacked table name: {"parameters": ..., <slot>: ...}}``, as upstream.

    The engine's per-table variables: ``table_variables(table)``.
    """
    self.build()
    return sharded_views.stacked_views(self)

  def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
    """Creates the variables; as upstream, ``_batch_initialize_tables()``
    is called once unless a restore waiting for the build fills them all."""
    if self._table_vars is not None:
      return
    # The shapes build fixes, on a copy (a refused build fixes none), then
    # the stacked tables against each chip's HBM, before any variable exists.
    shapes = copy.copy(self._shapes)
    shapes.build(per_replica_input_shapes, per_replica_batch_size)
    hbm_check.check("TPUEmbeddingV2.build()", True, self.feature_config,
                    self._tables, self._features, shapes.stored)
    with tf.init_scope():  # as upstream's _maybe_build: never in a traced step
      pending = sharded_views.uninitialized(self)
      super().build(per_replica_input_shapes, per_replica_batch_size)
      sharded_views.initialize_stacked(
          self, pending, TPUEmbeddingV2._batch_initialize_tables)

  def _batch_initialize_tables(self) -> Dict[str, Dict[str, list]]:
    """``{stacked table name: {slot: [one shard per chip]}}``: the initial
    values, as upstream's hook (called by ``build``; a replacement's values
    are written into the tables)."""
    return sharded_views.default_initial_values(self)

  def table_variables(self, table) -> Dict[str, tf.Variable]:
    """``{"parameters": var, <slot>: var}`` of one table, unstacked."""
    self.build()
    return self._table_vars[self.table_name(table)]

  def _slot_names(self, stack):
    first = next(l.table for l in self._sparsecore.layouts if l.stack == stack)
    return [s for s in self._table_vars[first] if s != "parameters"]

  @property
  def embedding_layouts(self):
    """``{table name: SparseCoreTableLayout}`` proto per table, as upstream."""
    proto = sc_layout.layouts_to_proto(self._sparsecore.layouts)
    return {t.table_name: t for t in proto.tables}

  # --- the SparseCore protocol ---------------------------------------------

  @_library_code
  def embedding_lookup(self, features, weights=None):
    """``(activations, preserved_outputs)`` of this replica's batch."""
    with self._pipelined(pipelining.FORWARD):
      partitioned = self.enqueue(features, weights)
    return self.dequeue(partitioned)

  @_library_code
  def __call__(self, features, weights=None):
    return self.embedding_lookup(features, weights)

  @_library_code
  def enqueue(self, features, weights=None, device: Optional[str] = None):
    """Checks and records a batch; returns what ``dequeue`` takes.

    Outside ``strategy.run``, plain (not distributed) values without
    ``device`` are one replica's batch, on the first replica's device: so
    upstream traces it for Keras ("Use any of the TPU devices and trace once
    for a single device").
    """
    # SparseCore's own error for a dense tensor of the wrong size (sparsecore_inputs).
    sparsecore_inputs.check_dense_sample_counts(self.feature_config, features)
    reps = self._replicas
    if device is not None and not reps.in_replica_fn():
      _check_one_replica(features, weights)
    if (device is None and reps.num_local > 1 and not reps.in_replica_fn()
        and len(reps.split(features)) == 1):
      device = reps.strategy.extended.worker_devices[0]
    super().enqueue(features, weights, training=True, device=device)
    return partitioned.pack(self._stacks, self._feature_stacks,
                            [self._batches.recorded(r) for r in self._enqueued])

  @_library_code
  def dequeue(self, partitioned_tensors):
    """``(activations, preserved_outputs)`` of the batch ``enqueue`` recorded."""
    self._check_preserved(partitioned_tensors, "dequeue(partitioned_tensors)")
    self._adopt(partitioned_tensors, "dequeue()")
    with self._pipelined(pipelining.FORWARD):
      return super().dequeue(), partitioned_tensors

  @_library_code
  def _copy_tensors_to_device(self, partitioned_tensors):
    """``enqueue``'s output as ``apply_gradients`` takes it (unchanged here:
    the emulation has no host-to-TPU copy of the batch)."""
    self._check_preserved(partitioned_tensors,
                          "_copy_tensors_to_device(partitioned_tensors)")
    return partitioned_tensors

  @_library_code
  def apply_gradients(self, gradients, preserved_outputs=None):
    """Applies this replica's gradients of the batch of ``preserved_outputs``."""
    if self._table_vars is None:
      raise RuntimeError(
          "apply_gradients called on unbuilt TPUEmbeddingV2 object. Please either "
          "call the embedding lookup method first or manually call the build "
          "method.")
    self._check_preserved(preserved_outputs, "apply_gradients(preserved_outputs)")
    self._adopt(preserved_outputs, "apply_gradients()")
    with self._pipelined(pipelining.BACKWARD):
      super().apply_gradients(gradients)

  def _local_replica(self, what) -> int:
    # A lookup outside strategy.run is the first replica's (see enqueue);
    # apply_gradients there stays an error, as on a TPU.
    if what == "dequeue()":
      return self._replicas.local_replica()
    return super()._local_replica(what)

  def _prepare_batches(self, batches, training):
    prepared = super()._prepare_batches(batches, training)
    object.__setattr__(self, "_enqueued", sorted(prepared))  # for enqueue
    return prepared

  def _adopt(self, partitioned_tensors, what: str):
    """Takes the batch ``partitioned_tensors`` carries as this replica's
    pending one when the batch enqueued is not visible here (enqueued in
    another ``tf.function``, as a TPU program may): ``partitioned.py``."""
    replica = self._local_replica(what)
    if self._batches.visible(replica):
      return
    batch = partitioned.unpack(partitioned_tensors, self._feature_stacks,
                               self._output_shapes, self.feature_config)
    if batch is not None:
      self._batches.put(replica, batch, self._replicas.num_local)

  def _check_preserved(self, preserved: Any, what: str):
    keys = sorted(preserved) if isinstance(preserved, dict) else None
    if keys != self._stacks:
      raise errors.InputError(
          f"TPUEmbeddingV2.{what} got {type(preserved).__name__}"
          + (f" with keys {keys}" if keys is not None else "")
          + f", not the preserved outputs of this object's lookup (a dict keyed "
          f"by stacked table name: {self._stacks}). Fix: pass the second output "
          "of embedding_lookup (or enqueue's output to dequeue), unchanged.")


def _check_one_replica(features, weights):
  """Upstream's refusal of distributed values given with ``device=``.

  ``TPUEmbeddingV2.enqueue(..., device=)`` preprocesses one device's batch;
  ``_convert_input_feature_to_list_of_coo_tensors`` raises this ValueError for
  anything but a Tensor, SparseTensor or RaggedTensor.
  """
  for value in nest.flatten([features, weights]):
    if isinstance(value, tf.distribute.DistributedValues):
      raise errors.InputError(
          f"Input of unknown type {type(value)}. Please only pass Tensor, "
          "SparseTensor or RaggedTensor as input to embedding lookup. "
          "(TPUEmbeddingV2.enqueue(device=...) takes one replica's batch, got "
          f"{type(value).__name__}. Fix: pass strategy.experimental_local_results"
          "(x)[i] with device=strategy.extended.worker_devices[i], or enqueue "
          "inside strategy.run without device=.)")


def _check_weight_decay(feature_config, optimizer):
  """Upstream's NotImplementedError for weight decay, table by table."""
  for feature in nest.flatten(feature_config):
    table = feature.table
    table_optimizer = table.optimizer or optimizer
    if table_optimizer is None:
      continue
    if (getattr(table_optimizer, "weight_decay_factor", None) is not None or
        getattr(table_optimizer,
                "multiply_weight_decay_factor_by_learning_rate", None) is not None):
      raise NotImplementedError(
          "weight_decay_factor and multiply_weight_decay_factor_by_learning_rate "
          f"are not supported yet. But found in table {table.name} setting.")
