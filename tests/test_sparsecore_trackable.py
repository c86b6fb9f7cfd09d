"""Per-table variables saved and restored in TPUEmbeddingV2's stacked layout."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.trackable import autotrackable

import tpu_embed_ext as tee
from tpu_embed_ext import errors
from tpu_embed_ext.tf import optimizers
from tpu_embed_ext.sparsecore import convert_checkpoint
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.topology import Topology
from tpu_embed_ext.sparsecore.trackable import check_checkpoint, track_stacked
from tests.test_sparsecore_convert import OPTIMIZERS, _config, _train, _values

api = tf.tpu.experimental.embedding


def _stacked_holder(emb, optimizer, topology):
  layouts = sc_layout.compute_layouts(sc_layout.stacking_inputs(
      _config(optimizer), OPTIMIZERS[optimizer]()), topology)
  spec = optimizers.as_spec(OPTIMIZERS[optimizer]())
  fill = {"parameters": 0.0, **dict(zip(spec.slot_names, spec.slot_initial_values()))}
  # The per-table variables, copied: the holder saves and restores them.
  variables = {t: {s: tf.Variable(v) for s, v in slots.items()}
               for t, slots in emb.variables.items()}
  holder = autotrackable.AutoTrackable()
  track_stacked(holder, variables, layouts, {t: fill for t in variables})
  return holder, variables, layouts


@pytest.mark.parametrize("optimizer", ["adagrad", "ftrl"])
def test_saved_stacked_checkpoint_equals_the_converted_one(tmp_path, optimizer):
  emb = tee.CPUEmbedding(_config(optimizer), OPTIMIZERS[optimizer](), engine="v2")
  _train(emb, 2)
  per_table = tf.train.Checkpoint(embedding=emb).write(str(tmp_path / "per_table"))
  converted = str(tmp_path / "converted")
  convert_checkpoint(per_table, converted, _config(optimizer), Topology(2, 4),
                     optimizer=OPTIMIZERS[optimizer]())
  holder, variables, _ = _stacked_holder(emb, optimizer, Topology(2, 4))
  saved = tf.train.Checkpoint(embedding=holder).write(str(tmp_path / "saved"))
  # Two implementations (numpy slices streamed to disk; TF ops at save time)
  # write the same bytes under the same keys.
  ours, theirs = _values(saved), _values(converted)
  assert ours.keys() == theirs.keys()
  for key in ours:
    assert np.asarray(ours[key]).tobytes() == np.asarray(theirs[key]).tobytes(), key
  # Restoring writes every table and slot back.
  for slots in variables.values():
    for var in slots.values():
      var.assign(tf.zeros_like(var))
  tf.train.Checkpoint(embedding=holder).read(converted).assert_consumed()
  for table, slots in emb.variables.items():
    for slot, var in slots.items():
      assert variables[table][slot].numpy().tobytes() == var.numpy().tobytes()
  # And TPUEmbeddingForServing reads the saved checkpoint's tables.
  serving = api.TPUEmbeddingForServing(_config(optimizer), OPTIMIZERS[optimizer]())
  tf.train.Checkpoint(embedding=serving).restore(saved)
  serving.build()
  for table, var in serving.embedding_tables.items():
    np.testing.assert_array_equal(var.numpy(), emb.variables[table.name]["parameters"])


def test_restoring_another_topology_names_the_stack_and_shapes(tmp_path):
  emb = tee.CPUEmbedding(_config("sgd"), OPTIMIZERS["sgd"](), engine="v2")
  emb.build()
  per_table = tf.train.Checkpoint(embedding=emb).write(str(tmp_path / "per_table"))
  other = str(tmp_path / "other")
  convert_checkpoint(per_table, other, _config("sgd"), Topology(4, 4),
                     optimizer=OPTIMIZERS["sgd"]())
  holder, _, layouts = _stacked_holder(emb, "sgd", Topology(2, 4))
  # The message names the first field that places rows differently.
  message = (
      "table 'a': the checkpoint's SparseCore layout has num_sparse_cores 16, this "
      "engine's has 8 (checkpoint: 16 SparseCores on 4 chips, stack 'a_b_c', 128 x 8 "
      "padded, offset 0, rotation 0; engine: 8 SparseCores on 2 chips, stack 'a_b_c', "
      "128 x 8 padded, offset 0, rotation 0). Fix: convert the checkpoint to this "
      "topology (python -m tpu_embed_ext convert-checkpoint --topology ...).")
  with pytest.raises(errors.ConfigError) as e:
    check_checkpoint(other, layouts)     # before restoring: nothing changes
  assert str(e.value) == message
  with pytest.raises(errors.ConfigError) as e:
    check_checkpoint(per_table, layouts)
  assert str(e.value) == (
      f"checkpoint {per_table} holds per-table keys, not a SparseCore layout. Fix: "
      "convert it (python -m tpu_embed_ext convert-checkpoint --topology ...).")
  # A restore without the check fails too, on the layouts or a stack's shape
  # (an engine's own restore reshards instead: test_sparsecore_restore.py).
  with pytest.raises(errors.ConfigError, match="Fix: convert the checkpoint"):
    tf.train.Checkpoint(embedding=holder).read(other)


def test_stacked_shape_mismatch_is_named():
  emb = tee.CPUEmbedding(_config("sgd"), OPTIMIZERS["sgd"](), engine="v2")
  emb.build()
  holder, _, _ = _stacked_holder(emb, "sgd", Topology(2, 4))
  stack = holder._trackable_children()["d"]  # pylint: disable=protected-access
  with pytest.raises(errors.ConfigError) as e:
    stack._restore_from_tensors({"VARIABLE_VALUE": tf.zeros([32, 16])})  # pylint: disable=protected-access
  assert str(e.value) == (
      "stacked table 'd': the checkpoint holds shape [32, 16], this engine's SparseCore"
      " layout needs [64, 16]. Fix: convert the checkpoint to this topology (python -m "
      "tpu_embed_ext convert-checkpoint --topology ...).")


def test_missing_table_in_layouts_is_named():
  from tpu_embed_ext.sparsecore.trackable import check_layouts
  layouts = sc_layout.compute_layouts(
      [sc_layout.StackingInput("a", 8, 8, "g"), sc_layout.StackingInput("b", 8, 8, "g")],
      Topology(1, 4))
  with pytest.raises(errors.ConfigError) as e:
    check_layouts(layouts[:1], layouts)
  assert str(e.value) == (
      "table 'b' is not in the checkpoint's SparseCore layouts. Fix: restore a "
      "checkpoint of the same tables.")


def test_layouts_are_compared_on_the_fields_that_place_rows():
  import dataclasses
  from tpu_embed_ext.sparsecore.trackable import check_layouts
  layouts = sc_layout.compute_layouts(
      [sc_layout.StackingInput("a", 8, 8, "g", 16, 1),
       sc_layout.StackingInput("b", 8, 8, "g")], Topology(1, 4))
  # A batch size or feature count places no row: accepted.
  check_layouts([dataclasses.replace(l, per_sparse_core_batch_size=99, num_features=7)
                 for l in layouts], layouts)
  moved = [dataclasses.replace(l, rotation=(l.rotation + 1) % 4) if l.table == "b"
           else l for l in layouts]
  with pytest.raises(errors.ConfigError) as e:
    check_layouts(moved, layouts)
  b = next(l for l in layouts if l.table == "b")
  assert str(e.value).startswith(
      f"table 'b': the checkpoint's SparseCore layout has rotation "
      f"{(b.rotation + 1) % 4}, this engine's has {b.rotation} (checkpoint: ")
