"""EmbeddingSpec: parsing, precedence, round trips, no mutation, pinned errors."""

import copy
import json
import os

import pytest
import tensorflow as tf
import yaml

import tpu_embed_ext as tee
from tpu_embed_ext.spec import optimizers

BASE = {
    "optimizer": {"type": "adagrad", "learning_rate": 0.05},
    "schedules": {"warm": {"class": "ExponentialDecay", "initial_learning_rate": 0.1,
                           "decay_steps": 10, "decay_rate": 0.5}},
    "tables": {
        "user_id": {"vocabulary_size": 1000, "dim": 8},
        "item_id": {"vocabulary_size": 500, "dim": 8,
                    "optimizer": {"learning_rate": "warm"}},
        "cat_1": {"vocabulary_size": 10, "dim": 4, "combiner": "sqrtn"},
        "cat_2": {"vocabulary_size": 20, "dim": 4,
                  "optimizer": {"type": "ftrl", "l1_regularization_strength": 0.1}},
    },
    "overrides": [
        {"match": "cat_*", "optimizer": {"type": "sgd", "learning_rate": 0.2,
                                         "clip_weight_min": -1.0}},
        {"match": "cat_1", "optimizer": {"clip_weight_max": 1.0}},
    ],
    "features": {
        "user": {"table": "user_id"},
        "item": {"table": "item_id"},
        "history": {"table": "item_id", "max_sequence_length": 5},
        "c1": {"table": "cat_1"},
        "c2": {"table": "cat_2"},
    },
}


def test_precedence_global_then_overrides_in_order_then_table():
  spec = tee.EmbeddingSpec.from_dict(BASE)
  assert spec.optimizer_for("user_id") == optimizers.Adagrad(learning_rate=0.05)
  # Override 0 replaces the type (nothing inherited), override 1 merges into it.
  assert spec.optimizer_for("cat_1") == optimizers.SGD(
      learning_rate=0.2, clip_weight_min=-1.0, clip_weight_max=1.0)
  # The table's own FTRL replaces the SGD of the override: no clip inherited.
  assert spec.optimizer_for("cat_2") == optimizers.FTRL(l1_regularization_strength=0.1)
  item = spec.optimizer_for("item_id")
  assert isinstance(item, optimizers.Adagrad)
  assert item.learning_rate == spec.schedules["warm"]


def test_round_trip_dict_yaml_json(tmp_path):
  spec = tee.EmbeddingSpec.from_dict(BASE)
  assert tee.EmbeddingSpec.from_dict(spec.to_dict()) == spec
  (tmp_path / "s.yaml").write_text(spec.to_yaml())
  (tmp_path / "s.json").write_text(json.dumps(spec.to_dict()))
  assert tee.EmbeddingSpec.from_file(tmp_path / "s.yaml") == spec
  assert tee.EmbeddingSpec.from_file(tmp_path / "s.json") == spec
  # Named schedules come back as their names.
  assert spec.to_dict()["tables"]["item_id"]["optimizer"]["learning_rate"] == "warm"


def test_spec_is_frozen_and_input_is_not_kept():
  config = copy.deepcopy(BASE)
  spec = tee.EmbeddingSpec.from_dict(config)
  config["tables"]["user_id"]["dim"] = 99
  config["optimizer"]["learning_rate"] = 9.0
  assert spec.table("user_id").dim == 8
  assert spec.optimizer_for("user_id").learning_rate == 0.05
  with pytest.raises(AttributeError):
    spec.tables = ()


def test_feature_config_is_fresh_and_never_mutates_the_spec():
  spec = tee.EmbeddingSpec.from_dict(BASE)
  before = spec.to_dict()
  step = tf.Variable(0, dtype=tf.int64)
  first, second = spec.feature_config(step=step), spec.feature_config(step=step)
  assert set(first) == {"user", "item", "history", "c1", "c2"}
  assert first["item"].table is first["history"].table  # Shared table.
  assert first["user"].table is not second["user"].table
  assert first["user"].table.optimizer is not second["user"].table.optimizer
  serving = tf.tpu.experimental.embedding.TPUEmbeddingForServing(
      first, tf.tpu.experimental.embedding.SGD(0.5))
  serving.build()
  assert spec.to_dict() == before
  table = first["c2"].table
  assert (table.name, table.vocabulary_size, table.dim) == ("cat_2", 20, 4)
  assert isinstance(table.optimizer, tf.tpu.experimental.embedding.FTRL)
  assert first["history"].max_sequence_length == 5


def test_schedules_need_a_step():
  spec = tee.EmbeddingSpec.from_dict(BASE)
  with pytest.raises(tee.ConfigError, match="needs a step variable. Fix: pass step="):
    spec.feature_config()


def _with(path, value):
  config = copy.deepcopy(BASE)
  node = config
  for key in path[:-1]:
    node = node[key]
  if value is _DELETE:
    del node[path[-1]]
  else:
    node[path[-1]] = value
  return config


_DELETE = object()

# (name, path to change, new value, exception, exact message)
BAD = [
    ("top_level_typo", ("tabels",), {}, tee.ConfigError,
     'tabels: unknown top-level key "tabels". Did you mean "tables"? Valid: "features", "optimizer", "overrides", "schedules", "tables", "train".'),
    ("no_global_type", ("optimizer", "type"), _DELETE, tee.ConfigError,
     "optimizer.type: the global optimizer needs a `type`. Fix: add `type:` with one of \"adagrad\", \"adagrad_momentum\", \"adam\", \"ftrl\", \"sgd\"."),
    ("optimizer_type_typo", ("optimizer", "type"), "adagrd", tee.ConfigError,
     'optimizer.type: unknown optimizer type "adagrd". Did you mean "adagrad"? Valid: "adagrad", "adagrad_momentum", "adam", "ftrl", "sgd".'),
    ("optimizer_field_typo", ("optimizer", "learning_rat"), 0.1, tee.ConfigError,
     'optimizer.learning_rat: unknown field "learning_rat" for optimizer type "adagrad". Did you mean "learning_rate"?'),
    ("negative_lr", ("optimizer", "learning_rate"), -1.0, tee.ConfigError,
     "optimizer.learning_rate: learning_rate must be a finite number >= 0, got learning_rate=-1.0. Fix: use a positive rate such as 0.01, or a schedule."),
    ("string_lr", ("optimizer", "learning_rate"), "fast", tee.ConfigError,
     'optimizer.learning_rate: unknown schedule "fast". Valid: "warm".'),
    ("schedule_name_typo", ("tables", "item_id", "optimizer", "learning_rate"), "wrm",
     tee.ConfigError,
     'tables.item_id.optimizer.learning_rate: unknown schedule "wrm". Did you mean "warm"? Valid: "warm".'),
    ("schedule_class_typo", ("schedules", "warm", "class"), "ExponentialDecy",
     tee.ConfigError,
     'schedules.warm.class: unknown schedule class "ExponentialDecy". Did you mean "ExponentialDecay"?'),
    ("schedule_missing_arg", ("schedules", "warm", "decay_rate"), _DELETE,
     tee.ConfigError, "schedules.warm.decay_rate: ExponentialDecay needs decay_rate. Fix: add decay_rate: ...."),
    ("schedule_arg_typo", ("schedules", "warm", "decay_step"), 3, tee.ConfigError,
     'schedules.warm.decay_step: unknown argument "decay_step" for ExponentialDecay. Did you mean "decay_steps"?'),
    ("table_field_typo", ("tables", "user_id", "dimension"), 8, tee.ConfigError,
     'tables.user_id.dimension: unknown table field "dimension". Did you mean "dim"?'),
    ("zero_vocab", ("tables", "user_id", "vocabulary_size"), 0, tee.ConfigError,
     "tables.user_id.vocabulary_size: vocabulary_size must be a positive integer, got 0. Fix: use 1 or more."),
    ("string_vocab", ("tables", "user_id", "vocabulary_size"), "1000",
     tee.ConfigTypeError,
     "tables.user_id.vocabulary_size: vocabulary_size must be a positive integer, got str '1000'. Fix: write a whole number such as 1000."),
    ("float_dim", ("tables", "user_id", "dim"), 8.5, tee.ConfigTypeError,
     "tables.user_id.dim: dim must be a positive integer, got float 8.5."),
    ("missing_dim", ("tables", "user_id", "dim"), _DELETE, tee.ConfigError,
     "tables.user_id.dim: table 'user_id' has no dim. Fix: add `dim:` (a positive integer)."),
    ("bad_combiner", ("tables", "cat_1", "combiner"), "avg", tee.ConfigError,
     'tables.cat_1.combiner: unknown combiner "avg". Valid: "mean", "sqrtn", "sum".'),
    ("table_is_list", ("tables", "user_id"), [1000, 8], tee.ConfigTypeError,
     "tables.user_id: a table must be a mapping, got list [1000, 8]."),
    ("unknown_table_in_feature", ("features", "user", "table"), "user_ids",
     tee.ConfigError,
     "features.user.table: feature 'user' uses unknown table 'user_ids'. Did you mean \"user_id\"?"),
    ("feature_field_typo", ("features", "user", "max_seq_length"), 3, tee.ConfigError,
     'features.user.max_seq_length: unknown feature field "max_seq_length". Did you mean "max_sequence_length"?'),
    ("negative_sequence", ("features", "history", "max_sequence_length"), -2,
     tee.ConfigError,
     "features.history.max_sequence_length: max_sequence_length must be a positive integer, got -2."),
    ("pattern_matches_nothing", ("overrides", 0, "match"), "kat_*", tee.ConfigError,
     'overrides[0].match: pattern "kat_*" matches no table.'),
    ("override_without_optimizer", ("overrides", 1, "optimizer"), _DELETE,
     tee.ConfigError, "overrides[1].optimizer: override has no `optimizer`. Fix: add it."),
    ("overrides_not_a_list", ("overrides",), {"match": "cat_*"}, tee.ConfigTypeError,
     "overrides: overrides must be a list of {match, optimizer}, got dict."),
    ("bad_value_in_override", ("overrides", 0, "optimizer", "clip_weight_min"), 5.0,
     tee.ConfigError,
     "overrides[0].optimizer.clip_weight_min: clip_weight_min must not exceed clip_weight_max, got clip_weight_min=5.0 > clip_weight_max=1.0."),
    ("bad_value_in_table_optimizer", ("tables", "cat_2", "optimizer", "learning_rate_power"),
     0.5, tee.ConfigError,
     "tables.cat_2.optimizer.learning_rate_power: learning_rate_power must be <= 0, got learning_rate_power=0.5. Fix: use -0.5 (Adagrad-like), or 0 for a fixed rate."),
    ("adam_beta_2", ("optimizer",), {"type": "adam", "beta_2": 1.0}, tee.ConfigError,
     "optimizer.beta_2: beta_2 must be in [0, 1), got beta_2=1.0. Fix: use a value such as 0.999."),
    ("non_lazy_adam_without_accumulation", ("optimizer",),
     {"type": "adam", "lazy_adam": False, "use_gradient_accumulation": False},
     tee.ConfigError,
     "optimizer.lazy_adam: lazy_adam=False (update every row) needs gradient accumulation, got use_gradient_accumulation=False. Fix: set use_gradient_accumulation=True, or lazy_adam=True."),
    ("bool_as_number", ("optimizer", "initial_accumulator_value"), True,
     tee.ConfigTypeError,
     "optimizer.initial_accumulator_value: initial_accumulator_value must be a finite number, got bool True."),
    ("unused_table", ("features", "c2"), _DELETE, tee.ConfigError,
     "tables.cat_2: table 'cat_2' is used by no feature"),
    ("no_features", ("features",), {}, tee.ConfigError,
     "features: no features. Fix: add at least one feature under `features:`."),
    ("bad_quantization", ("tables", "user_id", "quantization"),
     {"num_buckets": 1, "lower": 0.0, "upper": 1.0}, tee.ConfigError,
     "tables.user_id.quantization.num_buckets: num_buckets must be an integer >= 2, got 1."),
    ("bad_initializer", ("tables", "user_id", "initializer"), {"type": "gaussian"},
     tee.ConfigError,
     'tables.user_id.initializer.type: unknown initializer type "gaussian".'),
    ("cosine_warmup_target_negative", ("schedules", "warm"),
     {"class": "CosineDecay", "initial_learning_rate": 0.0, "warmup_target": -0.1,
      "warmup_steps": 10, "decay_steps": 50}, tee.ConfigError,
     "schedules.warm: CosineDecay gives the learning rate -0.01 at step 1; a learning rate must be a finite number >= 0 at every step."),
    ("piecewise_value_negative", ("schedules", "warm"),
     {"class": "PiecewiseConstantDecay", "boundaries": [50, 100],
      "values": [0.1, -0.05, 0.01]}, tee.ConfigError,
     "schedules.warm: PiecewiseConstantDecay gives the learning rate -0.05 at step 51;"),
    ("piecewise_boundaries_unsorted", ("schedules", "warm"),
     {"class": "PiecewiseConstantDecay", "boundaries": [100, 50],
      "values": [0.1, 0.05, 0.01]}, tee.ConfigError,
     "schedules.warm.boundaries: PiecewiseConstantDecay boundaries must increase, got boundaries=[100, 50] (boundaries[1]=50 is not after 100). Fix: sort them, and their values with them."),
    ("polynomial_end_negative", ("schedules", "warm"),
     {"class": "PolynomialDecay", "initial_learning_rate": 0.1, "decay_steps": 100,
      "end_learning_rate": -0.01}, tee.ConfigError,
     "schedules.warm: PolynomialDecay gives the learning rate -0.0089 at step 99;"),
    ("exponential_decay_rate_negative", ("schedules", "warm"),
     {"class": "ExponentialDecay", "initial_learning_rate": 0.1, "decay_steps": 10,
      "decay_rate": -0.5, "staircase": True}, tee.ConfigError,
     "schedules.warm: ExponentialDecay gives the learning rate -0.05 at step 10;"),
]


@pytest.mark.parametrize("path,value,error,message",
                         [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_error_is_pinned(path, value, error, message):
  with pytest.raises(error) as info:
    tee.EmbeddingSpec.from_dict(_with(path, value))
  assert str(info.value).startswith(message), str(info.value)


def test_file_errors_name_the_file_and_line(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text("tables:\n  a: {vocabulary_size: 3, dim: 2}\n  a: {vocabulary_size: 4, dim: 2}\n")
  with pytest.raises(tee.ConfigError, match=r"bad.yaml: a: duplicate key \"a\" at line 3"):
    tee.EmbeddingSpec.from_file(bad)
  bad.write_text("tables: {a: [1,\n")
  with pytest.raises(tee.ConfigError, match=r"bad.yaml: invalid YAML at line 2"):
    tee.EmbeddingSpec.from_file(bad)
  wrong = copy.deepcopy(BASE)
  wrong["tables"]["user_id"]["dim"] = 0
  bad.write_text(yaml.safe_dump(wrong))
  with pytest.raises(tee.ConfigError) as info:
    tee.EmbeddingSpec.from_file(bad)
  assert str(info.value).startswith(f"{bad}: tables.user_id.dim: dim must be")
  with pytest.raises(tee.ConfigError, match="config file not found"):
    tee.EmbeddingSpec.from_file(tmp_path / "missing.yaml")


def test_yaml_reads_1_2_numbers_and_merge_keys(tmp_path):
  # PyYAML alone reads `1e-3` as a string and rejects `<<: *base`.
  config = tmp_path / "c.yaml"
  config.write_text(
      "optimizer: {type: adagrad, learning_rate: 1e-3, initial_accumulator_value: 1E-1}\n"
      "tables:\n"
      "  a: &wide {vocabulary_size: 100, dim: 8, combiner: sum}\n"
      "  b: {<<: *wide, vocabulary_size: 50}\n"
      "  c:\n"
      "    <<: *wide\n"
      "    optimizer: {type: sgd, learning_rate: 2.5e+2}\n"
      "features: {fa: {table: a}, fb: {table: b}, fc: {table: c}}\n")
  spec = tee.EmbeddingSpec.from_file(config)
  assert spec.optimizer_for("a") == optimizers.Adagrad(
      learning_rate=0.001, initial_accumulator_value=0.1)
  assert spec.optimizer_for("c") == optimizers.SGD(learning_rate=250.0)
  assert [(t.name, t.vocabulary_size, t.dim, t.combiner) for t in spec.tables] == [
      ("a", 100, 8, "sum"), ("b", 50, 8, "sum"), ("c", 100, 8, "sum")]
  # Still YAML 1.2 strings and ints where YAML says so; duplicates still refused.
  config.write_text("tables: {a: {vocabulary_size: 1e3, dim: 8}}\n"
                    "features: {f: {table: a}}\noptimizer: {type: sgd}\n")
  with pytest.raises(tee.ConfigTypeError, match="got float 1000.0"):
    tee.EmbeddingSpec.from_file(config)
  config.write_text("base: &b {dim: 2}\ntables:\n  a: {<<: *b, dim: 3, dim: 4}\n")
  with pytest.raises(tee.ConfigError, match='duplicate key "dim" at line 3'):
    tee.EmbeddingSpec.from_file(config)


def test_directory_as_config_is_a_config_error(tmp_path):
  with pytest.raises(tee.ConfigError) as info:
    tee.EmbeddingSpec.from_file(tmp_path)
  assert str(info.value) == (
      f"{tmp_path}: is a directory, not a config file. Fix: name a .yaml or .json "
      "file, e.g. configs/ranking.yaml.")


@pytest.mark.parametrize("path", ["configs/ranking.yaml", "configs/criteo.yaml"])
def test_shipped_configs_load_and_round_trip(path):
  spec = tee.EmbeddingSpec.from_file(path)
  assert tee.EmbeddingSpec.from_dict(spec.to_dict()) == spec
  assert len(spec.tables) == 26


# --- the dict form is written from the dataclass fields ---------------------------

# Every field of every spec class, each at a value that is not its default.
_EVERY_FIELD = {
    "optimizer": {"type": "adam", "learning_rate": "warm", "bias_correction": True},
    "schedules": BASE["schedules"],
    "tables": {"t": {"vocabulary_size": 6, "dim": 2, "combiner": "sum",
                     "initializer": {"type": "constant", "value": 1.0},
                     "quantization": {"num_buckets": 4, "lower": -1.0, "upper": 1.0},
                     "optimizer": {"learning_rate": 0.2}}},
    "overrides": [{"match": "t", "optimizer": {"beta_1": 0.8}}],
    "features": {"f": {"table": "t", "max_sequence_length": 3,
                       "output_shape": [4, 2]}},
    "train": {"steps": 7},
}
# The fields not written under their own name: an entry's name is its key,
# the source file is not part of the spec's value.
_NOT_WRITTEN = {"TableSpec": {"name"}, "FeatureSpec": {"name"},
                "EmbeddingSpec": {"source"}, "Override": set()}


def test_to_dict_writes_every_field_of_every_spec_class():
  import dataclasses
  spec = tee.EmbeddingSpec.from_dict(_EVERY_FIELD, source="s.yaml")
  written = spec.to_dict()
  assert written == _EVERY_FIELD
  assert tee.EmbeddingSpec.from_dict(written) == spec
  forms = {"EmbeddingSpec": (spec, written), "TableSpec": (spec.tables[0],
           written["tables"]["t"]), "FeatureSpec": (spec.features[0],
           written["features"]["f"]), "Override": (spec.overrides[0],
           written["overrides"][0])}
  for name, (value, form) in forms.items():
    fields = {f.name for f in dataclasses.fields(value)}
    assert set(form) == fields - _NOT_WRITTEN[name], name


def test_to_dict_leaves_out_defaults_but_writes_the_combiner():
  spec = tee.EmbeddingSpec.from_dict(
      {"optimizer": {"type": "sgd", "learning_rate": 0.5},
       "tables": {"t": {"vocabulary_size": 6, "dim": 2}},
       "features": {"f": {"table": "t"}}})
  assert spec.to_dict() == {
      "optimizer": {"type": "sgd", "learning_rate": 0.5},
      "tables": {"t": {"vocabulary_size": 6, "dim": 2, "combiner": "mean"}},
      "features": {"f": {"table": "t"}}}


def test_spec_loads_without_tensorflow_or_keras():
  import subprocess
  import sys
  script = (
      "import glob, sys\n"
      "import tpu_embed_ext.spec\n"
      "from tpu_embed_ext.spec import EmbeddingSpec\n"
      "paths = sorted(glob.glob('configs/*.yaml'))\n"
      "assert len(paths) >= 4, paths\n"
      "for path in paths:\n"
      "  spec = EmbeddingSpec.from_file(path)\n"
      "  assert EmbeddingSpec.from_dict(spec.to_dict()) == spec\n"
      "  for table in spec.tables:\n"
      "    spec.optimizer_for(table.name)\n"
      "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root)
  out = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120, check=True)
  assert out.stdout.strip() == "[]", out.stderr[-2000:]


# --- a config dict or path where a spec is taken ---------------------------------

_DICT = {"optimizer": {"type": "sgd", "learning_rate": 0.5},
         "tables": {"t": {"vocabulary_size": 6, "dim": 2,
                          "initializer": {"type": "constant", "value": 1.0}}},
         "features": {"f": {"table": "t"}}}


@pytest.mark.parametrize("form", ["dict", "path", "pathlib"])
def test_a_config_dict_or_path_is_taken_where_a_spec_is(tmp_path, form):
  """Before: AttributeError from CPUEmbedding, EmbeddingLayer and plan. A
  config is unambiguous (plain data with tables/features), so it is built."""
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump(_DICT))
  given = {"dict": _DICT, "path": str(path), "pathlib": path}[form]
  emb = tee.CPUEmbedding(given)
  emb.enqueue({"f": tf.constant([1, 3])}, training=True)
  emb.apply_gradients(tf.nest.map_structure(tf.ones_like, emb.dequeue()))
  want = [[1.0, 1.0]] * 6
  want[1] = want[3] = [0.5, 0.5]  # SGD(0.5), gradient 1, from the config
  assert emb.variables["t"]["parameters"].numpy().tolist() == want
  layer = tee.EmbeddingLayer(given)
  assert layer.embedding.variables["t"]["parameters"].shape == (6, 2)
  assert [r.name for r in tee.plan(given).tables] == ["t"]


@pytest.mark.parametrize("call,message", [
    (lambda: tee.plan(42), "plan() takes an EmbeddingSpec, a config dict or a config "
     "file path, got int. Fix: pass EmbeddingSpec.from_file(path), or the path itself."),
    (lambda: tee.CPUEmbedding({"f": "t"}), "feature_config entry 'f' is a str, not a "
     "FeatureConfig. Fix: pass a nested structure of "
     "tf.tpu.experimental.embedding.FeatureConfig, or an EmbeddingSpec, a config "
     "dict or a config file path."),
    (lambda: tee.CPUEmbedding("no/such.yaml"), "no/such.yaml: config file not found."),
    (lambda: tee.EmbeddingLayer({**_DICT, "tables": []}),
     "tables: the tables must be a mapping, got list []."),
], ids=["plan_of_an_int", "feature_config_of_strings", "missing_file", "bad_dict"])
def test_what_is_not_a_spec_is_one_line(call, message):
  with pytest.raises(tee.ConfigError) as info:
    call()
  assert str(info.value).startswith(message), str(info.value)
