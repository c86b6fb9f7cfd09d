"""SparseCore (``TPUEmbeddingV2``) table layouts, stacked checkpoints and input limits.

Pure functions over table shapes, numpy arrays and checkpoint files: nothing
here depends on the CPU engine's internals (see docs/sparsecore.md).
"""
