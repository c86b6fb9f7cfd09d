"""Config and spec inputs: each bad one is a clear error, on the CLI one line
with exit status 2 (issue 22's config items), found before anything is built.

Config files are read in bounded time and memory whatever they contain
(nested YAML aliases, recursion, depth, size); names derived from user names
(variables, slot variables, checkpoint keys, SparseCore stacks) never collide.
"""

import re

import pytest
import tensorflow as tf
import yaml

import tpu_embed_ext as tee
from tests import jobs
from tpu_embed_ext.spec import files as config_files, names as derived_names
from tpu_embed_ext.sparsecore import layout as sc_layout
from tpu_embed_ext.sparsecore.topology import Topology, parse_topology

api = tf.tpu.experimental.embedding
TINY = "configs/tiny.yaml"


_cli = jobs.run_cli


def _write(tmp_path, config, name="c.yaml"):
  path = tmp_path / name
  path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
  return str(path)


def _small(**table):
  return {"optimizer": {"type": "adagrad", "learning_rate": 0.1},
          "tables": {"t": {"vocabulary_size": 10, "dim": 4, **table}},
          "features": {"f": {"table": "t"}}}


def _one_line(capsys, message, *args):
  line = jobs.one_line_error(capsys, *args)
  assert message in line, line


CASES = {
    "learning_rate_1e30": (
        lambda c: c["optimizer"].update(learning_rate=1e30), (),
        "optimizer.learning_rate: table 't': learning_rate=1e+30, above 1e+06: one "
        "step moves a weight by lr * g"),
    "learning_rate_400_digit_integer": (
        lambda c: c["optimizer"].update(learning_rate=10 ** 400), (),
        "optimizer.learning_rate: learning_rate 10000000000000000000... is beyond "
        "any float. Fix: write a rate such as 0.01."),
    "negative_warmup_steps": (
        lambda c: c["optimizer"].update(learning_rate={
            "class": "CosineDecay", "initial_learning_rate": 0.0, "decay_steps": 100,
            "warmup_target": 0.1, "warmup_steps": -10}), (),
        "optimizer.learning_rate.warmup_steps: CosineDecay warmup_steps must be in "
        "[0, 1e+12] steps, got warmup_steps=-10. Fix: use 0 for no warm-up"),
    "vocabulary_2_63_proto": (
        lambda c: c["tables"]["t"].update(vocabulary_size=2 ** 63), ("--proto",),
        "tables.t.vocabulary_size: vocabulary_size=9223372036854775808 is larger "
        "than 281,474,976,710,656 (2^48)"),
    "vocabulary_2_63_engine_v2": (
        lambda c: c["tables"]["t"].update(vocabulary_size=2 ** 63),
        ("--engine", "v2"), "vocabulary_size=9223372036854775808 is larger"),
    "rows_past_sparsecore_limit_engine_v2": (
        lambda c: c["tables"]["t"].update(vocabulary_size=2 ** 40),
        ("--engine", "v2"),
        "tables.t.vocabulary_size: table 't' has 1,099,511,627,776 rows, "
        "1,099,511,627,776 once padded for 16 SparseCores: SparseCore row numbers "
        "are signed 32-bit"),
    "topology_too_large": (
        None, ("--engine", "v2", "--topology", "v5p:99999999"),
        "topology 99999999 chips x 4 SparseCores is larger than any TPU (at most "
        "65,536 chips here, 4 SparseCores per chip)"),
    "topology_huge_digits": (
        None, ("--engine", "v2", "--topology", "8" * 5000 + "x4"),
        "cannot read topology"),
    "sparsecores_per_chip_3": (
        None, ("--engine", "v2", "--topology", "8x3"),
        "topology '8x3': a TPU chip has 2 or 4 SparseCores, not 3 (v5p: 4; v6e: 2; "
        "tpu7x: 2). Fix: write 8x4 (v5p), 8x2 (v6e, tpu7x), or v5p:8."),
    "numeric_table_key": (
        "123", (), "tables.123: table name 123 is of type int, not a string: YAML "
        "reads an unquoted `123:` as a number"),
    "table_and_its_slot_name": (
        "x/accumulators", (),
        "tables.x/accumulators: tables 'x' and 'x/accumulators' both give TensorFlow "
        "the variable name 'x/accumulators' (a slot variable of 'x', the table "
        "variable of 'x/accumulators')"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_input_errors_are_one_line(capsys, tmp_path, name):
  edit, flags, message = CASES[name]
  config = _small()
  if name == "numeric_table_key":
    text = yaml.safe_dump(config).replace("  t:", "  123:").replace(
        "table: t", "table: 123")
    path = _write(tmp_path, text)
  elif name == "table_and_its_slot_name":
    config["tables"]["x"] = {"vocabulary_size": 4, "dim": 4}
    config["tables"]["x/accumulators"] = {"vocabulary_size": 4, "dim": 4}
    config["features"].update(a={"table": "x"}, b={"table": "x/accumulators"})
    path = _write(tmp_path, config)
  else:
    if edit:
      edit(config)
    path = _write(tmp_path, config)
  _one_line(capsys, message, "plan", "--config", path, *flags)


# --- bounded reading -------------------------------------------------------------

def _laughs(levels=9):
  lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
  for i in range(1, levels + 1):
    lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
  lines.append(f"optimizer: {{type: adagrad, learning_rate: *a{levels}}}")
  return "\n".join(lines) + "\n"


def test_billion_laughs_is_refused_before_it_is_expanded(capsys, tmp_path):
  text = _laughs()
  assert len(text) < 1600  # 9^10 = 3.5 billion strings once expanded
  path = _write(tmp_path, text)
  with pytest.raises(tee.ConfigError, match=re.escape(
      "the YAML expands to more than 1,000,000 values once its aliases (*name) are "
      "expanded (the node at line 7). Fix: use aliases for repeated settings only, "
      "not nested in each other.")):
    tee.EmbeddingSpec.from_file(path)
  _one_line(capsys, "the YAML expands to more than 1,000,000 values", "plan",
            "--config", path)


def test_aliases_and_merge_keys_of_normal_size_still_work(tmp_path):
  text = _laughs(levels=2).replace(
      "optimizer: {type: adagrad, learning_rate: *a2}",
      "base: &opt {type: adagrad, learning_rate: 0.1}\noptimizer: {<<: *opt}")
  assert config_files._load_yaml(text)["optimizer"] == {
      "type": "adagrad", "learning_rate": 0.1}
  assert len(config_files._load_yaml(text)["a2"]) == 9


def test_recursive_alias_deep_nesting_and_size_are_refused(tmp_path):
  with pytest.raises(tee.ConfigError, match="refers to a node that contains it"):
    config_files._load_yaml("a: &a [1, *a]\n")
  with pytest.raises(tee.ConfigError, match="the YAML nests more than 100 levels"):
    config_files._load_yaml("a: " + "[" * 150 + "]" * 150 + "\n")
  with pytest.raises(tee.ConfigError, match="nested deeper than Python can read|"
                                            "the YAML nests more than"):
    config_files._load_yaml("[" * 100000 + "]" * 100000)
  with pytest.raises(tee.ConfigError, match="nests more than 100 levels|nested deeper"):
    tee.EmbeddingSpec.from_file(_write(tmp_path, "[" * 200 + "]" * 200, "d.json"))
  big = tmp_path / "big.yaml"
  with open(big, "wb") as f:
    f.truncate(config_files.MAX_BYTES + 1)
  with pytest.raises(tee.ConfigError, match=re.escape(
      "the config file is larger than 16 MiB. Fix: name the config file")):
    tee.EmbeddingSpec.from_file(str(big))


def test_json_has_the_yaml_limit_on_values(tmp_path):
  """A JSON file has no aliases, but 16 MiB of `0,` is 8 million values: the
  YAML limit of 1,000,000 applies to it too; a config of normal size is read."""
  boundaries = list(range(1, config_files.MAX_NODES + 2))
  path = tmp_path / "big.json"
  path.write_text('{"schedules": {"s": {"boundaries": %s}}}' % boundaries)
  with pytest.raises(tee.ConfigError, match=re.escape(
      "the config holds more than 1,000,000 values. Fix: name the config file")):
    tee.EmbeddingSpec.from_file(str(path))
  path.write_text('{"a": %s}' % boundaries[:10_000])
  assert len(config_files.load(str(path))["a"]) == 10_000


# --- the train: section's dense optimizer (issue 28) ------------------------------

DENSE_OPTIMIZERS = {
    # Before: KeyError: 'class_name' from Keras.
    "no_class": ({"learning_rate": 0.002}, tee.ConfigError,
                 "train.dense_optimizer: the dense optimizer {'learning_rate': 0.002} "
                 "has no `class`. Fix: write e.g. {class: Adam, learning_rate: 0.001}"),
    # Before: KeyError: 'inner_optimizer'.
    "loss_scale_optimizer": (
        {"class": "LossScaleOptimizer"}, tee.ConfigError,
        "train.dense_optimizer: Keras cannot build the dense optimizer {'class': "
        "'LossScaleOptimizer'}: it needs the argument 'inner_optimizer', which the "
        "job cannot give. Fix: write e.g. {class: Adam, learning_rate: 0.001}"),
    # Before: the string turned AMSGrad on.
    "amsgrad_string": (
        {"class": "Adam", "amsgrad": "false"}, tee.ConfigTypeError,
        "train.dense_optimizer.amsgrad: amsgrad must be true or false, got str "
        "'false'. Fix: write true or false (unquoted)."),
    "nesterov_int_keras_form": (
        {"class_name": "SGD", "config": {"nesterov": 0}}, tee.ConfigTypeError,
        "train.dense_optimizer.nesterov: nesterov must be true or false, got int 0."),
}


@pytest.mark.parametrize("name", sorted(DENSE_OPTIMIZERS))
def test_dense_optimizer_errors_are_one_line(name):
  from tpu_embed_ext.job import config as job_config  # pylint: disable=g-import-not-at-top
  optimizer, error, message = DENSE_OPTIMIZERS[name]
  with pytest.raises(error) as info:
    job_config.TrainConfig.from_dict({"dense_optimizer": optimizer})
  assert str(info.value).startswith(message), str(info.value)
  assert "\n" not in str(info.value)


def test_dense_optimizer_booleans_that_are_bools_are_kept():
  import keras  # pylint: disable=g-import-not-at-top
  from tpu_embed_ext.job import config as job_config  # pylint: disable=g-import-not-at-top
  for amsgrad in (False, True):
    cfg = job_config.TrainConfig.from_dict(
        {"dense_optimizer": {"class": "Adam", "amsgrad": amsgrad}})
    built = keras.optimizers.get(job_config.keras_config(cfg.dense_optimizer))
    assert built.amsgrad is amsgrad


# --- derived names ---------------------------------------------------------------

def test_table_and_slot_names_collide_at_engine_construction_from_tf_configs():
  x = api.TableConfig(4, 2, name="x")
  y = api.TableConfig(4, 2, name="x/accumulators")
  with pytest.raises(tee.ConfigError, match=re.escape(
      "tables 'x' and 'x/accumulators' both give TensorFlow the variable name "
      "'x/accumulators'")):
    tee.CPUEmbedding({"a": api.FeatureConfig(x), "b": api.FeatureConfig(y)},
                     api.Adagrad(0.1))
  # With SGD (no slots) there is no collision, as in TensorFlow.
  tee.CPUEmbedding({"a": api.FeatureConfig(x), "b": api.FeatureConfig(y)},
                   api.SGD(0.1)).build()
  derived_names.check_table_names({"x": ("momenta",), "x/accumulators": ()})


def test_two_sparsecore_stacks_with_one_name_are_refused(capsys, tmp_path):
  inputs = [sc_layout.StackingInput("a", 64, 8, "g1"),
            sc_layout.StackingInput("b_c", 64, 8, "g1"),
            sc_layout.StackingInput("a_b", 64, 8, "g2"),
            sc_layout.StackingInput("c", 64, 8, "g2")]
  message = ("two SparseCore stacks are both named 'a_b_c' (TPUEmbeddingV2 names a "
             "stack after its tables joined by '_'): one holds table 'a', the other "
             "table 'a_b'.")
  for use_tensorflow in (True, False):
    with pytest.raises(tee.ConfigError, match=re.escape(message)):
      sc_layout.compute_layouts(inputs, Topology(2, 4), use_tensorflow=use_tensorflow)
  config = {"tables": {n: {"vocabulary_size": 64, "dim": 8, "optimizer": {
      "type": "adagrad" if n in ("a", "b_c") else "sgd"}} for n in ("a", "b_c", "a_b", "c")},
            "features": {f"f_{n}": {"table": n} for n in ("a", "b_c", "a_b", "c")}}
  config["features"]["f_a"]["output_shape"] = [8]
  _one_line(capsys, "two SparseCore stacks are both named", "plan", "--config",
            _write(tmp_path, config), "--engine", "v2", "--topology", "2x4")


def test_real_sparsecore_counts_per_chip():
  assert parse_topology("8x4").num_sparse_cores == 32
  assert parse_topology("8x2").num_sparse_cores == 16
  assert parse_topology("v6e:8").sparsecores_per_chip == 2
  for text in ("8x1", "8x8", "8x0"):
    with pytest.raises(tee.ConfigError, match="a TPU chip has 2 or 4 SparseCores"):
      parse_topology(text)


def test_a_stack_named_like_another_stacks_slot_is_refused():
  inputs = [sc_layout.StackingInput("a", 64, 8, "g1"),
            sc_layout.StackingInput("b", 64, 8, "g1"),
            sc_layout.StackingInput("a_b/momenta", 64, 8, "g2")]
  with pytest.raises(tee.ConfigError, match=re.escape(
      "SparseCore stack 'a_b/momenta' (table 'a_b/momenta') has the name of stack "
      "'a_b''s momenta slot variable (table 'b')")):
    sc_layout.compute_layouts(inputs, Topology(2, 4), use_tensorflow=False)


def test_convert_checks_memory_before_allocating(monkeypatch):
  from tpu_embed_ext.sparsecore import convert
  monkeypatch.setattr(convert, "_available_memory", lambda: 50_000)
  table = convert._Table(name="big", rows=1000, dim=8, slots=(), initial=())
  (layout,) = sc_layout.compute_layouts(
      [sc_layout.StackingInput("big", 1000, 8, "g")], Topology(8, 4),
      use_tensorflow=False)
  assert layout.padded_rows == 1024  # a multiple of 8 * 32 SparseCores
  convert._check_memory([table], None)  # per table: 1000 * 8 * 4 = 32,000 bytes
  with pytest.raises(tee.ConfigError, match=re.escape(
      "table 'big' needs 63.2 KiB in memory to convert (1,000 x 8, padded for the "
      "topology), this machine has 48.8 KiB available. Fix:")):
    convert._check_memory([table], {"big": layout})  # 32,000 + 32,768 bytes
