"""A spec's entries (a table, a feature, an override) and the dict form of
every spec value, written field by field from the dataclass fields.

Each field is written under its own name, in field order, unless its metadata
(``dict_form``) says otherwise: ``NAME`` (the entry's name: the key of its
section's mapping, not repeated inside), ``NOT_WRITTEN``, ``BY_NAME`` (a tuple
of entries written as ``{name: entry}``) or ``written_as(fn)`` (a function
gives the written form); ``ALWAYS`` (or ``always=True``): written even when
None or at its default. A field
that is None or equal to its default is left out: a file's absent key means
the default. A new field is therefore one line in its dataclass (plus its
parser in parsing.py); to_dict follows, and tests/test_spec.py checks it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

from tpu_embed_ext.spec import schedules

__all__ = ["TableSpec", "FeatureSpec", "Override", "to_dict", "written_fields",
           "NAME", "NOT_WRITTEN", "ALWAYS", "BY_NAME", "written_as",
           "optimizer_form"]

NAME = {"dict_form": "name"}
NOT_WRITTEN = {"dict_form": "not_written"}
ALWAYS = {"always": True}
BY_NAME = {"dict_form": "by_name"}


def written_as(form, always: bool = False) -> Dict[str, Any]:
  """Metadata: the field's written form is ``form(value)``."""
  return {"dict_form": form, "always": always}


def optimizer_form(value: Optional[Mapping[str, Any]]
                   ) -> Optional[Dict[str, Any]]:
  """An unresolved optimizer mapping as a file holds it: a schedule by its
  ``schedules:`` name (or its config), tuples as lists."""
  if value is None:
    return None
  out = {}
  for key, v in value.items():
    if key == "learning_rate":
      v = schedules.learning_rate_to_config(v)
    out[key] = list(v) if isinstance(v, tuple) else copy.deepcopy(v)
  return out


_OPTIMIZER = written_as(optimizer_form)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
  """One embedding table."""

  name: str = dataclasses.field(metadata=NAME)
  vocabulary_size: int
  dim: int
  combiner: str = dataclasses.field(default="mean", metadata=ALWAYS)
  """How a multi-id row combines: ``mean``, ``sum`` or ``sqrtn``."""
  initializer: Optional[Mapping[str, Any]] = None
  """``{type: truncated_normal|normal|uniform|zeros|constant, ...}``; None:
  TensorFlow's default, truncated normal with stddev 1/sqrt(dim)."""
  quantization: Optional[Mapping[str, Any]] = None
  """Simulated quantization ``{num_buckets, lower, upper}`` (forward only)."""
  optimizer: Optional[Mapping[str, Any]] = dataclasses.field(
      default=None, metadata=_OPTIMIZER)
  """The table's own optimizer override (highest precedence), unresolved."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSpec:
  """One input feature, looked up in ``table``."""

  name: str = dataclasses.field(metadata=NAME)
  table: str
  max_sequence_length: int = 0
  """> 0: a sequence feature with output ``[batch, max_sequence_length, dim]``."""
  output_shape: Optional[Tuple[int, ...]] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Override:
  """Optimizer fields for every table whose name matches the glob ``match``."""

  match: str
  # Written even when None: an override's entry always has both keys.
  optimizer: Mapping[str, Any] = dataclasses.field(
      metadata=written_as(optimizer_form, always=True))


def written_fields(cls) -> Tuple[str, ...]:
  """The keys of ``cls``'s dict form, in field order (its name excluded)."""
  return tuple(f.name for f in dataclasses.fields(cls)
               if f.metadata.get("dict_form") not in ("name", "not_written"))


def to_dict(value) -> Dict[str, Any]:
  """The dict form of a spec dataclass, field by field (see the docstring)."""
  out = {}
  for field in dataclasses.fields(value):
    form = field.metadata.get("dict_form")
    item = getattr(value, field.name)
    if form in ("name", "not_written"):
      continue
    if not field.metadata.get("always") and (
        item is None or _is_default(field, item)):
      continue
    if callable(form):
      out[field.name] = form(item)
    elif form == "by_name":
      out[field.name] = {entry.name: to_dict(entry) for entry in item}
    else:
      out[field.name] = _plain(item)
  return out


def _is_default(field: dataclasses.Field, item) -> bool:
  if field.default is not dataclasses.MISSING:
    return item == field.default
  if field.default_factory is not dataclasses.MISSING:
    return item == field.default_factory()
  return False


def _plain(item):
  """A field's value as plain data: entries as dicts, tuples as lists."""
  if dataclasses.is_dataclass(item):
    return to_dict(item)
  if isinstance(item, tuple):
    return [_plain(i) if dataclasses.is_dataclass(i) else i for i in item]
  if isinstance(item, Mapping):
    return copy.deepcopy(dict(item))
  return copy.deepcopy(item)
