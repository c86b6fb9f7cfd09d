"""Where training runs: a TPU (TPUStrategy), the emulated TPU, or CPU emulation.

``--tpu emulate`` (or ``emulate:N``) runs the job's TPU path unchanged under
``emulate_tpu`` (N replicas on logical CPU devices, default that of
``emulate_tpu``): the resolver, ``initialize_tpu_system``, ``TPUStrategy`` and
the layer's ``TPUEmbedding`` branch are the emulation's.
``--tpu emulate:TOPOLOGY`` (the spellings of ``emulate --topology``) emulates
that TPU slice with its replicas: ``emulate:v5e:4``, ``emulate:v4:4``,
``emulate:v3:4`` (8 replicas, two per chip) take the ``TPUEmbedding`` branch;
``emulate:v5p:4``, ``emulate:v6e:8``, ``emulate:8x2`` have SparseCore, one
replica per chip, and the layer takes the ``TPUEmbeddingV2`` branch, as on a
v5p or v6e. The slice's HBM per device is what ``build()`` checks the tables
against.
"""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple, Optional

import tensorflow as tf

from tpu_embed_ext import emulated_tpu, errors
from tpu_embed_ext.emulated_tpu import runner
from tpu_embed_ext.emulation import dispatch
from tpu_embed_ext.sparsecore import chips as chips_lib
from tpu_embed_ext.sparsecore import topology as topology_lib

__all__ = ["resolve_strategy", "emulation", "emulated_tpu_of", "EmulatedTPU"]

_EMULATE = re.compile(r"emulate(?::(.+))?")


class EmulatedTPU(NamedTuple):
  """What ``--tpu emulate[:N|:TOPOLOGY]`` asks for (``replicas`` 0: the default).

  ``slice``: the TPU slice of ``emulate:TOPOLOGY``; ``topology``: its
  SparseCore topology when its generation has SparseCore, else None."""
  replicas: int
  topology: Optional[topology_lib.Topology] = None
  slice: Optional[chips_lib.Slice] = None


def emulated_tpu_of(tpu: str) -> Optional[EmulatedTPU]:
  """The emulated TPU of ``--tpu emulate[:N|:TOPOLOGY]``, None for another ``--tpu``."""
  if not tpu.startswith("emulate"):
    return None
  match = _EMULATE.fullmatch(tpu)
  fix = ("Fix: write emulate (the default number of replicas), emulate:N with "
         "N >= 1 replicas (TPUEmbedding), e.g. emulate:2, or emulate:TOPOLOGY, a "
         "TPU slice: e.g. emulate:v5e:4 or emulate:v3:4 (TPUEmbedding), "
         "emulate:v5p:4, emulate:v6e:8 or emulate:8x2 (SparseCore, "
         "TPUEmbeddingV2).")
  if match is None:
    raise errors.ConfigError(f"{tpu!r} is not an emulated TPU. {fix}", path="--tpu")
  rest = match.group(1)
  if rest is None:
    return EmulatedTPU(0)
  if rest.isdigit():
    if int(rest) < 1:
      raise errors.ConfigError(f"{tpu!r} is not an emulated TPU. {fix}", path="--tpu")
    return EmulatedTPU(int(rest))
  try:
    slice_ = runner.check_slice(rest)  # Cloud TPU's slices only (v5p:3 is not).
    topology = topology_lib.parse_topology(rest) if slice_.sparsecore else None
  except errors.ConfigError as e:
    raise errors.ConfigError(f"{tpu!r} is not an emulated TPU: {e}", path="--tpu") from None
  return EmulatedTPU(slice_.replicas, topology, slice_)


def emulation(tpu: str):
  """The emulated TPU around a run for ``--tpu emulate[:N|:TOPOLOGY]``, else nothing."""
  asked = emulated_tpu_of(tpu)
  if asked is None:
    return contextlib.nullcontext()
  if asked.slice is not None:
    return emulated_tpu.emulate_tpu(replicas=asked.replicas,
                                    sparsecore=asked.slice.sparsecore,
                                    topology=asked.slice.name)
  return (emulated_tpu.emulate_tpu(replicas=asked.replicas) if asked.replicas
          else emulated_tpu.emulate_tpu())


def resolve_strategy(tpu: str):
  """Returns (strategy or None, description of where training runs).

  ``emulate[:N|:TOPOLOGY]`` must run inside ``emulation(tpu)``.
  """
  if tpu == "none":
    return None, "CPU emulation (CPUEmbedding)"
  if emulated_tpu_of(tpu) is not None:
    resolver, strategy = _tpu_strategy("")
    return strategy, _found(resolver, strategy)
  try:
    resolver, strategy = _tpu_strategy("" if tpu == "auto" else tpu)
  except (ValueError, RuntimeError, OSError, tf.errors.OpError) as e:
    if tpu != "auto":
      raise errors.ConfigError(
          f"TPU {tpu!r} cannot be reached: {type(e).__name__}: "
          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}. Fix: "
          "check the name (gcloud compute tpus list), use --tpu auto on a TPU "
          "VM, or --tpu none for CPU emulation.", path="--tpu") from None
    # Information, not an error: --tpu auto without a TPU is the CPU run.
    return None, "CPU emulation (CPUEmbedding), as no TPU is attached"
  return strategy, _found(resolver, strategy)


def _found(resolver, strategy) -> str:
  """Where a TPU run trains: the TPU, its replicas and the embedding API its
  hardware takes. Under ``emulate_tpu`` (``--tpu emulate[:N|:TOPOLOGY]``, or a
  notebook kernel run by ``python -m tpu_embed_ext emulate``) the resolver is
  the emulation's, and the line says so: it never claims a real TPU."""
  api = ("TPUEmbeddingV2, SparseCore" if dispatch.uses_sparsecore(strategy)
         else "TPUEmbedding")
  replicas = strategy.num_replicas_in_sync
  emulation = emulated_tpu.current()
  if emulation is not None:
    named = emulation.slice is not None and not emulation.slice.name.endswith(
        "(default)")
    shape = (f" {emulation.topology}" if emulation.topology is not None
             else f" {emulation.slice}" if named else "")
    return (f"emulated TPU{shape}, {replicas} replica{'s' if replicas != 1 else ''} "
            f"({api})")
  return f"TPU ({resolver.master() or 'local'}), {replicas} replicas ({api})"


def _tpu_strategy(tpu: str):
  """The TPU program's opening: (resolver, TPUStrategy), connected, initialized."""
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  return resolver, tf.distribute.TPUStrategy(resolver)
