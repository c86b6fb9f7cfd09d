"""The dict form of a spec, read one section at a time.

``parse`` checks the top level, then runs ``SECTIONS`` in order, as absl runs
its flag validators: one loop over rows. A row is a section and its parser;
the parser reads its section of the config and the sections parsed before it
(optimizers name schedules, overrides and features name tables) and returns
the ``EmbeddingSpec`` field of that name. Errors carry their key path.
"""

from __future__ import annotations

import copy
import fnmatch
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from tpu_embed_ext import errors
from tpu_embed_ext.spec import fields, optimizers, schedules
from tpu_embed_ext.spec.entries import (FeatureSpec, Override, TableSpec,
                                        written_fields)

__all__ = ["parse", "SECTIONS", "TOP_LEVEL", "COMBINERS"]

COMBINERS = ("mean", "sum", "sqrtn")
TOP_LEVEL = ("optimizer", "schedules", "tables", "overrides", "features", "train")

Parsed = Dict[str, Any]


def parse(config: Mapping[str, Any]) -> Parsed:
  """``EmbeddingSpec``'s fields from the dict form; ConfigError with key paths."""
  fields.require_mapping(config, "", "the config")
  fields.check_keys(config, TOP_LEVEL, "", "top-level key")
  parsed: Parsed = {}
  for section, parser in SECTIONS:
    parsed[section] = parser(config, parsed)
  return parsed


def optimizer(value, path: str, named: Mapping[str, schedules.Schedule],
              need_type: bool = False) -> Optional[Dict[str, Any]]:
  """An unresolved optimizer mapping; its learning rate parsed (a schedule's
  name looked up in ``named``). Resolution is ``EmbeddingSpec.optimizer_for``."""
  if value is None:
    return None
  fields.require_mapping(value, path, "an optimizer")
  value = copy.deepcopy(dict(value))
  if need_type and "type" not in value:
    raise errors.ConfigError(
        f"the global optimizer needs a `type`. Fix: add `type:` with one of "
        f"{errors.one_of(optimizers.TYPES)}.", path=f"{path}.type")
  if "type" in value:
    errors.require_name(value["type"], f"{path}.type", "an optimizer type")
    if value["type"] not in optimizers.TYPES:
      raise errors.unknown_name("optimizer type", value["type"],
                                optimizers.TYPES, path=f"{path}.type")
  if "learning_rate" in value:
    try:
      value["learning_rate"] = schedules.parse_learning_rate(
          value["learning_rate"], named)
    except errors.ConfigError as e:
      raise e.at(path) from None
  return value


# --- one parser per section ------------------------------------------------------

def _schedules(config, parsed: Parsed):
  del parsed
  return schedules.parse_schedules(config.get("schedules"))


def _global_optimizer(config, parsed: Parsed):
  return optimizer(config.get("optimizer"), "optimizer", parsed["schedules"],
                   need_type=True)


def _tables(config, parsed: Parsed) -> Tuple[TableSpec, ...]:
  return tuple(_table(str(name), raw, path, parsed["schedules"])
               for name, raw, path in fields.entries(
                   config, "tables", "table", written_fields(TableSpec)))


def _table(name: str, raw, path: str, named) -> TableSpec:
  for key in ("vocabulary_size", "dim"):
    if key not in raw:
      raise errors.ConfigError(
          f"table '{name}' has no {key}. Fix: add `{key}:` (a positive "
          "integer).", path=f"{path}.{key}")
  fields.size(raw["vocabulary_size"], f"{path}.vocabulary_size",
              "vocabulary_size", fields.MAX_VOCABULARY_SIZE)
  fields.size(raw["dim"], f"{path}.dim", "dim", fields.MAX_DIM)
  combiner = raw.get("combiner", "mean")
  if combiner not in COMBINERS:
    raise errors.unknown_name("combiner", combiner, COMBINERS,
                              path=f"{path}.combiner")
  return TableSpec(
      name=name, vocabulary_size=raw["vocabulary_size"], dim=raw["dim"],
      combiner=combiner,
      optimizer=optimizer(raw.get("optimizer"), f"{path}.optimizer", named),
      initializer=fields.parse_initializer(raw.get("initializer"),
                                           f"{path}.initializer"),
      quantization=fields.parse_quantization(raw.get("quantization"),
                                             f"{path}.quantization"))


def _overrides(config, parsed: Parsed) -> Tuple[Override, ...]:
  raw_overrides = config.get("overrides") or []
  if not isinstance(raw_overrides, list):
    raise errors.ConfigTypeError(
        f"overrides must be a list of {{match, optimizer}}, got "
        f"{type(raw_overrides).__name__}. Fix: start each entry with `- match:`.",
        path="overrides")
  names = [t.name for t in parsed["tables"]]
  return tuple(_override(raw, f"overrides[{i}]", names, parsed["schedules"])
               for i, raw in enumerate(raw_overrides))


def _override(raw, path: str, names, named) -> Override:
  fields.require_fields(raw, written_fields(Override), path, "override")
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
  return Override(match=pattern,
                  optimizer=optimizer(raw["optimizer"], f"{path}.optimizer", named))


def _features(config, parsed: Parsed) -> Tuple[FeatureSpec, ...]:
  """The features, then the rule that joins the two sections: every table is
  used by a feature."""
  names = [t.name for t in parsed["tables"]]
  features = tuple(_feature(str(name), raw, path, names)
                   for name, raw, path in fields.entries(
                       config, "features", "feature", written_fields(FeatureSpec)))
  used = {f.table for f in features}
  for name in names:
    if name not in used:
      raise errors.ConfigError(
          f"table '{name}' is used by no feature: TPUEmbedding would not "
          "create it. Fix: add a feature with `table: "
          f"{name}`, or remove the table.", path=f"tables.{name}")
  return features


def _feature(name: str, raw, path: str, names) -> FeatureSpec:
  table = raw.get("table")
  if table not in names:
    raise errors.ConfigError(
        f"feature '{name}' uses unknown table {table!r}."
        f"{errors.did_you_mean(table, names)} Tables: {errors.one_of(names)}.",
        path=f"{path}.table")
  length = raw.get("max_sequence_length", 0)
  if length != 0:
    fields.positive_int(length, f"{path}.max_sequence_length",
                        "max_sequence_length")
  shape = raw.get("output_shape")
  if shape is not None:
    if not isinstance(shape, (list, tuple)) or not shape:
      raise errors.ConfigTypeError(
          f"output_shape must be a list of positive integers, got {shape!r}.",
          path=f"{path}.output_shape")
    for d in shape:
      fields.positive_int(d, f"{path}.output_shape", "output_shape entries")
    shape = tuple(shape)
  return FeatureSpec(name=name, table=table, max_sequence_length=length,
                     output_shape=shape)


def _train(config, parsed: Parsed):
  """The training job's settings, carried untouched (job/ reads them)."""
  del parsed
  train = config.get("train")
  if train is None:
    return None
  fields.require_mapping(train, "train", "the train section")
  return copy.deepcopy(dict(train))


# Section -> parser, in the order they run: a parser reads the sections above it.
SECTIONS: Tuple[Tuple[str, Callable[[Mapping[str, Any], Parsed], Any]], ...] = (
    ("schedules", _schedules),
    ("optimizer", _global_optimizer),
    ("tables", _tables),
    ("overrides", _overrides),
    ("features", _features),
    ("train", _train),
)
