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
TensorFlow objects every call (see tf/config.py), so nothing the spec hands
out can be mutated back into it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import tpu_embed_ext
from tpu_embed_ext import errors
from tpu_embed_ext.spec import (entries, files as config_files, names as
                                derived_names, numeric_traps, optimizers,
                                parsing)
from tpu_embed_ext.spec.entries import FeatureSpec, Override, TableSpec

__all__ = ["TableSpec", "FeatureSpec", "Override", "EmbeddingSpec"]

COMBINERS = parsing.COMBINERS


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingSpec:
  """Tables, features and optimizers; build it with ``from_dict``/``from_file``."""

  # Field order is the dict form's key order (entries.to_dict).
  optimizer: Optional[Mapping[str, Any]] = dataclasses.field(
      metadata=entries.written_as(entries.optimizer_form))
  schedules: Mapping[str, Any] = dataclasses.field(
      default_factory=dict, metadata=entries.written_as(
          lambda named: {n: s.to_config() for n, s in named.items()}))
  tables: Tuple[TableSpec, ...] = dataclasses.field(metadata=entries.BY_NAME)
  overrides: Tuple[Override, ...] = ()
  features: Tuple[FeatureSpec, ...] = dataclasses.field(metadata=entries.BY_NAME)
  train: Optional[Mapping[str, Any]] = None
  """The training job's settings, carried untouched (see job/)."""
  source: Optional[str] = dataclasses.field(
      default=None, compare=False, metadata=entries.NOT_WRITTEN)
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
    """Parses and validates the dict form (parsing.py: one parser per
    section); raises ConfigError with key paths."""
    return cls(**parsing.parse(config), source=source)

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
    """Fresh ``{feature: tf.tpu.experimental.embedding.FeatureConfig}``:
    ``tpu_embed_ext.feature_config(spec, step)``, for users who ask for
    TensorFlow's objects (``TPUEmbedding`` on a TPU); schedules read ``step``.

    TensorFlow's objects are made by the ``tf`` stage (tf/config.py), a later
    one: the spec reaches it through the package's public names, as a user
    does, and imports nothing of it (docs/layout.md).
    """
    return tpu_embed_ext.feature_config(self, step=step)

  # --- writing -------------------------------------------------------------

  def to_dict(self) -> Dict[str, Any]:
    """The dict form, field by field (entries.py);
    ``EmbeddingSpec.from_dict(spec.to_dict()) == spec``."""
    return entries.to_dict(self)

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
