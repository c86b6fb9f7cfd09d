"""The training job's former module path, kept for existing imports.

Everything lives in the ``tpu_embed_ext.job`` package (one module per concern);
``tpu_embed_ext.train.serving_inputs`` and the other names documented here
remain importable from this path.
"""

from tpu_embed_ext.job import *  # pylint: disable=wildcard-import,unused-wildcard-import
from tpu_embed_ext.job import __all__
