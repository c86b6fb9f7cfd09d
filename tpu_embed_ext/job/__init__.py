"""The main job: train, evaluate and export a ranking model from one config
(``tpu-embed train``, ``export``) on a TPU, the emulated TPU or CPU emulation.
"""

from tpu_embed_ext.job.building import build_model
from tpu_embed_ext.job.config import TrainConfig
from tpu_embed_ext.job.data import input_datasets
from tpu_embed_ext.job.evaluation import evaluate
from tpu_embed_ext.job.export_serving import export, serving_inputs
from tpu_embed_ext.job.loop import train
from tpu_embed_ext.host.memory import (MemoryLimitError, available_memory,
                                       check_memory, memory_shortfall)
from tpu_embed_ext.job.outputs import learning_rate_series

__all__ = ["TrainConfig", "MemoryLimitError", "train", "export", "evaluate",
           "build_model", "input_datasets", "check_memory", "memory_shortfall",
           "available_memory", "learning_rate_series", "serving_inputs"]
