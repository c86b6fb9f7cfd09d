"""SparseCore topologies: how many chips, and how many SparseCores per chip.

A stacked SparseCore table is sharded over ``chips * sparsecores_per_chip``
SparseCores, so the layout of a checkpoint depends on both numbers.

Sparsecores per chip, with where the figure comes from:
- v5p: 4. jax-tpu-embedding ``NUM_SC_PER_DEVICE_MAP`` ('TPU v5', 'TPU v5p': 4);
  also TensorFlow's fallback when the TPU does not report it
  (``tpu_embedding_v3.py``, ``TPUEmbeddingV2.__init__``: "Using 4 as the
  default value for SparseCore").
- v6e (Trillium): 2. jax-tpu-embedding ``NUM_SC_PER_DEVICE_MAP`` ('TPU v6e',
  'TPU v6 lite': 2); Cloud TPU v6e documentation lists SparseCore as a feature.
- tpu7x (Ironwood): 2. jax-tpu-embedding ``NUM_SC_PER_DEVICE_MAP`` ('TPU7x': 2,
  "Megacore is disabled").
"""

from __future__ import annotations

import dataclasses
import re

from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore import chips as chips_lib

__all__ = ["PRESETS", "Topology", "parse_topology", "check_slice", "SPARSECORES_PER_CHIP",
           "MAX_CHIPS"]

# generation -> (SparseCores per chip, source of the figure): the generations
# whose embedding engine is TPUEmbeddingV2 (chips.py).
PRESETS = {g.name: (g.sparsecores_per_chip, g.source)
           for g in chips_lib.GENERATIONS.values() if g.embedding_v2}

# The SparseCore counts a chip can have: the values above (TPUEmbeddingV2 reads
# tpu_hardware_feature.num_embedding_devices_per_chip and falls back to 4).
SPARSECORES_PER_CHIP = tuple(sorted({n for n, _ in PRESETS.values()}))
MAX_CHIPS = chips_lib.MAX_CHIPS
"""Above the largest TPU slices (``chips.MAX_CHIPS``): a bound that keeps
``chips * sparsecores_per_chip`` inside the stacker's 32-bit ints and the
padding (rows to a multiple of ``8 * chips * sparsecores_per_chip``) far below
memory."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """The SparseCores a ``TPUEmbeddingV2`` shards its tables over.

  ``chips`` is ``strategy.num_replicas_in_sync`` (the stacker's
  ``num_partitions``); ``sparsecores_per_chip`` is
  ``tpu_hardware_feature.num_embedding_devices_per_chip``.
  """
  chips: int
  sparsecores_per_chip: int
  name: str = ""

  def __post_init__(self):
    for field in ("chips", "sparsecores_per_chip"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.ConfigError(
            f"topology {field} must be a positive integer, got {field}={value!r}.")
    if self.chips > MAX_CHIPS or self.sparsecores_per_chip > max(SPARSECORES_PER_CHIP):
      raise errors.ConfigError(
          f"topology {self.chips} chips x {self.sparsecores_per_chip} SparseCores "
          f"is larger than any TPU (at most {MAX_CHIPS:,} chips here, "
          f"{max(SPARSECORES_PER_CHIP)} SparseCores per chip); its padding alone "
          "would exhaust memory. Fix: give the slice's chip count, e.g. "
          "v5p:128.")

  @property
  def num_sparse_cores(self) -> int:
    return self.chips * self.sparsecores_per_chip

  def __str__(self) -> str:
    what = f"{self.chips} chips x {self.sparsecores_per_chip} SparseCores"
    return f"{self.name} ({what})" if self.name else what


_SPELLINGS = ("GENERATION:CHIPS (" + ", ".join(f"{g}:4" for g in PRESETS)
              + ") or CHIPSxSPARSECORES (8x4)")


def parse_topology(text) -> Topology:
  """``"v5p:4"`` (4 v5p chips), ``"v6e:8"`` or ``"8x4"`` (8 chips, 4 each)."""
  if isinstance(text, Topology):
    return text
  text = str(text).strip()
  match = re.fullmatch(r"([a-z0-9]+):(\d+)", text)
  if match and len(match.group(2)) > 9:
    raise errors.ConfigError(
        f"topology {text[:40]!r}: {match.group(2)[:20]}... chips is larger than "
        "any TPU. Fix: give the slice's chip count, e.g. v5p:128.")
  if match:
    generation, chips = match.group(1), int(match.group(2))
    if generation not in PRESETS:
      raise errors.unknown_name("TPU generation", generation, PRESETS)
    return Topology(chips, PRESETS[generation][0], name=text)
  match = re.fullmatch(r"(\d{1,9})x(\d{1,9})", text)
  if match:
    chips, per_chip = int(match.group(1)), int(match.group(2))
    if per_chip not in SPARSECORES_PER_CHIP:
      raise errors.ConfigError(
          f"topology {text!r}: a TPU chip has {' or '.join(map(str, SPARSECORES_PER_CHIP))}"
          f" SparseCores, not {per_chip} ("
          + "; ".join(f"{g}: {n}" for g, (n, _) in PRESETS.items())
          + f"). Fix: write {chips}x4 (v5p), {chips}x2 (v6e, tpu7x), or "
          f"v5p:{chips}.")
    return Topology(chips, per_chip, name=text)
  raise errors.ConfigError(
      f"cannot read topology {text!r}. Fix: write {_SPELLINGS}.")


# The chip counts of real slices, per generation (chips.py).
_SLICE_CHIPS = {name: (chips_lib.GENERATIONS[name].slices,
                       chips_lib.GENERATIONS[name].slice_exists) for name in PRESETS}


def check_slice(text) -> Topology:
  """``parse_topology``, and for ``GENERATION:CHIPS`` a slice that exists.

  ``v5p:3`` is refused (no v5p slice has 3 chips); ``NxS`` names chips and
  SparseCores directly and is not checked against slices.
  """
  topology = parse_topology(text)
  generation = str(text).split(":")[0] if ":" in str(text) else None
  if generation in _SLICE_CHIPS:
    what, exists = _SLICE_CHIPS[generation]
    if not exists(topology.chips):
      nearest = next(c for c in range(max(topology.chips, 1), MAX_CHIPS)
                     if exists(c))
      raise errors.ConfigError(
          f"topology {str(text)!r} is not a {generation} slice: {generation} "
          f"slices have {what}. Fix: e.g. {generation}:{nearest}, or "
          f"{topology.chips}x{topology.sparsecores_per_chip} for "
          f"{topology.chips} chips of {topology.sparsecores_per_chip} SparseCores.")
  return topology
