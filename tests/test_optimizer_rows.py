"""One row per optimizer drives both kernel paths and matches the references.

The package's table (``emulation/optimizer_rows.py``) and the tests' table
(``tests/references.py``) must list the same optimizers. For each row, the
step pipeline then runs several steps of two replicas' ids (with duplicates
within and across replicas) on TensorFlow ops and on the native kernel. Both
must match the numpy reference to float32 rounding, and match each other bit
for bit. The C++ enums must agree with the row table's native encoding.
"""

import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf

from tpu_embed_ext.spec import optimizers as opt
from tpu_embed_ext.emulation import (check_runner, native, optimizer_rows,
                                     payloads as payloads_lib, rules,
                                     step_pipeline, updates)
from tests import references

VOCAB, DIM, STEPS, OCCURRENCES = 7, 5, 6, 9
WHERE = "feature 'f' (table 't')"

# Each row's optimizer with hyperparameters away from the defaults, so that
# every parameter the row encodes changes the result.
CASES = {
    "sgd": opt.SGD(learning_rate=0.1),
    "adagrad": opt.Adagrad(learning_rate=0.1, initial_accumulator_value=0.2),
    "adagrad_momentum": opt.AdagradMomentum(
        learning_rate=0.05, momentum=0.9, use_nesterov=True, exponent=3.0,
        beta2=0.9, epsilon=0.1),
    "adam": opt.Adam(learning_rate=0.05, beta_1=0.8, beta_2=0.95, epsilon=1e-3,
                     sum_inside_sqrt=False),
    "ftrl": opt.FTRL(learning_rate=0.2, learning_rate_power=-0.3,
                     l1_regularization_strength=0.01,
                     l2_regularization_strength=0.02, beta=0.1,
                     initial_accumulator_value=0.3),
}


def test_the_package_and_the_tests_list_the_same_optimizers():
  package = {row.spec.type_name for row in optimizer_rows.ROWS.values()}
  assert package == set(opt.TYPES)
  assert package == set(references.REFERENCES)
  assert package == set(CASES)
  for name, spec in CASES.items():
    assert optimizer_rows.row(spec).slot_names == tuple(references.REFERENCES[name].slots)


def test_each_optimizer_holds_its_facts():
  """Every optimizer class holds its facts (spec/optimizers.py): TensorFlow's
  class, plan settings that are its fields, and its own numeric traps, which
  are checks the plan lists and which its check_own_traps runs."""
  from tensorflow.python.tpu import tpu_embedding_v2_utils as tf_utils
  from tpu_embed_ext.spec import numeric_traps
  from tpu_embed_ext.tf import optimizers as tf_optimizers
  own_traps = {c for c in numeric_traps.CHECKS if c not in numeric_traps.COMMON}
  used = set()
  for name, cls in opt.TYPES.items():
    assert cls.tf_class, name
    tf_class = getattr(tf_utils, cls.tf_class)
    assert tf_optimizers._tf_classes()[cls] is tf_class  # pylint: disable=protected-access
    assert type(tf_optimizers.to_tf(CASES[name])) is tf_class
    fields = set(opt.field_names(cls))
    assert cls.plan_settings or cls is opt.SGD, name
    assert set(cls.plan_settings) <= fields, name
    assert set(cls.numeric_traps) <= own_traps, name
    assert (cls.check_own_traps is not opt.OptimizerSpec.check_own_traps) == bool(
        cls.numeric_traps), name
    assert list(numeric_traps.checks_for(CASES[name])) == [
        c for c in numeric_traps.CHECKS
        if c in numeric_traps.COMMON or c in cls.numeric_traps]
    used |= set(cls.numeric_traps)
  assert used == own_traps  # every own trap belongs to some optimizer


def _batches():
  """Per step, two replicas' (ids, gradients); ids repeat within and across."""
  rng = np.random.RandomState(11)
  return [[(rng.randint(0, 4 if r == 0 else VOCAB, OCCURRENCES).astype(np.int64),
            rng.normal(0, 1, (OCCURRENCES, DIM)).astype(np.float32))
           for r in range(2)] for _ in range(STEPS)]


def _initial():
  return np.random.RandomState(3).uniform(-1, 1, (VOCAB, DIM)).astype(np.float32)


def _payload(ids, grads, kernel):
  status = check_runner.status(None)
  if kernel == "native":
    empty_rows, empty_gains = tf.zeros([0], tf.int64), tf.zeros([0], tf.float32)
    return payloads_lib.NativePayload(status, [(tf.constant(ids), empty_rows,
                                            empty_gains, tf.constant(grads))])
  return payloads_lib.OpsPayload(status, [tf.constant(ids)], [tf.constant(grads)])


def _train(spec, kernel, mode):
  """The tables after STEPS steps of the pipeline on ``kernel``."""
  variables = [tf.Variable(_initial())] + [
      tf.Variable(np.full((VOCAB, DIM), v, np.float32))
      for v in spec.slot_initial_values()]
  table = step_pipeline.Table("t", spec, variables, VOCAB)
  backend = (native.update.kernel([0], [WHERE]) if kernel == "native"
             else updates.compute)
  step = tf.Variable(0, dtype=tf.int64)
  failure = tf.Variable([0, 0, 0], dtype=tf.int64)

  def run(payloads):
    step_pipeline.apply_step(payloads, [table], backend, rules=rules.V1,
                             validate=True, step=step, failure=failure)

  run = tf.function(run) if mode == "tf_function" else run
  for replicas in _batches():
    run([_payload(ids, grads, kernel) for ids, grads in replicas])
  assert int(step.numpy()) == STEPS
  return [v.numpy() for v in variables]


def _reference(name, spec):
  table = _initial().astype(np.float64)
  hparams = references.hparams_of(name, spec)
  slots = references.initial_slots(name, table.shape, **hparams)
  for replicas in _batches():
    ids = np.concatenate([i for i, _ in replicas])
    grads = np.concatenate([g for _, g in replicas])
    references.train_step(name, table, slots, ids, grads, spec.learning_rate,
                          **hparams)
  return [table] + list(slots.values())


@pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")
@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_row_drives_both_kernels_to_the_reference(name, mode):
  spec = CASES[name]
  want = _reference(name, spec)
  on_tf_ops, on_native = _train(spec, "tf", mode), _train(spec, "native", mode)
  labels = ["parameters", *spec.slot_names]
  for label, ours, theirs, expected in zip(labels, on_tf_ops, on_native, want):
    np.testing.assert_array_equal(theirs, ours, err_msg=f"native/{label}")
    np.testing.assert_allclose(ours, expected, rtol=2e-5, atol=2e-6,
                               err_msg=f"tf/{label}")
  assert not np.allclose(want[0][:4], _initial()[:4])  # the steps moved rows


def _constant_name(camel):
  """``EveryRow`` -> ``EVERY_ROW``, ``Beta2IsOne`` -> ``BETA2_IS_ONE``."""
  return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", camel).upper()


def _source():
  return (pathlib.Path(native.__file__).parent / "update_op.cc").read_text()


def _cc_enum(name):
  """update_op.cc's ``enum name``: Python constant name -> value."""
  body = re.search(r"enum %s \{(.*?)\};" % name, _source(), re.S).group(1)
  body = re.sub(r"//[^\n]*", "", body)
  values, last = {}, -1
  for entry in filter(None, (e.strip() for e in body.split(","))):
    key, _, value = (p.strip() for p in entry.partition("="))
    last = int(value) if value else last + 1
    values[_constant_name(key[1:])] = last
  return values


def test_the_kernels_enums_agree_with_the_row_table():
  kinds = _cc_enum("Kind")
  assert kinds.pop("NUM_KINDS") == len(optimizer_rows.ROWS)
  assert kinds == {_constant_name(row.spec.__name__): row.native_kind
                   for row in optimizer_rows.ROWS.values()}
  slots = re.search(r"kNumSlots\[kNumKinds\] = \{(.*?)\}", _source()).group(1)
  assert [int(n) for n in slots.split(",")] == [
      len(row.slot_names) for row in sorted(optimizer_rows.ROWS.values(),
                                            key=lambda r: r.native_kind)]
  for enum in ("Mode", "Flag"):
    for key, value in _cc_enum(enum).items():
      assert getattr(optimizer_rows, key) == value, key
  params = _cc_enum("Param")
  assert params["A"] == optimizer_rows.FIRST_ROW_PARAM
  assert params["NUM_PARAMS"] == optimizer_rows.NUM_PARAMS
  for name, spec in CASES.items():
    kind, _, _, encoded = optimizer_rows.native_encoding(spec, rules.V1)
    assert kind == kinds[_constant_name(type(spec).__name__)]
    room = optimizer_rows.NUM_PARAMS - optimizer_rows.FIRST_ROW_PARAM
    assert len(optimizer_rows.row(spec).native_params(spec)) <= room, name
    assert len(encoded) == optimizer_rows.NUM_PARAMS
