"""CPUEmbedding: the TPU embedding engine, emulated on CPU, that trains.

The engine object: the ``TPUEmbedding`` protocol (``build``, ``enqueue``,
``dequeue``, ``apply_gradients``, ``__call__``), its variables and their
checkpoint keys. The work is done by the modules beside it: inputs
(``lookups``, ``shapes``, ``protocol``), checks (``checks`` run by
``check_runner`` on ``input_checks``' schedule; ``structure_checks``), the step
(``payloads``, ``step_pipeline``), replicas, tables and SparseCore limits
(docs/layout.md lists each module's role).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import tensorflow as tf
from tensorflow.python.trackable import autotrackable

from tpu_embed_ext import errors, spec as spec_lib
from tpu_embed_ext.host import memory
from tpu_embed_ext.emulation import (check_runner, input_checks, lookups, native,
                                      payloads, protocol, replicas,
                                      rules as rules_lib, shapes, sparsecore_limits,
                                      structure_checks, tables as tables_lib)

__all__ = ["CPUEmbedding", "HOOKS", "TENSORFLOW_PRIVATE_API"]

# The protected members that CPUEmbedding's subclasses (the emulated TPU's
# TPUEmbedding, TPUEmbeddingV2 and PipelinedSteps) may use; every other
# private member is the engine's own (tests/test_engine_hooks.py).
HOOKS = (
    # State, read and never reassigned:
    "_features", "_tables",  # tables.Feature, tables.Table (feature order)
    "_table_vars",           # {table: {slot: var}}; None before build
    "_replicas",             # replicas.Replicas: the strategy's replicas
    "_shapes",               # shapes.OutputShapes (.stored: _output_shapes)
    "_batches",              # protocol.Batches, through its public methods
    "_sparsecore",           # the SparseCore state with a topology, else None
    # Methods, overridden (calling super()) or called:
    "_prepare_batches",  # one enqueue's batches, checked: {replica: Pending}
    "_table_lookup",     # one feature's activation from its table's rows
    "_apply_payloads",   # the step, once, from every replica's payload
    "_check_gradients",  # apply_gradients' checks of its gradients
    "_local_replica",    # the calling replica's index
    "_native_step",      # whether ops built now use the native kernels
)

# TensorFlow's private names that TPU programs and TensorFlow's tests use:
# TensorFlow's protocol, kept under its names, not hooks of this engine.
TENSORFLOW_PRIVATE_API = (
    "_variables",            # TPUEmbedding's {table: {slot: var}}, read
    "_output_shapes",        # TPUEmbedding's activation shapes, assignable
    "_create_config_proto",  # TPUEmbedding's TPU configuration
    "_retrieve_variables",   # TPUEmbedding's TPU -> host copy (checkpoints)
    "_load_variables",       # TPUEmbedding's host -> TPU copy
    "_checkpoint_adapter",   # Trackable's restore hooks (a checkpoint in
    "_lookup_dependency",    # another SparseCore layout)
)


# Autograph leaves library code alone, as it does TensorFlow's own: converting
# it only slows tracing (no control flow here depends on tensors).
_library_code = tf.autograph.experimental.do_not_convert


class CPUEmbedding(autotrackable.AutoTrackable):
  """A drop-in for ``tf.tpu.experimental.embedding.TPUEmbedding`` off-TPU.

  Args:
    feature_config: a nested structure of ``FeatureConfig``s, as
      ``TPUEmbedding`` takes it, or an ``EmbeddingSpec`` (its schedules then
      bind to this engine's ``step``).
    optimizer: the optimizer of tables that have none: a
      ``tf.tpu.experimental.embedding`` optimizer or one of our specs. None
      (and no ``TableConfig.optimizer``): those tables are for lookups only,
      without slots, as with ``TPUEmbeddingForServing``; training calls
      raise (``TPUEmbedding`` under a ``TPUStrategy`` refuses None).
    pipeline_execution_with_tensor_core: accepted for signature parity; it
      only changes scheduling on a TPU, not results.
    engine: ``"v1"`` emulates ``TPUEmbedding`` (TPU v2-v4), ``"v2"``
      ``TPUEmbeddingV2`` (SparseCore); their differences are ``rules.py``'s.
    validate: check ids, shapes and gradients on every step (one reduction
      per feature; on by default).
    topology: with ``engine="v2"``, a SparseCore topology ("v5p:4", a
      ``sparsecore.Topology``): checkpoints are then written and read in
      ``TPUEmbeddingV2``'s stacked layout for it (``<stack>``,
      ``<stack>/<slot>``, ``_sparse_core_table_layouts``), and each step's ids
      are checked against SparseCore's input limits, dropped as SparseCore
      drops them with ``allow_id_dropping`` (docs/sparsecore.md).
      ``variables`` stay per table.
    sparse_core_config: the ``SparseCoreEmbeddingConfig`` of those limits
      (None: TPUEmbeddingV2's defaults).
    kernels: ``"auto"`` (default: the native C++ kernels when they load,
      else TensorFlow ops; the ``TPU_EMBED_EXT_KERNELS`` environment variable
      can force either), ``"native"`` or ``"tf"``. Both paths give the same
      results; XLA always uses TensorFlow ops (docs/native_kernels.md).

  Protocol: one pending batch per replica (``protocol.py``): a second
  ``enqueue`` before ``dequeue``, and a second ``dequeue`` of one batch, are
  errors; a rejected ``apply_gradients`` leaves its batch pending.

  Replicas: under ``MirroredStrategy`` (or ``MultiWorkerMirroredStrategy``)
  the protocol is ``TPUEmbedding``'s: ``enqueue`` takes distributed values
  outside ``strategy.run``, each replica's values inside it, or one device's
  values with ``device=`` (a ``strategy.extended.worker_devices`` entry, as
  ``TPUEmbedding``'s per-device feeding); ``dequeue``
  and ``apply_gradients`` run inside ``strategy.run``. The per-id gradients
  of all replicas are summed (never divided by the number of replicas) and
  every touched id is updated once per step, on one copy of each table.

  XLA (``jit_compile=True``): XLA cannot stop a step from inside, so a step
  that fails a check writes nothing, returns NaN activations for the bad
  feature and raises its ``InputError`` at the next eager call
  (``raise_if_failed``).

  ``use_gradient_accumulation=False`` (v1): an id that occurs several times
  in a step is updated once per contribution, in input order (the TPU's
  order is unspecified; docs/semantics.md, other options), not once with
  their sum (the default).

  Hooks: subclasses use the protected members in ``HOOKS`` only (their
  comments say what each is), as TensorFlow's ``tpu_embedding_base.py``
  declares its own; the state there is read, never reassigned.
  """

  def __init__(self, feature_config, optimizer=None,
               pipeline_execution_with_tensor_core: bool = False, *,
               engine: str = "v1", validate: bool = True, topology=None,
               sparse_core_config=None, kernels: str = "auto"):
    del pipeline_execution_with_tensor_core
    rules = rules_lib.of(engine)  # ValueError for another engine
    # Internal state is set with _untracked: a tracked attribute would add
    # checkpoint keys that TPUEmbedding does not have.
    _untracked(self, _rules=rules, _validate=validate,
               _replicas=replicas.Replicas(), _kernels=native.choose(kernels))
    with tf.init_scope(), self._replicas.single_copy_variables():
      _untracked(self, step=tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name="step"),
                 _failure=tf.Variable([0] * check_runner.RECORD, dtype=tf.int64,
                                      trainable=False, name="failure"))
    feature_config = spec_lib.EmbeddingSpec.coerce(feature_config)
    if isinstance(feature_config, spec_lib.EmbeddingSpec):
      feature_config, tables, features = tables_lib.from_spec(
          feature_config, self.step, rules)
    else:
      tables, features = tables_lib.resolve_all(feature_config, optimizer, rules)
      tables = tables_lib.bind_schedules(tables, self.step)
    _untracked(self, _feature_config=feature_config, _tables=tables,
               _features=features, _table_vars=None,
               _batches=protocol.Batches(),
               _shapes=shapes.OutputShapes(features))
    _untracked(self, _sparsecore=None if topology is None else
               sparsecore_limits.state(self._tables, self._features, rules,
                                       feature_config, optimizer, topology,
                                       sparse_core_config))

  # --- variables -----------------------------------------------------------

  def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
    """Creates the tables and slots (restoring them if a restore is pending).

    Shapes are ``TPUEmbedding.build``'s (``tpu_embedding_v2.py``,
    ``_get_and_update_output_shapes_from_input``): ``per_replica_input_shapes``
    (one shape per feature, or a batch size) or ``per_replica_batch_size``
    fix every feature's activation shape; ``FeatureConfig.output_shape`` has
    priority and must agree; the result must be fully defined. Unlike
    ``TPUEmbedding``, ``build()`` with neither creates the variables and
    leaves unset shapes to the first batch (docs/shapes.md).
    """
    if self._table_vars is not None:
      return
    self._shapes.build(per_replica_input_shapes, per_replica_batch_size)
    memory.check_tables([(t.name, t.config.vocabulary_size, t.config.dim,
                               len(tables_lib.slot_names(t))) for t in self._tables])
    with tf.init_scope(), self._replicas.single_copy_variables():
      _untracked(self, _table_vars={
          t.name: tables_lib.create_variables(self, t, self._sparsecore is not None)
          for t in self._tables})
      if self._sparsecore is not None:
        self._sparsecore.track(self, self._table_vars)
      if self._kernels == "native":  # large tables on huge pages
        native.use_huge_pages([v for variables in self._table_vars.values()
                               for v in variables.values()])

  @property
  def _variables(self) -> Optional[Dict[str, Dict[str, tf.Variable]]]:
    """``TPUEmbedding``'s private ``{table_name: {slot: var}}`` (None before
    ``build``), which programs and TensorFlow's own tests read; the engine
    keeps it as ``_table_vars`` (``TPUEmbeddingV2`` answers it per stack)."""
    return self._table_vars

  @property
  def variables(self) -> Dict[str, Dict[str, tf.Variable]]:
    """``{table_name: {"parameters": var, <slot>: var}}``."""
    self.build()
    self.raise_if_failed()
    return self._table_vars

  def table_variables(self, table) -> Dict[str, tf.Variable]:
    """``{"parameters": var, <slot>: var}`` of one of this engine's tables.

    ``table`` is a ``TableConfig`` of the feature config (the same object), or
    a table name. The way to reach an unnamed ``TableConfig``'s variables:
    ``TPUEmbedding`` writes the generated name (``table_<i>``) into the
    user's object, so ``variables[table.name]`` works there; we never modify
    the user's objects, so ``table.name`` stays None and this looks the
    table up by identity instead (``table_name`` gives the name used).
    """
    return self.variables[self.table_name(table)]

  def table_name(self, table) -> str:
    """The name a table's variables and checkpoint keys use (``table_<i>``
    for an unnamed ``TableConfig``, ``i`` its order of first use, as
    ``TPUEmbedding`` names it)."""
    return tables_lib.name_of(self._tables, table)

  @property
  def embedding_tables(self) -> Dict[Any, tf.Variable]:
    """``{TableConfig: parameters variable}``, keyed by the user's configs."""
    self.build()
    return {t.config: self._table_vars[t.name]["parameters"] for t in self._tables}

  @property
  def feature_config(self):
    return self._feature_config

  def check_checkpoint(self, path: str, prefix: str = "embedding"):
    """Raises ConfigError unless ``path`` holds every table and slot, same shapes.

    TensorFlow's own restore reports a mismatch one variable at a time, after
    restoring the variables before it; this checks all tables first, naming
    the table and both shapes. ``prefix`` is the embedding's checkpoint path
    (``tf.train.Checkpoint(embedding=e)``: "embedding"). With a topology,
    the checkpoint's SparseCore layouts must be this engine's.
    """
    if self._sparsecore is not None:
      return self._sparsecore.check_checkpoint(path, prefix)
    tables_lib.check_checkpoint(self._tables, path, prefix)

  # With a topology, a checkpoint saved per table or in another SparseCore
  # layout restores as into TPUEmbeddingV2 (its checkpoint adapter): see
  # sparsecore/restore.py. Both hooks are TensorFlow's restore's own.
  def _checkpoint_adapter(self, path):
    if self._sparsecore is not None:
      self._sparsecore.checkpoint_adapter(self, path)
    return None

  def _lookup_dependency(self, name, cached_dependencies=None):
    if self._sparsecore is not None and self._sparsecore.claims(name):
      return None  # deferred, then loaded by the router
    return super()._lookup_dependency(name, cached_dependencies)

  @property
  def engine(self) -> str:
    return self._rules.name

  @property
  def kernels(self) -> str:
    """``"native"`` or ``"tf"``: the path this engine's steps run (outside
    XLA, which always runs TensorFlow ops)."""
    return self._kernels

  def _native_step(self) -> bool:
    """Hook: whether ops built now use the native kernels (never under XLA)."""
    return self._kernels == "native" and not check_runner.in_xla_context()

  def raise_if_failed(self):
    """Raises the InputError of a step that XLA could not stop (see class doc).

    Called by every eager entry point; a step compiled with XLA that failed a
    check wrote nothing and recorded why. Clears the record.
    """
    if not tf.executing_eagerly():
      return
    record = self._failure.numpy()
    if not record[0]:
      return
    self._failure.assign([0] * check_runner.RECORD)
    message = check_runner.failure_message(record, self._features, self._tables)
    raise errors.InputError(
        f"a step compiled with XLA was rejected and changed nothing: {message}")

  # --- lookups -------------------------------------------------------------

  @_library_code
  def __call__(self, features, weights=None):
    """Looks up ``features`` without recording anything for training."""
    self.build()
    self.raise_if_failed()
    return self._activations(self._prepare({None: (features, weights)}, False,
                                           strict=False)[None])

  @_library_code
  def enqueue(self, features, weights=None, training: bool = True,
              name: Optional[str] = None, device: Optional[str] = None):
    """Records a batch for ``dequeue`` (and, if training, ``apply_gradients``).

    Outside ``strategy.run`` under a strategy with several replicas, features
    are distributed values (``experimental_distribute_dataset``), or one
    replica's values with ``device`` naming its device
    (``strategy.extended.worker_devices[i]``); inside it, each replica
    enqueues its own.
    """
    del name
    self.build()
    self.raise_if_failed()
    if training:
      tables_lib.check_trainable(self._tables, "enqueue(training=True)")
    self._put(protocol.route(self._replicas, features, weights, device),
              training)

  def _put(self, batches: Dict[int, Any], training: bool):
    """Checks every replica's batch, then records them (all or none)."""
    self._batches.check_free(list(batches), self._replicas.num_local)
    for replica, pending in self._prepare_batches(batches, training).items():
      self._batches.put(replica, pending, self._replicas.num_local)

  def _prepare_batches(self, batches: Dict[int, Any], training: bool
                       ) -> Dict[int, protocol.Pending]:
    """Hook: ``{replica: Pending}`` of one ``enqueue``'s ``{replica:
    (features, weights)}``, checked; nothing recorded yet."""
    return self._prepare(batches, training)

  @_library_code
  def dequeue(self, name: Optional[str] = None):
    """This replica's activations of the last enqueued batch (once per batch)."""
    del name
    replica = self._local_replica("dequeue()")
    activations = self._activations(self._batches.get(replica, "dequeue()"))
    self._batches.deliver(replica)
    return activations

  def _local_replica(self, what) -> int:
    """Hook: the calling replica, for ``what`` ("dequeue()", ...)."""
    reps = self._replicas
    if not reps.in_replica_fn() and reps.num_local > 1:
      raise errors.InputError(
          f"{what} was called outside strategy.run under "
          f"{type(reps.strategy).__name__} with {reps.num_local} replicas. "
          "Fix: call it inside strategy.run, as TPUEmbedding requires.")
    return reps.local_replica()

  @property
  def _output_shapes(self) -> List[tf.TensorShape]:
    """Every feature's activation shape as fixed so far (``shapes.py``)."""
    return self._shapes.stored

  def _prepare(self, batches, training: bool,
               strict: bool = True) -> Dict[Any, protocol.Pending]:
    """Checks batches as ``TPUEmbedding.enqueue`` does; their occurrences.

    ``batches``: ``{replica: (features, weights)}`` (replica None: the
    calling one). Structures first, then input shapes, then values
    (``input_checks.prepare``). ``strict`` (``enqueue``, the TPU
    protocol): the first batch (or ``build``) fixes unset output shapes,
    later batches are checked against them, and shapes must be fully
    defined, as the TPU compiles them. ``__call__`` is a lookup with no
    ``TPUEmbedding`` counterpart (like ``TPUEmbeddingForServing``'s): the
    input rules and ``FeatureConfig.output_shape`` bind, but every call has
    its own batch (Keras builds models on an unknown batch dimension and
    evaluates a last, smaller batch), read when the batch runs if unknown
    when traced; nothing is recorded.
    """
    inputs = {replica: (features, *self._inputs(features, weights))
              for replica, (features, weights) in batches.items()}
    return input_checks.prepare(
        inputs, training, features=self._features, tables=self._tables,
        shapes=self._shapes, rules=self._rules,
        native=self._native_step(), validate=self._validate, strict=strict,
        limit=self._limited)

  def _inputs(self, features, weights):
    """A batch's structures checked; ``(ids, weights)``, one per feature."""
    self._replicas.check_not_compiled_across_devices()
    return input_checks.flat_inputs(self._feature_config, self._features,
                                    features, weights)

  def _limited(self, pending: protocol.Pending, replica=None) -> protocol.Pending:
    """``pending`` with SparseCore's input limits applied (with a topology),
    once its ids were checked."""
    if self._sparsecore is None:
      return pending
    return pending._replace(occurrences=sparsecore_limits.keep(
        self._sparsecore, self._replicas, pending.occurrences, pending.verdict,
        self._replicas.local_replica() if replica is None else replica))

  def _activations(self, pending: protocol.Pending):
    verdict = pending.verdict
    gate = verdict.assertion if verdict is not None else None
    outputs = []
    for i, (feature, occ) in enumerate(zip(self._features, pending.occurrences)):
      out = self._table_lookup(self._tables[feature.table], occ, gate)
      if verdict is not None and verdict.assertion is None:
        # XLA: a bad feature's activations are NaN, so the loss shows it.
        out = tf.where(verdict.per_item_ok[i], out, tf.fill(tf.shape(out), float("nan")))
      outputs.append(out)
    return tf.nest.pack_sequence_as(pending.features, outputs)

  def _table_lookup(self, table: tables_lib.Table, occ: lookups.Occurrences,
                    gate=None) -> tf.Tensor:
    """Hook: one feature's ``[*occ.shape, dim]`` activation from ``table``'s
    rows; ``gate`` (an op or None) runs before any row is read."""
    activation = (native.lookup.activation if self._native_step()
                  else lookups.activation)
    return activation(self._table_vars[table.name]["parameters"], occ,
                      table.config, gate)

  # --- training ------------------------------------------------------------

  @_library_code
  def apply_gradients(self, gradients, name: Optional[str] = None):
    """Applies ``dL/dactivations`` of the last enqueued batch to the tables.

    Under a strategy every replica calls it with its own gradients; their
    per-id sums are applied once. Every table, slot and the step change
    together or not at all: all inputs are checked before the first write.
    """
    del name
    tables_lib.check_trainable(self._tables, "apply_gradients()")
    self._check_gradients(gradients)  # then our pending batch
    replica = self._local_replica("apply_gradients()")
    pending = self._batches.get(replica, "apply_gradients()")
    if not pending.training:
      raise errors.InputError(
          "apply_gradients() needs a batch enqueued with training=True. Fix: "
          "call enqueue(features, training=True) and dequeue() first.")
    self._batches.deliver(replica)
    native_update = payloads.uses_native(self._native_step(), self._rules,
                                         self._tables, self._replicas.num_workers)
    payload = payloads.build(pending, tf.nest.flatten(gradients), self._tables,
                             self._features, native_update=native_update)
    self._replicas.merge(self._apply_payloads, payload)
    # Accepted (a rejected step raised above): the batch is used up.
    self._batches.consume(replica)

  def _check_gradients(self, gradients):
    """Hook: ``apply_gradients``' checks of ``gradients``, in upstream's
    order: the structure, then each gradient's type and shape
    (tpu_embedding_v2.py apply_gradients)."""
    structure_checks.check_structure(
        self._feature_config, "gradients", gradients,
        "pass one gradient per feature, shaped like its activation (None "
        "means a zero gradient).")
    for feature, grad, shape in zip(self._features, tf.nest.flatten(gradients),
                                    self._shapes.stored):
      structure_checks.check_gradient_type(feature.where, grad)
      if grad is not None and shape.rank and shape.is_fully_defined():
        structure_checks.check_gradient(
            feature.where, grad,
            shape.as_list() + [self._tables[feature.table].config.dim])

  def _apply_payloads(self, replica_payloads: List[payloads.Payload]):
    """Hook: the step, once, from every replica's payload (in cross-replica
    context under a strategy: ``replicas.Replicas.merge``)."""
    return payloads.apply(replica_payloads, self._tables, self._features,
                          self._table_vars, rules=self._rules,
                          validate=self._validate, step=self.step,
                          failure=self._failure)

  # --- one batch for a forward and a backward pass (keras/adapters.py) ----

  @_library_code
  def lookup_for_training(self, features, weights=None):
    """``__call__``'s activations, and the batch it prepared, for
    ``apply_gradients_to`` (nothing is enqueued yet)."""
    self.build()
    self.raise_if_failed()
    pending = self._prepare({None: (features, weights)}, True, strict=False)[None]
    shapes = self._shapes.for_batch(self._inputs(features, weights)[0], False,
                                    self._rules)
    return (self._activations(pending),
            protocol.TrainingBatch(features, weights, pending, shapes))

  @_library_code
  def apply_gradients_to(self, batch: protocol.TrainingBatch, gradients):
    """``enqueue(batch's features, training=True)`` then ``apply_gradients``
    (the same checks, errors and step), without preparing the batch again
    when ``enqueue`` would prepare the same (one replica, same shapes)."""
    self.build()
    self.raise_if_failed()
    tables_lib.check_trainable(self._tables, "enqueue(training=True)")
    routed = protocol.route(self._replicas, batch.features, batch.weights, None)
    replica, num_local = self._replicas.local_replica(), self._replicas.num_local
    self._batches.check_free(list(routed), num_local)
    shapes = self._shapes.for_batch(
        self._inputs(batch.features, batch.weights)[0], True, self._rules)
    if list(routed) == [replica] and shapes == batch.shapes:
      self._shapes.record(shapes)
      self._batches.put(replica, batch.pending, num_local)
    else:
      self._put(routed, True)
    self.apply_gradients(gradients)


# --- helpers -----------------------------------------------------------------

def _untracked(obj, **attributes):
  """Sets attributes without checkpoint dependency tracking."""
  for name, value in attributes.items():
    object.__setattr__(obj, name, value)
