"""SparseCore (``TPUEmbeddingV2``) below the engine: topology, stacked table
layouts, input limits and stacked checkpoints (conversion and restore).
"""

from tpu_embed_ext.sparsecore.convert import checkpoint_layouts, convert_checkpoint
from tpu_embed_ext.sparsecore.topology import (PRESETS, Topology, check_slice,
                                              parse_topology)

__all__ = ["PRESETS", "Topology", "checkpoint_layouts", "convert_checkpoint",
           "parse_topology", "check_slice"]
