"""HBM per device (sparsecore/hbm.py, chips.py): counts against numbers
computed here from the published rules, at the boundary, and plan --topology."""

import math
import warnings

import pytest
import tensorflow as tf

from tpu_embed_ext.sparsecore import chips, hbm
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.topology import Topology

GIB = 1 << 30
TE = tf.tpu.experimental.embedding


def _config(rows, dim=64, optimizer=None, features=1, table_name="big"):
  table = TE.TableConfig(rows, dim, optimizer=optimizer, name=table_name)
  return {f"f{i}": TE.FeatureConfig(table, name=f"f{i}") for i in range(features)}


def _v1_bytes(rows, devices, dim, states, batch, features):
  """The published count: ceil(rows / devices) rows of each state, 4 B each,
  plus activations and gradients for every feature."""
  return (math.ceil(rows / devices) * dim * states * 4
          + 2 * batch * features * dim * 4)


def test_generations_have_their_published_figures():
  g = chips.GENERATIONS
  # Cloud TPU's figures, per chip; v2 and v3 show each TensorCore as a device.
  assert {n: (x.hbm_gib, x.replicas_per_chip, x.sparsecores_per_chip, x.embedding_v2)
          for n, x in g.items()} == {
      "v2": (16, 2, 0, False), "v3": (32, 2, 0, False), "v4": (32, 1, 4, False),
      "v5e": (16, 1, 0, False), "v5p": (95, 1, 4, True), "v6e": (32, 1, 2, True),
      "tpu7x": (192, 1, 2, True)}
  assert all("cloud.google.com/tpu/docs/" + n in x.source for n, x in g.items())
  # XLA's own capacity where its messages publish it, else the nominal figure.
  assert g["v5e"].capacity_bytes == round(15.75 * GIB)
  assert g["v3"].capacity_bytes == round(15.48 * GIB)
  assert g["v2"].capacity_bytes == 8 * GIB
  assert g["v5p"].capacity_bytes == 95 * GIB
  assert chips.parse_slice("v3:4").replicas == 8
  assert chips.parse_slice("v5e:1").replicas == 1
  assert not chips.parse_slice("v5e:1").sparsecore
  assert chips.parse_slice("8x4").generation.name == "v5p"
  assert chips.default_slice(8, False).generation.name == chips.DEFAULT_V1 == "v4"
  assert chips.default_slice(8, True).generation.name == chips.DEFAULT_V2 == "v5p"
  with pytest.raises(Exception, match="'v5e:3' is not a v5e slice.*Fix: e.g. v5e:4"):
    chips.parse_slice("v5e:3")


def _boundary_rows(slice_, dim, states, batch, features):
  """The most rows of one table that fit ``slice_``'s capacity."""
  capacity = slice_.generation.capacity_bytes
  devices = slice_.replicas
  room = capacity - 2 * batch * features * dim * 4
  per_device = room // (dim * states * 4)
  return per_device * devices


@pytest.mark.parametrize("topology", ["v5e:1", "v3:4"])
def test_tpu_embedding_boundary_one_row(topology):
  slice_ = chips.parse_slice(topology)
  opt = TE.Adagrad(0.1)  # accumulators + the gradient accumulator: 3 states.
  batch, dim = 128, 64
  rows = _boundary_rows(slice_, dim, 3, batch, 2)
  shapes = [tf.TensorShape([batch])] * 2
  fits = hbm.for_tpu_embedding(_config(rows, dim, features=2), opt, shapes, slice_)
  assert fits.lower == _v1_bytes(rows, slice_.replicas, dim, 3, batch, 2)
  assert fits.lower <= fits.capacity
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", hbm.HBMNearlyFullWarning)
    hbm.check(fits, "build()")
  over = rows + slice_.replicas  # One more row on every device.
  refused = hbm.for_tpu_embedding(_config(over, dim, features=2), opt, shapes, slice_)
  assert refused.lower == _v1_bytes(over, slice_.replicas, dim, 3, batch, 2)
  with pytest.raises(hbm.HBMExhaustedError) as e:
    hbm.check(refused, "TPUEmbedding.build()")
  used = refused.lower / GIB
  cap = slice_.generation.capacity_bytes / GIB
  assert e.value.message.startswith(
      f"Ran out of memory in memory space hbm. Used {used:.2f}G of {cap:.2f}G "
      "hbm. Exceeded hbm capacity by ")
  assert isinstance(e.value, tf.errors.ResourceExhaustedError)
  assert "'big'" in e.value.message and "gradient_accumulators" in e.value.message
  assert "Fix: a larger slice" in e.value.message


def test_gradient_accumulation_off_and_sgd_count_their_states():
  slice_ = chips.parse_slice("v5e:1")
  shapes = [tf.TensorShape([8])]
  sgd = hbm.for_tpu_embedding(_config(1000, 8), TE.SGD(0.1), shapes, slice_)
  assert sgd.tables[0].states == ("parameters", "gradient_accumulators")
  off = hbm.for_tpu_embedding(
      _config(1000, 8), TE.Adam(0.1, use_gradient_accumulation=False), shapes, slice_)
  assert off.tables[0].states == ("parameters", "momenta", "velocities")
  assert off.lower == 1000 * 8 * 3 * 4 + 2 * 8 * 8 * 4


def test_upper_bound_pads_widths_and_warns_above_90_percent():
  slice_ = chips.parse_slice("v5e:1")
  capacity = slice_.generation.capacity_bytes
  # dim 5: lower counts 5 floats, upper 8; choose rows so lower < 90% < upper.
  rows = int(0.9 * capacity / (5 * 2 * 4)) - 1
  memory = hbm.for_tpu_embedding(_config(rows, 5), TE.SGD(0.1), [None], slice_)
  assert memory.lower == rows * 5 * 2 * 4 and memory.upper == rows * 8 * 2 * 4
  assert memory.uncounted == ("f0",)
  with pytest.warns(hbm.HBMNearlyFullWarning, match="over 90%"):
    hbm.check(memory, "build()")


def test_tpu_embedding_v2_counts_stacked_shards_per_chip():
  slice_ = chips.parse_slice("v6e:4")
  opt = TE.Adagrad(0.1)
  t1 = TE.TableConfig(1000, 12, optimizer=opt, name="a")
  t2 = TE.TableConfig(300, 16, optimizer=opt, name="b")
  config = {"x": TE.FeatureConfig(t1, name="x", output_shape=[16]),
            "y": TE.FeatureConfig(t2, name="y", output_shape=[16])}
  memory = hbm.for_tpu_embedding_v2(config, None, [tf.TensorShape([16])] * 2, slice_)
  # Rows padded to a multiple of 8 x 8 SparseCores, widths to 8: both 16 wide,
  # one stack a_b; each chip holds 2 of the 8 shards, parameters + accumulators.
  padded = (math.ceil(1000 / 64) * 64) + (math.ceil(300 / 64) * 64)
  assert [t.name for t in memory.tables] == ["a_b"]
  assert memory.tables[0].lower == padded // 8 * 2 * 16 * 2 * 4
  assert memory.buffers == 2 * 16 * (12 + 16) * 4
  layouts = sc_layout.compute_layouts(sc_layout.stacking_inputs(config),
                                      Topology(4, 2))
  assert memory.tables[0].rows == layouts[0].rows_per_shard * 2


def test_plan_topology_prints_memory_per_device():
  from tpu_embed_ext.cli import plan as plan_lib
  p = plan_lib.plan("tiny")
  memory = p.memory("v5e:1", batch_size=32)
  text = plan_lib.memory_text(memory)
  assert text.startswith("memory per device, TPUEmbedding on v5e:1 (")
  assert "headroom" in text and text.endswith("not counted).")
  assert memory.lower == sum(t.lower for t in memory.tables) + memory.buffers
  v2 = p.memory("v5p:4", batch_size=32)
  assert v2.engine == "TPUEmbeddingV2"


def test_plan_refuses_criteo_on_one_v5e_chip_and_fits_four():
  import subprocess
  import sys
  import tpu_embed_ext as tee
  from tpu_embed_ext.spec import files
  spec = tee.EmbeddingSpec.from_file(files.resolve("criteo"))

  def lower(devices, batch):
    total = 0
    for t in spec.tables:
      o = spec.optimizer_for(t.name)
      states = 1 + len(o.slot_names) + (1 if o.use_gradient_accumulation else 0)
      total += math.ceil(t.vocabulary_size / devices) * t.dim * states * 4
    dim_of = {t.name: t.dim for t in spec.tables}
    dims = sum(dim_of[f.table] for f in spec.features)
    return total + 2 * batch * dims * 4

  out = subprocess.run(
      [sys.executable, "-m", "tpu_embed_ext", "plan", "--config", "criteo",
       "--topology", "v5e:1"], capture_output=True, text=True, timeout=600,
      check=True).stdout
  used = lower(1, 512) / GIB  # criteo's train.batch_size, one device.
  assert (f"would be refused: Ran out of memory in memory space hbm. Used "
          f"{used:.2f}G of 15.75G hbm.") in out
  assert "v5e:4 holds it" in out
  from tpu_embed_ext.cli import plan as plan_lib
  memory = plan_lib.plan(spec).memory("v5e:4", batch_size=128)
  assert memory.lower == lower(4, 128) and memory.fits
