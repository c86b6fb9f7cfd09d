"""CPUEmbedding: the TPU embedding engine, emulated on CPU, that trains.

Lookups follow ``TPUEmbeddingForServing`` (``cpu_embedding_lookup``): a dense
id tensor is a plain gather (output ``ids.shape + [dim]``, no weights, no
sequence features); a ragged or sparse rank-2 input is combined per row
(``sum``, ``mean`` = ``sum(w e) / sum(w)``, ``sqrtn`` = ``sum(w e) /
sqrt(sum(w^2))``, 0 for an empty row); a sequence feature
(``max_sequence_length > 0``) returns ``[batch, max_sequence_length, dim]``
with later positions truncated and missing ones zero; ``output_shape``
reshapes as ``TPUEmbeddingForServing`` does. Simulated quantization
(``TableConfig.quantization_config``) is applied to the gathered rows before
the combiner, forward only (docs/semantics.md, other options).

Every lookup is reduced to one form per feature: occurrence ``i`` sends
``gain_i * E[id_i]`` to output row ``r_i``. Training reuses it backwards: the
gradient of occurrence ``i`` is ``gain_i * dL/dact[r_i]``; per table these are
summed per id over all features (``tf.unique`` + ``unsorted_segment_sum``),
and each touched id is updated once by ``update_rules.apply_update``. Only the
touched rows of the table and its slots are gathered and scattered, so a step
costs O(ids in the batch), whatever the vocabulary (non-lazy Adam excepted: it
updates every row by definition).

Checkpoints: variables are named and tracked exactly as ``TPUEmbedding`` and
``TPUEmbeddingForServing`` do (``<table>`` and ``<table>/<slot>`` on the
embedding object), so a checkpoint written by one restores into the other.
Unlike upstream, the user's ``TableConfig`` objects are never modified (no
optimizer or name is written into them).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, NamedTuple, Optional

import tensorflow as tf
from tensorflow.python.trackable import autotrackable
from tensorflow.python.util import nest

from tpu_embed_ext import errors, optimizers
from tpu_embed_ext.emulation import update_rules

__all__ = ["CPUEmbedding", "create_embedding"]

_ENGINES = ("v1", "v2")


class _Table(NamedTuple):
  config: Any        # the user's TableConfig (never modified)
  name: str
  optimizer: Any     # resolved optimizer spec
  tf_optimizer: Any  # the TF optimizer object, if one was given (slot creation)


class _Feature(NamedTuple):
  path: str
  config: Any        # the user's FeatureConfig
  table: int         # index into CPUEmbedding._tables


class _Update(NamedTuple):
  """One table's step, prepared: ``grads`` is checked, then ``write`` runs.

  Tables are written independently (not batched by optimizer): measured on
  W2 (benchmarks/), concatenating same-optimizer tables for one update cost
  more than it saved, as it serialises the per-table gathers and scatters
  that TensorFlow otherwise runs in parallel.
  """
  table: Any
  grads: tf.Tensor           # what is applied; checked for NaN/Inf first
  write: Any                 # () -> op, or None when eager


class _Occurrences(NamedTuple):
  """One feature's lookup in flat form: ids[i] * gains[i] -> row rows[i]."""
  ids: tf.Tensor            # [n] int64
  rows: Optional[tf.Tensor]  # [n] int; None: the identity (dense lookups)
  gains: Optional[tf.Tensor]  # [n] float32; None: all ones
  num_rows: tf.Tensor       # scalar: rows of the [num_rows, dim] output
  shape: Any                # the activation shape, without dim


class CPUEmbedding(autotrackable.AutoTrackable):
  """A drop-in for ``tf.tpu.experimental.embedding.TPUEmbedding`` off-TPU.

  Args:
    feature_config: a nested structure of ``FeatureConfig``s, as
      ``TPUEmbedding`` takes it, or an ``EmbeddingSpec`` (its schedules then
      bind to this engine's ``step``).
    optimizer: the optimizer of tables that have none: a
      ``tf.tpu.experimental.embedding`` optimizer or one of our specs.
    pipeline_execution_with_tensor_core: accepted for signature parity; it
      only changes scheduling on a TPU, not results.
    engine: ``"v1"`` emulates ``TPUEmbedding`` (TPU v2-v4); ``"v2"`` emulates
      ``TPUEmbeddingV2`` (SparseCore), which ignores weight clipping,
      ``clipvalue``, ``use_gradient_accumulation`` and ``lazy_adam`` and
      rejects weight decay (docs/semantics.md, engine v1 and v2).
    validate: check ids, shapes and gradients on every step (one reduction
      per feature; on by default).

  ``use_gradient_accumulation=False``: the TPU then applies the optimizer to
  gradient contributions as they arrive, so an id that occurs several times in
  a step is updated several times, in an order the TPU does not specify
  (docs/semantics.md, other options). The emulator makes that order deterministic: in
  round ``k`` it applies the ``k``-th contribution (in input order) of every
  id that has at least ``k`` contributions. With accumulation (the default)
  contributions are summed and each id is updated once.
  """

  def __init__(self, feature_config, optimizer=None,
               pipeline_execution_with_tensor_core: bool = False, *,
               engine: str = "v1", validate: bool = True):
    del pipeline_execution_with_tensor_core
    if engine not in _ENGINES:
      raise ValueError(f'engine must be "v1" or "v2", got engine={engine!r}.')
    # Internal state is set with _untracked: a tracked attribute would add
    # checkpoint keys that TPUEmbedding does not have.
    _untracked(self, _engine=engine, _validate=validate)
    _untracked(self, step=tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name="step"))
    if hasattr(feature_config, "feature_config"):  # An EmbeddingSpec.
      feature_config = feature_config.feature_config(step=self.step)
    tables: List[_Table] = []
    features: List[_Feature] = []
    _untracked(self, _feature_config=feature_config, _tables=tables,
               _features=features, _variables=None, _pending=None)
    index = {}
    for path, feature in nest.flatten_with_joined_string_paths(feature_config):
      if id(feature.table) not in index:
        index[id(feature.table)] = len(tables)
        tables.append(self._resolve_table(feature.table, optimizer, len(tables)))
      features.append(_Feature(path, feature, index[id(feature.table)]))
    names = [t.name for t in tables]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise ValueError(f"Tables must have unique names; found {duplicates} "
                       "more than once. Fix: name each TableConfig uniquely.")

  def _resolve_table(self, table, global_optimizer, i) -> _Table:
    name = table.name if table.name is not None else f"table_{i}"
    tf_optimizer = table.optimizer or global_optimizer
    if tf_optimizer is None:
      raise ValueError(
          f"table '{name}' has no optimizer. Fix: set TableConfig.optimizer "
          "or pass optimizer= to CPUEmbedding.")
    spec = optimizers.as_spec(tf_optimizer)
    if self._engine == "v2" and spec.weight_decay_factor:
      raise errors.ConfigError(
          f"table '{name}': weight_decay_factor={spec.weight_decay_factor!r} "
          "is rejected by TPUEmbeddingV2 (SparseCore). Fix: remove weight "
          'decay, or emulate TPUEmbedding with engine="v1".')
    is_tf = not isinstance(tf_optimizer, optimizers.OptimizerSpec)
    return _Table(table, name, spec, tf_optimizer if is_tf else None)

  # --- variables -----------------------------------------------------------

  def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
    """Creates the tables and slots (restoring them if a restore is pending)."""
    del per_replica_input_shapes, per_replica_batch_size
    if self._variables is not None:
      return
    with tf.init_scope():
      _untracked(self, _variables={
          t.name: self._create_variables(t) for t in self._tables})

  def _create_variables(self, table: _Table) -> Dict[str, tf.Variable]:
    shape = (table.config.vocabulary_size, table.config.dim)

    def getter(name, shape, dtype, initializer, trainable):
      del shape
      return tf.Variable(
          name=name, initial_value=functools.partial(
              initializer, (table.config.vocabulary_size, table.config.dim),
              dtype=dtype),
          shape=(table.config.vocabulary_size, table.config.dim), dtype=dtype,
          trainable=trainable)

    def create(name, initializer, trainable=False):
      # The custom getter lets a pending checkpoint restore fill the variable
      # at creation, as TPUEmbedding does.
      return self._add_variable_with_custom_getter(
          name=name, initializer=initializer, shape=shape, dtype=tf.float32,
          getter=getter, trainable=trainable)

    parameters = create(table.name, table.config.initializer)
    make_slot = lambda slot, init: create(f"{table.name}/{slot}", init)
    if table.tf_optimizer is not None:
      # Honours a TF optimizer's slot_variable_creation_fn.
      slots = dict(table.tf_optimizer._create_slots(parameters, make_slot))  # pylint: disable=protected-access
    else:
      slots = {
          slot: make_slot(slot, tf.constant_initializer(value))
          for slot, value in zip(table.optimizer.slot_names,
                                 table.optimizer.slot_initial_values())}
    slots["parameters"] = parameters
    return slots

  @property
  def variables(self) -> Dict[str, Dict[str, tf.Variable]]:
    """``{table_name: {"parameters": var, <slot>: var}}``."""
    self.build()
    return self._variables

  @property
  def embedding_tables(self) -> Dict[Any, tf.Variable]:
    """``{TableConfig: parameters variable}``, keyed by the user's configs."""
    self.build()
    return {t.config: self._variables[t.name]["parameters"] for t in self._tables}

  @property
  def feature_config(self):
    return self._feature_config

  def check_checkpoint(self, path: str, prefix: str = "embedding"):
    """Raises ConfigError unless ``path`` holds every table and slot, same shapes.

    TensorFlow's own restore reports a mismatch one variable at a time, after
    restoring the variables before it; this checks all tables first, naming
    the table and both shapes. ``prefix`` is the embedding's checkpoint path
    (``tf.train.Checkpoint(embedding=e)``: "embedding").
    """
    stored = dict(tf.train.list_variables(path))
    for table in self._tables:
      key = lambda slot: (f"{prefix}/{table.name}" + (f".S{slot}" if slot else "")
                          + "/.ATTRIBUTES/VARIABLE_VALUE")
      want = [table.config.vocabulary_size, table.config.dim]
      if key(None) not in stored:
        raise errors.ConfigError(
            f"table '{table.name}' is not in checkpoint {path}. Fix: restore a "
            "checkpoint of the same spec, or rename the table back.")
      if list(stored[key(None)]) != want:
        raise errors.ConfigError(
            f"table '{table.name}': checkpoint {path} holds shape "
            f"{list(stored[key(None)])}, this spec has {want}. Fix: restore into a "
            "spec with the same vocabulary_size and dim.")
      have = sorted(k.split(".S", 1)[1].split("/", 1)[0] for k in stored
                    if k.startswith(f"{prefix}/{table.name}.S"))
      if sorted(table.optimizer.slot_names) != have:
        raise errors.ConfigError(
            f"table '{table.name}': checkpoint {path} holds optimizer slots {have}, "
            f"its {table.optimizer.type_name} optimizer needs "
            f"{sorted(table.optimizer.slot_names)}. Fix: restore with the optimizer "
            "the checkpoint was trained with.")

  @property
  def engine(self) -> str:
    return self._engine

  # --- lookups -------------------------------------------------------------

  def __call__(self, features, weights=None):
    """Looks up ``features`` without recording anything for training."""
    self.build()
    occurrences, check = self._occurrences(features, weights)
    return self._activations(features, occurrences, check)

  def enqueue(self, features, weights=None, training: bool = True,
              name: Optional[str] = None, device: Optional[str] = None):
    """Records a batch for ``dequeue`` (and, if training, ``apply_gradients``)."""
    del name, device
    self.build()
    occurrences, check = self._occurrences(features, weights)
    _untracked(self, _pending=occurrences, _pending_check=check,
               _pending_features=features, _training=training)

  def dequeue(self, name: Optional[str] = None):
    """Activations of the last enqueued batch, with the features' structure."""
    del name
    if self._pending is None:
      raise errors.InputError(
          "dequeue() called before enqueue(). Fix: call enqueue(features) "
          "first, once per step.")
    return self._activations(self._pending_features, self._pending,
                             self._pending_check)

  def _check_structure(self, what, value, fix):
    paths = [p for p, _ in nest.flatten_with_joined_string_paths(value)]
    expected = [f.path for f in self._features]
    if paths != expected:
      missing = sorted(set(expected) - set(paths))
      unexpected = sorted(set(paths) - set(expected))
      raise errors.InputError(
          f"{what} do not match the feature config's structure: missing "
          f"{missing}, unexpected {unexpected}. Fix: {fix}")

  def _occurrences(self, features, weights):
    """``([_Occurrences per feature], id check op or None)``."""
    self._check_structure(
        "features", features, "pass one entry per FeatureConfig "
        f"({', '.join(f.path for f in self._features)}).")
    flat = tf.nest.flatten(features, expand_composites=False)
    flat_weights = [None] * len(flat)
    if weights is not None:
      self._check_structure(
          "weights", weights, "give weights the structure of features (None "
          "entries allowed).")
      flat_weights = tf.nest.flatten(weights)
    occurrences = [self._feature_occurrences(f, x, w)
                   for f, x, w in zip(self._features, flat, flat_weights)]
    check = self._check_ids(occurrences) if self._validate else None
    return occurrences, check

  def _feature_occurrences(self, feature: _Feature, x, w) -> _Occurrences:
    config = feature.config
    table = self._tables[feature.table]
    where = _where(feature, table)
    if not isinstance(x, (tf.SparseTensor, tf.RaggedTensor)):
      x = tf.convert_to_tensor(x)
    if not x.dtype.is_integer:
      raise errors.InputError(
          f"{where}: ids must be integers, got dtype {x.dtype.name}. Fix: cast "
          "the ids with tf.cast(ids, tf.int64).")
    if w is not None and isinstance(x, tf.Tensor):
      raise errors.InputError(
          f"{where}: weights were given for a dense id tensor. Fix: pass the "
          "ids as a RaggedTensor or SparseTensor to weight them.")
    if w is not None and config.max_sequence_length > 0:
      raise errors.InputError(
          f"{where}: weights were given for a sequence feature "
          f"(max_sequence_length={config.max_sequence_length}). Fix: drop them.")
    if w is not None and type(w) is not type(x):
      raise errors.InputError(
          f"{where}: weights are a {type(w).__name__} but ids a "
          f"{type(x).__name__}. Fix: give weights the ids' type and layout.")
    if isinstance(x, tf.Tensor):
      if config.max_sequence_length > 0:
        raise errors.InputError(
            f"{where} is a sequence feature (max_sequence_length="
            f"{config.max_sequence_length}) but got a dense tensor. Fix: pass a "
            "RaggedTensor or SparseTensor.")
      ids = tf.reshape(x, [-1])
      shape = x.shape.as_list() if x.shape.is_fully_defined() else tf.shape(x)
      occ = _Occurrences(ids, None, None, tf.size(ids), shape)
    elif isinstance(x, tf.RaggedTensor):
      occ = self._ragged_occurrences(where, config, x, w)
    else:
      occ = self._sparse_occurrences(where, config, x, w)
    return occ._replace(ids=tf.cast(occ.ids, tf.int64))

  def _ragged_occurrences(self, where, config, x, w) -> _Occurrences:
    if x.shape.rank != 2:
      raise errors.InputError(
          f"{where}: ragged ids must have rank 2 [batch, (ids)], got rank "
          f"{x.shape.rank}. Fix: merge the extra ragged dimensions.")
    batch = x.nrows(out_type=tf.int64)
    ids, row = x.values, x.value_rowids()
    weight = None if w is None else tf.cast(w.values, tf.float32)
    if w is not None and self._validate:
      _check_same_layout(where, x, w)
    out = config.output_shape
    if out:
      size = _prod(out)
      static_batch = x.shape[0]
      if static_batch is not None and size == static_batch:
        return self._combined(config, ids, row, weight, batch, list(out))
      length = size // static_batch if static_batch else None
      if static_batch is None or size % static_batch or length < 1:
        raise errors.InputError(
            f"{where}: output_shape {list(out)} must have the batch size "
            f"{static_batch} or a multiple of it as its number of elements. "
            "Fix: change FeatureConfig.output_shape.")
      return _sequence(ids, row, _positions(x), batch, length, list(out))
    if config.max_sequence_length > 0:
      length = config.max_sequence_length
      return _sequence(ids, row, _positions(x), batch, length, [batch, length])
    return self._combined(config, ids, row, weight, batch, tf.reshape(batch, [1]))

  def _sparse_occurrences(self, where, config, x, w) -> _Occurrences:
    rank = x.shape.rank
    if rank is None or rank < 2:
      raise errors.InputError(
          f"{where}: sparse ids must have rank >= 2, got rank {rank}. Fix: "
          "add a batch dimension.")
    if w is not None and self._validate:
      _check_same_indices(where, x, w)
    weight = None if w is None else tf.cast(w.values, tf.float32)
    if config.max_sequence_length > 0 and not config.output_shape and rank == 2:
      length = config.max_sequence_length
      batch = x.dense_shape[0]
      return _sequence(x.values, x.indices[:, 0], x.indices[:, 1], batch,
                       length, [batch, length])
    # Combine over the last dimension, as embedding_lookup_sparse does.
    outer = x.dense_shape[:-1]
    row = tf.zeros_like(x.indices[:, 0])
    for d in range(rank - 1):
      row = row * x.dense_shape[d] + x.indices[:, d]
    # Like embedding_lookup_sparse, output_shape does not reshape sparse input.
    return self._combined(config, x.values, row, weight, tf.reduce_prod(outer),
                          outer)

  def _combined(self, config, ids, row, weight, num_rows, shape):
    """Per-row combiner gains (docs/semantics.md, the step)."""
    combiner = config.table.combiner
    w = tf.ones_like(ids, tf.float32) if weight is None else weight
    if combiner == "sum":
      gains = w
    else:
      square = combiner == "sqrtn"
      total = tf.math.unsorted_segment_sum(w * w if square else w, row, num_rows)
      total = tf.sqrt(total) if square else total
      gains = tf.math.divide_no_nan(w, tf.gather(total, row))
    return _Occurrences(ids, row, gains, num_rows, shape)

  def _check_ids(self, occurrences: List[_Occurrences]):
    """Raises (eagerly) or asserts (in graphs) that every id is in range.

    In a graph one assertion covers every feature and is returned; gathers
    and table writes wait for it, so a bad batch fails before anything changes.
    """
    vocabs = [self._tables[f.table].config.vocabulary_size for f in self._features]
    if tf.executing_eagerly():
      for feature, occ, vocab in zip(self._features, occurrences, vocabs):
        if tf.size(occ.ids) == 0:
          continue
        low, high = int(tf.reduce_min(occ.ids)), int(tf.reduce_max(occ.ids))
        if low < 0 or high >= vocab:
          bad = low if low < 0 else high
          raise errors.InputError(
              f"{_where(feature, self._tables[feature.table])}: id {bad} is out "
              f"of range [0, {vocab}). Fix: map ids into the vocabulary (e.g. "
              f"hash them modulo {vocab}) or enlarge vocabulary_size.")
      return None
    # Two reductions per feature (an empty feature gives min=MAX, max=MIN: ok).
    low = tf.stack([tf.reduce_min(o.ids) for o in occurrences])
    high = tf.stack([tf.reduce_max(o.ids) for o in occurrences])
    bad = tf.logical_or(low < 0, high >= tf.constant(vocabs, tf.int64))
    messages = tf.constant([
        f"{_where(f, self._tables[f.table])}: ids must be in [0, {v}). Fix: map "
        "ids into the vocabulary or enlarge vocabulary_size."
        for f, v in zip(self._features, vocabs)])
    return tf.debugging.Assert(
        tf.logical_not(tf.reduce_any(bad)),
        [tf.boolean_mask(messages, bad), "Smallest and largest ids:",
         tf.boolean_mask(low, bad), tf.boolean_mask(high, bad)],
        summarize=8)

  def _activations(self, features, occurrences, check):
    outputs = []
    for feature, occ in zip(self._features, occurrences):
      table = self._tables[feature.table]
      params = self._variables[table.name]["parameters"]
      with tf.control_dependencies([check] if check is not None else []):
        rows = tf.gather(params, occ.ids)
      rows = _quantize(rows, table.config.quantization_config)
      dim = table.config.dim
      if occ.rows is None:
        out = rows
      else:
        if occ.gains is not None:
          rows = rows * occ.gains[:, None]
        out = tf.math.unsorted_segment_sum(rows, occ.rows, occ.num_rows)
      if isinstance(occ.shape, list):
        outputs.append(tf.reshape(out, occ.shape + [dim]))
      else:
        outputs.append(tf.reshape(out, tf.concat(
            [tf.cast(occ.shape, tf.int32), [dim]], 0)))
      _set_static_shape(outputs[-1], occ.shape, dim)
    return tf.nest.pack_sequence_as(features, outputs)

  # --- training ------------------------------------------------------------

  def apply_gradients(self, gradients, name: Optional[str] = None):
    """Applies ``dL/dactivations`` of the last enqueued batch to the tables.

    Every table, slot and the step change together or not at all: all inputs
    are checked before the first variable is written.
    """
    del name
    if self._pending is None or not self._training:
      raise errors.InputError(
          "apply_gradients() needs a batch enqueued with training=True. Fix: "
          "call enqueue(features, training=True) and dequeue() first.")
    flat = self._flat_gradients(gradients)
    per_table = [[] for _ in self._tables]
    for feature, occ, grad in zip(self._features, self._pending, flat):
      per_table[feature.table].append(self._occurrence_gradients(feature, occ, grad))
    rates = {}
    updates = []
    for table, parts in zip(self._tables, per_table):
      ids, grads = (parts[0] if len(parts) == 1 else
                    [tf.concat(p, 0) for p in zip(*parts)])
      lr = self._learning_rate(table.optimizer, rates)
      updates.append(self._reduce(table, ids, grads, lr))
    checks = [self._pending_check, self._check_finite(updates)]
    with tf.control_dependencies([c for c in checks if c is not None]):
      writes = [u.write() for u in updates]
    with tf.control_dependencies([w for w in writes if w is not None]):
      self.step.assign_add(1)
    _untracked(self, _pending=None, _pending_check=None)

  def _flat_gradients(self, gradients):
    self._check_structure(
        "gradients", gradients, "pass one gradient per feature, shaped like its "
        "activation (None means a zero gradient).")
    return tf.nest.flatten(gradients)

  def _occurrence_gradients(self, feature, occ, grad):
    table = self._tables[feature.table]
    dim = table.config.dim
    if grad is None:
      return occ.ids, tf.zeros([tf.size(occ.ids), dim], tf.float32)
    grad = tf.convert_to_tensor(grad, tf.float32)
    if self._validate and tf.executing_eagerly():
      expected = [int(s) for s in occ.shape] + [dim]
      if grad.shape.as_list() != expected:
        raise errors.InputError(
            f"feature '{feature.path}' (table '{table.name}'): gradient shape "
            f"{grad.shape.as_list()} does not match its activation shape "
            f"{expected}. Fix: pass dL/d(activation) for exactly the "
            "activations dequeue() returned.")
    grad = tf.reshape(grad, [-1, dim])
    if occ.rows is not None:
      grad = tf.gather(grad, occ.rows)
    if occ.gains is not None:
      grad = grad * occ.gains[:, None]
    return occ.ids, grad

  def _check_finite(self, updates):
    """Rejects non-finite gradients of any table before any write.

    Checks what each table will apply (per-id sums with accumulation), so a
    sum that overflows is rejected too. Eagerly raises InputError; in a graph
    returns one assertion over all tables.
    """
    if not self._validate:
      return None
    message = ("gradient has NaN or Inf values; no table, slot or step was "
               "changed. Fix: check the loss for overflow, or clip the "
               "activations' gradients.")
    finite = [tf.reduce_all(tf.math.is_finite(u.grads)) for u in updates]
    if tf.executing_eagerly():
      for update, ok in zip(updates, finite):
        if not bool(ok):
          raise errors.InputError(f"table '{update.table.name}': {message}")
      return None
    finite = tf.stack(finite)
    names = tf.constant([f"table '{u.table.name}'" for u in updates])
    return tf.debugging.Assert(
        tf.reduce_all(finite),
        [f"{message} Tables:", tf.boolean_mask(names, tf.logical_not(finite))])

  def _learning_rate(self, spec, cache):
    lr = spec.learning_rate
    if not callable(lr):
      return tf.constant(lr, tf.float32)
    # One evaluation per distinct callable per step (shared schedules = tags).
    if id(lr) not in cache:
      cache[id(lr)] = tf.cast(lr(), tf.float32)
    return cache[id(lr)]

  def _reduce(self, table: _Table, ids, grads, lr) -> "_Update":
    """What one table applies this step: per-id sums, unless the mode differs."""
    spec = table.optimizer
    args = (spec, *self._table_variables(table))
    if (self._engine == "v1" and isinstance(spec, optimizers.Adam)
        and not spec.lazy_adam):
      g = tf.tensor_scatter_nd_add(tf.zeros_like(args[1]), ids[:, None], grads)
      return _Update(table, g, functools.partial(
          self._update_all_rows, *args, g, lr))
    if self._engine == "v1" and not spec.use_gradient_accumulation:
      return _Update(table, grads, functools.partial(
          self._update_in_rounds, *args, ids, grads, lr))
    unique, index = tf.unique(ids)
    g = tf.math.unsorted_segment_sum(grads, index, tf.size(unique))
    return _Update(table, g, functools.partial(
        self._write_rows, *args, unique, g, lr))

  def _table_variables(self, table: _Table):
    """``(parameters, [slot variables in the spec's slot order])``."""
    variables = self._variables[table.name]
    return (variables["parameters"],
            [variables[s] for s in table.optimizer.slot_names])

  def _write_rows(self, spec, params, slot_vars, rows, g, lr):
    """Updates ``rows`` (unique ids) of one table with their gradients ``g``."""
    w = tf.gather(params, rows)
    slots = tuple(tf.gather(s, rows) for s in slot_vars)
    w, slots = update_rules.apply_update(spec, w, slots, g, lr,
                                         engine=self._engine)
    ops = [params.scatter_update(tf.IndexedSlices(w, rows))]
    ops += [v.scatter_update(tf.IndexedSlices(s, rows))
            for v, s in zip(slot_vars, slots)]
    return tf.group(ops)

  def _update_all_rows(self, spec, params, slot_vars, g, lr):
    """Non-lazy Adam: every row steps, untouched ones with g = 0."""
    w, slots = update_rules.apply_update(
        spec, params.read_value(), tuple(s.read_value() for s in slot_vars), g,
        lr, engine=self._engine)
    return tf.group([params.assign(w)] +
                    [v.assign(s) for v, s in zip(slot_vars, slots)])

  def _update_in_rounds(self, spec, params, slot_vars, ids, grads, lr):
    """No accumulation: round k applies each id's k-th contribution."""
    n = tf.size(ids)
    unique, index = tf.unique(ids)
    order = tf.argsort(index, stable=True)
    sorted_index = tf.gather(index, order)
    starts = tf.math.unsorted_segment_min(tf.range(n), sorted_index,
                                          tf.size(unique))
    rank_sorted = tf.range(n) - tf.gather(starts, sorted_index)
    rank = tf.scatter_nd(order[:, None], rank_sorted, [n])
    rounds = tf.reduce_max(tf.concat([rank + 1, [0]], 0))
    if tf.executing_eagerly():
      for k in range(int(rounds)):
        mask = tf.equal(rank, k)
        self._write_rows(spec, params, slot_vars, tf.boolean_mask(ids, mask),
                         tf.boolean_mask(grads, mask), lr)
      return None

    def body(k):
      mask = tf.equal(rank, k)
      with tf.control_dependencies([self._write_rows(
          spec, params, slot_vars, tf.boolean_mask(ids, mask),
          tf.boolean_mask(grads, mask), lr)]):
        return k + 1
    return tf.while_loop(lambda k: k < rounds, body, [tf.constant(0)]).op


# --- helpers -----------------------------------------------------------------

def _where(feature: _Feature, table: _Table) -> str:
  return f"feature '{feature.path}' (table '{table.name}')"


def _untracked(obj, **attributes):
  """Sets attributes without checkpoint dependency tracking."""
  for name, value in attributes.items():
    object.__setattr__(obj, name, value)


def _prod(shape) -> int:
  out = 1
  for s in shape:
    out *= int(s)
  return out


def _positions(x: tf.RaggedTensor) -> tf.Tensor:
  """Position of every value inside its row."""
  starts = tf.gather(x.row_starts(), x.value_rowids())
  return tf.range(tf.size(x.values, out_type=tf.int64), dtype=tf.int64) - starts


def _sequence(ids, row, col, batch, length, shape) -> _Occurrences:
  """Sequence lookups: position col of row lands in output row*length+col."""
  keep = col < length
  ids, row, col = (tf.boolean_mask(t, keep) for t in (ids, row, col))
  return _Occurrences(ids, row * length + col, None,
                      tf.cast(batch, tf.int64) * length, shape)


def _quantize(rows, config):
  """Simulated quantization of gathered rows (forward only)."""
  if config is None:
    return rows
  lower, upper = float(config.lower), float(config.upper)
  quantum = (upper - lower) / (config.num_buckets - 1)
  x = tf.clip_by_value(rows, lower, upper)
  q = tf.floor((x - lower) / quantum + 0.5) * quantum + lower
  # Straight-through: the backward pass sees the identity (docs/semantics.md).
  return rows + tf.stop_gradient(q - rows)


def _set_static_shape(tensor, shape, dim):
  if isinstance(shape, (list, tuple)):
    static = [s if isinstance(s, int) else None for s in shape]
    tensor.set_shape(static + [dim])


def _check_same_layout(where, ids: tf.RaggedTensor, weights: tf.RaggedTensor):
  if tf.executing_eagerly() and (
      ids.row_splits.shape != weights.row_splits.shape or not bool(tf.reduce_all(
          tf.equal(ids.row_splits,
                   tf.cast(weights.row_splits, ids.row_splits.dtype))))):
    raise errors.InputError(
        f"{where}: weights have row lengths {weights.row_lengths().numpy().tolist()} "
        f"but ids {ids.row_lengths().numpy().tolist()}. Fix: give one weight "
        "per id, in the same rows.")


def _check_same_indices(where, ids: tf.SparseTensor, weights: tf.SparseTensor):
  if tf.executing_eagerly():
    same = (ids.indices.shape == weights.indices.shape and bool(
        tf.reduce_all(tf.equal(ids.indices, weights.indices))))
    if not same:
      raise errors.InputError(
          f"{where}: weights' indices do not match the ids' indices. Fix: give "
          "one weight per id, at the same indices.")


# --- dispatch ----------------------------------------------------------------

def _sparsecore(strategy) -> bool:
  """Whether a TPUStrategy's hardware embeds with SparseCore (TPUEmbeddingV2)."""
  feature = strategy.extended.tpu_hardware_feature.embedding_feature
  from tensorflow.python.tpu import tpu_hardware_feature
  return feature in (tpu_hardware_feature.HardwareFeature.EmbeddingFeature.V2,)


def create_embedding(feature_config, optimizer=None, *, engine=None,
                     validate: bool = True, strategy=None):
  """The right mid-level API object for where the code runs.

  Under a ``TPUStrategy`` (the one in scope, or ``strategy``):
  ``TPUEmbeddingV2`` on SparseCore hardware (``embedding_feature`` V2, e.g.
  v5p/v6e) or when ``engine="v2"``, ``TPUEmbedding`` otherwise. Anywhere
  else: ``CPUEmbedding`` emulating ``engine`` (default ``"v1"``).

  The TPU branch was not run on TPU hardware (none is reachable where this
  package is developed); tests exercise the dispatch with a stand-in strategy.
  An ``EmbeddingSpec`` on a TPU binds its schedules to a fresh step variable
  that the caller must advance (``EmbeddingLayer`` does).
  """
  from tensorflow.python.distribute import tpu_strategy
  strategy = strategy or tf.distribute.get_strategy()
  if isinstance(strategy, (tpu_strategy.TPUStrategy, tpu_strategy.TPUStrategyV2)):
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    if hasattr(feature_config, "feature_config"):
      feature_config = feature_config.feature_config(step=step)
    if isinstance(optimizer, optimizers.OptimizerSpec):
      optimizer = optimizers.to_tf(optimizer)
    use_v2 = engine == "v2" or (engine is None and _sparsecore(strategy))
    if use_v2:
      from tensorflow.python.tpu import tpu_embedding_v3
      embedding = tpu_embedding_v3.TPUEmbeddingV2(feature_config, optimizer)
    else:
      embedding = tf.tpu.experimental.embedding.TPUEmbedding(
          feature_config, optimizer)
    # TPU engines have no step; the caller advances this one per update.
    _untracked(embedding, step=step)
    return embedding
  return CPUEmbedding(feature_config, optimizer, engine=engine or "v1",
                      validate=validate)
