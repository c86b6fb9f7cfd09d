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

__all__ = ["PRESETS", "Topology", "parse_topology"]

# generation -> (SparseCores per chip, source of the figure).
PRESETS = {
    "v5p": (4, "jax-tpu-embedding NUM_SC_PER_DEVICE_MAP 'TPU v5p': 4; "
               "TPUEmbeddingV2's default of 4"),
    "v6e": (2, "jax-tpu-embedding NUM_SC_PER_DEVICE_MAP 'TPU v6e': 2"),
    "tpu7x": (2, "jax-tpu-embedding NUM_SC_PER_DEVICE_MAP 'TPU7x': 2"),
}


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
  if match:
    generation, chips = match.group(1), int(match.group(2))
    if generation not in PRESETS:
      raise errors.unknown_name("TPU generation", generation, PRESETS)
    return Topology(chips, PRESETS[generation][0], name=text)
  match = re.fullmatch(r"(\d+)x(\d+)", text)
  if match:
    return Topology(int(match.group(1)), int(match.group(2)), name=text)
  raise errors.ConfigError(
      f"cannot read topology {text!r}. Fix: write {_SPELLINGS}.")
