"""The embedding spec: tables, features, and per-table optimizers.

One frozen value describes every table and feature and the optimizer each
table trains with. It is parsed from one form, a plain dict (YAML and JSON
files are loaded into that), and ``to_dict`` writes that form back exactly.

Optimizer precedence, lowest first: the global ``optimizer``, then every entry
of ``overrides`` whose glob ``match`` fits the table name (in file order), then
the table's own ``optimizer``. An override without ``type`` (or with the
inherited type) merges its fields into the inherited optimizer; one with a
different ``type`` replaces it, inheriting nothing.

The spec knows nothing of engines. ``feature_config`` builds fresh
TensorFlow objects every call (see tf_config.py), so nothing the spec hands
out can be mutated back into it.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from tpu_embed_ext.spec import (files as config_files, names as derived_names,
                                numeric_traps, optimizers, fields as
                                spec_fields, schedules as learning_rates)
from tpu_embed_ext import errors

__all__ = ["TableSpec", "FeatureSpec", "Override", "EmbeddingSpec"]

COMBINERS = ("mean", "sum", "sqrtn")
INITIALIZERS = spec_fields.INITIALIZERS
_TOP_LEVEL = ("optimizer", "schedules", "tables", "overrides", "features", "train")
_TABLE_FIELDS = ("vocabulary_size", "dim", "combiner", "optimizer", "initializer",
                 "quantization")
_FEATURE_FIELDS = ("table", "max_sequence_length", "output_shape")
_OVERRIDE_FIELDS = ("match", "optimizer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
  """One embedding table."""

  name: str
  vocabulary_size: int
  dim: int
  combiner: str = "mean"
  """How a multi-id row combines: ``mean``, ``sum`` or ``sqrtn``."""
  optimizer: Optional[Mapping[str, Any]] = None
  """The table's own optimizer override (highest precedence), unresolved."""
  initializer: Optional[Mapping[str, Any]] = None
  """``{type: truncated_normal|normal|uniform|zeros|constant, ...}``; None:
  TensorFlow's default, truncated normal with stddev 1/sqrt(dim)."""
  quantization: Optional[Mapping[str, Any]] = None
  """Simulated quantization ``{num_buckets, lower, upper}`` (forward only)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSpec:
  """One input feature, looked up in ``table``."""

  name: str
  table: str
  max_sequence_length: int = 0
  """> 0: a sequence feature with output ``[batch, max_sequence_length, dim]``."""
  output_shape: Optional[Tuple[int, ...]] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Override:
  """Optimizer fields for every table whose name matches the glob ``match``."""

  match: str
  optimizer: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingSpec:
  """Tables, features and optimizers; build it with ``from_dict``/``from_file``."""

  optimizer: Optional[Mapping[str, Any]]
  tables: Tuple[TableSpec, ...]
  features: Tuple[FeatureSpec, ...]
  overrides: Tuple[Override, ...] = ()
  schedules: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  train: Optional[Mapping[str, Any]] = None
  """The training job's settings, carried untouched (see train.py)."""
  source: Optional[str] = dataclasses.field(default=None, compare=False)
  """The file the spec was read from, for error messages."""

  def __post_init__(self):
    # Every table's optimizer must resolve and validate (numeric traps
    # included), and no two derived names (variables, checkpoint keys) clash:
    # also for a spec built directly rather than by from_dict.
    derived_names.check_table_names(
        {t.name: self.optimizer_for(t.name).slot_names for t in self.tables})
    derived_names.check_feature_names([f.name for f in self.features])

  # --- parsing ---------------------------------------------------------------

  @classmethod
  def coerce(cls, value):
    """``value`` as a spec if it is one, a config file path or a config dict;
    anything else (a nested structure of ``FeatureConfig``) unchanged.

    A config dict is told from a ``FeatureConfig`` structure by its content:
    plain data with ``tables`` or ``features``, and no TensorFlow object.
    """
    if isinstance(value, (str, os.PathLike)):
      return cls.from_file(value)
    if (isinstance(value, Mapping) and {"tables", "features"} & set(value)
        and all(isinstance(leaf, (str, int, float, bool, type(None)))
                for leaf in _leaves(value))):
      return cls.from_dict(value)
    return value

  @classmethod
  def from_file(cls, path: str) -> "EmbeddingSpec":
    """Reads a ``.yaml``/``.yml`` or ``.json`` file (config_files.py: bounded
    in size, nesting and YAML alias expansion), or a shipped config by name
    (``"ranking"``, ``"tiny"``...) as ``--config`` does; an existing path wins."""
    path = config_files.resolve(path, flag=None)
    data = config_files.load(path)
    try:
      return cls.from_dict(data, source=path)
    except errors.ConfigError as e:
      raise e.at(file=path) from None

  @classmethod
  def from_dict(cls, config: Mapping[str, Any], *,
                source: Optional[str] = None) -> "EmbeddingSpec":
    """Parses and validates the dict form; raises ConfigError with key paths."""
    spec_fields.require_mapping(config, "", "the config")
    spec_fields.check_keys(config, _TOP_LEVEL, "", "top-level key")
    schedules = learning_rates.parse_schedules(config.get("schedules"))

    def parse_optimizer(value, path, need_type=False):
      if value is None:
        return None
      spec_fields.require_mapping(value, path, "an optimizer")
      value = copy.deepcopy(dict(value))
      if need_type and "type" not in value:
        raise errors.ConfigError(
            f"the global optimizer needs a `type`. Fix: add `type:` with one of "
            f"{errors.one_of(optimizers.TYPES)}.", path=f"{path}.type")
      if "type" in value:
        errors.require_name(value["type"], f"{path}.type", "an optimizer type")
      if "type" in value and value["type"] not in optimizers.TYPES:
        raise errors.unknown_name("optimizer type", value["type"],
                                  optimizers.TYPES, path=f"{path}.type")
      if "learning_rate" in value:
        try:
          value["learning_rate"] = learning_rates.parse_learning_rate(
              value["learning_rate"], schedules)
        except errors.ConfigError as e:
          raise e.at(path) from None
      return value

    global_optimizer = parse_optimizer(config.get("optimizer"), "optimizer",
                                       need_type=True)
    tables = []
    for name, raw, path in spec_fields.entries(config, "tables", "table", _TABLE_FIELDS):
      for key in ("vocabulary_size", "dim"):
        if key not in raw:
          raise errors.ConfigError(
              f"table '{name}' has no {key}. Fix: add `{key}:` (a positive "
              "integer).", path=f"{path}.{key}")
      spec_fields.size(raw["vocabulary_size"], f"{path}.vocabulary_size",
                       "vocabulary_size", spec_fields.MAX_VOCABULARY_SIZE)
      spec_fields.size(raw["dim"], f"{path}.dim", "dim", spec_fields.MAX_DIM)
      combiner = raw.get("combiner", "mean")
      if combiner not in COMBINERS:
        raise errors.unknown_name("combiner", combiner, COMBINERS,
                                  path=f"{path}.combiner")
      tables.append(TableSpec(
          name=str(name), vocabulary_size=raw["vocabulary_size"], dim=raw["dim"],
          combiner=combiner,
          optimizer=parse_optimizer(raw.get("optimizer"), f"{path}.optimizer"),
          initializer=spec_fields.parse_initializer(raw.get("initializer"),
                                         f"{path}.initializer"),
          quantization=spec_fields.parse_quantization(raw.get("quantization"),
                                           f"{path}.quantization")))

    overrides = []
    raw_overrides = config.get("overrides") or []
    if not isinstance(raw_overrides, list):
      raise errors.ConfigTypeError(
          f"overrides must be a list of {{match, optimizer}}, got "
          f"{type(raw_overrides).__name__}. Fix: start each entry with `- match:`.",
          path="overrides")
    names = [t.name for t in tables]
    for i, raw in enumerate(raw_overrides):
      path = f"overrides[{i}]"
      spec_fields.require_fields(raw, _OVERRIDE_FIELDS, path, "override")
      pattern = raw["match"]
      if not isinstance(pattern, str):
        raise errors.ConfigTypeError(
            f"match must be a glob string, got {pattern!r}. Fix: quote it, "
            'e.g. "cat_*".', path=f"{path}.match")
      if not fnmatch.filter(names, pattern):
        raise errors.ConfigError(
            f'pattern "{pattern}" matches no table.'
            f"{errors.did_you_mean(pattern, names)} Tables: "
            f"{errors.one_of(names)}.", path=f"{path}.match")
      overrides.append(Override(match=pattern, optimizer=parse_optimizer(
          raw["optimizer"], f"{path}.optimizer")))

    features = []
    for name, raw, path in spec_fields.entries(config, "features", "feature", _FEATURE_FIELDS):
      table = raw.get("table")
      if table not in names:
        raise errors.ConfigError(
            f"feature '{name}' uses unknown table {table!r}."
            f"{errors.did_you_mean(table, names)} Tables: {errors.one_of(names)}.",
            path=f"{path}.table")
      length = raw.get("max_sequence_length", 0)
      if length != 0:
        spec_fields.positive_int(length, f"{path}.max_sequence_length", "max_sequence_length")
      shape = raw.get("output_shape")
      if shape is not None:
        if not isinstance(shape, (list, tuple)) or not shape:
          raise errors.ConfigTypeError(
              f"output_shape must be a list of positive integers, got {shape!r}.",
              path=f"{path}.output_shape")
        for d in shape:
          spec_fields.positive_int(d, f"{path}.output_shape", "output_shape entries")
        shape = tuple(shape)
      features.append(FeatureSpec(name=str(name), table=table,
                                  max_sequence_length=length, output_shape=shape))
    used = {f.table for f in features}
    for t in tables:
      if t.name not in used:
        raise errors.ConfigError(
            f"table '{t.name}' is used by no feature: TPUEmbedding would not "
            "create it. Fix: add a feature with `table: "
            f"{t.name}`, or remove the table.", path=f"tables.{t.name}")
    train = config.get("train")
    if train is not None:
      spec_fields.require_mapping(train, "train", "the train section")
      train = copy.deepcopy(dict(train))
    spec = cls(optimizer=global_optimizer, tables=tuple(tables),
               features=tuple(features), overrides=tuple(overrides),
               schedules=schedules, train=train, source=source)
    return spec

  # --- resolution --------------------------------------------------------------

  def table(self, name: str) -> TableSpec:
    for t in self.tables:
      if t.name == name:
        return t
    raise errors.unknown_name("table", name, [t.name for t in self.tables])

  def optimizer_for(self, table_name: str) -> optimizers.OptimizerSpec:
    """The resolved optimizer spec of a table (global < overrides < table)."""
    table = self.table(table_name)
    layers = [(self.optimizer, "optimizer")]
    layers += [(o.optimizer, f"overrides[{i}].optimizer")
               for i, o in enumerate(self.overrides)
               if fnmatch.fnmatchcase(table_name, o.match)]
    layers.append((table.optimizer, f"tables.{table_name}.optimizer"))
    merged: Dict[str, Any] = {}
    origin: Dict[str, str] = {}
    for layer, path in layers:
      if not layer:
        continue
      if "type" in layer and layer["type"] != merged.get("type"):
        merged, origin = {}, {}
      # Gradient clipping set in one form replaces what was inherited in the
      # other (clipvalue, or v1's clip_gradient_min/max); both forms in one
      # mapping stay an error (optimizers.OptimizerSpec._merge_v1_clip).
      v1 = optimizers.V1_CLIP_FIELDS
      if "clipvalue" in layer and not any(k in layer for k in v1):
        for key in v1:
          merged.pop(key, None)
      elif any(k in layer for k in v1) and "clipvalue" not in layer:
        merged.pop("clipvalue", None)
      merged.update(layer)
      origin.update({k: path for k in layer})
    if "type" not in merged:
      raise errors.ConfigError(
          f"table '{table_name}' has no optimizer type: no global optimizer, "
          "and no override or table optimizer sets `type`. Fix: add a global "
          "`optimizer: {type: ...}`.", path=f"tables.{table_name}.optimizer")
    try:
      return optimizers.from_dict(merged)
    except errors.ConfigError as e:
      field = e.path.split(".")[0]
      located = e.at(origin.get(field, f"tables.{table_name}.optimizer"))
      if isinstance(e, numeric_traps.NumericTrapError):
        # Overrides and the global optimizer apply to several tables: name it.
        located = type(e)(f"table '{table_name}': {e.message}",
                          path=located.path, file=located.file)
      raise located from None

  def feature_config(self, step=None) -> Dict[str, Any]:
    """Fresh ``{feature: tf.tpu.experimental.embedding.FeatureConfig}``."""
    # Lazy: keeps TensorFlow off `import tpu_embed_ext.spec` (tf/ builds its objects).
    from tpu_embed_ext.tf import config as tf_config  # pylint: disable=g-import-not-at-top
    return tf_config.feature_config(self, step=step)

  # --- writing -------------------------------------------------------------

  def to_dict(self) -> Dict[str, Any]:
    """The dict form; ``EmbeddingSpec.from_dict(spec.to_dict()) == spec``."""

    def optimizer_dict(value):
      if value is None:
        return None
      out = {}
      for key, v in value.items():
        if key == "learning_rate":
          v = learning_rates.learning_rate_to_config(v)
        out[key] = list(v) if isinstance(v, tuple) else copy.deepcopy(v)
      return out

    out: Dict[str, Any] = {}
    if self.optimizer is not None:
      out["optimizer"] = optimizer_dict(self.optimizer)
    if self.schedules:
      out["schedules"] = {n: s.to_config() for n, s in self.schedules.items()}
    out["tables"] = {}
    for t in self.tables:
      entry = {"vocabulary_size": t.vocabulary_size, "dim": t.dim,
               "combiner": t.combiner}
      for key in ("initializer", "quantization"):
        if getattr(t, key) is not None:
          entry[key] = copy.deepcopy(dict(getattr(t, key)))
      if t.optimizer is not None:
        entry["optimizer"] = optimizer_dict(t.optimizer)
      out["tables"][t.name] = entry
    if self.overrides:
      out["overrides"] = [{"match": o.match, "optimizer": optimizer_dict(o.optimizer)}
                          for o in self.overrides]
    out["features"] = {}
    for f in self.features:
      entry = {"table": f.table}
      if f.max_sequence_length:
        entry["max_sequence_length"] = f.max_sequence_length
      if f.output_shape is not None:
        entry["output_shape"] = list(f.output_shape)
      out["features"][f.name] = entry
    if self.train is not None:
      out["train"] = copy.deepcopy(dict(self.train))
    return out

  def to_yaml(self) -> str:
    import yaml
    return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _leaves(value):
  """Every non-container value of nested dicts and lists (iteratively)."""
  stack = [value]
  while stack:
    node = stack.pop()
    if isinstance(node, Mapping):
      stack.extend(node.values())
    elif isinstance(node, (list, tuple)):
      stack.extend(node)
    else:
      yield node
