"""No false refusals (issue 44): what ran before still passes the memory and
SparseCore compile-time checks.

Pinned, by pure counting (no table is allocated: criteo alone is 15.7 GiB):

- every shipped config at each topology the repository documents for it, at its
  ``train.batch_size``: ``hbm.check`` (``TPUEmbedding`` on a generation without
  SparseCore, ``TPUEmbeddingV2`` on one with) neither refuses nor warns, and on
  SparseCore the scratchpad (E3001) and HBM stack (E3000) fit at TensorFlow's
  default limits (``sparsecore/state.py``'s ``compile_verdicts``, the check the
  first step runs);
- TF Model Garden's DLRM and DCN-v2 ranking configs, their facts written below
  as data, each with the file of tensorflow/models (or of the
  tf-models-official 2.20.0 wheel) it comes from.

Model Garden documents no topology in its YAMLs (``runtime.distribution_strategy:
'tpu'`` only). Its README names one slice for the embedding: "We can have up to
96 GB embedding tables for TPU v3-8" (https://github.com/tensorflow/models/blob/master/official/recommendation/ranking/README.md),
so the configs are pinned on v3-8 (``v3:4``: 4 chips, 8 TensorCores), with
``TPUEmbedding``; and on the smallest v5p slice (``v5p:4``, "v5p-8"), where
TensorFlow Recommenders' ``TPUEmbedding`` layer builds ``TPUEmbeddingV2``
(tensorflow_recommenders/layers/embedding/tpu_embedding_layer.py: ``embedding_feature
== V2``), and where task.py's comment places the multi-hot DCN-v2 ("to work
around PartialTPUEmbedding issue in v5p").
"""

import math
import warnings

import pytest
import tensorflow as tf

from tpu_embed_ext.spec import EmbeddingSpec
from tpu_embed_ext.spec import files
from tpu_embed_ext.sparsecore import chips, hbm
from tpu_embed_ext.sparsecore import scratchpad as sp
from tpu_embed_ext.sparsecore.state import SparseCoreState

TE = tf.tpu.experimental.embedding
GIB = 1 << 30

# --- TF Model Garden's ranking configs, as data ------------------------------

# official/recommendation/ranking/configs/yaml/dlrm_criteo_tpu.yaml and
# dcn_v2_criteo_tpu.yaml, task.model.vocab_sizes (the same 26 in both, and in
# official/recommendation/ranking/configs/config.py `vocab_sizes`): Criteo
# Terabyte's 26 categorical features.
MG_VOCAB_SIZES = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346,
    10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972,
    108, 36)
# Both YAMLs: task.model.embedding_dim: 64; task.train_data.global_batch_size: 16384.
MG_DIM = 64
MG_GLOBAL_BATCH = 16384
# configs/config.py, OptimizationConfig.embedding_optimizer = 'SGD' (neither
# YAML overrides it); task.py build_model: tf_keras.optimizers.get('SGD',
# use_legacy_optimizer=True), which TensorFlow Recommenders translates to
# tf.tpu.experimental.embedding.SGD(learning_rate) (tpu_embedding_layer.py
# _OPTIMIZER_PARAMETERS): no slots, TensorFlow's default
# use_gradient_accumulation=True (one gradient accumulator per element:
# tpu_embedding_optimization_parameters_utils.cc, SGD supports it).
# configs/config.py ModelConfig: use_partial_tpu_embedding = True,
# size_threshold = 50_000: task.py builds
# tfrs.experimental.layers.embedding.PartialTPUEmbedding, which gives
# TPUEmbedding only the tables with vocabulary_size > size_threshold
# (partial_tpu_embedding.py); the others are Keras Embedding layers of the
# dense model (replicated, not counted by hbm.py).
MG_SIZE_THRESHOLD = 50_000
# configs/config.py, the 'dlrm_dcn_v2_criteo' experiment (DLRM-DCNv2, multi-hot):
# embedding_dim 64, use_partial_tpu_embedding=False (every table in tfrs
# TPUEmbedding), use_multi_hot=True with these multi_hot_sizes, the same
# vocab_sizes, global batch 16384 (train_batch_size), embedding optimizer SGD.
MG_MULTI_HOT_SIZES = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
# README.md's "Training on TPU" command: embedding_dim 128, bottom_mlp
# [512,256,128], the same vocab_sizes and global_batch_size 16384, no topology.
MG_README_DIM = 128


def _model_garden(dim=MG_DIM, threshold=MG_SIZE_THRESHOLD, optimizer=None):
  """``{feature: FeatureConfig}`` as task.py's _get_tpu_embedding_feature_config
  builds it (combiner 'mean', tables 'embedding_table_%02d', features str(i),
  output_shape [global_batch_size]: task.py passes
  ``batch_size=train_data.global_batch_size``), keeping the tables
  PartialTPUEmbedding gives TPUEmbedding (all with ``threshold`` None)."""
  optimizer = optimizer or TE.SGD(0.01)
  out = {}
  for i, vocab in enumerate(MG_VOCAB_SIZES):
    if threshold is not None and not vocab > threshold:
      continue
    table = TE.TableConfig(vocab, dim, combiner="mean", name="embedding_table_%02d" % i,
                           optimizer=optimizer)
    out[str(i)] = TE.FeatureConfig(table, name=str(i), output_shape=[MG_GLOBAL_BATCH])
  return out


# --- the shipped configs at their documented topologies ----------------------

# (config, topology, where the repository documents it). "emulate:N" is
# `train --tpu emulate:N`: TPUEmbedding on N replicas of the default
# generation without SparseCore (chips.default_slice); the others are
# `--tpu emulate:TOPOLOGY` / `--topology`: TPUEmbedding on v3 and v5e,
# TPUEmbeddingV2 on SparseCore (v5p, CxS).
SHIPPED = [
    ("tiny", "emulate:2", "tests/test_emulated_job.py (tiny at 2 replicas)"),
    ("tiny", "emulate:8", "docs/cli.md: --tpu emulate is 8 replicas"),
    ("tiny", "v5p:4", "docs/guides/tpu-on-cpu.md: train --config configs/tiny.yaml "
                      "--tpu emulate:v5p:4"),
    ("tiny", "2x4", "tests/test_emulated_job_sparsecore.py (emulate:2x4)"),
    ("tiny", "v5p:8", "docs/guides/tpu-coverage.md: tiny on 2 and 8 SparseCore chips"),
    ("tiny", "v5e:4", "tests/test_emulated_job.py: --tpu emulate:v5e:4"),
    ("tiny", "v3:4", "docs/cli.md: --tpu emulate:v3:4 (8 replicas), an example slice"),
    ("ranking", "v5e:4", "docs/cli.md: --tpu emulate:v5e:4, an example slice"),
    ("ranking", "v3:4", "docs/cli.md: --tpu emulate:v3:4 (8 replicas), an example slice"),
    ("movielens", "v5e:4", "docs/cli.md: --tpu emulate:v5e:4, an example slice"),
    ("movielens", "v3:4", "docs/cli.md: --tpu emulate:v3:4 (8 replicas), an example slice"),
    ("ranking", "emulate:2", "docs/guides/tpu-on-cpu.md: train --config "
                             "configs/ranking.yaml --tpu emulate:2"),
    ("ranking", "emulate:8", "tests/test_emulated_job.py (ranking at 8 replicas)"),
    ("ranking", "v5p:4", "README.md / docs/cli.md: convert-checkpoint --topology v5p:4; "
                         "emulate --topology v5p:4 -m trainers.ranking"),
    ("movielens", "emulate:2", "tests/test_emulated_job.py (movielens at 2 replicas)"),
    ("movielens", "emulate:8", "docs/cli.md: --tpu emulate is 8 replicas"),
    ("criteo", "v5p:8", "configs/criteo.yaml: train --tpu emulate:v5p:8"),
    ("criteo", "v5p:4", "README.md / docs/cli.md: plan --config criteo --engine v2 "
                        "--topology v5p:4"),
    ("criteo", "2x4", "tests/test_emulated_job_sparsecore.py (criteo on 2 chips)"),
]


def _slice(topology):
  if topology.startswith("emulate:"):
    return chips.default_slice(int(topology.split(":")[1]), sparsecore=False)
  return chips.parse_slice(topology)


def _shipped(name):
  """(TensorFlow's feature config, train.batch_size) of a shipped config; its
  schedules read a step variable (a scalar: no table is made)."""
  path = files.resolve(name)
  spec = EmbeddingSpec.from_file(path)
  step = tf.Variable(0, dtype=tf.int64, trainable=False)
  return spec.feature_config(step), int(files.load(path)["train"]["batch_size"])


def _with_output_shape(feature_config, per_replica_batch):
  """The features with the per-replica batch as ``output_shape``, as the
  training job gives them on SparseCore."""
  return {k: TE.FeatureConfig(f.table, max_sequence_length=f.max_sequence_length,
                              output_shape=[per_replica_batch], name=f.name)
          for k, f in feature_config.items()}


def _memory(feature_config, optimizer, slice_, per_replica_batch):
  flat = tf.nest.flatten(feature_config)
  shapes = [tf.TensorShape([per_replica_batch])] * len(flat)
  count = hbm.for_tpu_embedding_v2 if slice_.sparsecore else hbm.for_tpu_embedding
  return count(feature_config, optimizer, shapes, slice_)


def _check_no_refusal(feature_config, optimizer, slice_, per_replica_batch,
                      global_batch, what, allow_warning=False):
  """hbm.check passes (and warns not, unless ``allow_warning``); on SparseCore,
  E3001 and E3000 fit at TPUEmbeddingV2's default limits. Returns the count."""
  memory = _memory(feature_config, optimizer, slice_, per_replica_batch)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore" if allow_warning else "error",
                          hbm.HBMNearlyFullWarning)
    hbm.check(memory, what)  # raises HBMExhaustedError on a refusal
  assert memory.fits and memory.lower <= memory.capacity, memory.summary()
  assert not memory.uncounted
  if slice_.sparsecore:
    state = SparseCoreState(feature_config, optimizer, slice_.name)
    stacks, stack_hbm = state.compile_verdicts(
        [global_batch] * len(tf.nest.flatten(feature_config)))
    assert stacks
    for s in stacks:
      assert s.verdict == sp.FITS, s.message()
    assert not stack_hbm.refused, stack_hbm.message()
  return memory


@pytest.mark.parametrize("name,topology,source", SHIPPED,
                         ids=[f"{n}@{t}" for n, t, _ in SHIPPED])
def test_shipped_config_at_its_documented_topology_is_not_refused(name, topology, source):
  config, batch = _shipped(name)
  slice_ = _slice(topology)
  assert batch % slice_.replicas == 0, source
  per_replica = batch // slice_.replicas
  if slice_.sparsecore:
    config = _with_output_shape(config, per_replica)
  memory = _check_no_refusal(config, None, slice_, per_replica, batch,
                             f"{name} on {topology} ({source})")
  # Far from the boundary: a shipped config takes under half a device.
  assert memory.upper < memory.capacity // 2, memory.summary()


def test_the_shipped_checks_can_refuse():
  # Not vacuous: the same count refuses criteo on one v5e chip (issue 44's
  # "Done when"), with the TPUEmbedding of `emulate` on that slice.
  config, batch = _shipped("criteo")
  memory = _memory(config, None, chips.parse_slice("v5e:1"), batch)
  with pytest.raises(hbm.HBMExhaustedError, match="Ran out of memory in memory space hbm"):
    hbm.check(memory, "criteo on v5e:1")


# --- Model Garden ------------------------------------------------------------

MODEL_GARDEN = [
    # (what, feature config kwargs, topology)
    ("dlrm_criteo_tpu.yaml", {}, "v3:4"),
    ("dcn_v2_criteo_tpu.yaml", {}, "v3:4"),   # same tables; interaction 'cross'
    ("dlrm_criteo_tpu.yaml", {}, "v5p:4"),
    ("dcn_v2_criteo_tpu.yaml", {}, "v5p:4"),
    ("config.py dlrm_dcn_v2_criteo", {"threshold": None}, "v3:4"),
    ("config.py dlrm_dcn_v2_criteo", {"threshold": None}, "v5p:4"),
]


@pytest.mark.parametrize("what,kwargs,topology", MODEL_GARDEN,
                         ids=[f"{w.split()[-1]}@{t}" for w, _, t in MODEL_GARDEN])
def test_model_garden_config_is_not_refused(what, kwargs, topology):
  slice_ = chips.parse_slice(topology)
  config = _model_garden(**kwargs)
  # Each feature's output_shape is Model Garden's [global_batch_size] (task.py),
  # counted per device: more than the data pipeline's global / replicas, so a
  # pass here holds for the smaller batch too.
  _check_no_refusal(config, None, slice_, MG_GLOBAL_BATCH,
                    MG_GLOBAL_BATCH * slice_.replicas, f"Model Garden {what} on {topology}")


def test_model_garden_dlrm_count_is_the_published_formula():
  # TPUEmbedding on v3-8: every table divided over the 8 TensorCores,
  # ceil(rows / 8) rows on a device, x dim x 4 B x (1 parameters + 0 slots of
  # SGD + 1 gradient accumulator); plus activations and their gradients for
  # every feature at its output shape.
  slice_ = chips.parse_slice("v3:4")
  devices = 8
  assert slice_.replicas == devices
  config = _model_garden()
  tpu_tables = [v for v in MG_VOCAB_SIZES if v > MG_SIZE_THRESHOLD]
  assert len(tpu_tables) == len(config) == 8
  states = 1 + 0 + 1
  tables = sum(math.ceil(v / devices) * MG_DIM * 4 * states for v in tpu_tables)
  buffers = 2 * len(tpu_tables) * MG_GLOBAL_BATCH * MG_DIM * 4
  memory = _memory(config, None, slice_, MG_GLOBAL_BATCH)
  assert memory.lower - memory.buffers == tables == 12_009_360_384
  assert memory.buffers == buffers
  assert memory.lower == tables + buffers
  assert memory.upper == memory.lower  # 64 is a multiple of 8: nothing padded
  assert memory.capacity == round(15.48 * GIB)
  assert memory.lower / memory.capacity < 0.75


def test_model_garden_adagrad_count_is_the_published_formula():
  # The same tables with `embedding_optimizer: Adagrad` (configs/config.py
  # OptimizationConfig accepts any Keras optimizer name): 1 slot.
  slice_ = chips.parse_slice("v3:4")
  config = _model_garden(optimizer=TE.Adagrad(0.01))
  tpu_tables = [v for v in MG_VOCAB_SIZES if v > MG_SIZE_THRESHOLD]
  states = 1 + 1 + 1
  tables = sum(math.ceil(v / 8) * MG_DIM * 4 * states for v in tpu_tables)
  memory = _memory(config, None, slice_, MG_GLOBAL_BATCH)
  assert memory.lower - memory.buffers == tables


def test_model_garden_dlrm_sparsecore_count_is_the_published_formula():
  # TPUEmbeddingV2 on v5p-8 (4 chips x 4 SparseCores = 16): each table's rows
  # padded to a multiple of 8 x 16 (SparseCoreLayoutStacker), stacked, divided
  # over the 16 SparseCores; a chip holds 4 shards, x dim x 4 B x 1 state (SGD:
  # no slots, and SparseCore keeps no gradient accumulator).
  slice_ = chips.parse_slice("v5p:4")
  sparsecores = 4 * 4
  config = _model_garden()
  tpu_tables = [v for v in MG_VOCAB_SIZES if v > MG_SIZE_THRESHOLD]
  padded = sum(math.ceil(v / (8 * sparsecores)) * 8 * sparsecores for v in tpu_tables)
  tables = padded // sparsecores * 4 * MG_DIM * 4 * 1
  memory = _memory(config, None, slice_, MG_GLOBAL_BATCH)
  assert memory.lower - memory.buffers == tables == 12_009_381_888
  assert memory.buffers == 2 * len(tpu_tables) * MG_GLOBAL_BATCH * MG_DIM * 4


def test_model_garden_readme_96_gb_on_v3_8_needs_gradient_accumulation_off():
  # A finding, pinned so that it is seen: README.md says "We can have up to 96
  # GB embedding tables for TPU v3-8"; its TPU command (embedding_dim 128, the
  # same vocab_sizes) has 187,646,234 rows in TPUEmbedding, 96.07 GB of
  # parameters. With TensorFlow 2.21's SGD (use_gradient_accumulation=True by
  # default: a second float per element) a v3-8 TensorCore needs
  # ceil(rows / 8) x 128 x 4 B x 2 = 24.0 GB, over XLA's 15.48G: refused. It
  # fits v3-8 with use_gradient_accumulation=False, or v3-16 (v3:8) as is.
  # Model Garden documents no topology for that command, so this is no false
  # refusal; the README's figure does not count the accumulator.
  tpu_tables = [v for v in MG_VOCAB_SIZES if v > MG_SIZE_THRESHOLD]
  assert sum(tpu_tables) == 187_646_234
  assert round(sum(tpu_tables) * MG_README_DIM * 4 / 1e9, 2) == 96.07
  v3_8, v3_16 = chips.parse_slice("v3:4"), chips.parse_slice("v3:8")
  default = _memory(_model_garden(dim=MG_README_DIM), None, v3_8, MG_GLOBAL_BATCH)
  assert default.lower - default.buffers == sum(
      math.ceil(v / 8) * MG_README_DIM * 4 * 2 for v in tpu_tables) == 24_018_720_768
  with pytest.raises(hbm.HBMExhaustedError, match="Ran out of memory in memory space hbm"):
    hbm.check(default, "README's command on v3-8")
  no_accumulator = TE.SGD(0.01, use_gradient_accumulation=False)
  _check_no_refusal(_model_garden(dim=MG_README_DIM, optimizer=no_accumulator), None,
                    v3_8, MG_GLOBAL_BATCH, MG_GLOBAL_BATCH * 8, "README, v3-8, no accumulator")
  _check_no_refusal(_model_garden(dim=MG_README_DIM), None, v3_16, MG_GLOBAL_BATCH,
                    MG_GLOBAL_BATCH * 16, "README's command on v3-16")
