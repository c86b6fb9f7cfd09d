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
``,hosts=H`` after any of these emulates a pod slice of H hosts (TPU VMs),
each feeding ``replicas / H`` cores from its own input pipeline:
``emulate:8,hosts=2`` is 8 replicas on 2 hosts of 4. A named slice implies
its hosts, as Cloud TPU's VMs hold its chips (``emulate:v5p:8`` is 2 hosts of
4 chips, ``emulate:v3:8`` 2 hosts of 8 replicas); ``,hosts=H`` with it must
say the same. (``emulate:2x4`` is 2 chips of 4 SparseCores, one host.)
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

_EMULATE = re.compile(r"emulate(?::([^,]+))?(?:,hosts=(\d+))?")


class EmulatedTPU(NamedTuple):
  """What ``--tpu emulate[:N|:TOPOLOGY][,hosts=H]`` asks for (``replicas`` 0:
  the default).

  ``slice``: the TPU slice of ``emulate:TOPOLOGY``; ``topology``: its
  SparseCore topology when its generation has SparseCore, else None;
  ``hosts``: the pod's hosts (the slice's, else 1 unless ``,hosts=H``)."""
  replicas: int
  topology: Optional[topology_lib.Topology] = None
  slice: Optional[chips_lib.Slice] = None
  hosts: int = 1


_FIX = ("Fix: write emulate (the default number of replicas), emulate:N with "
        "N >= 1 replicas (TPUEmbedding), e.g. emulate:2, or emulate:TOPOLOGY, a "
        "TPU slice: e.g. emulate:v5e:4 or emulate:v3:4 (TPUEmbedding), "
        "emulate:v5p:4, emulate:v6e:8 or emulate:8x2 (SparseCore, "
        "TPUEmbeddingV2); add ,hosts=H for a pod slice of H hosts, e.g. "
        "emulate:8,hosts=2.")


def emulated_tpu_of(tpu: str) -> Optional[EmulatedTPU]:
  """The emulated TPU of ``--tpu emulate[:N|:TOPOLOGY][,hosts=H]``, None for
  another ``--tpu``."""
  if not tpu.startswith("emulate"):
    return None
  match = _EMULATE.fullmatch(tpu)
  if match is None:
    raise errors.ConfigError(f"{tpu!r} is not an emulated TPU. {_FIX}", path="--tpu")
  rest, hosts = match.group(1), match.group(2)
  if rest is None:
    asked = EmulatedTPU(0)
  elif rest.isdigit():
    if int(rest) < 1:
      raise errors.ConfigError(f"{tpu!r} is not an emulated TPU. {_FIX}", path="--tpu")
    asked = EmulatedTPU(int(rest))
  else:
    try:
      slice_ = runner.check_slice(rest)  # Cloud TPU's slices only (v5p:3 is not).
      topology = topology_lib.parse_topology(rest) if slice_.sparsecore else None
    except errors.ConfigError as e:
      raise errors.ConfigError(f"{tpu!r} is not an emulated TPU: {e}",
                               path="--tpu") from None
    asked = EmulatedTPU(slice_.replicas, topology, slice_, slice_.hosts)
  return asked if hosts is None else _on_hosts(tpu, asked, int(hosts))


def _on_hosts(tpu: str, asked: EmulatedTPU, hosts: int) -> EmulatedTPU:
  """``asked`` on ``hosts`` hosts (``,hosts=H``), or ConfigError."""
  replicas = asked.replicas or 8  # emulate_tpu's default.
  base = tpu.partition(",")[0]
  why = fix = None
  if hosts < 1:
    why = "a pod slice has at least 1 host"
    fix = f"{base},hosts=2 for 2 hosts, or {base} for one"
  elif asked.slice is not None and hosts != asked.slice.hosts:
    implied = asked.slice.hosts
    why = (f"topology {asked.slice.name!r} has {implied} host"
           f"{'s' if implied != 1 else ''} ({asked.replicas // implied} replicas "
           f"each, as Cloud TPU's VMs hold them)")
    fix = f"write {base} (its {implied} host{'s' if implied != 1 else ''})"
    if asked.slice.sparsecore and hosts == 1:
      chips, per_chip = asked.slice.chips, asked.slice.generation.sparsecores_per_chip
      fix += (f", or emulate:{chips}x{per_chip} ({chips} chips of {per_chip} "
              "SparseCores on one host)")
    elif not asked.slice.sparsecore:
      on = f"{hosts} hosts" if hosts > 1 else "one host"
      fix += (f", or emulate:{replicas}" + (f",hosts={hosts}" if hosts > 1 else "")
              + f" ({replicas} replicas on {on}, no named slice)")
  elif replicas % hosts:
    why = (f"{replicas} replicas do not split over {hosts} hosts (each host "
           "feeds as many cores)")
    fix = (f"a multiple of {hosts} replicas, e.g. emulate:{hosts * max(1, replicas // hosts)}"
           f",hosts={hosts}")
  if why is not None:
    raise errors.ConfigError(f"{tpu!r} is not an emulated TPU: {why}. Fix: {fix}.",
                             path="--tpu")
  return asked._replace(hosts=hosts)


def emulation(tpu: str):
  """The emulated TPU around a run for ``--tpu emulate[:N|:TOPOLOGY][,hosts=H]``,
  else nothing."""
  asked = emulated_tpu_of(tpu)
  if asked is None:
    return contextlib.nullcontext()
  if asked.slice is not None:
    return emulated_tpu.emulate_tpu(replicas=asked.replicas,
                                    sparsecore=asked.slice.sparsecore,
                                    topology=asked.slice.name)
  return emulated_tpu.emulate_tpu(replicas=asked.replicas or None, hosts=asked.hosts)


def resolve_strategy(tpu: str):
  """Returns (strategy or None, description of where training runs).

  ``emulate[:N|:TOPOLOGY][,hosts=H]`` must run inside ``emulation(tpu)``.
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
  the emulation's, and the line says so (with a pod's hosts: "8 replicas on 2
  hosts"): it never claims a real TPU."""
  api = ("TPUEmbeddingV2, SparseCore" if dispatch.uses_sparsecore(strategy)
         else "TPUEmbedding")
  replicas = strategy.num_replicas_in_sync
  emulation = emulated_tpu.current()
  if emulation is not None:
    named = emulation.slice is not None and not emulation.slice.name.endswith(
        "(default)")
    shape = (f" {emulation.topology}" if emulation.topology is not None
             else f" {emulation.slice}" if named else "")
    hosts = f" on {emulation.hosts} hosts" if emulation.hosts > 1 else ""
    return (f"emulated TPU{shape}, {replicas} replica{'s' if replicas != 1 else ''}"
            f"{hosts} ({api})")
  return f"TPU ({resolver.master() or 'local'}), {replicas} replicas ({api})"


def _tpu_strategy(tpu: str):
  """The TPU program's opening: (resolver, TPUStrategy), connected, initialized."""
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  return resolver, tf.distribute.TPUStrategy(resolver)
