"""Where training runs: a TPU (TPUStrategy), the emulated TPU, or CPU emulation.

``--tpu emulate`` (or ``emulate:N``) runs the job's TPU path unchanged under
``emulate_tpu`` (N replicas on logical CPU devices, default that of
``emulate_tpu``): the resolver, ``initialize_tpu_system``, ``TPUStrategy`` and
the layer's ``TPUEmbedding`` branch are the emulation's.
"""

from __future__ import annotations

import contextlib
import re
from typing import Optional

import tensorflow as tf

from tpu_embed_ext import emulated_tpu, errors

__all__ = ["resolve_strategy", "emulation", "emulated_replicas"]

_EMULATE = re.compile(r"emulate(?::(\d+))?")


def emulated_replicas(tpu: str) -> Optional[int]:
  """N of ``--tpu emulate:N`` (0: ``emulate``, the default), None otherwise."""
  if not tpu.startswith("emulate"):
    return None
  match = _EMULATE.fullmatch(tpu)
  if match is None or (match.group(1) is not None and int(match.group(1)) < 1):
    raise errors.ConfigError(
        f"{tpu!r} is not an emulated TPU. Fix: write emulate (the default "
        "number of replicas) or emulate:N with N >= 1 replicas, e.g. emulate:2.",
        path="--tpu")
  return int(match.group(1) or 0)


def emulation(tpu: str):
  """The emulated TPU around a run for ``--tpu emulate[:N]``, else nothing."""
  replicas = emulated_replicas(tpu)
  if replicas is None:
    return contextlib.nullcontext()
  return (emulated_tpu.emulate_tpu(replicas=replicas) if replicas
          else emulated_tpu.emulate_tpu())


def resolve_strategy(tpu: str):
  """Returns (strategy or None, description of where training runs).

  ``emulate[:N]`` must run inside ``emulation(tpu)``.
  """
  if tpu == "none":
    return None, "CPU emulation (CPUEmbedding)"
  if emulated_replicas(tpu) is not None:
    _, strategy = _tpu_strategy("")
    return strategy, f"emulated TPU, {strategy.num_replicas_in_sync} replicas (TPUEmbedding)"
  try:
    resolver, strategy = _tpu_strategy("" if tpu == "auto" else tpu)
    return strategy, f"TPU ({resolver.master()}) via TPUEmbedding"
  except (ValueError, RuntimeError, OSError, tf.errors.OpError) as e:
    if tpu != "auto":
      raise errors.ConfigError(
          f"TPU {tpu!r} cannot be reached: {type(e).__name__}: "
          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}. Fix: "
          "check the name (gcloud compute tpus list), use --tpu auto on a TPU "
          "VM, or --tpu none for CPU emulation.", path="--tpu") from None
    # Information, not an error: --tpu auto without a TPU is the CPU run.
    return None, "CPU emulation (CPUEmbedding), as no TPU is attached"


def _tpu_strategy(tpu: str):
  """The TPU program's opening: (resolver, TPUStrategy), connected, initialized."""
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  return resolver, tf.distribute.TPUStrategy(resolver)
