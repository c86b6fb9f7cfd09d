"""synthetic_clicks builds offline and deterministically; the pipeline's layouts."""

import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tpu_embed_ext.data import pipeline, synthetic_clicks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def builder(tiny_data_dir):
  return tfds.builder("synthetic_clicks/tiny", data_dir=tiny_data_dir)  # built once


def _examples(builder, split="train", n=None):
  ds = builder.as_dataset(split=split, shuffle_files=False)
  return list(tfds.as_numpy(ds.take(n or -1)))


def test_build_is_deterministic_and_offline(builder, tmp_path, capsys):
  # Built again by the training job's data step, which prints progress as
  # examples are generated: 4,000 train and 1,000 test examples, 20% each.
  from tpu_embed_ext.job import config, data
  spec, cfg = config.load(os.path.join(ROOT, "configs", "tiny.yaml"),
                          {"data_dir": str(tmp_path)})
  data.input_datasets(spec, cfg)
  printed = capsys.readouterr().out.splitlines()
  expected = [f"  {split}: {k * n // 5:,} of {n:,} examples generated ({20 * k}%)"
              for split, n in (("train", 4000), ("test", 1000)) for k in range(1, 6)]
  assert [l for l in printed if l.startswith("  ")] == expected, printed
  assert printed[0].startswith("Building the synthetic_clicks/tiny dataset in ")
  assert printed[-1] == "Built synthetic_clicks/tiny."
  other = tfds.builder("synthetic_clicks/tiny", data_dir=str(tmp_path))
  assert other.is_prepared()
  a, b = _examples(builder, n=50), _examples(other, n=50)
  for x, y in zip(a, b):
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])
  loaded = tfds.load("synthetic_clicks/tiny", split="test", data_dir=str(tmp_path))
  assert sum(1 for _ in loaded) == 1000


def test_a_different_seed_gives_different_data():
  config = synthetic_clicks.SyntheticClicksConfig(name="s1", seed=1, num_train=10,
                                                  num_test=10)
  world0 = synthetic_clicks._World(synthetic_clicks._CONFIGS["tiny"])
  world1 = synthetic_clicks._World(config)
  assert not np.allclose(world0.dense_weights, world1.dense_weights)


def test_examples_are_well_formed(builder):
  vocab = synthetic_clicks.vocabulary_sizes("tiny")
  multi_hot = synthetic_clicks.multi_hot_lengths("tiny")
  assert sorted(multi_hot) == sorted(synthetic_clicks.MULTI_HOT)
  examples = _examples(builder)
  assert len(examples) == 4000
  labels = np.array([x["label"] for x in examples])
  assert 0.15 < labels.mean() < 0.35  # Click rate near the configured 0.25.
  for x in examples[:500]:
    assert x["dense"].shape == (13,) and x["dense"].dtype == np.float32
    for name, size in vocab.items():
      ids = x[name]
      assert ids.min() >= 0 and ids.max() < size
      if name in multi_hot:
        assert 1 <= len(ids) <= multi_hot[name]
      else:
        assert len(ids) == 1


def test_planted_auc_is_the_auc_of_the_planted_logits(builder):
  examples = _examples(builder, split="test")
  labels = np.array([x["label"] for x in examples])
  logits = np.array([x["planted_logit"] for x in examples])
  value = synthetic_clicks.planted_auc("synthetic_clicks/tiny", data_dir=builder.data_dir.split("/synthetic_clicks")[0])
  assert value == pytest.approx(pipeline.auc(labels, logits))
  assert 0.7 < value < 0.95


def test_pipeline_layouts_carry_the_raw_ids(builder):
  raw = _examples(builder, n=8)
  ds = pipeline.make_dataset(
      builder.as_dataset(split="train", shuffle_files=False),
      features={"user": ("c0", "dense"), "tags": ("c21", "ragged"),
                "more": ("c22", "sparse")}, batch_size=8)
  features, labels = next(iter(ds))
  np.testing.assert_array_equal(features["categorical"]["user"],
                                [x["c0"][0] for x in raw])
  assert features["categorical"]["tags"].to_list() == [list(x["c21"]) for x in raw]
  sparse = tf.sparse.to_dense(features["categorical"]["more"], default_value=-1).numpy()
  assert [list(r[r >= 0]) for r in sparse] == [list(x["c22"]) for x in raw]
  np.testing.assert_array_equal(labels, [x["label"] for x in raw])
  assert features["dense"].shape == (8, 13)


def test_shuffling_is_fixed_by_the_seed(builder):
  def first_ids(seed):
    ds = pipeline.make_dataset(builder.as_dataset(split="train", shuffle_files=False),
                               features={"c0": ("c0", "dense")}, batch_size=16,
                               shuffle_seed=seed, repeat=True)
    return [b[0]["categorical"]["c0"].numpy().tolist() for b in ds.take(3)]
  assert first_ids(3) == first_ids(3)
  assert first_ids(3) != first_ids(4)


def test_unknown_layout_is_rejected(builder):
  with pytest.raises(ValueError, match="feature 'x': layout must be one of"):
    pipeline.make_dataset(builder.as_dataset(split="train"),
                          features={"x": ("c0", "dense_ish")}, batch_size=2)


@pytest.mark.parametrize("shuffle_seed", [None, 3])
def test_batch_parsing_gives_the_tfds_batches(builder, shuffle_seed):
  features = {"user": ("c0", "dense"), "tags": ("c21", "ragged"),
              "more": ("c22", "sparse")}
  common = dict(features=features, batch_size=64, drop_remainder=False,
                shuffle_seed=shuffle_seed)
  by_example = pipeline.make_dataset(
      builder.as_dataset(split="test", shuffle_files=False), **common)
  by_batch = pipeline.make_dataset(
      synthetic_clicks.serialized_split(builder, "test"),
      parse_batch=builder.info.features.decode_batch, **common)
  batches = 0
  for (a, label_a), (b, label_b) in zip(by_example, by_batch):
    np.testing.assert_array_equal(label_a, label_b)
    np.testing.assert_array_equal(a["dense"], b["dense"])
    np.testing.assert_array_equal(a["categorical"]["user"], b["categorical"]["user"])
    assert a["categorical"]["tags"].to_list() == b["categorical"]["tags"].to_list()
    x, y = a["categorical"]["more"], b["categorical"]["more"]
    for part in ("indices", "values", "dense_shape"):
      np.testing.assert_array_equal(getattr(x, part), getattr(y, part))
    batches += 1
  assert batches == 16  # 1,000 examples: 15 batches of 64 and one of 40.
  # A split tfds must slice falls back to tfds's own reading.
  assert synthetic_clicks.serialized_split(builder, "train[:10%]") is None
