"""Where training runs: a TPU (TPUStrategy) or CPU emulation."""

from __future__ import annotations

import tensorflow as tf

from tpu_embed_ext import errors

__all__ = ["resolve_strategy"]


def resolve_strategy(tpu: str):
  """Returns (strategy or None, description of where training runs)."""
  if tpu == "none":
    return None, "CPU emulation (CPUEmbedding)"
  try:
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
        tpu="" if tpu == "auto" else tpu)
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return (tf.distribute.TPUStrategy(resolver),
            f"TPU ({resolver.master()}) via TPUEmbedding")
  except (ValueError, RuntimeError, OSError, tf.errors.OpError) as e:
    if tpu != "auto":
      raise errors.ConfigError(
          f"TPU {tpu!r} cannot be reached: {type(e).__name__}: "
          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}. Fix: "
          "check the name (gcloud compute tpus list), use --tpu auto on a TPU "
          "VM, or --tpu none for CPU emulation.", path="--tpu") from None
    return None, f"CPU emulation (CPUEmbedding): no TPU found ({type(e).__name__})"
