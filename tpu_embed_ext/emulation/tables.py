"""The engine's tables: resolved optimizers, variables, checkpoint keys.

Variables are named and tracked exactly as ``TPUEmbedding`` and
``TPUEmbeddingForServing`` name them (``<table>`` and ``<table>/<slot>`` on
the embedding object), so a checkpoint written by one restores into the
other. The user's ``TableConfig`` objects are never modified (no optimizer
or name is written into them).

A table without an optimizer (none of its own and ``optimizer=None``) is
lookup-only, as ``TPUEmbedding`` off a TPU and ``TPUEmbeddingForServing``
allow (``tpu_embedding_v2.py`` ``__init__``): it has no slot variables, and
the engine refuses to train it, as ``TPUEmbedding`` under a ``TPUStrategy``
refuses to be created with it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, NamedTuple, Tuple

import keras
import tensorflow as tf
from tensorflow.python.util import nest

from tpu_embed_ext.spec import names as derived_names, optimizers
from tpu_embed_ext.spec.schedules import Schedule
from tpu_embed_ext import errors
from tpu_embed_ext.tf import config as tf_config, optimizers as tf_optimizers, rates
from tpu_embed_ext.emulation import structure_checks
from tpu_embed_ext.emulation.rules import EngineRules
from tpu_embed_ext.host import checkpoint_scan

__all__ = ["Table", "Feature", "from_spec", "resolve_all", "resolve", "slot_names", "check_trainable", "name_of",
           "create_variables", "check_checkpoint"]


class Table(NamedTuple):
  config: Any        # the user's TableConfig (never modified)
  name: str
  optimizer: Any     # resolved optimizer spec; None: lookup-only
  # The TF optimizer object the user gave (its _create_slots makes the slots,
  # honouring slot_variable_creation_fn); None for a spec's tables.
  tf_optimizer: Any = None


class Feature(NamedTuple):
  path: str
  config: Any        # the user's FeatureConfig
  table: int         # index into the engine's tables
  where: str         # "feature 'path' (table 'name')", for errors


def from_spec(spec, step, rules: EngineRules):
  """``(feature_config, tables, features)`` of an ``EmbeddingSpec``: the
  engine's front door for a spec.

  Each table's optimizer is the spec's own resolved one, with its rate bound
  to ``step`` once (``rates.RateBinder``: a schedule and Adam's bias
  correction become one zero-arg callable, shared by the tables that share
  it). ``feature_config`` holds ``TPUEmbedding``'s ``FeatureConfig``s of the
  spec, the structure the engine's inputs follow and its ``feature_config``
  property returns; their optimizers carry the same bound rates. Nothing is
  read back from TensorFlow's objects.
  """
  binder = rates.RateBinder(step)
  own = {t.name: spec.optimizer_for(t.name) for t in spec.tables}
  feature_config = tf_config.feature_config(spec, binder=binder,
                                            table_optimizers=own)
  resolved = {name: o.with_bound_rate(binder.rate(o)) for name, o in own.items()}
  tables, features = resolve_all(feature_config, None, rules, resolved)
  return feature_config, tables, features


def resolve_all(feature_config, optimizer, rules: EngineRules, resolved=None
                ) -> Tuple[List[Table], List[Feature]]:
  """The tables (in order of first use, as ``TPUEmbedding`` orders them) and
  the flattened features of ``feature_config``. ``resolved``: ``{table name:
  optimizer spec}`` (``from_spec``), else each ``TableConfig``'s optimizer
  or ``optimizer``."""
  tables: List[Table] = []
  features: List[Feature] = []
  index = {}
  for path, feature in nest.flatten_with_joined_string_paths(feature_config):
    if not isinstance(feature, tf.tpu.experimental.embedding.FeatureConfig):
      raise errors.ConfigTypeError(
          f"feature_config entry '{path}' is a {type(feature).__name__}, not a "
          "FeatureConfig. Fix: pass a nested structure of "
          "tf.tpu.experimental.embedding.FeatureConfig, or an EmbeddingSpec, a "
          "config dict or a config file path.")
    if id(feature.table) not in index:
      index[id(feature.table)] = len(tables)
      tables.append(resolve(feature.table, optimizer, len(tables), rules,
                            resolved))
    table = index[id(feature.table)]
    features.append(Feature(path, feature, table,
                            f"feature '{path}' (table '{tables[table].name}')"))
  if rules.output_shape_required:
    for feature in features:
      if not tf.TensorShape(feature.config.output_shape).is_fully_defined():
        # tpu_embedding_v3.py _stack_tables_with_same_table_dim_and_optimizer
        # counts each feature's samples as prod(output_shape) at creation.
        raise errors.ConfigError(
            f"{feature.where}: TPUEmbeddingV2 (SparseCore) needs a fully "
            "defined FeatureConfig.output_shape, got "
            f"{structure_checks.listed(tf.TensorShape(feature.config.output_shape))}. "
            "Fix: set output_shape (e.g. [per_replica_batch]), or emulate "
            'TPUEmbedding with engine="v1".')
  names = [t.name for t in tables]
  duplicates = sorted({n for n in names if names.count(n) > 1})
  if duplicates:
    # TensorFlow's phrase first (tpu_embedding_v2.py __init__): users' tests
    # match it.
    raise errors.ConfigError(
        f"Tables must have unique names. Multiple tables with name "
        f"{duplicates[0]} found. Tables must have unique names; found "
        f"{duplicates} more than once (distinct TableConfig objects). Fix: "
        "name each TableConfig uniquely, or share one TableConfig object "
        "between the features of one table.")
  derived_names.check_table_names({t.name: slot_names(t) for t in tables})
  return tables, features


def resolve(table, global_optimizer, i: int, rules: EngineRules,
            resolved=None) -> Table:
  """A ``TableConfig`` with its optimizer resolved: from ``resolved`` (a
  spec's, by table name), else its own, else the global one."""
  name = table.name if table.name is not None else f"table_{i}"
  tf_optimizer = None
  if resolved is not None:
    spec = resolved[name]
  else:
    given = table.optimizer or global_optimizer
    if given is None:
      return Table(table, name, None)
    spec = tf_optimizers.as_spec(given, where=f"table '{name}'")
    if not isinstance(given, optimizers.OptimizerSpec):
      tf_optimizer = given
  if rules.refuses_weight_decay and spec.weight_decay_factor:
    raise errors.ConfigError(
        f"table '{name}': weight_decay_factor={spec.weight_decay_factor!r} "
        "is rejected by TPUEmbeddingV2 (SparseCore). Fix: remove weight "
        'decay, or emulate TPUEmbedding with engine="v1".')
  return Table(table, name, spec, tf_optimizer)


def bind_schedules(tables: List[Table], step) -> List[Table]:
  """Tables whose rate is a schedule object get it bound to ``step``.

  ``TPUEmbedding`` takes a number or a zero-arg callable; a Keras
  ``LearningRateSchedule`` (or a ``spec.schedules.Schedule``) given as an
  optimizer's ``learning_rate`` failed at the first step with a TypeError
  about ``step``. As a Keras user expects, it follows the engine's step, as
  an ``EmbeddingSpec``'s schedules do (checked over its whole range first).
  """
  binder = rates.RateBinder(step)
  out = []
  for t in tables:
    lr = t.optimizer.learning_rate if t.optimizer is not None else None
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
      try:
        lr = Schedule.from_keras(lr)
      except errors.ConfigError as e:
        raise e.at(f"table '{t.name}'.learning_rate") from None
    if isinstance(lr, Schedule):
      t = t._replace(optimizer=dataclasses.replace(
          t.optimizer, learning_rate=binder.schedule(lr)))
    out.append(t)
  return out


def slot_names(table: Table) -> Tuple[str, ...]:
  return table.optimizer.slot_names if table.optimizer is not None else ()


def check_trainable(tables: List[Table], what: str):
  """InputError for a training call when some table has no optimizer."""
  missing = [t.name for t in tables if t.optimizer is None]
  if missing:
    raise errors.InputError(
        f"{what} trains the tables, but table(s) {missing} have no optimizer "
        "(optimizer=None and no TableConfig.optimizer): the engine was made "
        "for lookups only, as TPUEmbeddingForServing, and TPUEmbedding under "
        "a TPUStrategy refuses to be created so. Fix: pass optimizer= to "
        "CPUEmbedding (or set TableConfig.optimizer of those tables), or "
        "enqueue with training=False for lookups.")


def create_variables(owner, table: Table, stacked: bool) -> Dict[str, tf.Variable]:
  """``{"parameters": var, <slot>: var}`` of ``table``, tracked on ``owner``.

  ``stacked``: the variables are saved in SparseCore's stacked layout
  instead (``sparsecore/``), so they are not tracked here.
  """
  shape = (table.config.vocabulary_size, table.config.dim)

  def getter(name, shape, dtype, initializer, trainable):
    del shape
    return tf.Variable(
        name=derived_names.graph_name(name), initial_value=functools.partial(
            initializer, (table.config.vocabulary_size, table.config.dim),
            dtype=dtype),
        shape=(table.config.vocabulary_size, table.config.dim), dtype=dtype,
        trainable=trainable)

  def create(name, initializer, trainable=False):
    if stacked:
      return getter(name, shape, tf.float32, initializer, trainable)
    # The custom getter lets a pending checkpoint restore fill the variable
    # at creation, as TPUEmbedding does.
    return owner._add_variable_with_custom_getter(  # pylint: disable=protected-access
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
        for slot, value in zip(slot_names(table),
                               table.optimizer.slot_initial_values()
                               if table.optimizer is not None else ())}
  slots["parameters"] = parameters
  return slots


def check_checkpoint(tables: List[Table], path: str, prefix: str):
  """ConfigError unless ``path`` holds every table and slot, same shapes;
  CheckpointError if one holds NaN or Inf.

  Keys are TensorFlow's (``derived_names.checkpoint_key``); a table's slots
  are the slot keys of its own name present in the checkpoint (another
  table's variable is never taken for one). A lookup-only table needs its
  parameters only (its slots, if stored, are not read).
  """
  stored = dict(tf.train.list_variables(path))
  ours = {derived_names.checkpoint_key(prefix, t.name, s)
          for t in tables for s in (None,) + slot_names(t)}
  described = {}
  for table in tables:
    key = functools.partial(derived_names.checkpoint_key, prefix, table.name)
    want = [table.config.vocabulary_size, table.config.dim]
    if key() not in stored:
      raise errors.ConfigError(
          f"table '{table.name}' is not in checkpoint {path}. Fix: restore a "
          "checkpoint of the same spec, or rename the table back.")
    if list(stored[key()]) != want:
      raise errors.ConfigError(
          f"table '{table.name}': checkpoint {path} holds shape "
          f"{list(stored[key()])}, this spec has {want}. Fix: restore into a "
          "spec with the same vocabulary_size and dim.")
    described[key()] = f"table '{table.name}'"
    if table.optimizer is None:
      continue
    have = sorted(s for s in derived_names.SLOT_NAMES if key(s) in stored and (
        key(s) not in ours or s in table.optimizer.slot_names))
    if sorted(table.optimizer.slot_names) != have:
      raise errors.ConfigError(
          f"table '{table.name}': checkpoint {path} holds optimizer slots {have}, "
          f"its {table.optimizer.type_name} optimizer needs "
          f"{sorted(table.optimizer.slot_names)}. Fix: restore with the optimizer "
          "the checkpoint was trained with.")
    for slot in have:
      if list(stored[key(slot)]) != want:
        raise errors.ConfigError(
            f"table '{table.name}': checkpoint {path} holds its {slot} slot with "
            f"shape {list(stored[key(slot)])}, this spec has {want}. Fix: the "
            "checkpoint is damaged; restore an earlier one.")
      described[key(slot)] = f"table '{table.name}' (slot '{slot}')"
  checkpoint_scan.check_finite(path, described)


def name_of(tables: List[Table], table) -> str:
  """The name of ``table`` (a ``TableConfig`` of the engine, by identity, or a name)."""
  if isinstance(table, str):
    names = [t.name for t in tables]
    if table not in names:
      raise errors.InputError(
          f"no table named '{table}'. Fix: use one of {names}.")
    return table
  for t in tables:
    if t.config is table:
      return t.name
  raise errors.InputTypeError(
      f"{table!r} is not a TableConfig of this engine's feature config. Fix: "
      "pass the TableConfig object the FeatureConfigs were built with, or "
      "a table name.")
