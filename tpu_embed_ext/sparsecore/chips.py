"""TPU generations: HBM, TensorCores and SparseCores per chip, and their slices.

Each figure is Cloud TPU's published one (cloud.google.com/tpu/docs/<generation>,
"System architecture" / each version's page), cited in ``GENERATIONS``:

- v2: 16 GiB of HBM per chip, two TensorCores, each its own device (8 GiB);
  TPUEmbedding (``embedding_feature`` V1), no SparseCore.
- v3: 32 GiB per chip, two TensorCores, each its own device (16 GiB); V1.
- v4: 32 GiB per chip, two TensorCores as one device (megacore), four
  SparseCores running TPUEmbedding (V1).
- v5e: 16 GiB per chip, one TensorCore; V1, no SparseCore.
- v5p: 95 GiB per chip, two TensorCores as one device (megacore), four
  SparseCores running TPUEmbeddingV2 (V2). OpenXLA's SparseCore deep dive
  (openxla.org/xla/sparsecore, "Specifications at a glance") lists 96 GiB;
  the smaller figure is used.
- v6e (Trillium): 32 GiB per chip, one TensorCore, two SparseCores (V2).
- tpu7x (Ironwood): 192 GiB per chip; two SparseCores as TensorFlow and
  jax-tpu-embedding see them (``NUM_SC_PER_DEVICE_MAP`` 'TPU7x': 2, megacore
  disabled); V2.

What XLA reports as a device's capacity ("Ran out of memory in memory space
hbm. Used X of Y hbm.", OpenXLA error E1000) is less than the nominal figure:
the runtime reserves some. Where XLA's own messages publish Y for a
generation, ``xla_capacity_gib`` holds it: v5e 15.75G (one chip) and v3
15.48G (one TensorCore; the same messages list "reserved 530.00M"), both seen
in many public error reports. Elsewhere Y is the nominal figure per device,
an upper bound: a count refused against it is refused by the TPU too.

Hosts. A TensorFlow "host" is one worker task, one TPU VM: its CPU runs
that host's input pipeline and feeds its chips (``Slice.hosts``). Chips per
VM, from each generation's "Configurations" table:

- v2, v3: 4 chips (8 TensorCores) per host (v2-8, v3-8: one host; v3-32:
  four);
- v4, v5p: 4 chips per host (v5p: "2x2x1: 4 chips, 1 host; 2x2x2: 8 chips,
  2 hosts; 2x4x4: 32 chips, 8 hosts");
- tpu7x: "Each Ironwood (TPU7x) virtual machine (VM) contains four chips"
  (cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood);
- v5e, v6e: one VM of up to 8 chips for slices of 8 chips or fewer (v6e
  "2x4: 8 chips, 1 VM"), 4-chip VMs on larger slices (v6e "4x4: 16 chips,
  4 VMs"; v5e: "Each TPU VM in a v5e TPU slice contains 1, 4 or 8 chips", its
  4-chip VMs on multi-host slices inferred from v6e's table).

A ``CHIPSxSPARSECORES`` slice names no generation and implies no hosts
(``Slice.hosts`` 1 unless given).

This module loads no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

from tpu_embed_ext import errors

__all__ = ["Generation", "GENERATIONS", "Slice", "parse_slice", "default_slice",
           "DEFAULT_V1", "DEFAULT_V2", "GIB", "MAX_CHIPS",
           "sparsecore_generation"]

GIB = 1 << 30
MAX_CHIPS = 1 << 16
"""Above the largest TPU slices (a v5p pod has 8,960 chips, an Ironwood pod
9,216); ``topology.py`` bounds SparseCore topologies by it too."""


@dataclasses.dataclass(frozen=True)
class Generation:
  """One TPU generation, per chip."""
  name: str
  hbm_gib: float
  """HBM per chip, Cloud TPU's figure."""
  replicas_per_chip: int
  """Devices (replicas) a ``TPUStrategy`` sees per chip: 2 on v2 and v3 (each
  TensorCore its own device), 1 elsewhere (one TensorCore, or megacore)."""
  sparsecores_per_chip: int
  embedding_v2: bool
  """Its embedding engine is ``TPUEmbeddingV2`` on SparseCore
  (``embedding_feature`` V2); else ``TPUEmbedding`` (V1)."""
  slices: str
  """The chip counts of its slices, for errors."""
  slice_exists: Callable[[int], bool]
  source: str
  xla_capacity_gib: Optional[float] = None
  """Y of XLA's "Used X of Y hbm" per device, where public messages show it."""
  single_host_chips: int = 4
  """The most chips one VM holds (a slice of at most this many is one host)."""
  chips_per_host: int = 4
  """Chips per VM of a slice larger than ``single_host_chips``."""

  def hosts(self, chips: int) -> int:
    """TensorFlow hosts (TPU VMs, worker tasks) of a slice of ``chips``."""
    if chips <= self.single_host_chips:
      return 1
    return -(-chips // self.chips_per_host)

  @property
  def hbm_bytes_per_device(self) -> int:
    """Nominal HBM of one device (replica)."""
    return int(self.hbm_gib * GIB) // self.replicas_per_chip

  @property
  def capacity_bytes(self) -> int:
    """HBM one device (replica) can use, as XLA counts it (see the module doc)."""
    if self.xla_capacity_gib is not None:
      return round(self.xla_capacity_gib * GIB)
    return self.hbm_bytes_per_device


def _multiple_of_4(chips: int) -> bool:
  return chips % 4 == 0


_POWERS = (1, 4, 8, 16, 32, 64, 128, 256)

GENERATIONS = {g.name: g for g in (
    Generation("v2", 16, 2, 0, False, "a multiple of 4 chips (v2-8 = 4 chips)",
               _multiple_of_4, "cloud.google.com/tpu/docs/v2: 16 GiB HBM per chip, "
               "2 TensorCores"),
    Generation("v3", 32, 2, 0, False, "a multiple of 4 chips (v3-8 = 4 chips)",
               _multiple_of_4, "cloud.google.com/tpu/docs/v3: 32 GiB HBM per chip, "
               "2 TensorCores; XLA's capacity per TensorCore 15.48G",
               xla_capacity_gib=15.48),
    Generation("v4", 32, 1, 4, False, "a multiple of 4 chips (2x2x1 = 4, 2x2x2 = 8, ...)",
               _multiple_of_4, "cloud.google.com/tpu/docs/v4: 32 GiB HBM per chip, "
               "megacore, 4 SparseCores"),
    Generation("v5e", 16, 1, 0, False, "1, 4, 8, 16, 32, 64, 128 or 256 chips",
               lambda chips: chips in _POWERS,
               "cloud.google.com/tpu/docs/v5e: 16 GiB HBM per chip, 1 TensorCore; "
               "XLA's capacity 15.75G", xla_capacity_gib=15.75,
               single_host_chips=8),
    Generation("v5p", 95, 1, 4, True, "a multiple of 4 chips (2x2x1 = 4, 2x2x2 = 8, ...)",
               _multiple_of_4, "cloud.google.com/tpu/docs/v5p: 95 GiB HBM per chip, "
               "megacore; 4 SparseCores (jax-tpu-embedding NUM_SC_PER_DEVICE_MAP; "
               "TPUEmbeddingV2's default of 4)"),
    Generation("v6e", 32, 1, 2, True, "1, 4, 8, 16, 32, 64, 128 or 256 chips",
               lambda chips: chips in _POWERS,
               "cloud.google.com/tpu/docs/v6e: 32 GiB HBM per chip, 1 TensorCore; "
               "2 SparseCores (jax-tpu-embedding NUM_SC_PER_DEVICE_MAP)",
               single_host_chips=8),
    Generation("tpu7x", 192, 1, 2, True, "a multiple of 4 chips (2x2x1 = 4, 2x2x2 = 8, ...)",
               _multiple_of_4, "cloud.google.com/tpu/docs/tpu7x: 192 GiB HBM per chip; "
               "2 SparseCores as TensorFlow sees them (jax-tpu-embedding "
               "NUM_SC_PER_DEVICE_MAP 'TPU7x': 2, megacore disabled)"),
)}

DEFAULT_V1 = "v4"
"""The generation of an emulated TPU without SparseCore when none is named:
the most HBM per device among the generations whose embedding engine is
``TPUEmbedding`` (V1), so a program it refuses for memory is refused by every
TPU that runs ``TPUEmbedding``: no false refusal."""
DEFAULT_V2 = "v5p"
"""With SparseCore: ``TPUEmbeddingV2``'s own default of 4 SparseCores per chip
(``tpu_embedding_v3.py``) is v5p's."""


@dataclasses.dataclass(frozen=True)
class Slice:
  """``chips`` chips of one generation (``generation`` None: ``CxS`` named
  only chips and SparseCores, and the HBM is the most any generation with
  that many SparseCores per chip has)."""
  chips: int
  generation: Generation
  name: str
  named_generation: bool = True

  @property
  def replicas(self) -> int:
    return self.chips * self.generation.replicas_per_chip

  @property
  def sparsecore(self) -> bool:
    """Whether the slice runs ``TPUEmbeddingV2`` (SparseCore, V2)."""
    return self.generation.embedding_v2

  @property
  def hosts(self) -> int:
    """Its TensorFlow hosts (TPU VMs; see the module doc): 1 for
    ``CHIPSxSPARSECORES`` and for a default slice, which name no machine."""
    if not self.named_generation or self.name.endswith("(default)"):
      return 1
    return self.generation.hosts(self.chips)

  def __str__(self) -> str:
    return self.name


def sparsecore_generation(per_chip: int) -> Generation:
  """The SparseCore (V2) generation with ``per_chip`` SparseCores and the most
  HBM (of every V2 generation if none has that many): no false refusal."""
  v2 = [g for g in GENERATIONS.values() if g.embedding_v2]
  return max([g for g in v2 if g.sparsecores_per_chip == per_chip] or v2,
             key=lambda g: g.hbm_gib)


def parse_slice(text, check: bool = True) -> Slice:
  """``"v5e:1"``, ``"v3:4"`` (4 chips, 8 replicas) or ``"8x4"`` (8 chips of 4
  SparseCores). ``check``: a ``GENERATION:CHIPS`` must be a slice that exists."""
  if isinstance(text, Slice):
    return text
  text = str(text).strip()
  match = re.fullmatch(r"([a-z0-9]+):(\d{1,9})", text)
  if match:
    name, chips = match.group(1), int(match.group(2))
    if name not in GENERATIONS:
      raise errors.unknown_name("TPU generation", name, GENERATIONS)
    generation = GENERATIONS[name]
    if chips < 1:
      raise errors.ConfigError(
          f"topology {text!r} has no chips. Fix: e.g. {name}:4.")
    if chips > MAX_CHIPS:
      raise errors.ConfigError(
          f"topology {text!r}: {chips:,} chips is larger than any TPU (at most "
          f"{MAX_CHIPS:,} chips here). Fix: give the slice's chip count, e.g. "
          f"{name}:4.")
    if check and not generation.slice_exists(chips):
      nearest = next(c for c in range(chips, chips + 1024)
                     if generation.slice_exists(c))
      per_chip = generation.sparsecores_per_chip
      spelling = (f", or {chips}x{per_chip} for {chips} chips of {per_chip} "
                  "SparseCores" if generation.embedding_v2 else "")
      raise errors.ConfigError(
          f"topology {text!r} is not a {name} slice: {name} slices have "
          f"{generation.slices}. Fix: e.g. {name}:{nearest}{spelling}.")
    return Slice(chips, generation, text)
  match = re.fullmatch(r"(\d{1,9})x(\d{1,9})", text)
  per_chip = {g.sparsecores_per_chip for g in GENERATIONS.values()
              if g.embedding_v2}
  if match and int(match.group(2)) in per_chip and int(match.group(1)) >= 1:
    generation = sparsecore_generation(int(match.group(2)))
    return Slice(int(match.group(1)), generation, text, named_generation=False)
  if match:
    raise errors.ConfigError(
        f"topology {text!r}: a SparseCore chip has "
        f"{' or '.join(map(str, sorted(per_chip)))} SparseCores, not "
        f"{match.group(2)}, and at least 1 chip. Fix: write {match.group(1)}x4 "
        f"(v5p), {match.group(1)}x2 (v6e, tpu7x), or GENERATION:CHIPS.")
  raise errors.ConfigError(
      f"cannot read topology {text[:40]!r}. Fix: write GENERATION:CHIPS ("
      + ", ".join(f"{g}:4" for g in GENERATIONS) + ") or CHIPSxSPARSECORES (8x4).")


def default_slice(replicas: int, sparsecore: bool) -> Slice:
  """The slice of an emulation that names none: ``DEFAULT_V2`` with
  SparseCore, else ``DEFAULT_V1``, one chip per replica."""
  generation = GENERATIONS[DEFAULT_V2 if sparsecore else DEFAULT_V1]
  chips = max(1, replicas // generation.replicas_per_chip)
  return Slice(chips, generation, f"{generation.name}:{chips} (default)")
