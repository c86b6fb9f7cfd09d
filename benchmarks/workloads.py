"""Benchmark workloads and the contenders that train them.

A workload is a set of tables and features plus a batch generator; every
contender trains the same tables on the same batches with the same loss,
``sum over features of sum(activation^2) / batch``, and the same optimizer
hyperparameters (``OPTIMIZERS``), each with its own implementation:

* ``cpu_embedding``: ``tee.CPUEmbedding`` (enqueue, dequeue, apply_gradients)
  with the ``tf.tpu.experimental.embedding`` optimizer -- the TPU's math on the
  touched rows, with its default input validation.
* ``cpu_embedding_unchecked``: the same with ``validate=False``.
* ``keras_embedding``: one ``keras.layers.Embedding`` per table + the Keras 3
  optimizer, what a Keras user writes (multi-hot rows reduced with a segment
  sum / mean).
* ``serving_keras``: ``TPUEmbeddingForServing`` lookups + ``tf.GradientTape``
  + the Keras 3 optimizer on its tables: the CPU route TensorFlow documents.
* ``keras_rs``: keras-rs ``DistributedEmbedding`` off-TPU (its
  ``default_device`` placement) + the Keras 3 optimizer; skipped, with the
  reason recorded, when keras-rs does not import.
* ``sparse_floor``: the least work a sparse step with the TPU's accumulate-
  then-apply math can do with TensorFlow's own kernels: per table ``unique`` +
  ``unsorted_segment_sum`` + one fused sparse-apply kernel
  (``ResourceScatterSub`` for SGD, ``ResourceSparseApplyAdagradV2``,
  ``ResourceSparseApplyFtrlV2``; TensorFlow has no sparse Adam kernel, so for
  Adam it is a bare gather / elementwise / scatter of the touched rows).

Keras optimizers differ from the TPU's in details (Adagrad's epsilon, Adam's
bias correction); the hyperparameters are matched, the math is each route's own.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

import tpu_embed_ext as tee

E = tf.tpu.experimental.embedding
BATCH = 4096


@dataclasses.dataclass(frozen=True)
class Table:
  name: str
  vocab: int
  dim: int
  combiner: str = "sum"
  max_ids: int = 1
  """1: single-hot feature (a dense [batch] id tensor); >1: multi-hot,
  1..max_ids ids per row (a RaggedTensor)."""


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  tables: Tuple[Table, ...]
  batch: int = BATCH

  def batches(self, n: int, seed: int = 0) -> List[Dict[str, tf.Tensor]]:
    """``n`` batches of Zipf(1.2) ids, popular ids scattered over the table."""
    rng = np.random.default_rng(seed)
    permutations = {t.name: rng.permutation(t.vocab) for t in self.tables}
    out = []
    for _ in range(n):
      features = {}
      for t in self.tables:
        lengths = (rng.integers(1, t.max_ids + 1, self.batch) if t.max_ids > 1
                   else np.ones(self.batch, np.int64))
        ranks = np.minimum(rng.zipf(1.2, lengths.sum()) - 1, t.vocab - 1)
        ids = tf.constant(permutations[t.name][ranks], tf.int64)
        features[t.name] = (tf.RaggedTensor.from_row_lengths(ids, lengths)
                            if t.max_ids > 1 else ids)
      out.append(features)
    return out

  @property
  def parameters(self) -> int:
    return sum(t.vocab * t.dim for t in self.tables)


def w1(vocab: int) -> Workload:
  """One table, dim 16, single-hot."""
  return Workload(f"W1-{vocab}", (Table("t", vocab, 16),))


# Criteo's 26 cardinalities and the dims of configs/criteo.yaml (64 for the
# large tables); the last six features multi-hot (1-5 ids, mean), as in the
# synthetic_clicks data.
_CRITEO = ((1460, 16), (583, 16), (10131227, 64), (2202608, 64), (305, 16),
           (24, 16), (12517, 16), (633, 16), (3, 16), (93145, 16), (5683, 16),
           (8351593, 64), (3194, 16), (27, 16), (14992, 16), (5461306, 64),
           (10, 16), (5652, 16), (2173, 16), (4, 16), (7046547, 64), (18, 16),
           (15, 16), (286181, 64), (105, 16), (142572, 64))


def w2(cap: int = 500_000) -> Workload:
  """Criteo-like: 26 tables, Criteo's cardinalities capped at ``cap`` rows."""
  return Workload(f"W2-cap{cap}", tuple(
      Table(f"C{i + 1}", min(v, cap), d,
            combiner="mean" if i >= 20 else "sum", max_ids=5 if i >= 20 else 1)
      for i, (v, d) in enumerate(_CRITEO)))


# name -> (TPU optimizer, Keras optimizer), same hyperparameters.
OPTIMIZERS: Dict[str, Callable[[], Tuple[object, keras.optimizers.Optimizer]]] = {
    "sgd": lambda: (E.SGD(0.1), keras.optimizers.SGD(0.1)),
    "adagrad": lambda: (E.Adagrad(0.1, initial_accumulator_value=0.1),
                        keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.1)),
    "adam": lambda: (E.Adam(0.001), keras.optimizers.Adam(0.001)),
    "ftrl": lambda: (E.FTRL(0.1), keras.optimizers.Ftrl(
        0.1, initial_accumulator_value=0.1)),
}


def _loss(activations, batch: int):
  return tf.add_n([tf.reduce_sum(a * a) for a in tf.nest.flatten(activations)]) / batch


SLOT_INITIAL_VALUES = {"sgd": (), "adagrad": (0.1,), "adam": (0.0, 0.0),
                       "ftrl": (0.1, 0.0)}
"""Each optimizer's slot variables (each the table's shape), as initialised."""
SLOTS = {name: len(values) for name, values in SLOT_INITIAL_VALUES.items()}

INIT = 0.01
"""Every table starts at this value, so the first steps already move rows."""


def _feature_config(workload: Workload):
  return {t.name: E.FeatureConfig(
      E.TableConfig(t.vocab, t.dim, initializer=tf.constant_initializer(INIT),
                    combiner=t.combiner, name=t.name), name=t.name)
          for t in workload.tables}


# Each contender: (workload, optimizer name) -> (step(features), {table: variable}).

def cpu_embedding(workload: Workload, optimizer: str, validate: bool = True):
  emb = tee.CPUEmbedding(_feature_config(workload), OPTIMIZERS[optimizer]()[0],
                         validate=validate)
  emb.build()

  @tf.function
  def step(features):
    emb.enqueue(features, training=True)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = _loss(activations, workload.batch)
    emb.apply_gradients(tape.gradient(loss, activations))
  return step, {name: v["parameters"] for name, v in emb.variables.items()}


def _keras_train_step(lookup, variables, keras_optimizer, batch):
  keras_optimizer.build(variables)

  @tf.function
  def step(features):
    with tf.GradientTape() as tape:
      loss = _loss(lookup(features), batch)
    keras_optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
  return step


def keras_embedding(workload: Workload, optimizer: str):
  layers = {t.name: keras.layers.Embedding(
      t.vocab, t.dim, embeddings_initializer=keras.initializers.Constant(INIT))
            for t in workload.tables}
  for layer in layers.values():
    layer.build((None,))
  combiners = {t.name: t.combiner for t in workload.tables}

  def lookup(features):
    out = {}
    for name, ids in features.items():
      if isinstance(ids, tf.RaggedTensor):
        rows = layers[name](ids.values)
        reduce = (tf.math.unsorted_segment_mean if combiners[name] == "mean"
                  else tf.math.unsorted_segment_sum)
        out[name] = reduce(rows, ids.value_rowids(), ids.nrows())
      else:
        out[name] = layers[name](ids)
    return out

  variables = [layer.embeddings for layer in layers.values()]
  keras_optimizer = OPTIMIZERS[optimizer]()[1]
  return (_keras_train_step(lookup, variables, keras_optimizer, workload.batch),
          {name: layer.embeddings for name, layer in layers.items()})


def serving_keras(workload: Workload, optimizer: str):
  serving = E.TPUEmbeddingForServing(_feature_config(workload),
                                     OPTIMIZERS[optimizer]()[0])
  serving.build()
  variables = list(serving.embedding_tables.values())
  keras_optimizer = OPTIMIZERS[optimizer]()[1]
  return (_keras_train_step(serving, variables, keras_optimizer, workload.batch),
          {t.name: v for t, v in serving.embedding_tables.items()})


def keras_rs_available() -> Optional[str]:
  """None if keras-rs imports, else why not."""
  try:
    import keras_rs  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
  except ImportError as e:
    return f"keras-rs does not import here: {e}"
  return None


def keras_rs(workload: Workload, optimizer: str):
  import keras_rs as krs  # pylint: disable=import-outside-toplevel
  configs = {t.name: krs.layers.FeatureConfig(
      name=t.name, table=krs.layers.TableConfig(
          name=t.name, vocabulary_size=t.vocab, embedding_dim=t.dim,
          combiner=t.combiner, initializer=keras.initializers.Constant(INIT),
          placement="default_device"),
      input_shape=(workload.batch, t.max_ids if t.max_ids > 1 else 1),
      output_shape=(workload.batch, t.dim)) for t in workload.tables}
  layer = krs.layers.DistributedEmbedding(configs)
  layer(workload.batches(1, seed=99)[0])  # Builds the tables.
  keras_optimizer = OPTIMIZERS[optimizer]()[1]
  return (_keras_train_step(layer, layer.trainable_variables, keras_optimizer,
                            workload.batch),
          {v.path.split("/")[-2]: v for v in layer.trainable_variables})


def sparse_floor(workload: Workload, optimizer: str, huge_pages: bool = False):
  """Per table: unique + segment sum + one fused sparse-apply kernel.

  ``huge_pages``: its tables and slots on 2 MiB pages too, as the native
  path puts its own (``native.use_huge_pages``), to tell that gain apart.
  """
  slots = SLOT_INITIAL_VALUES[optimizer]
  tables = {}
  for t in workload.tables:
    shape = [t.vocab, t.dim]
    tables[t.name] = (t, tf.Variable(tf.fill(shape, INIT)),
                      [tf.Variable(tf.fill(shape, v)) for v in slots])
  if huge_pages:
    from tpu_embed_ext.emulation import native  # pylint: disable=import-outside-toplevel
    native.use_huge_pages([v for _, var, s in tables.values() for v in (var, *s)])

  def update(var, slots, unique, g):
    if optimizer == "sgd":
      tf.raw_ops.ResourceScatterSub(resource=var.handle, indices=unique,
                                    updates=0.1 * g)
    elif optimizer == "adagrad":
      tf.raw_ops.ResourceSparseApplyAdagradV2(
          var=var.handle, accum=slots[0].handle, lr=0.1, epsilon=0.0, grad=g,
          indices=unique, update_slots=True)
    elif optimizer == "ftrl":
      tf.raw_ops.ResourceSparseApplyFtrlV2(
          var=var.handle, accum=slots[0].handle, linear=slots[1].handle, grad=g,
          indices=unique, lr=0.1, l1=0.0, l2=0.0, l2_shrinkage=0.0, lr_power=-0.5)
    else:  # No fused sparse Adam kernel in TensorFlow: the bare touched-row math.
      m, v = (tf.gather(s, unique) for s in slots)
      w = tf.gather(var, unique)
      m = 0.9 * m + 0.1 * g
      v = 0.999 * v + 0.001 * g * g
      var.scatter_update(tf.IndexedSlices(w - 0.001 * m / tf.sqrt(v + 1e-16), unique))
      slots[0].scatter_update(tf.IndexedSlices(m, unique))
      slots[1].scatter_update(tf.IndexedSlices(v, unique))

  @tf.function
  def step(features):
    for name, ids in features.items():
      t, var, slots = tables[name]
      if isinstance(ids, tf.RaggedTensor):
        flat, row = ids.values, ids.value_rowids()
        rows = tf.gather(var, flat)
        total = tf.math.unsorted_segment_sum(rows, row, ids.nrows())
        counts = tf.cast(ids.row_lengths(), tf.float32)[:, None]
        act = total / counts if t.combiner == "mean" else total
        d_act = 2.0 * act / workload.batch
        d_rows = tf.gather(d_act / counts if t.combiner == "mean" else d_act, row)
      else:
        flat = ids
        act = tf.gather(var, flat)
        d_rows = 2.0 * act / workload.batch
      unique, index = tf.unique(flat)
      g = tf.math.unsorted_segment_sum(d_rows, index, tf.size(unique))
      update(var, slots, unique, g)
  return step, {name: var for name, (_, var, _) in tables.items()}


CONTENDERS = {
    "cpu_embedding": cpu_embedding,
    "cpu_embedding_unchecked": lambda w, o: cpu_embedding(w, o, validate=False),
    "keras_embedding": keras_embedding,
    "serving_keras": serving_keras,
    "keras_rs": keras_rs,
    "sparse_floor": sparse_floor,
}
