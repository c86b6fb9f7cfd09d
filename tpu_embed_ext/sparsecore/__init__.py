"""SparseCore (``TPUEmbeddingV2``) table layouts, stacked checkpoints and input limits.

Pure functions over table shapes, numpy arrays and checkpoint files: nothing
here depends on the CPU engine's internals (see docs/sparsecore.md).
"""

from tpu_embed_ext.sparsecore.convert import checkpoint_layouts, convert_checkpoint
from tpu_embed_ext.sparsecore.topology import PRESETS, Topology, parse_topology

__all__ = ["PRESETS", "Topology", "checkpoint_layouts", "convert_checkpoint",
           "parse_topology"]
