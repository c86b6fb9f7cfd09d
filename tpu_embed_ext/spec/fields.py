"""Field checks of the spec's dict form: mappings, names, sizes, numbers.

Used by spec.py while it parses; every error names its key path.
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Mapping

import numpy as np

from tpu_embed_ext.spec import names as derived_names
from tpu_embed_ext import errors

__all__ = ["require_mapping", "entries", "require_fields", "check_keys",
           "positive_int", "number", "size", "parse_initializer", "parse_quantization",
           "INITIALIZERS", "MAX_VOCABULARY_SIZE", "MAX_DIM"]

INITIALIZERS = {
    "truncated_normal": {"mean": 0.0, "stddev": None},
    "normal": {"mean": 0.0, "stddev": None},
    "uniform": {"minval": -0.05, "maxval": 0.05},
    "zeros": {},
    "constant": {"value": 0.0},
}
_QUANTIZATION_FIELDS = ("num_buckets", "lower", "upper")
# Sizes are checked before anything is built from them: a protobuf int64 field
# or a numpy shape raises a bare OverflowError on 2**63, and an allocation of
# that size exhausts memory. 2**48 rows is far beyond any TPU's memory (the
# plan and train report what does not fit), and keeps rows * dim * 4 bytes *
# (1 + slots) inside int64.
MAX_VOCABULARY_SIZE = 2 ** 48
MAX_DIM = 2 ** 20
_F32_MAX = float(np.finfo(np.float32).max)
_F32_NORMAL_MIN = float(np.finfo(np.float32).tiny)


def require_mapping(value, path, what):
  if not isinstance(value, Mapping):
    raise errors.ConfigTypeError(
        f"{what} must be a mapping, got {type(value).__name__} {value!r}. Fix: "
        "write `key: value` entries.", path=path)


def entries(config, section, kind, fields):
  """(name, entry, key path) of a non-empty ``section`` of named mappings."""
  entries = config.get(section)
  require_mapping(entries, section, f"the {section}")
  if not entries:
    raise errors.ConfigError(
        f"no {section}. Fix: add at least one {kind} under `{section}:`.",
        path=section)
  for name, raw in entries.items():
    path = f"{section}.{name}"
    if not isinstance(name, str) or not name:
      raise errors.ConfigTypeError(
          f"{kind} name {name!r} is of type {type(name).__name__}, not a string: YAML "
          f"reads an unquoted `{name}:` as a number, and the names TensorFlow "
          "derives (variables, checkpoint keys) are strings. Fix: quote it: "
          f'"{name}":' if name != "" else
          f"{kind} name is empty. Fix: give it a name.", path=path)
    derived_names.check_characters(kind, name)
    require_mapping(raw, path, f"a {kind}")
    check_keys(raw, fields, path, f"{kind} field")
    yield name, raw, path


def require_fields(value, fields, path, kind):
  """A mapping with exactly ``fields``: no unknown key, none missing."""
  require_mapping(value, path, f"an {kind}" if kind[0] in "aeiou" else f"a {kind}")
  check_keys(value, fields, path, f"{kind} field")
  for key in fields:
    if key not in value:
      raise errors.ConfigError(f"{kind} has no `{key}`. Fix: add it.",
                               path=f"{path}.{key}")


def check_keys(mapping, allowed, path, kind):
  for key in mapping:
    if key not in allowed:
      raise errors.ConfigError(
          f'unknown {kind} "{key}".{errors.did_you_mean(key, allowed)} Valid: '
          f"{errors.one_of(allowed)}.", path=f"{path}.{key}" if path else str(key))


def positive_int(value, path, name):
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise errors.ConfigTypeError(
        f"{name} must be a positive integer, got {type(value).__name__} "
        f"{value!r}. Fix: write a whole number such as 1000.", path=path)
  if value <= 0:
    raise errors.ConfigError(
        f"{name} must be a positive integer, got {value}. Fix: use 1 or more.",
        path=path)


def number(value, path, name):
  """A number finite in float32 (the TPU's precision: larger is Inf there)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise errors.ConfigTypeError(
        f"{name} must be a finite number, got {value!r}.", path=path)
  if abs(value) > _F32_MAX:  # Before math.isfinite: a huge int overflows it.
    raise errors.ConfigError(
        f"{name}={value!r} is beyond float32's range (+-{_F32_MAX:.4g}): the "
        "TPU would store Inf. Fix: use a value of the usual magnitude.",
        path=path)
  if not math.isfinite(value):
    raise errors.ConfigTypeError(
        f"{name} must be a finite number, got {value!r}.", path=path)
  return value


def size(value, path, name, limit):
  """A positive integer no larger than ``limit``."""
  positive_int(value, path, name)
  if value > limit:
    raise errors.ConfigError(
        f"{name}={value} is larger than {limit:,} (2^{limit.bit_length() - 1}): "
        "no TPU holds it, and its byte counts overflow 64-bit integers. Fix: "
        "use the real size (vocabulary_size is the number of ids, dim the "
        "embedding width).", path=path)


def parse_initializer(value, path):
  if value is None:
    return None
  require_mapping(value, path, "an initializer")
  kind = value.get("type")
  errors.require_name(kind, f"{path}.type", "an initializer type")
  if kind not in INITIALIZERS:
    raise errors.unknown_name("initializer type", kind, INITIALIZERS,
                              path=f"{path}.type")
  check_keys(value, ("type", *INITIALIZERS[kind]), path, f"{kind} field")
  for key in value:
    if key != "type":
      number(value[key], f"{path}.{key}", key)
  if "stddev" in value and value["stddev"] <= 0:
    raise errors.ConfigError(f"stddev must be > 0, got {value['stddev']}.",
                             path=f"{path}.stddev")
  if kind == "uniform" and value.get("minval", -0.05) >= value.get("maxval", 0.05):
    raise errors.ConfigError("uniform initializer needs minval < maxval. Fix: "
                             "swap them.", path=f"{path}.minval")
  return copy.deepcopy(dict(value))


def parse_quantization(value, path):
  if value is None:
    return None
  require_fields(value, _QUANTIZATION_FIELDS, path, "quantization")
  buckets = value["num_buckets"]
  if isinstance(buckets, bool) or not isinstance(buckets, numbers.Integral) or buckets < 2:
    raise errors.ConfigError(
        f"num_buckets must be an integer >= 2, got {buckets!r}.",
        path=f"{path}.num_buckets")
  lower = number(value["lower"], f"{path}.lower", "lower")
  upper = number(value["upper"], f"{path}.upper", "upper")
  if lower >= upper:
    raise errors.ConfigError(
        f"quantization needs lower < upper, got lower={lower}, upper={upper}.",
        path=f"{path}.lower")
  # x = floor((x - lower) / q + 0.5) * q + lower, q = (upper - lower) /
  # (num_buckets - 1), in float32 (docs/numeric-traps.md).
  with np.errstate(over="ignore", under="ignore"):
    q = float((np.float32(upper) - np.float32(lower)) / np.float32(buckets - 1))
  if not _F32_NORMAL_MIN <= q < _F32_MAX:
    raise errors.ConfigError(
        f"quantization step q = (upper - lower) / (num_buckets - 1) = "
        f"({upper!r} - {lower!r}) / {buckets - 1} is {q:g} in float32: "
        "(x - lower) / q then divides by "
        + ("Inf, and 0 * Inf writes NaN into the activations"
           if q >= _F32_MAX else "0, and writes Inf or NaN into the activations")
        + ". Fix: use bounds of the usual magnitude and fewer buckets, e.g. "
        "lower: -1, upper: 1, num_buckets: 256.", path=f"{path}.num_buckets")
  return copy.deepcopy(dict(value))


