"""Datasets and input pipelines. Importing this registers ``synthetic_clicks``."""

from tpu_embed_ext.data import synthetic_clicks  # Registers the tfds builder.
from tpu_embed_ext.data.pipeline import auc, make_dataset
from tpu_embed_ext.data.synthetic_clicks import planted_auc, vocabulary_sizes

__all__ = ["synthetic_clicks", "make_dataset", "auc", "planted_auc",
           "vocabulary_sizes"]
