"""convert-checkpoint on a checkpoint written by a TensorFlow program, without our YAML.

The tables, slots and shapes come from the checkpoint and its object graph;
the output restores into the emulated TPUEmbeddingV2 of the program (which
stacks its two tables) directly, every table and slot equal to the saved
ones. With a config, feature names that a serving signature would refuse
(Model Garden's '0'..'7') are no reason to refuse a conversion.
"""

import numpy as np
import pytest
import tensorflow as tf
import yaml

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.sparsecore import checkpoint_layouts, convert_checkpoint
from tests import jobs
from tests import sparsecore_program as sc
from tests.test_sparsecore_restore import SLOTS, _assign, _state_after
from tests.builders import checkpoint_values
from tests.builders import emulated_tpu_strategy

api = tf.tpu.experimental.embedding


def _tensorflow_program_checkpoint(tmp_path):
  """A per-table checkpoint as TensorFlow's TPUEmbeddingForServing writes it,
  inside a model object (Model Garden: model/embedding)."""
  serving = api.TPUEmbeddingForServing(sc.feature_config(sc.PER_REPLICA), None)
  serving.build()
  _assign(lambda t: serving._variables[t], _state_after(2))  # pylint: disable=protected-access
  dense = tf.Variable(tf.ones([3, 5]))
  return tf.train.Checkpoint(model=tf.train.Checkpoint(embedding=serving, dense=dense),
                             step=tf.Variable(10, dtype=tf.int64)).save(
                                 str(tmp_path / "ckpt"))


def _restored(path):
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      embedding = api.TPUEmbeddingV2(sc.feature_config(sc.PER_REPLICA), None)
    dense, step = tf.Variable(tf.zeros([3, 5])), tf.Variable(0, dtype=tf.int64)
    status = tf.train.Checkpoint(model=tf.train.Checkpoint(
        embedding=embedding, dense=dense), step=step).restore(path)
    embedding.build()
    status.assert_consumed()
    tables = {t: {s: embedding.table_variables(t)[s].numpy() for s in SLOTS}
              for t in sc.VOCAB}
  assert int(step) == 10 and (dense.numpy() == 1).all()
  return tables


def test_converted_without_config_restores_into_the_program(tmp_path):
  path = _tensorflow_program_checkpoint(tmp_path)
  out = str(tmp_path / "v2x4" / "ckpt-1")
  layouts = convert_checkpoint(path, out, None, "2x4")
  assert {l.table: l.stack for l in layouts} == {"item": "item_user",
                                                 "user": "item_user"}
  assert checkpoint_layouts(out, "model/embedding") is not None
  tables = _restored(out)
  state = _state_after(2)
  for table in sc.VOCAB:
    for slot in SLOTS:
      np.testing.assert_array_equal(tables[table][slot], state[table][slot])


def test_command_needs_no_config_and_ignores_feature_names(tmp_path, capsys):
  path = _tensorflow_program_checkpoint(tmp_path)
  out = str(tmp_path / "cli" / "ckpt-1")
  status, stdout, err = jobs.run_cli(capsys, "convert-checkpoint", "--checkpoint", path,
                                     "--out", out, "--topology", "2x4")
  assert status == 0, err
  assert stdout.strip().splitlines()[-1] == (
      f"{path} -> {out}: SparseCore layout for 2x4 (2 chips x 4 SparseCores) (1 stacks).")
  # A config whose feature names a serving signature refuses ('0', '1').
  config = tmp_path / "model_garden.yaml"
  config.write_text(yaml.safe_dump({
      "optimizer": {"type": "adagrad", "learning_rate": 0.2,
                    "initial_accumulator_value": 0.1},
      "tables": {n: {"vocabulary_size": v, "dim": 4} for n, v in sc.VOCAB.items()},
      "features": {"0": {"table": "user"}, "1": {"table": "item"}}}))
  with pytest.raises(errors.ConfigError, match="feature name '0'"):
    tee.EmbeddingSpec.from_file(str(config))  # why the command must not load it as is
  out2 = str(tmp_path / "cli2" / "ckpt-1")
  status, _, err = jobs.run_cli(capsys, "convert-checkpoint", "--config", str(config),
                                "--checkpoint", path, "--out", out2, "--topology", "2x4")
  assert status == 0, err
  # The same tables, stacked the same: the same values under the same keys.
  without, with_config = checkpoint_values(out), checkpoint_values(out2)
  assert sorted(without) == sorted(with_config)
  for key in without:
    if "_sparse_core_table_layouts" not in key:
      assert np.asarray(without[key]).tobytes() == np.asarray(with_config[key]).tobytes()
  state = _state_after(2)
  tables = _restored(out2)
  for table in sc.VOCAB:
    np.testing.assert_array_equal(tables[table]["accumulators"],
                                  state[table]["accumulators"])


def test_without_config_an_embedding_must_be_recognisable(tmp_path):
  # SGD tables have no slot: nothing marks the object as an embedding.
  cpu = tee.CPUEmbedding({"user": api.FeatureConfig(api.TableConfig(8, 4, name="user"))},
                         api.SGD(0.1))
  cpu.build()
  path = tf.train.Checkpoint(embedding=cpu).write(str(tmp_path / "sgd"))
  with pytest.raises(errors.ConfigError) as e:
    convert_checkpoint(path, str(tmp_path / "out"), None, "2x4")
  assert str(e.value) == (
      f"checkpoint {path} has no object that holds embedding tables (per table: 2-D "
      "variables with optimizer slots '<table>/<slot>'; stacked: "
      "_sparse_core_table_layouts). Fix: pass --prefix with the embedding's path in "
      "the checkpoint, or --config with its tables (tables trained with SGD have no "
      "slot to recognise them by).")
  # With --prefix it converts.
  layouts = convert_checkpoint(path, str(tmp_path / "out"), None, "2x4", prefix="embedding")
  assert [l.table for l in layouts] == ["user"]


def test_stacked_checkpoint_converts_to_per_table_without_config(tmp_path):
  path = _tensorflow_program_checkpoint(tmp_path)
  stacked, back = str(tmp_path / "stacked" / "ckpt-1"), str(tmp_path / "back" / "ckpt-1")
  convert_checkpoint(path, stacked, None, "2x4")
  assert convert_checkpoint(stacked, back, None, None) is None
  original, returned = checkpoint_values(path), checkpoint_values(back)
  assert sorted(original) == sorted(returned)
  for key in original:
    assert np.asarray(original[key]).tobytes() == np.asarray(returned[key]).tobytes(), key


def test_keras_model_checkpoint_converts_without_config(tmp_path):
  import keras  # pylint: disable=g-import-not-at-top
  def model():
    features = {n: keras.Input(shape=(), dtype="int64", name=n) for n in sc.VOCAB}
    layer = tee.EmbeddingLayer(sc.feature_config(sc.PER_REPLICA), name="embedding")
    outputs = keras.layers.Dense(1)(keras.layers.Concatenate()(list(
        layer(features).values())))
    return keras.Model(features, outputs), layer
  cpu_model, cpu_layer = model()
  cpu_layer.embedding.build()
  _assign(lambda t: cpu_layer.embedding.variables[t], _state_after(2))
  path = tf.train.Checkpoint(model=cpu_model).write(str(tmp_path / "keras"))
  out = str(tmp_path / "stacked" / "keras")
  layouts = convert_checkpoint(path, out, None, "2x4")
  assert {l.stack for l in layouts} == {"item_user"}
  with tee.emulate_tpu(replicas=sc.REPLICAS, sparsecore=True):
    strategy = emulated_tpu_strategy()
    with strategy.scope():
      tpu_model, tpu_layer = model()
    tf.train.Checkpoint(model=tpu_model).read(out)
    tpu_layer.embedding.build()
    for table in sc.VOCAB:
      for slot in SLOTS:
        np.testing.assert_array_equal(
            tpu_layer.embedding.table_variables(table)[slot].numpy(),
            _state_after(2)[table][slot])
