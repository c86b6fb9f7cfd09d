"""Datasets and input pipelines. Importing this registers ``synthetic_clicks``."""

from tpu_embed_ext.data import synthetic_clicks  # noqa: F401  (registers the builder)
from tpu_embed_ext.data.pipeline import auc, make_dataset

__all__ = ["synthetic_clicks", "make_dataset", "auc"]
