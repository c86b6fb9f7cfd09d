"""The training job's former module path, kept for existing imports.

Everything lives in the ``tpu_embed_ext.job`` package (one module per concern);
``tpu_embed_ext.train.serving_inputs`` and the other names documented here
remain importable from this path.
"""

from tpu_embed_ext.job import (MemoryLimitError, TrainConfig, available_memory,
                               build_model, check_memory, evaluate, export,
                               input_datasets, learning_rate_series,
                               memory_shortfall, serving_inputs, train)

__all__ = ["TrainConfig", "MemoryLimitError", "train", "export", "evaluate",
           "build_model", "input_datasets", "check_memory", "memory_shortfall",
           "available_memory", "learning_rate_series", "serving_inputs"]
