"""Training data: the offline ``synthetic_clicks`` tfds dataset (registered on
import), MovieLens columns, ids drawn from a spec, and the input pipeline.
"""

from tpu_embed_ext.data import synthetic_clicks  # Registers the tfds builder.
from tpu_embed_ext.data.pipeline import auc, make_dataset
from tpu_embed_ext.data.synthetic_clicks import planted_auc, vocabulary_sizes

__all__ = ["synthetic_clicks", "make_dataset", "auc", "planted_auc",
           "vocabulary_sizes"]
