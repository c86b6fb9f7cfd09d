"""Config fuzzing: any input loads to a valid spec or raises ConfigError, nothing else."""

import copy

from hypothesis import HealthCheck, given, settings, strategies as st

import tpu_embed_ext as tee
from tests.test_spec import BASE

FUZZ_EXAMPLES = 400  # Per test; the count is quoted in docs/BAD_INPUTS.md.

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**12),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12),
                    st.sampled_from(["adagrad", "sgd", "ftrl", "adam", "mean", "sum",
                                     "user_id", "cat_*", "warm", "CosineDecay"]))
values = st.recursive(
    scalars, lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=10), st.sampled_from(
            ["type", "learning_rate", "tables", "features", "table", "dim",
             "vocabulary_size", "optimizer", "match", "class"])), children, max_size=4)),
    max_leaves=12)


def _paths(node, prefix=()):
  yield prefix
  if isinstance(node, dict):
    for k, v in node.items():
      yield from _paths(v, prefix + (k,))
  elif isinstance(node, list):
    for i, v in enumerate(node):
      yield from _paths(v, prefix + (i,))


PATHS = [p for p in _paths(BASE) if p]


def _load(config):
  try:
    spec = tee.EmbeddingSpec.from_dict(config)
  except tee.ConfigError:
    return None
  assert tee.EmbeddingSpec.from_dict(spec.to_dict()) == spec  # Valid: round-trips.
  return spec


@settings(max_examples=FUZZ_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_arbitrary_values_load_or_raise_config_error(config):
  _load(config)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=3))
def test_mutated_valid_configs_load_or_raise_config_error(mutations):
  config = copy.deepcopy(BASE)
  for path, value in mutations:
    node = config
    try:
      for key in path[:-1]:
        node = node[key]
      node[path[-1]] = value
    except (KeyError, IndexError, TypeError):
      continue  # An earlier mutation removed this path.
  _load(config)
