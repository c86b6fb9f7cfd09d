"""Ids drawn from a spec alone (``plan --data`` on a config without a dataset)."""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.data import spec_ids


def _power_law_mass(a, b, vocabulary, s):
  """P(a <= id < b) for p(x) ~ x**-s on [1, V + 1), id = floor(x) - 1 (from the CDF)."""
  cdf = lambda x: (x ** (1 - s) - 1) / ((vocabulary + 1) ** (1 - s) - 1)
  return cdf(b + 1) - cdf(a + 1)


@pytest.mark.parametrize("s", [1.1, 1.0000000000001, 2.0])
def test_zipf_ids_follow_the_power_law(s):
  vocabulary, n = 1000, 200_000
  ids = spec_ids.draw_ids(np.random.default_rng(0), vocabulary, n, "zipf", exponent=s)
  assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < vocabulary
  for a, b in [(0, 1), (1, 2), (2, 10), (10, 100), (100, 1000)]:
    want = _power_law_mass(a, b, vocabulary, s if abs(s - 1) > 1e-9 else 1 + 1e-9)
    have = np.mean((ids >= a) & (ids < b))
    assert abs(have - want) < 0.005, (a, b, have, want)


def test_uniform_ids_cover_the_vocabulary_evenly():
  ids = spec_ids.draw_ids(np.random.default_rng(1), 10, 100_000, "uniform")
  np.testing.assert_allclose(np.bincount(ids, minlength=10) / 100_000, 0.1, atol=0.005)


@pytest.mark.parametrize("vocabulary", [1, 2, 10**10])
def test_ids_stay_in_range_at_the_extremes(vocabulary):
  ids = spec_ids.draw_ids(np.random.default_rng(2), vocabulary, 10_000)
  assert ids.min() >= 0 and ids.max() < vocabulary


def test_batches_have_the_pipeline_layouts_and_repeat_with_the_seed():
  spec = tee.EmbeddingSpec.from_dict({
      "optimizer": {"type": "sgd", "learning_rate": 0.1},
      "tables": {"t": {"vocabulary_size": 50, "dim": 4},
                 "u": {"vocabulary_size": 7, "dim": 4}},
      "features": {"one": {"table": "t"}, "many": {"table": "u"},
                   "seq": {"table": "t", "max_sequence_length": 3},
                   "shaped": {"table": "u", "output_shape": [2, 5]}}})
  batches = list(spec_ids.spec_batches(spec, batch_size=6, batches=2,
                                       hotness={"many": 4}, seed=3))
  again = list(spec_ids.spec_batches(spec, batch_size=6, batches=2,
                                     hotness={"many": 4}, seed=3))
  first = batches[0]
  assert first["one"].shape == [6] and first["one"].dtype == tf.int64
  assert isinstance(first["many"], tf.RaggedTensor)
  assert first["many"].row_lengths().numpy().tolist() == [4] * 6
  assert first["seq"].row_lengths().numpy().tolist() == [3] * 6  # max_sequence_length
  assert first["shaped"].shape == [2, 5]
  for batch in batches:
    assert int(tf.reduce_max(batch["many"].values)) < 7
    assert int(tf.reduce_max(batch["one"])) < 50
  for b, c in zip(batches, again):
    np.testing.assert_array_equal(b["many"].values, c["many"].values)
  assert not np.array_equal(batches[0]["one"], batches[1]["one"])


def test_hotness_flag():
  spec = tee.EmbeddingSpec.from_file("configs/criteo.yaml")
  assert set(spec_ids.parse_hotness("", spec).values()) == {1}
  assert set(spec_ids.parse_hotness("3", spec).values()) == {3}
  mixed = spec_ids.parse_hotness("2,cat_3=5", spec)
  assert mixed["cat_3"] == 5 and mixed["cat_1"] == 2
  with pytest.raises(errors.ConfigError) as e:
    spec_ids.parse_hotness("cat_33=2", spec)
  assert str(e.value).startswith('--hotness: unknown feature "cat_33". Did you mean "cat_3')
  with pytest.raises(errors.ConfigError) as e:
    spec_ids.parse_hotness("cat_3=0", spec)
  assert str(e.value) == (
      "--hotness: hotness must be a positive integer (ids per example), got "
      "'cat_3=0'. Fix: write e.g. --hotness 1 or --hotness cat_1=3.")
