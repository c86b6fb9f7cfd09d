"""Checkpoint conversion per-table <-> SparseCore stacked, checked with TensorFlow's code."""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.tpu import tpu_embedding_v3_utils

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.tf import optimizers as tf_optimizers
from tpu_embed_ext.sparsecore import checkpoint as sparsecore_checkpoint
from tpu_embed_ext.sparsecore import convert_checkpoint, checkpoint_layouts
from tpu_embed_ext.sparsecore.topology import Topology

api = tf.tpu.experimental.embedding
# name: (rows, dim): "b" and "c" stack with "a" when optimizers are equal;
# dims 5 and 13 pad to 8 and 16 columns, rows to a multiple of 8 x SparseCores.
TABLES = {"a": (100, 8), "b": (13, 5), "c": (70, 8), "d": (9, 13)}
OPTIMIZERS = {
    "sgd": lambda: api.SGD(0.1),
    "adagrad": lambda: api.Adagrad(0.1, initial_accumulator_value=0.5),
    "adagrad_momentum": lambda: api.AdagradMomentum(0.1, momentum=0.9),
    "adam": lambda: api.Adam(0.01),
    "ftrl": lambda: api.FTRL(0.1, initial_accumulator_value=0.2, beta=0.1),
}


def _config(optimizer):
  tables = {n: api.TableConfig(vocabulary_size=r, dim=d, name=n,
                               initializer=tf.random_uniform_initializer(-1, 1, seed=i))
            for i, (n, (r, d)) in enumerate(TABLES.items())}
  return {n: api.FeatureConfig(table=t, name=n, output_shape=[4])
          for n, t in tables.items()}


def _batch(step):
  rng = np.random.default_rng(step)
  return {n: tf.ragged.constant([list(rng.integers(0, r, size=rng.integers(1, 4)))
                                 for _ in range(4)], dtype=tf.int64)
          for n, (r, _) in TABLES.items()}


def _train(emb, steps, start=0):
  for step in range(start, start + steps):
    emb.enqueue(_batch(step), training=True)
    acts = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(
        lambda a: tf.sin(a + float(step)), acts))


def _values(path):
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def _trained_checkpoint(tmp_path, optimizer, steps=3):
  emb = tee.CPUEmbedding(_config(optimizer), OPTIMIZERS[optimizer](), engine="v2")
  _train(emb, steps)
  return emb, tf.train.Checkpoint(embedding=emb).write(str(tmp_path / "per_table"))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_round_trips_are_bit_identical_with_every_slot(tmp_path, optimizer):
  emb, path = _trained_checkpoint(tmp_path, optimizer)
  config = _config(optimizer)
  stacked = str(tmp_path / "stacked")
  layouts = convert_checkpoint(path, stacked, config, Topology(2, 4),
                               optimizer=OPTIMIZERS[optimizer]())
  assert {l.table: l.stack for l in layouts} == {  # d pads to 16 columns, not 8
      "a": "a_b_c", "b": "a_b_c", "c": "a_b_c", "d": "d"}
  # Every slot of every table, read back from the stacked tensors with
  # TensorFlow's own unshuffle function, equals the trained variables.
  stored = _values(stacked)
  slots = emb.variables["a"].keys()
  assert {k.split("/")[1] for k in stored if k.startswith("embedding/")} == (
      {"_sparse_core_table_layouts"} | {stack if s == "parameters" else
                                         f"{stack}.S{s}" for s in slots
                                         for stack in ("a_b_c", "d")})
  fill = dict(zip(tf_optimizers.as_spec(OPTIMIZERS[optimizer]()).slot_names,
                  tf_optimizers.as_spec(OPTIMIZERS[optimizer]()).slot_initial_values()))
  for l in layouts:
    for slot in slots:
      key = f"embedding/{l.stack}" + ("" if slot == "parameters" else f".S{slot}")
      padded = tpu_embedding_v3_utils.unshuffle_from_sc_to_cpu(
          tf.constant(stored[key + "/.ATTRIBUTES/VARIABLE_VALUE"]), l.num_sparse_cores,
          l.row_offset, l.rows_in_shard, l.rotation).numpy()
      np.testing.assert_array_equal(padded[:l.rows, :l.dim], emb.variables[l.table][slot])
      # Padding reads as never trained: 0 in the table, the initial value in slots.
      expected = 0.0 if slot == "parameters" else fill[slot]
      assert (padded[l.rows:] == expected).all() and (padded[:, l.dim:] == expected).all()
  # Stacked -> per-table gives back the original bits, keys and object graph.
  back = str(tmp_path / "back")
  assert convert_checkpoint(stacked, back, config,
                            optimizer=OPTIMIZERS[optimizer]()) is None
  original, returned = _values(path), _values(back)
  assert original.keys() == returned.keys()
  for key in original:
    assert original[key].tobytes() == returned[key].tobytes(), key
  # Stacked -> stacked on another topology -> stacked again: bit-identical.
  other, again = str(tmp_path / "other"), str(tmp_path / "again")
  convert_checkpoint(stacked, other, config, "v6e:4", optimizer=OPTIMIZERS[optimizer]())
  assert checkpoint_layouts(other)[0].num_sparse_cores == 8
  convert_checkpoint(other, again, config, Topology(2, 4),
                     optimizer=OPTIMIZERS[optimizer]())
  first, second = _values(stacked), _values(again)
  assert first.keys() == second.keys()
  for key in first:
    assert np.asarray(first[key]).tobytes() == np.asarray(second[key]).tobytes(), key


@pytest.mark.parametrize("topology", [Topology(2, 4), Topology(1, 2), "v5p:4"], ids=str)
def test_tpu_embedding_for_serving_restores_the_stacked_checkpoint(tmp_path, topology):
  emb, path = _trained_checkpoint(tmp_path, "adagrad")
  stacked = str(tmp_path / "stacked")
  convert_checkpoint(path, stacked, _config("adagrad"), topology,
                     optimizer=OPTIMIZERS["adagrad"]())
  serving = api.TPUEmbeddingForServing(_config("adagrad"), OPTIMIZERS["adagrad"]())
  tf.train.Checkpoint(embedding=serving).restore(stacked)  # before build: its
  serving.build()                                  # stacked-table path reads it
  assert serving._get_sparse_core_table_layouts_str()  # pylint: disable=protected-access
  for table, var in serving.embedding_tables.items():
    assert isinstance(serving._variables[table.name]["parameters"].handle, tf.Tensor)  # pylint: disable=protected-access
    np.testing.assert_array_equal(var.numpy(), emb.variables[table.name]["parameters"])


def test_converted_checkpoint_trains_on_like_the_original_run(tmp_path):
  # 3 steps, then stacked (as a SparseCore TPU would hold it), then back to
  # per-table and 3 more steps, equals 6 uninterrupted steps to the last bit.
  optimizer = "adam"
  emb, path = _trained_checkpoint(tmp_path, optimizer)
  stacked, back = str(tmp_path / "stacked"), str(tmp_path / "back")
  convert_checkpoint(path, stacked, _config(optimizer), "v6e:4",
                     optimizer=OPTIMIZERS[optimizer]())
  convert_checkpoint(stacked, back, _config(optimizer), optimizer=OPTIMIZERS[optimizer]())
  resumed = tee.CPUEmbedding(_config(optimizer), OPTIMIZERS[optimizer](), engine="v2")
  status = tf.train.Checkpoint(embedding=resumed).read(back)
  resumed.build()
  status.assert_consumed()
  for table, slots in emb.variables.items():
    for slot, var in slots.items():
      assert var.numpy().tobytes() == resumed.variables[table][slot].numpy().tobytes()
  _train(resumed, 3, start=3)
  _train(emb, 3, start=3)
  for table, slots in emb.variables.items():
    for slot, var in slots.items():
      assert var.numpy().tobytes() == resumed.variables[table][slot].numpy().tobytes()


def test_other_objects_in_the_checkpoint_are_kept(tmp_path):
  emb = tee.CPUEmbedding(_config("sgd"), OPTIMIZERS["sgd"](), engine="v2")
  emb.build()
  dense = tf.Variable([1.5, 2.5], name="dense")
  path = tf.train.Checkpoint(model=tf.train.Checkpoint(embedding=emb, dense=dense),
                             step=tf.Variable(7)).save(str(tmp_path / "c"))
  stacked, back = str(tmp_path / "stacked"), str(tmp_path / "back")
  convert_checkpoint(path, stacked, _config("sgd"), "v5p:1", prefix="model/embedding",
                     optimizer=OPTIMIZERS["sgd"]())
  convert_checkpoint(stacked, back, _config("sgd"), prefix="model/embedding",
                     optimizer=OPTIMIZERS["sgd"]())
  fresh = tee.CPUEmbedding(_config("sgd"), OPTIMIZERS["sgd"](), engine="v2")
  fresh_dense, step = tf.Variable([0.0, 0.0]), tf.Variable(0)
  status = tf.train.Checkpoint(model=tf.train.Checkpoint(
      embedding=fresh, dense=fresh_dense), step=step).restore(back)
  fresh.build()
  status.assert_consumed()
  assert fresh_dense.numpy().tolist() == [1.5, 2.5] and int(step) == 7
  np.testing.assert_array_equal(fresh.variables["d"]["parameters"],
                                emb.variables["d"]["parameters"])


def _errors_case(tmp_path, change):
  _, path = _trained_checkpoint(tmp_path, "adagrad", steps=1)
  stacked = str(tmp_path / "stacked")
  convert_checkpoint(path, stacked, _config("adagrad"), Topology(1, 4),
                     optimizer=OPTIMIZERS["adagrad"]())
  return {"per_table": path, "stacked": stacked}[change]


@pytest.mark.parametrize("source, table_change, optimizer, message", [
    ("per_table", ("b", 14, 5), "adagrad",
     "table 'b': checkpoint {src} holds shape [13, 5], the config has [14, 5]. Fix: "
     "convert with the config the checkpoint was trained with."),
    ("stacked", ("c", 70, 9), "adagrad",
     "table 'c': checkpoint {src} holds shape [70, 8] (in stack 'a_b_c'), the config "
     "has [70, 9]. Fix: convert with the config the checkpoint was trained with."),
    ("per_table", None, "adam",
     "table 'a': checkpoint {src} holds optimizer slots ['accumulators'], the config's "
     "optimizer has ['momenta', 'velocities']. Fix: convert with the optimizer the "
     "checkpoint was trained with."),
    ("stacked", ("e", 10, 8), "adagrad",
     "table 'e' is not in the SparseCore layouts of checkpoint {src}. Fix: convert with "
     "the config the checkpoint was trained with."),
])
def test_mismatches_name_the_table_and_both_shapes(tmp_path, source, table_change,
                                                   optimizer, message):
  src = _errors_case(tmp_path, source)
  config = _config("adagrad")
  if table_change:
    name, rows, dim = table_change
    config[name] = api.FeatureConfig(table=api.TableConfig(
        vocabulary_size=rows, dim=dim, name=name), name=name, output_shape=[4])
  out = tmp_path / "out"
  with pytest.raises(errors.ConfigError) as e:
    convert_checkpoint(src, str(out), config, "v5p:1", optimizer=OPTIMIZERS[optimizer]())
  assert str(e.value) == message.format(src=src)
  assert not list(tmp_path.glob("out*"))  # nothing written


def test_unknown_prefix_is_named(tmp_path):
  _, path = _trained_checkpoint(tmp_path, "sgd", steps=1)
  with pytest.raises(errors.ConfigError) as e:
    convert_checkpoint(path, str(tmp_path / "o"), _config("sgd"), prefix="embeding",
                       optimizer=OPTIMIZERS["sgd"]())
  assert str(e.value) == (
      f'checkpoint {path} has no object "embeding" (no child "embeding"). Did you '
      'mean "embedding"? Fix: leave --prefix out to find the embedding, or pass '
      'its path in the checkpoint (tf.train.Checkpoint(embedding=...): "embedding"; '
      'train\'s checkpoints: "model/embedding/embedding").')


def test_convert_checkpoint_command(tmp_path):
  spec = tee.EmbeddingSpec.from_file("configs/tiny.yaml")
  emb = tee.CPUEmbedding(spec)  # the same checkpoint keys as engine="v2"
  emb.build()
  for slots in emb.variables.values():
    for var in slots.values():
      var.assign(tf.random.stateless_uniform(var.shape, seed=[1, 2]))
  path = tf.train.Checkpoint(embedding=emb).write(str(tmp_path / "per_table"))
  stacked = str(tmp_path / "stacked")
  out = subprocess.run(
      [sys.executable, "-m", "tpu_embed_ext", "convert-checkpoint", "--config",
       "configs/tiny.yaml", "--checkpoint", path, "--out", stacked, "--topology",
       "v6e:8"], capture_output=True, text=True, timeout=600, check=True).stdout
  layouts = checkpoint_layouts(stacked)
  stacks = {l.stack for l in layouts}
  assert out.strip().splitlines() == [
      f"Converting {path} table by table...",
      f"{path} -> {stacked}: SparseCore layout for v6e:8 (8 chips x 2 SparseCores) "
      f"({len(stacks)} stacks)."]
  assert len(layouts) == len(emb.variables) and len(stacks) < len(layouts)
  back = str(tmp_path / "back")
  convert_checkpoint(stacked, back, spec)
  original, returned = _values(path), _values(back)
  assert original.keys() == returned.keys()
  assert all(original[k].tobytes() == returned[k].tobytes() for k in original)


def _tiny_embedding():
  spec = tee.EmbeddingSpec.from_file("configs/tiny.yaml")
  emb = tee.CPUEmbedding(spec)
  emb.build()
  for i, slots in enumerate(emb.variables.values()):
    for var in slots.values():
      var.assign(tf.random.stateless_uniform(var.shape, seed=[i, 2]))
  return spec, emb


def _keras_model(spec):
  features = {f.name: tf.keras.Input(shape=(), dtype=tf.int64, name=f.name)
              for f in spec.features}
  layer = tee.EmbeddingLayer(spec, name="tables")
  outputs = tf.keras.layers.Concatenate()(list(layer(features).values()))
  return tf.keras.Model(features, outputs), layer


@pytest.mark.parametrize("form", ["cpu_embedding", "keras_model", "train_job"])
def test_the_embedding_is_found_without_a_prefix(tmp_path, form):
  """A bare CPUEmbedding, a Keras model with EmbeddingLayer, and train's layout
  (``model/embedding/embedding``): converted to stacked and back without
  --prefix, every table and slot bit-identical."""
  spec, emb = _tiny_embedding()
  if form == "cpu_embedding":
    root, where = tf.train.Checkpoint(embedding=emb), "embedding"
  elif form == "keras_model":
    model, layer = _keras_model(spec)
    for name, slots in emb.variables.items():
      for slot, var in slots.items():
        layer.variables_by_table[name][slot].assign(var)
    root, where = tf.train.Checkpoint(model=model), None
  else:
    holder = tf.Module()
    holder.embedding = tf.Module()
    holder.embedding.embedding = emb
    root, where = tf.train.Checkpoint(model=holder), "model/embedding/embedding"
  path = root.write(str(tmp_path / "src"))
  found = sparsecore_checkpoint.embedding_paths(path, [t.name for t in spec.tables])
  assert len(found) == 1 and (where is None or found == [where])
  convert_checkpoint(path, str(tmp_path / "stacked"), spec, "v5p:1")
  convert_checkpoint(str(tmp_path / "stacked"), str(tmp_path / "back"), spec)
  before = {k.split(found[0] + "/", 1)[1]: v for k, v in _values(path).items()
            if k.startswith(found[0] + "/") and "/table_step" not in k}
  after = {k.split(found[0] + "/", 1)[1]: v for k, v in _values(str(tmp_path / "back")).items()
           if k.startswith(found[0] + "/") and "/table_step" not in k}
  assert before.keys() == after.keys()
  assert len(before) == sum(len(slots) for slots in emb.variables.values())
  assert all(before[k].tobytes() == after[k].tobytes() for k in before)


def test_two_embeddings_need_a_prefix_and_the_error_lists_them(tmp_path):
  spec, emb = _tiny_embedding()
  _, other = _tiny_embedding()
  path = tf.train.Checkpoint(embedding=emb, backup=other).write(str(tmp_path / "two"))
  with pytest.raises(errors.ConfigError) as e:
    convert_checkpoint(path, str(tmp_path / "out"), spec, "v5p:1")
  assert str(e.value) == (f"checkpoint {path} holds 2 embeddings with these tables: "
                          "backup, embedding. Fix: pass --prefix with one of them.")
  assert not list(tmp_path.glob("out*"))
  convert_checkpoint(path, str(tmp_path / "out"), spec, "v5p:1", prefix="backup")
  assert checkpoint_layouts(str(tmp_path / "out"), prefix="backup")


def test_a_checkpoint_without_the_tables_is_named(tmp_path):
  spec, _ = _tiny_embedding()
  path = tf.train.Checkpoint(v=tf.Variable(1.0)).write(str(tmp_path / "none"))
  with pytest.raises(errors.ConfigError, match=(
      r"has no object holding the tables t_c0, t_c1, .* \(per-table\) or SparseCore "
      r"layouts\. Fix: convert a checkpoint trained with this config, or pass "
      r"--prefix with the embedding's path in the checkpoint\.")):
    convert_checkpoint(path, str(tmp_path / "out"), spec, "v5p:1")


def _rewrite(src, dst, changes):
  """A copy of checkpoint ``src`` with the tensors in ``changes`` replaced."""
  reader = tf.train.load_checkpoint(src)
  keys = sorted(reader.get_variable_to_shape_map())
  tf.raw_ops.SaveV2(prefix=dst, tensor_names=keys, shape_and_slices=[""] * len(keys),
                    tensors=[changes.get(k, reader.get_tensor(k)) for k in keys])
  return dst


def test_damaged_checkpoints_are_named(tmp_path):
  _, path = _trained_checkpoint(tmp_path, "adagrad", steps=1)
  config, opt = _config("adagrad"), OPTIMIZERS["adagrad"]()
  key = "embedding/b.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"
  bad = _rewrite(path, str(tmp_path / "bad_slot"), {key: np.zeros([13, 4], np.float32)})
  with pytest.raises(errors.ConfigError) as e:
    convert_checkpoint(bad, str(tmp_path / "o1"), config, "v5p:1", optimizer=opt)
  assert str(e.value) == (
      f"table 'b' slot 'accumulators': checkpoint {bad} holds shape [13, 4], the "
      "config has [13, 5]. Fix: convert with the config the checkpoint was trained with.")
  # A layouts key from another topology over stacked tensors of this one: a
  # (100 -> 128) + b (13 -> 32) + c (70 -> 96) rows on 4 SparseCores, 128 + 64 +
  # 128 on 8.
  stacked, other = str(tmp_path / "stacked"), str(tmp_path / "other")
  convert_checkpoint(path, stacked, config, Topology(1, 4), optimizer=opt)
  convert_checkpoint(path, other, config, Topology(2, 4), optimizer=opt)
  layouts_key = "embedding/_sparse_core_table_layouts/.ATTRIBUTES/VARIABLE_VALUE"
  mixed = _rewrite(stacked, str(tmp_path / "mixed"), {
      layouts_key: tf.train.load_checkpoint(other).get_tensor(layouts_key)})
  with pytest.raises(errors.ConfigError) as e:
    convert_checkpoint(mixed, str(tmp_path / "o2"), config, optimizer=opt)
  assert str(e.value) == (
      f"stack 'a_b_c' (parameters): checkpoint {mixed} holds shape [256, 8], its layout "
      "needs [320, 8]. Fix: the checkpoint is damaged or its layouts key belongs to "
      "another checkpoint.")
  # A stacked checkpoint with a table the config lacks.
  fewer = {k: v for k, v in config.items() if k != "d"}
  with pytest.raises(errors.ConfigError) as e:
    convert_checkpoint(stacked, str(tmp_path / "o3"), fewer, optimizer=opt)
  assert str(e.value) == (
      f"checkpoint {stacked} holds SparseCore tables ['d'] that the config does not "
      "have; converting would drop them. Fix: convert with the config the checkpoint "
      "was trained with.")
  # A per-table checkpoint without a table of the config, at a given prefix
  # (without one, the search names the tables no object holds:
  # test_a_checkpoint_without_the_tables_is_named).
  more = dict(config, e=api.FeatureConfig(table=api.TableConfig(
      vocabulary_size=3, dim=8, name="e"), name="e"))
  with pytest.raises(errors.ConfigError) as e:
    convert_checkpoint(path, str(tmp_path / "o4"), more, "v5p:1", optimizer=opt,
                       prefix="embedding")
  assert str(e.value) == (
      f"table 'e' is not in checkpoint {path} (no key embedding/e/.ATTRIBUTES/"
      "VARIABLE_VALUE). Fix: convert with the config the checkpoint was trained with, "
      "or pass its --prefix.")
  # Not an object-based checkpoint.
  raw = str(tmp_path / "raw")
  tf.raw_ops.SaveV2(prefix=raw, tensor_names=["x"], shape_and_slices=[""],
                    tensors=[tf.zeros([2])])
  with pytest.raises(errors.ConfigError) as e:
    convert_checkpoint(raw, str(tmp_path / "o5"), config, optimizer=opt)
  assert str(e.value) == (
      f"{raw} is not an object-based (TF2) checkpoint: it has no "
      "_CHECKPOINTABLE_OBJECT_GRAPH. Fix: convert a checkpoint written by "
      "tf.train.Checkpoint.")


def _tf_layouts(layouts, stack):
  """TensorFlow's layout protos of ``stack``, in row-offset order (as its adapter sorts)."""
  from tpu_embed_ext.sparsecore import layout as sc_layout
  protos = {p.table_name: p for p in sc_layout.layouts_to_proto(layouts).tables}
  return [protos[l.table] for l in sorted(layouts, key=lambda l: l.row_offset)
          if l.stack == stack]


def _padding_mask(layouts, stack):
  """True where the stacked variable holds padding."""
  first = next(l for l in layouts if l.stack == stack)
  mask = np.ones((first.stacked_rows, first.padded_dim), bool)
  for l in layouts:
    if l.stack == stack:
      rows = l.stacked_index(np.arange(l.rows))
      mask[rows[:, None], np.arange(l.dim)[None, :]] = False
  return mask


def test_tensorflow_checkpoint_adapter_shards_and_reshards_like_us(tmp_path):
  # TensorFlow's own TPUEmbeddingV2 checkpoint adapter (per-table -> stacked,
  # and stacked -> another topology) as the oracle. It pads slots with 0
  # where we write the slot's initial value; everything else is equal.
  from tensorflow.python.tpu import tpu_embedding_v3_checkpoint_adapter as adapter
  emb, path = _trained_checkpoint(tmp_path, "ftrl")
  config, opt = _config("ftrl"), OPTIMIZERS["ftrl"]()
  fill = {"parameters": 0.0, "accumulators": 0.2, "linears": 0.0}
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  layouts_a = convert_checkpoint(path, a, config, Topology(2, 4), optimizer=opt)
  layouts_b = convert_checkpoint(a, b, config, "v6e:8", optimizer=opt)
  stored_a, stored_b = _values(a), _values(b)
  for stack in {l.stack for l in layouts_b}:
    for slot, value in fill.items():
      suffix = "" if slot == "parameters" else f".S{slot}"
      key = f"embedding/{stack}{suffix}/.ATTRIBUTES/VARIABLE_VALUE"
      ours = stored_b[key]
      mask = _padding_mask(layouts_b, stack)
      assert (ours[mask] == value).all()
      spec = f"{ours.shape[0]} {ours.shape[1]} 0,{ours.shape[0]}:0,{ours.shape[1]}"
      to = _tf_layouts(layouts_b, stack)
      sharded = adapter._shard_from_cpu_to_sc(  # pylint: disable=protected-access
          [emb.variables[l.table_name][slot] for l in to], spec, to).numpy()
      assert sharded[~mask].tobytes() == ours[~mask].tobytes()
      assert (sharded[mask] == 0).all()
      sources = {s: _tf_layouts(layouts_a, s) for s in {l.stack for l in layouts_a}}
      resharded = adapter.EmbeddingReshardCallback(stack, sources, to).reshard(
          [tf.constant(stored_a[f"embedding/{s}{suffix}/.ATTRIBUTES/VARIABLE_VALUE"])
           for s in sources], spec).numpy()
      assert resharded[~mask].tobytes() == ours[~mask].tobytes()
