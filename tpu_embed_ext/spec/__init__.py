"""The spec: frozen values for tables, features, optimizers and schedules,
and their parsing from Python, YAML or JSON. No TensorFlow at import.
"""

import importlib

__all__ = ["TableSpec", "FeatureSpec", "Override", "EmbeddingSpec"]


def __getattr__(name):  # The spec classes load on first use (PEP 562).
  if name not in __all__:
    raise AttributeError(f"module 'tpu_embed_ext.spec' has no attribute '{name}'")
  value = getattr(importlib.import_module("tpu_embed_ext.spec.embedding_spec"),
                  name)
  globals()[name] = value
  return value
