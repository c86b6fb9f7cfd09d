"""Writes docs/BAD_INPUTS.md from the pinned cases in the tests.

Run from the repository root: .venv/bin/python docs/make_bad_inputs.py
"""
import sys
sys.path.insert(0, ".")
import tests.test_spec as ts, tests.test_optimizers as to, tests.test_keras_optimizers as tk
rows = []
for name, path, value, err, msg in ts.BAD:
  where = ".".join(str(p) for p in path)
  rows.append((f"config: `{where}` = `{value!r}`" if value is not ts._DELETE else f"config: `{where}` missing",
               err.__name__, msg, f"tests/test_spec.py::test_bad_config_error_is_pinned[{name}]"))
for name, _, msg in to.BAD:
  rows.append((f"optimizer spec: {name.replace('_', ' ')}", "ConfigError", msg,
               f"tests/test_optimizers.py::test_invalid_values_are_pinned[{name}]"))
for p in tk.test_rejected_options_are_pinned.pytestmark:
  if p.name == "parametrize":
    ids = p.kwargs["ids"]
    for i, (opt, msg) in zip(ids, p.args[1]):
      rows.append((f"Keras optimizer: {i.replace('_', ' ')}", "ConfigError", msg,
                   f"tests/test_keras_optimizers.py::test_rejected_options_are_pinned[{i}]"))
extra = [
  ("YAML duplicate key / syntax error / bad value in a file / missing file", "ConfigError",
   'bad.yaml: a: duplicate key "a" at line 3. ...', "tests/test_spec.py::test_file_errors_name_the_file_and_line"),
  ("schedule without a step variable", "ConfigError", "... needs a step variable. Fix: pass step=", "tests/test_spec.py::test_schedules_need_a_step"),
  ("id >= vocabulary", "InputError", "feature 'f' (table 't'): id 9 is out of range [0, 6). Fix: ...", "tests/test_engine.py::test_rejected_step_changes_nothing[too_large]"),
  ("negative id", "InputError", "feature 'f' (table 't'): id -1 is out of range [0, 6).", "tests/test_engine.py::test_rejected_step_changes_nothing[negative]"),
  ("NaN / Inf gradient", "InputError", "table 't': gradient has NaN or Inf values; no table, slot or step was changed.", "tests/test_engine.py::test_rejected_step_changes_nothing[nan_gradient]"),
  ("gradient of the wrong shape", "InputError", "feature 'f' (table 't'): gradient shape [2, 2] does not match its activation shape [1, 2].", "tests/test_engine.py::test_rejected_step_changes_nothing[gradient_shape]"),
  ("out-of-range id inside tf.function", "InvalidArgumentError", "[feature 'f' (table 't'): ids must be in [0, 6). Fix: map ids into the vocabulary or enlarge vocabulary_size.] [Smallest and largest ids:] [1] [6]", "tests/test_engine.py::test_out_of_range_ids_fail_inside_tf_function_before_any_write"),
  ("NaN / Inf gradient (or a per-id sum that overflows) inside tf.function", "InvalidArgumentError", "[gradient has NaN or Inf values; no table, slot or step was changed. Fix: ... Tables:] [table 'b']", "tests/test_engine.py::test_non_finite_gradient_fails_inside_tf_function_naming_the_table"),
  ("unknown / missing feature key", "InputError", "features do not match the feature config's structure: missing [...], unexpected [...]", "tests/test_engine.py::test_bad_features_are_named[unknown_key]"),
  ("float ids", "InputError", "feature 'f' (table 't'): ids must be integers, got dtype float32.", "tests/test_engine.py::test_bad_features_are_named[float_ids]"),
  ("ragged ids of rank 3", "InputError", "feature 'f' (table 't'): ragged ids must have rank 2", "tests/test_engine.py::test_bad_features_are_named[ragged_rank_3]"),
  ("weights for dense ids; weights with other row lengths", "InputError", "weights were given for a dense id tensor / weights have row lengths [1, 1] but ids [2]", "tests/test_engine.py::test_weights_on_dense_ids_and_mismatched_layout"),
  ("dense [1, 3] ids for a sequence feature; gradients of the wrong structure", "InputError", "feature 's' (table 't'): dense ids of shape [1, 3] have a last dimension of 3, but TPUEmbedding needs dense ids of rank >= 2 to end in a dimension of 1", "tests/test_engine.py::test_dense_ids_for_a_sequence_feature_and_gradient_structure"),
  ("empty batch / empty rows", "(valid)", "zero activations; no table or slot changes", "tests/test_engine.py::test_empty_batch_is_a_valid_no_op"),
  ("checkpoint with another shape / other slots", "ConfigError", "table 't': checkpoint ... holds shape [6, 2], this spec has [12, 2].", "tests/test_engine.py::test_checkpoint_of_another_spec_is_refused_naming_the_table"),
  ("weight decay on the SparseCore engine", "ConfigError", "table 't': weight_decay_factor=0.1 is rejected by TPUEmbeddingV2 (SparseCore).", "tests/test_engine.py::test_sparsecore_engine_ignores_clipping_and_rejects_weight_decay"),
  ("dynamic learning-rate tag rules (4 cases)", "ConfigError", "dynamic learning-rate tags must be 0..n-1 with none skipped, got [0, 2].", "tests/test_learning_rates.py::test_tag_rule_violations_are_pinned"),
  ("unknown input layout", "ValueError", "feature 'x': layout must be one of ...", "tests/test_data.py::test_unknown_layout_is_rejected"),
  ("bad config at the command line", "exit 2", "error: <file>: tables.a.vocabulary_size: vocabulary_size must be a positive ...", "tests/test_plan.py::test_plan_command_reports_config_errors"),
]
rows += extra

# TPUEmbedding's input contract (issue 13): each case raises upstream's class
# (InputTypeError is a TypeError, the others ValueErrors), eagerly and in
# tf.function; the tables come from tests/test_parity.py.
import tests.test_parity as tp
for name in sorted(tp.REJECTED_ENQUEUES):
  _, _, _, cls, msg = tp.REJECTED_ENQUEUES[name]
  error = "InputTypeError (TypeError)" if cls is TypeError else "InputError (ValueError)"
  rows.append((f"enqueue: {name.replace('_', ' ')}", error, msg,
               f"tests/test_parity.py::test_rejected_enqueue[{name}-eager/tf_function]"))
for name in sorted(tp.REJECTED_BUILDS):
  rows.append((f"build(per_replica_input_shapes): {name.replace('_', ' ')}",
               "InputError (ValueError)", tp.REJECTED_BUILDS[name][2],
               f"tests/test_parity.py::test_rejected_build[{name}]"))
for name in sorted(tp.GRADIENT_CASES):
  _, cls, msg = tp.GRADIENT_CASES[name]
  error = "InputTypeError (TypeError)" if cls is TypeError else "InputError (ValueError)"
  rows.append((f"apply_gradients: {name.replace('_', ' ')}", error, msg,
               f"tests/test_parity.py::test_rejected_gradients[{name}-eager/tf_function]"))
rows += [
  ("zero-padded multi-hot ids as a dense [B, L] tensor", "InputError (ValueError)", "feature 'history' (table 'video'): dense ids of shape [2, 3] have a last dimension of 3, ... Fix: for zero-padded multi-hot ids pass a RaggedTensor or SparseTensor (tf.RaggedTensor.from_tensor(ids, padding=0) or tf.sparse.from_dense(ids)); ...", "tests/test_parity.py::test_zero_padded_dense_multi_hot_ids_are_rejected_with_the_fix"),
  ("ids that cannot fill the recorded activation shape ([B, 1] after [B, 4, 1])", "InputError (ValueError)", "4 ids cannot fill the activation shape [4, 4] (16 rows).", "tests/test_parity.py::test_dense_values_drop_the_trailing_dimension"),
  ("a batch of another size than the first one", "InputError (ValueError)", "feature '0' (table 'video'): the input gives activations of shape [2], but the feature's output shape is [4]", "tests/test_parity.py::test_batch_shape_must_stay_the_one_the_feature_was_built_with"),
  ("enqueue of a batch dimension unknown when traced", "InputError (ValueError)", "feature '0' (table 'video'): output shape [None] is not fully defined; the TPU compiles every activation shape.", "tests/test_parity.py::test_unknown_batch_dimension_is_rejected_by_enqueue_but_not_by_lookups"),
  ("FeatureConfig.output_shape not fully defined", "InputError (ValueError)", "feature '0' (table 'video'): output shape [None, 4] is not fully defined", "tests/test_parity.py::test_partial_output_shape_in_feature_config_is_rejected_at_build"),
  ("an optimizer that is not a TPU embedding optimizer (v1 parameters, a string, a Keras optimizer)", "ConfigError (ValueError)", "table 'video': AdagradParameters is an unsupported optimizer class. Fix: pass one of tf.tpu.experimental.embedding's SGD, ...", "tests/test_parity.py::test_unsupported_optimizer_class_is_a_value_error"),
  ("a TableConfig of another engine to table_variables()", "InputTypeError (TypeError)", "TableConfig(...) is not a TableConfig of this engine's feature config.", "tests/test_parity.py::test_variables_of_an_unnamed_table_config"),
  ("clipvalue and clip_gradient_min/max together", "ConfigError", "clip_gradient_max: clipvalue=1.0 and clip_gradient_min=None / clip_gradient_max=2.0 both set gradient clipping.", "tests/test_parity.py::test_v1_gradient_clipping_fields"),
  ("clip_gradient_min that is not a number", "ConfigTypeError", "clip_gradient_min: clip_gradient_min must be a number or None, got str 'low'.", "tests/test_parity.py::test_v1_gradient_clipping_fields"),
  ('engine="v2" without a fully defined FeatureConfig.output_shape', "ConfigError (ValueError)", "feature 'f' (table 'video'): TPUEmbeddingV2 (SparseCore) needs a fully defined FeatureConfig.output_shape", "tests/test_parity.py::test_v2_needs_output_shape_at_construction"),
  ('engine="v2": ragged rows that cannot fill output_shape', "InputError (ValueError)", "feature 'f' (table 'video'): 2 rows of ragged ids cannot fill the activation shape [4] (4 rows).", "tests/test_parity.py::test_v2_shapes_come_from_output_shape"),
  ("serving signature whose lookups change the model's output shapes", "ConfigError", "serving output 'outputs' has shape [None, 1, 2], but the model computes [None, 2]", "tests/test_parity.py::test_serving_export_keeps_training_shapes"),
]
esc = lambda t: str(t).replace("|", "\\|").replace("\n", " ")
out = ["# Bad inputs and their errors", "",
       "Every row is pinned by the test it names (the message is asserted). Errors name the",
       "table or feature, the field, the value and the fix; a rejected training step leaves every",
       "table, slot and the step counter unchanged (asserted in the engine tests).", "",
       f"**{len(rows)} bad inputs** are listed here. In addition, "
       "`tests/test_fuzz_configs.py` runs 2 x 400 hypothesis examples per `make test` "
       "(arbitrary nested values, and valid configs with 1-3 values replaced by arbitrary ones): "
       "each loads to a valid spec that round-trips, or raises `ConfigError`; never another "
       "exception. A one-off run of 2 x 3,000 examples also passed (after fixing the three crashes "
       "it found: lists given where a name belongs, a string as a schedule argument).", "",
       "| bad input | error | message (start) | test |", "|---|---|---|---|"]
out += [f"| {esc(a)} | {esc(b)} | {esc(c)} | `{esc(d)}` |" for a, b, c, d in rows]
open("docs/BAD_INPUTS.md", "w").write("\n".join(out) + "\n")
print(len(rows))
