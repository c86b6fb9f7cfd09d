"""The main job: train, evaluate and export a ranking model from one config.

``python -m tpu_embed_ext train --config configs/ranking.yaml`` reads the
embedding spec and the ``train:`` section of the same file, builds the
``synthetic_clicks`` tfds dataset offline (or another tfds dataset), trains a
DLRM-style model with ``model.fit`` (tables updated by their own TPU
optimizers, dense weights by a Keras optimizer), checkpoints every
``steps_per_checkpoint`` steps and resumes from the last checkpoint in
``--model_dir``, then evaluates on the held-out split and writes
``metrics.json`` and ``learning_curve.png`` there.

Determinism (what makes a killed-and-resumed run equal an uninterrupted one):
the input order is a pure function of the seed and the step (the resumed run
skips the batches already trained on), weights are initialised from the seed,
and TensorFlow's op determinism is enabled.

One module per concern: ``config`` (the ``train:`` section), ``data`` (input
pipelines), ``building`` (model, variables, restore), ``strategy`` (TPU or CPU emulation), ``loop`` (the training
loop and its per-block callback), ``outputs`` (history.csv, TensorBoard
series, the plot), ``evaluation`` and ``export_serving``.
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
