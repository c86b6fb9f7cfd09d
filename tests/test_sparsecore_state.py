"""SparseCoreState: the masks an engine applies, eagerly and in tf.function."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore.state import SparseCoreState
from tests.test_sparsecore_limits import FA, FB

api = tf.tpu.experimental.embedding


def _state(**config):
  sgd = api.SGD(0.1)
  tables = {n: api.TableConfig(vocabulary_size=r, dim=8, name=n, optimizer=sgd)
            for n, r in (("a", 64), ("b", 32))}
  features = {"fa": api.FeatureConfig(table=tables["a"]),
              "fb": api.FeatureConfig(table=tables["b"])}
  return SparseCoreState(features, None, "2x2",
                         api.SparseCoreEmbeddingConfig(**config))


def test_masks_equal_the_hand_counted_drops_eagerly_and_in_a_graph():
  state = _state(max_ids_per_chip_per_sample=2, allow_id_dropping=True)
  args = ([FA.samples, FB.samples], [FA.ids, FB.ids], [8, 8])
  eager = state.keep_masks(*args)
  graph = tf.function(lambda s, i, c: state.keep_masks(s, i, c))(
      *[[tf.constant(x) for x in a] for a in args])
  for masks in (eager, graph):
    np.testing.assert_array_equal(masks[0], [1, 1, 1, 1, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(masks[1], [0, 0, 1, 1])
  assert state.padding == {"a": {"parameters": 0.0}, "b": {"parameters": 0.0}}


def test_limit_error_eagerly_and_in_a_graph():
  state = _state(max_ids_per_table={"a_b": 1})
  args = ([FA.samples, FB.samples], [FA.ids, FB.ids], [8, 8])
  with pytest.raises(errors.InputError, match=r"max_ids_per_table\['a_b'\]=1"):
    state.keep_masks(*args)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"max_ids_per_table\['a_b'\]=1"):
    tf.function(lambda s, i, c: state.keep_masks(s, i, c))(
        *[[tf.constant(x) for x in a] for a in args])


def test_wrong_number_of_features():
  with pytest.raises(errors.InputError) as e:
    _state().keep([FA.samples], [FA.ids], [8])
  assert str(e.value) == ("expected ids for 2 features (fa, fb), got 1. Fix: pass one "
                          "entry per feature, in flat order.")
