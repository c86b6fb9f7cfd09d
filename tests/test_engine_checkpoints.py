"""CPUEmbedding's checkpoints: TPUEmbeddingForServing's keys and values both
ways, restore before build, and a checkpoint of another spec refused by name."""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tests.builders import single_table_engine
from tests.builders import three_combiner_feature_config, three_combiner_inputs

api = tf.tpu.experimental.embedding


def _trained(optimizer, steps=3):
  config = three_combiner_feature_config()
  emb = tee.CPUEmbedding(config, optimizer)
  features, weights = three_combiner_inputs()
  for _ in range(steps):
    emb.enqueue(features, weights, training=True)
    acts = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(lambda a: 0.3 * tf.ones_like(a), acts))
  return emb


def test_checkpoint_keys_and_values_round_trip_with_tpu_embedding_for_serving(tmp_path):
  ours = _trained(api.Adam(0.1))
  path = tf.train.Checkpoint(embedding=ours).save(str(tmp_path / "ours"))
  serving = api.TPUEmbeddingForServing(three_combiner_feature_config(), api.Adam(0.1))
  serving.build()
  tf.train.Checkpoint(embedding=serving).restore(path).assert_consumed()
  for name, slots in ours.variables.items():
    for key, var in slots.items():
      np.testing.assert_array_equal(serving.variables[name][key], var, err_msg=f"{name}/{key}")

  # The reverse: TPUEmbeddingForServing's checkpoint restores into CPUEmbedding.
  for slots in serving.variables.values():
    for var in slots.values():
      var.assign(var + 1.0)
  back = tf.train.Checkpoint(embedding=serving).save(str(tmp_path / "theirs"))
  fresh = tee.CPUEmbedding(three_combiner_feature_config(), api.Adam(0.1))
  status = tf.train.Checkpoint(embedding=fresh).restore(back)  # Before build:
  fresh.build()                                  # filled in at creation.
  status.assert_consumed()
  for name, slots in serving.variables.items():
    for key, var in slots.items():
      np.testing.assert_array_equal(fresh.variables[name][key], var)
  ours_keys = {k for k, _ in tf.train.list_variables(path)}
  assert ours_keys == {k for k, _ in tf.train.list_variables(back)}
  assert "embedding/t_mean.Svelocities/.ATTRIBUTES/VARIABLE_VALUE" in ours_keys


def test_restore_before_build_fills_variables_at_creation(tmp_path):
  ours = _trained(api.Adagrad(0.1))
  path = tf.train.Checkpoint(embedding=ours).save(str(tmp_path / "c"))
  fresh = tee.CPUEmbedding(three_combiner_feature_config(), api.Adagrad(0.1))
  tf.train.Checkpoint(embedding=fresh).restore(path)
  fresh.build()
  np.testing.assert_array_equal(fresh.variables["t_sum"]["accumulators"],
                                ours.variables["t_sum"]["accumulators"])


@pytest.mark.parametrize("vocab,optimizer,message", [
    (12, api.Adagrad(0.1),
     "table 't': checkpoint {path} holds shape [6, 2], this spec has [12, 2]. Fix: "
     "restore into a spec with the same vocabulary_size and dim."),
    (6, api.Adam(0.1),
     "table 't': checkpoint {path} holds optimizer slots ['accumulators'], its adam "
     "optimizer needs ['momenta', 'velocities']. Fix: restore with the optimizer the "
     "checkpoint was trained with."),
    (6, api.SGD(0.1),
     "table 't': checkpoint {path} holds optimizer slots ['accumulators'], its sgd "
     "optimizer needs []."),
], ids=["shape", "other_slots", "fewer_slots"])
def test_checkpoint_of_another_spec_is_refused_naming_the_table(tmp_path, vocab,
                                                                optimizer, message):
  trained = single_table_engine(api.Adagrad(0.1))
  trained.build()
  path = tf.train.Checkpoint(embedding=trained).save(str(tmp_path / "c"))
  trained.check_checkpoint(path)  # Its own checkpoint passes.
  table = api.TableConfig(vocab, 2, name="t")
  other = tee.CPUEmbedding({"f": api.FeatureConfig(table, name="f")}, optimizer)
  with pytest.raises(tee.ConfigError) as info:
    other.check_checkpoint(path)
  assert str(info.value).startswith(message.format(path=path)), str(info.value)


