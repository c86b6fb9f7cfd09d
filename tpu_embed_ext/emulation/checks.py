"""The engine's checks of input values, one row each.

A row says what an item is (a feature, a table, a table's variable), what
it reads, the predicate its values must pass (element by element, True
where an element is fine) and its one message. ``check_runner.run`` turns a
row into the eager error, the graph-mode assertion and the XLA verdict, so
a message exists once, here, the same in all three modes.

A message names the feature or table, the field, the value and the fix.
Its fields are static (``{where}``, ``{vocab}``, ``{table}``,
``{variable}``: known when the step is traced) or dynamic (``{value}``,
``{dim}``, ``{bound}``: read from the failing element; ``shows`` computes
them, in the order listed by ``dynamic``).

Predicates are element-wise, with per-item bounds, so a row applies as well
to one replica's values as to every replica's values of the item
concatenated: the first failing element of the concatenation is reported.

Checks of structures, shapes and kinds, known when a step is traced,
raise at once in every mode and live in ``structure_checks``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Tuple

import tensorflow as tf

from tpu_embed_ext.spec.numeric_traps import MAX_LEARNING_RATE

__all__ = ["Check", "element", "CHECKS", "SPARSE_INDICES", "WEIGHTS_FINITE",
           "UNSIGNED_IDS", "WEIGHTS_LAYOUT", "IDS_IN_RANGE", "GRADIENT_FINITE",
           "UPDATE_FINITE", "RATE_IN_RANGE"]


def element(x: tf.Tensor, pos) -> tf.Tensor:
  """``x``'s element at flat position ``pos``, 0 at ``pos == size`` (where
  the runner points when no element failed, so gathers stay in range)."""
  flat = tf.concat([tf.reshape(x, [-1]), tf.zeros([1], x.dtype)], 0)
  return tf.gather(flat, pos)


def _the_value(values, pos, *bounds):
  del bounds
  return (element(values, pos),)


def _nothing(values, pos, *bounds):
  del values, pos, bounds
  return ()


@dataclasses.dataclass(frozen=True)
class Check:
  """One check of input values (see the module docstring)."""
  kind: int      # its code in the XLA failure record; CHECKS[kind - 1] is it
  over: str      # what one item is: "feature", "table" or "table variable"
  reads: str     # what the check reads, for readers of this table
  ok: Callable[..., tf.Tensor]  # (values, *bounds) -> bool, per element
  message: str   # str.format template; its fields are static or dynamic
  dynamic: Tuple[str, ...] = ("value",)  # fields read from the failing element
  shows: Callable[..., tuple] = _the_value  # (values, pos, *bounds) -> dynamic
  # How dynamic values travel in the int64 XLA failure record.
  encoding: str = "int64"  # "int64", "uint64" or "float32"


def _sparse_shows(indices, pos, shape):
  """The failing index, its dimension and that dimension's size (``shape``
  is one dense_shape, or one per index row: several replicas' indices
  concatenated, ``input_checks.joined``)."""
  rank = tf.maximum(tf.shape(indices, out_type=tf.int64)[-1], 1)
  dim = pos % rank
  bound = element(shape, pos) if shape.shape.rank == 2 else element(shape, dim)
  return element(indices, pos), dim, bound


# A message's fixed text, once: the out-of-range-id wording serves int64
# and uint64 ids, the eager error, the assertion and XLA's record, and the
# native update kernel (which fills in {value}).
_IDS_MESSAGE = ("{where}: id {value} is out of range [0, {vocab}). Fix: map ids "
                "into the vocabulary (e.g. hash them modulo {vocab}) or enlarge "
                "vocabulary_size.")

SPARSE_INDICES = Check(
    kind=1, over="feature",
    reads="a SparseTensor's indices [n, rank], bounded by its dense_shape "
          "(one outside names another output row; XLA clamps it silently)",
    ok=lambda indices, shape: tf.logical_and(
        indices >= 0, indices < (shape if shape.shape.rank == 2 else shape[None, :])),
    message="{where}: SparseTensor index {value} is outside the dense_shape of "
            "the ids ({value} is not in [0, {bound}) in dimension {dim}); its "
            "id would be looked up into, and trained by, another output row. "
            "Fix: build the SparseTensor with every index in [0, dense_shape) "
            "in its dimension (dense_shape[0] is the batch size), e.g. with "
            "tf.sparse.from_dense or RaggedTensor.to_sparse().",
    dynamic=("value", "dim", "bound"), shows=_sparse_shows)

WEIGHTS_FINITE = Check(
    kind=2, over="feature",
    reads="a feature's weights (as float32), before they reach a gradient",
    ok=tf.math.is_finite,
    message="{where}: weights have NaN or Inf values; no table, slot or step "
            "was changed. Fix: give finite weights (check how they are "
            "computed, or replace them with tf.where(tf.math.is_finite(w), w, "
            "0.0)).",
    dynamic=(), shows=_nothing)

UNSIGNED_IDS = Check(
    kind=3, over="feature",
    reads="uint64 ids before they become int64 (one of 2^63 or more would "
          "read as a negative id)",
    ok=lambda ids, vocab: ids < tf.cast(vocab, ids.dtype),
    message=_IDS_MESSAGE, encoding="uint64")

WEIGHTS_LAYOUT = Check(
    kind=4, over="feature",
    reads="whether ragged or sparse weights are laid out as their ids "
          "(structure_checks.weights_layout_ok: row splits or indices equal)",
    ok=tf.identity,
    message="{where}: weights do not match the ids (other row lengths, other "
            "indices, or another number of weights). Fix: give one weight per "
            "id, in the same rows (ragged) or at the same indices (sparse).",
    dynamic=(), shows=_nothing)

IDS_IN_RANGE = Check(
    kind=5, over="feature",
    reads="a feature's ids (int64), bounded by its table's vocabulary_size",
    ok=lambda ids, vocab: tf.logical_and(ids >= 0, ids < vocab),
    message=_IDS_MESSAGE)

GRADIENT_FINITE = Check(
    kind=6, over="table",
    reads="what a table applies: its per-id gradient sums (an overflowing sum "
          "is caught too)",
    ok=tf.math.is_finite,
    message="table '{table}': gradient has NaN or Inf values; no table, slot or "
            "step was changed. Fix: check the loss for overflow, or clip the "
            "activations' gradients.",
    dynamic=(), shows=_nothing)

UPDATE_FINITE = Check(
    kind=7, over="table variable",
    reads="the rows a table's update would write into its parameters and "
          "each slot",
    ok=tf.math.is_finite,
    message="table '{table}': the update would write NaN or Inf into its "
            "{variable}; no table, slot or step was changed. Fix: lower the "
            "learning rate, or clip gradients (clipvalue) or weights "
            "(clip_weight_min / clip_weight_max).",
    dynamic=(), shows=_nothing)

# A callable's rate is held at every step to the bounds a config's rate is
# held to when the spec is made (spec/optimizers.py: >= 0; spec/numeric_traps.py).
RATE_IN_RANGE = Check(
    kind=8, over="table",
    reads="this step's rate of a table whose learning rate is a user's "
          "callable (constants and schedules are checked when the spec is made)",
    ok=lambda rate: tf.logical_and(rate >= 0.0, rate <= MAX_LEARNING_RATE),
    message="table '{table}': its learning-rate callable gave {value:g} this "
            f"step; a rate must be a finite number in [0, {MAX_LEARNING_RATE:g}] "
            "(below 0 the step climbs the loss; above, one step moves a weight "
            "by lr * g and float32 overflows). No table, slot or step was "
            "changed. Fix: make the callable return a rate in "
            f"[0, {MAX_LEARNING_RATE:g}], such as 0.01.",
    encoding="float32")

CHECKS: Tuple[Check, ...] = (SPARSE_INDICES, WEIGHTS_FINITE, UNSIGNED_IDS,
                             WEIGHTS_LAYOUT, IDS_IN_RANGE, GRADIENT_FINITE,
                             UPDATE_FINITE, RATE_IN_RANGE)
assert all(c.kind == i + 1 for i, c in enumerate(CHECKS))
