"""``plan --data``: the ids each SparseCore receives, measured over the job's
training batches, or over ids drawn from the spec when it names no dataset.

The one part of ``plan`` that reads the job's data (tensorflow_datasets), so
``commands.py`` imports it only when ``--data`` is given.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tpu_embed_ext import job
from tpu_embed_ext.cli import sparsecore_report
from tpu_embed_ext.data import spec_ids
from tpu_embed_ext.data.spec_ids import parse_hotness
from tpu_embed_ext.sparsecore import limits as sc_limits
from tpu_embed_ext.sparsecore.topology import Topology

__all__ = ["measure_training_data", "parse_hotness"]


def measure_training_data(spec, topology: Topology, batches: int,
                          limits_: Optional[sc_limits.Limits] = None, *,
                          hotness=None, distribution: str = "zipf",
                          batch_size: int = 0) -> sparsecore_report.DataReport:
  """``measure`` over the first ``batches`` batches of the spec's training input.

  A spec whose ``train:`` section names no dataset is measured on ids drawn
  from the spec itself (``data.spec_ids``: ``distribution`` over each table's
  vocabulary, ``hotness`` ids per example, ``batch_size`` examples, default
  512); ``DataReport.source`` says which.
  """
  cfg = job.TrainConfig.from_dict(spec.train or {})
  config = spec.feature_config(step=tf.Variable(0, dtype=tf.int64, trainable=False))
  if "dataset" not in (spec.train or {}):
    size = batch_size or cfg.batch_size
    report = sparsecore_report.measure(config, spec_ids.spec_batches(
        spec, batch_size=size, batches=batches, hotness=hotness,
        distribution=distribution, seed=cfg.seed), topology, limits_,
                                       batch_size=size)
    report.source = (f"{batches} batches of {size} examples drawn from the spec "
                     f"({distribution} ids over each table's vocabulary; the "
                     "config names no dataset)")
    return report
  dataset, _ = job.input_datasets(spec, cfg)
  report = sparsecore_report.measure(
      config, (inputs["categorical"] for inputs, _ in dataset.take(batches)),
      topology, limits_, batch_size=cfg.batch_size)
  report.source = f"{batches} training batches of {cfg.dataset}"
  return report
