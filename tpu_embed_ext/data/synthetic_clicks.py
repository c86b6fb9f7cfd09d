"""``synthetic_clicks``: an offline, Criteo-like click log with a known answer.

13 dense features (``dense``, float32 [13]) and 26 categorical ones (``c0``..
``c25``, each a variable-length int64 id list; ``c20``..``c25`` multi-hot with
1-5 ids, the rest single-hot), ids Zipf-distributed over per-feature
vocabularies. Each ``label`` is drawn from a *planted* logistic model: hidden
per-id weights (averaged over a multi-hot row) plus a linear term in the dense
features plus a bias that sets the click rate. Each example also carries
``planted_logit``, the Bayes-optimal score, so the best AUC any model can reach
on a split is known exactly: ``planted_auc`` computes it, and the builder
records it for the full splits in ``info.metadata["planted_auc"]``.

Everything is generated from the config's seed with vectorised numpy: no
download, same bytes on every machine.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tpu_embed_ext.data.pipeline import auc

__all__ = ["SyntheticClicks", "SyntheticClicksConfig", "vocabulary_sizes",
           "multi_hot_lengths", "planted_auc", "serialized_split",
           "NUM_DENSE", "CATEGORICAL", "MULTI_HOT"]

NUM_DENSE = 13
CATEGORICAL = tuple(f"c{i}" for i in range(26))
MULTI_HOT = tuple(f"c{i}" for i in range(20, 26))
"""The multi-hot features of the built-in configs."""

# Criteo-like spread of cardinalities (3 .. 50k), scaled down so the default
# builds in well under a minute. configs/ranking.yaml sizes its tables to these.
_DEFAULT_VOCAB = (1000, 500, 50000, 20000, 300, 24, 8000, 600, 3, 30000, 4000,
                  40000, 3000, 27, 6000, 50000, 10, 4000, 2000, 4, 50000, 18, 15,
                  30000, 100, 20000)


@dataclasses.dataclass(eq=False)
class SyntheticClicksConfig(tfds.core.BuilderConfig):
  """Size, seed and shape of one ``synthetic_clicks`` variant."""

  seed: int = 0
  """Fixes the hidden weights and every example."""
  num_train: int = 500_000
  num_test: int = 20_000
  vocabulary: Tuple[int, ...] = _DEFAULT_VOCAB
  """Vocabulary size of ``c0``..``c25``, in order."""
  multi_hot: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {name: 5 for name in MULTI_HOT})
  """Multi-hot features and their maximum length (each row has 1..max ids)."""
  zipf_exponent: float = 1.1
  click_rate: float = 0.25
  """Mean click probability the planted bias is solved for."""

  def __post_init__(self):
    if len(self.vocabulary) != len(CATEGORICAL) or min(self.vocabulary) < 1:
      raise ValueError(f"vocabulary must be {len(CATEGORICAL)} positive sizes, "
                       f"got vocabulary={self.vocabulary!r}.")
    unknown = sorted(set(self.multi_hot) - set(CATEGORICAL))
    if unknown or any(n < 1 for n in self.multi_hot.values()):
      raise ValueError("multi_hot must map c0..c25 to lengths >= 1, got "
                       f"multi_hot={dict(self.multi_hot)!r}.")


_CONFIGS = {
    "default": SyntheticClicksConfig(
        name="default", description="500k train / 20k test, vocabularies 3..50k."),
    "tiny": SyntheticClicksConfig(
        name="tiny", description="4k train / 1k test, vocabularies <= 200.",
        num_train=4000, num_test=1000,
        vocabulary=tuple(min(v, 200) for v in _DEFAULT_VOCAB)),
}


def vocabulary_sizes(config_name: str = "default") -> Dict[str, int]:
  """``{"c0": size, ...}`` of a built-in config, to check specs against."""
  return dict(zip(CATEGORICAL, _config(config_name).vocabulary))


def multi_hot_lengths(config_name: str = "default") -> Dict[str, int]:
  """``{feature: max ids per row}`` for the multi-hot features of a config."""
  return dict(_config(config_name).multi_hot)


def _config(name: str) -> SyntheticClicksConfig:
  try:
    return _CONFIGS[name]
  except KeyError:
    raise ValueError(f"unknown synthetic_clicks config {name!r}; known: "
                     f"{sorted(_CONFIGS)}.") from None


class _World:
  """The hidden parameters of the planted model, fixed by the seed."""

  def __init__(self, config: SyntheticClicksConfig):
    rng = np.random.default_rng(config.seed)
    self.config = config
    # Popularity rank -> id, so popular ids are not simply the small ones.
    self.permutation = [rng.permutation(v) for v in config.vocabulary]
    self.zipf_p = []
    for v in config.vocabulary:
      p = 1.0 / np.arange(1, v + 1) ** config.zipf_exponent
      self.zipf_p.append(p / p.sum())
    # About 60% of the features carry signal; strength varies per feature.
    n = len(CATEGORICAL)
    strength = rng.uniform(0.1, 0.6, n) * (rng.random(n) < 0.6)
    # Weights fall as 100 / rank past rank 100: what a model cannot learn from
    # a handful of examples should not count much in the planted AUC.
    self.weights = []
    for f, (s, v) in enumerate(zip(strength, config.vocabulary)):
      by_rank = rng.normal(0, s, v) * np.minimum(1.0, 100.0 / np.arange(1, v + 1))
      weights = np.empty(v)
      weights[self.permutation[f]] = by_rank
      self.weights.append(weights)
    self.dense_weights = rng.normal(0, 0.25, NUM_DENSE)
    self.bias = 0.0
    self.bias = _solve_bias(self.sample(50_000, rng)[-1], config.click_rate)

  def sample(self, n: int, rng: np.random.Generator):
    """Returns (dense, {feature: (values, lengths)}, logits) for n examples."""
    # log1p of log-normal counts (Criteo's usual transform), roughly centred.
    dense = np.log1p(rng.lognormal(0.0, 1.0, (n, NUM_DENSE))).astype(np.float32)
    dense -= 0.8
    logits = dense @ self.dense_weights + self.bias
    ids = {}
    for f, name in enumerate(CATEGORICAL):
      max_length = self.config.multi_hot.get(name)
      lengths = (rng.integers(1, max_length + 1, n) if max_length
                 else np.ones(n, np.int64))
      ranks = rng.choice(len(self.zipf_p[f]), size=lengths.sum(), p=self.zipf_p[f])
      values = self.permutation[f][ranks]
      row_sum = np.add.reduceat(self.weights[f][values],
                                np.r_[0, np.cumsum(lengths)[:-1]])
      logits = logits + row_sum / lengths
      ids[name] = (values.astype(np.int64), lengths)
    return dense, ids, logits.astype(np.float32)


def _solve_bias(logits, rate):
  """The bias b with mean(sigmoid(logits + b)) == rate (bisection)."""
  lo, hi = -10.0, 10.0
  for _ in range(60):
    mid = (lo + hi) / 2
    if (1 / (1 + np.exp(-(logits + mid)))).mean() > rate:
      hi = mid
    else:
      lo = mid
  return (lo + hi) / 2


class _PackedIdLists(tfds.features.FeaturesDict):
  """A FeaturesDict that stores all its ``Sequence(int64)`` features as one list.

  Readers see the declared features (``c0``..``c25`` as variable-length int64
  tensors). On disk they are one flat ``packed_ids`` list plus
  ``packed_lengths``: tfds encodes and serializes every feature of every
  example in Python, and 29 features per example made the default config take
  about four times as long to build as 5 do.
  """

  _IDS, _LENGTHS = "packed_ids", "packed_lengths"

  def __init__(self, feature_dict, **kwargs):
    super().__init__(feature_dict, **kwargs)
    self._packed = tuple(
        k for k, f in self.items()
        if isinstance(f, tfds.features.Sequence) and f.feature.dtype == np.int64
        and f.feature.shape == ())
    self._rest = tfds.features.FeaturesDict(
        {k: f for k, f in self.items() if k not in self._packed})

  def get_serialized_info(self):
    info = dict(self._rest.get_serialized_info())  # Not ours to mutate.
    info[self._IDS] = tfds.features.TensorInfo(shape=(None,), dtype=np.int64)
    info[self._LENGTHS] = tfds.features.TensorInfo(
        shape=(len(self._packed),), dtype=np.int64)
    return info

  def encode_example(self, example_dict):
    out = self._rest.encode_example({k: example_dict[k] for k in self._rest})
    lists = [np.asarray(example_dict[k], np.int64).reshape(-1) for k in self._packed]
    out[self._IDS] = np.concatenate(lists)
    out[self._LENGTHS] = np.array([len(x) for x in lists], np.int64)
    return out

  def decode_example(self, serialized_example, *, decoders=None):
    out = self._rest.decode_example(
        {k: serialized_example[k] for k in self._rest}, decoders=decoders)
    out.update(zip(self._packed, tf.split(serialized_example[self._IDS],
                                          serialized_example[self._LENGTHS],
                                          num=len(self._packed))))
    return out

  def decode_batch(self, serialized: tf.Tensor) -> Dict[str, tf.Tensor]:
    """A batch of serialized examples -> what ``decode_example`` gives, batched.

    The packed features come back as RaggedTensors ``[batch, (ids)]``, the
    others (plain tensors and scalars, stored as they are) with a leading
    batch dimension. The parse spec is the serialized info's.
    """
    spec = {k: (tf.io.RaggedFeature(tf.as_dtype(info.dtype)) if k == self._IDS
                else tf.io.FixedLenFeature(info.shape, tf.as_dtype(info.dtype)))
            for k, info in self.get_serialized_info().items()}
    parsed = tf.io.parse_example(serialized, spec)
    ids, lengths = parsed.pop(self._IDS), parsed.pop(self._LENGTHS)
    # [batch * n, (ids)] in example-major order: feature j of example b is
    # list n b + j.
    lists = tf.RaggedTensor.from_row_lengths(ids.values, tf.reshape(lengths, [-1]))
    first = tf.range(tf.shape(lengths, out_type=tf.int64)[0]) * len(self._packed)
    for j, name in enumerate(self._packed):
      parsed[name] = tf.gather(lists, first + j)
    return parsed

  def decode_example_np(self, serialized_example, *, decoders=None):
    out = self._rest.decode_example_np(
        {k: serialized_example[k] for k in self._rest}, decoders=decoders)
    ends = np.cumsum(serialized_example[self._LENGTHS])[:-1]
    out.update(zip(self._packed, np.split(serialized_example[self._IDS], ends)))
    return out


class SyntheticClicks(tfds.core.GeneratorBasedBuilder):
  """Criteo-like synthetic click log with a planted model; builds offline."""

  VERSION = tfds.core.Version("1.3.0")
  RELEASE_NOTES = {
      "1.0.0": "First release.",
      "1.1.0": "Weaker planted weights for rare ids.",
      "1.2.0": "Planted weights fall as 1/rank past rank 100; 500k train.",
      "1.3.0": "Columns c0..c25 as Sequence(int64) (same examples); planted "
               "AUC and click rate in the metadata.",
  }
  BUILDER_CONFIGS = list(_CONFIGS.values())
  DEFAULT_CONFIG_NAME = "default"
  PROGRESS_STEPS = 5
  """Progress lines per split: one at every 20% of its examples."""

  progress: Optional[Callable[[str], None]] = None
  """Called with a line as examples are generated (the training job prints
  them: building the default config takes about a minute); None: silent."""

  def _info(self) -> tfds.core.DatasetInfo:
    features = {name: tfds.features.Sequence(np.int64) for name in CATEGORICAL}
    features.update(
        dense=tfds.features.Tensor(shape=(NUM_DENSE,), dtype=np.float32),
        label=tfds.features.Scalar(dtype=np.int64),
        planted_logit=tfds.features.Scalar(dtype=np.float32))
    return self.dataset_info_from_configs(
        features=_PackedIdLists(features),
        supervised_keys=None,
        description=__doc__,
        metadata=tfds.core.MetadataDict())

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    return {"train": self._generate_examples("train"),
            "test": self._generate_examples("test")}

  def _generate_examples(self, split):
    config = self.builder_config
    world = _World(config)
    n = config.num_train if split == "train" else config.num_test
    rng = np.random.default_rng([config.seed, 1 if split == "train" else 2])
    all_labels, all_logits = [], []
    # Progress at fixed fractions of the split (not of time): the same lines
    # on every machine.
    marks = {n * k // self.PROGRESS_STEPS: k for k in range(1, self.PROGRESS_STEPS + 1)}
    chunk = 20_000
    for start in range(0, n, chunk):
      size = min(chunk, n - start)
      dense, ids, logits = world.sample(size, rng)
      labels = (rng.random(size) < 1 / (1 + np.exp(-logits))).astype(np.int64)
      all_labels.append(labels)
      all_logits.append(logits)
      offsets = {name: np.r_[0, np.cumsum(ids[name][1])] for name in CATEGORICAL}
      for i in range(size):
        example = {name: ids[name][0][offsets[name][i]:offsets[name][i + 1]]
                   for name in CATEGORICAL}
        example.update(dense=dense[i], label=labels[i], planted_logit=logits[i])
        yield start + i, example
        if self.progress is not None and start + i + 1 in marks:
          self.progress(f"  {split}: {start + i + 1:,} of {n:,} examples generated "
                        f"({100 * marks[start + i + 1] // self.PROGRESS_STEPS}%)")
    # Runs once the split is fully generated, before the info is written.
    labels, logits = np.concatenate(all_labels), np.concatenate(all_logits)
    self.info.metadata.setdefault("planted_auc", {})[split] = auc(labels, logits)
    self.info.metadata.setdefault("click_rate", {})[split] = float(labels.mean())


def planted_auc(dataset: str = "synthetic_clicks/default", split: str = "test",
                data_dir: Optional[str] = None,
                num_examples: Optional[int] = None) -> float:
  """AUC of the planted (Bayes-optimal) score on a split or its first examples.

  The ceiling for any model evaluated on the same examples; a learned model's
  held-out AUC should be read against it, not against 1.
  """
  ds = tfds.load(dataset, split=split, data_dir=data_dir)
  if num_examples:
    ds = ds.take(num_examples)
  labels, logits = [], []
  for label, logit in ds.map(lambda x: (x["label"], x["planted_logit"])).batch(8192):
    labels.append(label.numpy())
    logits.append(logit.numpy())
  return auc(np.concatenate(labels), np.concatenate(logits))


# --- fast reading for training -------------------------------------------------

def serialized_split(builder: tfds.core.DatasetBuilder,
                     split: str) -> Optional[tf.data.Dataset]:
  """A split's serialized examples in stored order.

  Read them a batch at a time with ``builder.info.features.decode_batch``.

  tfds decodes one example at a time, about 60 ms per batch of 512 on two
  cores, more than a training step; parsing a whole batch at once is about
  fifteen times cheaper. None for a split tfds must slice (``train[:90%]``).
  """
  if split not in builder.info.splits:
    return None
  return tf.data.TFRecordDataset(
      [os.fspath(p) for p in builder.info.splits[split].filepaths])
