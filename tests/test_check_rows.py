"""Every row of emulation/checks.py gives one message in every mode.

Each case feeds a row good and bad items; numpy, written here, says which
element fails first and what the message's dynamic fields are. The runner
must raise that message eagerly, assert it in a graph, and record it under
XLA (jit_compile=True) so that raise_if_failed formats it the same. Each
message's fixed text is written once in the package.
"""

import ast
import pathlib
import re
import string
import types

import numpy as np
import pytest
import tensorflow as tf

import tpu_embed_ext as tee
from tpu_embed_ext.emulation import check_runner, checks

ROOT = pathlib.Path(tee.__file__).parent
_BIG = 2 ** 63 + 5

# The engine objects failure_message reads: features a (table s) and b
# (table t); table s trains with SGD (no slot), t with Adagrad.
TABLES = [types.SimpleNamespace(name="s", config=types.SimpleNamespace(vocabulary_size=6),
                                optimizer=types.SimpleNamespace(slot_names=())),
          types.SimpleNamespace(name="t", config=types.SimpleNamespace(vocabulary_size=8),
                                optimizer=types.SimpleNamespace(slot_names=("accumulators",)))]
FEATURES = [types.SimpleNamespace(where="feature 'a' (table 's')", table=0),
            types.SimpleNamespace(where="feature 'b' (table 't')", table=1)]
FEATURE = [{"where": f.where, "vocab": TABLES[f.table].config.vocabulary_size}
           for f in FEATURES]
VARIABLES = [{"table": "s", "variable": "parameters"},
             {"table": "t", "variable": "parameters"},
             {"table": "t", "variable": "accumulators"}]


def _first(bad):
  """numpy: the flat position of the first true element of ``bad``."""
  flat = np.asarray(bad).reshape(-1)
  return int(np.argmax(flat))


def _sparse_reference(indices, shape):
  return (indices < 0) | (indices >= shape[None, :])


def _sparse_fields(values, bounds, pos):
  rank = values.shape[1]
  return {"value": int(values.reshape(-1)[pos]), "dim": pos % rank,
          "bound": int(bounds[0][pos % rank])}


def _no_fields(values, bounds, pos):
  return {}


_NOT_FINITE = lambda values: ~np.isfinite(values)

# row name: (row, [(good items), (bad items)], static names per item, numpy
# predicate (True where an element fails), numpy dynamic fields). An item is
# (values, bounds).
CASES = {
    "sparse_indices": (
        checks.SPARSE_INDICES,
        [[(np.array([[0, 0], [1, 2]], np.int64), (np.array([2, 3], np.int64),))] * 2,
         [(np.array([[0, 0], [1, 2]], np.int64), (np.array([2, 3], np.int64),)),
          (np.array([[0, 0], [0, 4], [-1, 0]], np.int64), (np.array([2, 3], np.int64),))]],
        FEATURE, _sparse_reference, _sparse_fields),
    "weights_finite": (
        checks.WEIGHTS_FINITE,
        [[(np.array([1.0, 2.0], np.float32), ())] * 2,
         [(np.array([1.0, 2.0], np.float32), ()),
          (np.array([1.0, np.inf, np.nan], np.float32), ())]],
        FEATURE, _NOT_FINITE, _no_fields),
    "unsigned_ids": (
        checks.UNSIGNED_IDS,
        [[(np.array([1, 5], np.uint64), (6,)), (np.array([7], np.uint64), (8,))],
         [(np.array([1, 5], np.uint64), (6,)), (np.array([3, _BIG, 9], np.uint64), (8,))]],
        FEATURE, lambda values, vocab: values >= vocab,
        lambda values, bounds, pos: {"value": int(values.reshape(-1)[pos])}),
    "weights_layout": (
        checks.WEIGHTS_LAYOUT,
        [[(np.array(True), ())] * 2, [(np.array(True), ()), (np.array(False), ())]],
        FEATURE, lambda ok: ~ok, _no_fields),
    "ids_in_range": (
        checks.IDS_IN_RANGE,
        [[(np.array([0, 5], np.int64), (6,)), (np.array([7, 0], np.int64), (8,))],
         [(np.array([0, 5], np.int64), (6,)), (np.array([3, 8, -1], np.int64), (8,))]],
        FEATURE, lambda values, vocab: (values < 0) | (values >= vocab),
        lambda values, bounds, pos: {"value": int(values.reshape(-1)[pos])}),
    "ids_in_range_negative": (
        checks.IDS_IN_RANGE,
        [[(np.array([0], np.int64), (6,)), (np.array([1], np.int64), (8,))],
         [(np.array([-3, 9], np.int64), (6,)), (np.array([9], np.int64), (8,))]],
        FEATURE, lambda values, vocab: (values < 0) | (values >= vocab),
        lambda values, bounds, pos: {"value": int(values.reshape(-1)[pos])}),
    "gradient_finite": (
        checks.GRADIENT_FINITE,
        [[(np.ones([2, 2], np.float32), ())] * 2,
         [(np.ones([2, 2], np.float32), ()),
          (np.array([[1.0, 1.0], [np.nan, 1.0]], np.float32), ())]],
        [{"table": "s"}, {"table": "t"}], _NOT_FINITE, _no_fields),
    "update_finite": (
        checks.UPDATE_FINITE,
        [[(np.ones([2], np.float32), ())] * 3,
         [(np.ones([2], np.float32), ())] * 2 + [(np.array([1.0, -np.inf], np.float32), ())]],
        VARIABLES, _NOT_FINITE, _no_fields),
    **{f"rate_{name}": (
        checks.RATE_IN_RANGE,
        [[(np.float32(0.1), ()), (np.float32(1e6), ())],
         [(np.float32(0.0), ()), (np.float32(bad), ())]],
        [{"table": "s"}, {"table": "t"}],
        lambda rate: ~((rate >= 0) & (rate <= 1e6)),
        lambda values, bounds, pos: {"value": float(values)})
       for name, bad in (("negative", -1.0), ("huge", 1e30), ("nan", np.nan))},
}


def _expected(case, bad_items):
  """numpy: the message of the first failing element of the first failing item."""
  check, _, names, reference, fields = CASES[case]
  for i, (values, bounds) in enumerate(bad_items):
    bad = reference(values, *bounds)
    if np.asarray(bad).any():
      return i, check.message.format(**names[i], **fields(values, bounds, _first(bad)))
  raise AssertionError("the case has no failing item")


def _run(case, items):
  check, _, names, _, _ = CASES[case]
  return check_runner.run(check, [
      check_runner.Item(tf.constant(values), tuple(tf.constant(b) if isinstance(b, np.ndarray)
                                                   else b for b in bounds), names[i], i)
      for i, (values, bounds) in enumerate(items)])


def _graph_text(error) -> str:
  """The assertion's message as the user reads it (Assert escapes quotes)."""
  found = re.search(r"assertion failed: \[(.*?)\]\n\t \[\[\{\{", str(error), re.S)
  assert found, str(error)
  return found.group(1).replace("\\'", "'")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_row_gives_its_message_eagerly_in_a_graph_and_under_xla(case):
  check, (good, bad), _, _, _ = CASES[case]
  item, message = _expected(case, bad)

  # Eagerly: good items pass, bad ones raise the message.
  assert _run(case, good) is None
  with pytest.raises(tee.InputError) as info:
    _run(case, bad)
  assert str(info.value) == message

  # In a graph: the assertion stops the step with the same text.
  def asserted(items):
    with tf.control_dependencies([_run(case, items).assertion]):
      return tf.constant(0)

  tf.function(lambda: asserted(good))()
  with pytest.raises(tf.errors.InvalidArgumentError) as info:
    tf.function(lambda: asserted(bad))()
  assert _graph_text(info.value) == message

  # Under XLA: no assertion; the record gives the same message.
  def verdict(items):
    v = _run(case, items)
    assert v.assertion is None
    return v.ok, v.failure, v.per_item_ok

  ok, _, per_item = tf.function(lambda: verdict(good), jit_compile=True)()
  assert bool(ok) and per_item.numpy().all()
  ok, failure, per_item = tf.function(lambda: verdict(bad), jit_compile=True)()
  assert not bool(ok)
  assert list(failure.numpy()[:2]) == [check.kind, item]
  assert not per_item.numpy()[item]
  assert check_runner.failure_message(failure.numpy(), FEATURES, TABLES) == message


def test_a_row_applies_to_every_replicas_values_concatenated():
  """The issue 34 follow-up checks all replicas' ids at once: the first bad
  id of the concatenation is the one reported, as numpy finds it."""
  replicas = [np.array([1, 2, 5], np.int64), np.array([4, 11, 7], np.int64)]
  both = np.concatenate(replicas)
  first = both[_first((both < 0) | (both >= 6))]
  want = checks.IDS_IN_RANGE.message.format(**FEATURE[0], value=first)
  items = [check_runner.Item(tf.constant(both), (6,), FEATURE[0])]
  with pytest.raises(tee.InputError) as info:
    check_runner.run(checks.IDS_IN_RANGE, items)
  assert str(info.value) == want
  failure = tf.function(lambda: check_runner.run(checks.IDS_IN_RANGE, items).failure,
                        jit_compile=True)()
  assert check_runner.failure_message(failure.numpy(), FEATURES, TABLES) == want


def _package_strings():
  """Every string constant of the package's Python source (implicitly
  concatenated literals are one constant; an f-string's literal parts are
  constants)."""
  for path in ROOT.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield path, node.value


def _fixed_text(message: str) -> str:
  """The longest run of a message's literal text with no field, digit or
  bracket (where a value is formatted in, in the message or its source)."""
  literal = "|".join(text for text, _, _, _ in string.Formatter().parse(message))
  return max(re.split(r"[|0-9\[\]+]", literal), key=len)


@pytest.mark.parametrize("check", checks.CHECKS, ids=lambda c: str(c.kind))
def test_each_message_is_written_once_in_the_package(check):
  fixed = _fixed_text(check.message)
  assert len(fixed) >= 25, fixed
  found = [str(p.relative_to(ROOT)) for p, s in _package_strings() if fixed in s]
  assert found == ["emulation/checks.py"], (fixed, found)
  # The out-of-range-id wording serves int64 and uint64 ids: one constant.
  sharing = [c.kind for c in checks.CHECKS if c.message == check.message]
  assert len(sharing) == (2 if check.message == checks.IDS_IN_RANGE.message else 1)
