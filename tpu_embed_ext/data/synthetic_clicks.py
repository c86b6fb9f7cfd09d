"""``synthetic_clicks``: an offline, Criteo-like click log with a known answer.

13 dense features and 26 categorical ones (``c0``..``c25``; ``c20``..``c25``
multi-hot with 1-5 ids), ids Zipf-distributed over per-feature vocabularies.
Each label is drawn from a *planted* logistic model: hidden per-id weights
(averaged over a multi-hot row) plus a linear term in the dense features plus
a bias that sets the click rate. Each example also carries ``planted_logit``,
the Bayes-optimal score, so the best AUC any model can reach on a split is
known exactly (``planted_auc``).

Everything is generated from the config's seed with vectorised numpy: no
download, same bytes on every machine.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

__all__ = ["SyntheticClicks", "SyntheticClicksConfig", "vocabulary_sizes",
           "MULTI_HOT", "NUM_DENSE", "planted_auc", "columns", "CATEGORICAL"]

NUM_DENSE = 13
CATEGORICAL = tuple(f"c{i}" for i in range(26))
MULTI_HOT = tuple(f"c{i}" for i in range(20, 26))
MAX_MULTI_HOT = 5
# Criteo-like spread of cardinalities, scaled so the default builds in seconds.
_DEFAULT_VOCAB = (1000, 500, 50000, 20000, 300, 24, 8000, 600, 3, 30000, 4000,
                  40000, 3000, 27, 6000, 50000, 10, 4000, 2000, 4, 50000, 18, 15,
                  30000, 100, 20000)


@dataclasses.dataclass
class SyntheticClicksConfig(tfds.core.BuilderConfig):
  seed: int = 0
  num_train: int = 500_000
  num_test: int = 20_000
  vocabulary: Tuple[int, ...] = _DEFAULT_VOCAB
  zipf_exponent: float = 1.1
  click_rate: float = 0.25


_CONFIGS = {
    "default": SyntheticClicksConfig(name="default", description="500k/20k."),
    "tiny": SyntheticClicksConfig(
        name="tiny", description="4k/1k examples, vocabularies <= 200.",
        num_train=4000, num_test=1000,
        vocabulary=tuple(min(v, 200) for v in _DEFAULT_VOCAB)),
}


def vocabulary_sizes(config_name: str = "default") -> Dict[str, int]:
  return dict(zip(CATEGORICAL, _CONFIGS[config_name].vocabulary))


class _World:
  """The hidden parameters of the planted model, fixed by the seed."""

  def __init__(self, config: SyntheticClicksConfig):
    rng = np.random.default_rng(config.seed)
    self.config = config
    self.permutation = [rng.permutation(v) for v in config.vocabulary]
    self.zipf_p = []
    for v in config.vocabulary:
      p = 1.0 / np.arange(1, v + 1) ** config.zipf_exponent
      self.zipf_p.append(p / p.sum())
    # Half of the features carry signal; strength varies per feature.
    strength = rng.uniform(0.1, 0.6, len(CATEGORICAL)) * (rng.random(26) < 0.6)
    # Rare ids get weaker weights (scaled by 100 / rank past rank 100):
    # what a model cannot learn from a handful of examples should not count
    # much in the planted AUC. Weights are indexed by id, ranks permuted to ids.
    self.weights = []
    for f, (s, v) in enumerate(zip(strength, config.vocabulary)):
      by_rank = rng.normal(0, s, v) * np.minimum(1.0, 100.0 / np.arange(1, v + 1))
      weights = np.empty(v)
      weights[self.permutation[f]] = by_rank
      self.weights.append(weights)
    self.dense_weights = rng.normal(0, 0.25, NUM_DENSE)
    self.bias = 0.0
    logits = self.sample(50_000, rng)[-1]
    self.bias = _solve_bias(logits, config.click_rate)

  def sample(self, n: int, rng: np.random.Generator):
    """Returns (dense, {feature: (values, lengths)}, logits) for n examples."""
    dense = np.log1p(rng.lognormal(0.0, 1.0, (n, NUM_DENSE))).astype(np.float32)
    dense -= 0.8  # Roughly centred.
    logits = dense @ self.dense_weights + self.bias
    ids = {}
    for f, name in enumerate(CATEGORICAL):
      lengths = (rng.integers(1, MAX_MULTI_HOT + 1, n) if name in MULTI_HOT
                 else np.ones(n, np.int64))
      ranks = rng.choice(len(self.zipf_p[f]), size=lengths.sum(), p=self.zipf_p[f])
      values = self.permutation[f][ranks]
      row_sum = np.add.reduceat(self.weights[f][values], np.r_[0, np.cumsum(lengths)[:-1]])
      logits = logits + row_sum / lengths
      ids[name] = (values.astype(np.int64), lengths)
    return dense, ids, logits.astype(np.float32)


def _solve_bias(logits, rate):
  lo, hi = -10.0, 10.0
  for _ in range(60):
    mid = (lo + hi) / 2
    if (1 / (1 + np.exp(-(logits + mid)))).mean() > rate:
      hi = mid
    else:
      lo = mid
  return (lo + hi) / 2


class SyntheticClicks(tfds.core.GeneratorBasedBuilder):
  """Criteo-like synthetic click log with a planted model; builds offline."""

  VERSION = tfds.core.Version("1.2.0")
  RELEASE_NOTES = {"1.0.0": "First release.",
                   "1.1.0": "Weaker planted weights for rare ids.",
                   "1.2.0": "Planted weights fall as 1/rank past rank 100; 500k train."}
  BUILDER_CONFIGS = list(_CONFIGS.values())
  DEFAULT_CONFIG_NAME = "default"

  def _info(self) -> tfds.core.DatasetInfo:
    # All 26 id lists travel as one flat `ids` tensor plus per-column
    # `lengths`: 4 features per example instead of 29 makes encoding several
    # times faster. `columns()` splits them back into c0..c25.
    features = dict(
        ids=tfds.features.Tensor(shape=(None,), dtype=np.int64),
        lengths=tfds.features.Tensor(shape=(len(CATEGORICAL),), dtype=np.int64),
        dense=tfds.features.Tensor(shape=(NUM_DENSE,), dtype=np.float32),
        label=tfds.features.Scalar(dtype=np.int64),
        planted_logit=tfds.features.Scalar(dtype=np.float32))
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict(features),
        supervised_keys=None,
        description=__doc__)

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    return {"train": self._generate_examples("train"),
            "test": self._generate_examples("test")}

  def _generate_examples(self, split):
    world = _World(self.builder_config)
    n = self.builder_config.num_train if split == "train" else self.builder_config.num_test
    rng = np.random.default_rng([self.builder_config.seed, 1 if split == "train" else 2])
    chunk = 20_000
    for start in range(0, n, chunk):
      size = min(chunk, n - start)
      dense, ids, logits = world.sample(size, rng)
      labels = (rng.random(size) < 1 / (1 + np.exp(-logits))).astype(np.int64)
      lengths = np.stack([ids[name][1] for name in CATEGORICAL], axis=1)
      offsets = {name: np.r_[0, np.cumsum(ids[name][1])] for name in CATEGORICAL}
      for i in range(size):
        flat = np.concatenate([ids[name][0][offsets[name][i]:offsets[name][i + 1]]
                               for name in CATEGORICAL])
        yield start + i, dict(ids=flat, lengths=lengths[i], dense=dense[i],
                              label=labels[i], planted_logit=logits[i])


def columns(example):
  """``{"c0": ids, ..., "c25": ids}`` (variable-length int64) of one example."""
  parts = tf.split(example["ids"], example["lengths"], num=len(CATEGORICAL))
  out = {k: v for k, v in example.items() if k not in ("ids", "lengths")}
  out.update(zip(CATEGORICAL, parts))
  return out


def planted_auc(dataset: str = "synthetic_clicks/default", split: str = "test",
                data_dir: Optional[str] = None,
                num_examples: Optional[int] = None) -> float:
  """AUC of the planted (Bayes-optimal) score on a split."""
  from tpu_embed_ext.data.pipeline import auc
  ds = tfds.load(dataset, split=split, data_dir=data_dir)
  if num_examples:
    ds = ds.take(num_examples)
  labels, logits = [], []
  for batch in ds.map(lambda x: (x["label"], x["planted_logit"])).batch(8192):
    labels.append(batch[0].numpy())
    logits.append(batch[1].numpy())
  return auc(np.concatenate(labels), np.concatenate(logits))
