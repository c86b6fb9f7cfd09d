"""Batches of ids drawn from a spec alone, for a config that names no dataset.

``plan --data N`` measures what each step sends to each SparseCore. A config
without a ``train:`` dataset (``configs/criteo.yaml`` describes tables, not
data) still gets a measurement: ids drawn over each feature's table
vocabulary, Zipf-distributed by default (a few ids very frequent, as in real
categorical data), ``hotness`` ids per example. The numbers then describe
this draw, not a real workload: the caller says so.

Zipf draws use the inverse CDF of the continuous power law ``p(x) ~ x**-s``
on ``[1, V + 1)``, floored to ``[0, V)``: no per-id probability table, so a
table of 10^7 rows costs nothing to draw from.
"""

from __future__ import annotations

from typing import Dict, Iterator, Mapping, Optional

import numpy as np
import tensorflow as tf

from tpu_embed_ext import errors

__all__ = ["DISTRIBUTIONS", "draw_ids", "spec_batches", "default_hotness",
           "parse_hotness"]

DISTRIBUTIONS = ("zipf", "uniform")
ZIPF_EXPONENT = 1.1  # As synthetic_clicks draws its ids.


def draw_ids(rng: np.random.Generator, vocabulary: int, size: int,
             distribution: str = "zipf", exponent: float = ZIPF_EXPONENT) -> np.ndarray:
  """``size`` int64 ids in ``[0, vocabulary)``; id 0 is the most frequent."""
  if distribution == "uniform":
    return rng.integers(0, vocabulary, size, dtype=np.int64)
  if distribution != "zipf":
    raise errors.unknown_name("distribution", distribution, DISTRIBUTIONS,
                              path="--ids")
  u = rng.random(size)
  top = float(vocabulary) + 1.0
  if abs(exponent - 1.0) < 1e-12:
    x = top ** u
  else:
    a = 1.0 - exponent
    x = (1.0 + u * (top ** a - 1.0)) ** (1.0 / a)
  return np.minimum(np.floor(x).astype(np.int64) - 1, vocabulary - 1)


def default_hotness(spec) -> Dict[str, int]:
  """Ids per example: a sequence feature's max_sequence_length, else 1."""
  return {f.name: f.max_sequence_length or 1 for f in spec.features}


def parse_hotness(text: str, spec) -> Dict[str, int]:
  """``"3"`` (every feature) or ``"cat_1=3,cat_2=1"`` (others keep the default).

  A bare number and ``feature=N`` entries may be mixed: ``"2,cat_3=5"``.
  """
  hotness = default_hotness(spec)
  names = list(hotness)
  for entry in filter(None, (e.strip() for e in (text or "").split(","))):
    name, sep, value = entry.rpartition("=")
    if sep and name not in hotness:
      raise errors.unknown_name("feature", name, names, path="--hotness")
    try:
      n = int(value)
    except ValueError:
      n = 0
    if n <= 0:
      raise errors.ConfigError(
          f"hotness must be a positive integer (ids per example), got "
          f"{entry!r}. Fix: write e.g. --hotness 1 or --hotness {names[0]}=3.",
          path="--hotness")
    if sep:
      hotness[name] = n
    else:
      hotness = {k: n for k in hotness}
  return hotness


def spec_batches(spec, *, batch_size: int, batches: int,
                 hotness: Optional[Mapping[str, int]] = None,
                 distribution: str = "zipf", seed: int = 0
                 ) -> Iterator[Dict[str, tf.Tensor]]:
  """``batches`` batches ``{feature: ids}`` in the pipeline's layouts.

  A feature of hotness 1 gets int64 ``[batch_size]`` ids; a multi-hot one a
  ``tf.RaggedTensor`` of ``hotness`` ids per row; one with ``output_shape``
  int64 ids of that shape. The draw is a pure function of ``seed``.
  """
  hotness = {**default_hotness(spec), **(hotness or {})}
  rng = np.random.default_rng(seed)
  vocabulary = {t.name: t.vocabulary_size for t in spec.tables}
  for _ in range(batches):
    out = {}
    for f in spec.features:
      v, k = vocabulary[f.table], hotness[f.name]
      if f.output_shape:
        shape = tuple(f.output_shape)
        out[f.name] = tf.constant(
            draw_ids(rng, v, int(np.prod(shape)), distribution).reshape(shape))
      elif k == 1:
        out[f.name] = tf.constant(draw_ids(rng, v, batch_size, distribution))
      else:
        out[f.name] = tf.RaggedTensor.from_uniform_row_length(
            draw_ids(rng, v, batch_size * k, distribution), k)
    yield out
