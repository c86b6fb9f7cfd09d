"""The keys the package and TensorFlow derive from table names, and the
check that no two tables share one.

Every name a table gives a key must round-trip or be refused when the spec
is made (or ``CPUEmbedding`` is built from TensorFlow ``FeatureConfig``s):

- TensorFlow variables: a table ``t`` is tracked on the embedding object as
  ``t`` and one slot variable ``t/<slot>`` per optimizer slot (the *local
  names*, ``local_name``). The checkpoint key of a variable is its object
  path with each local name escaped as TensorFlow's object graph escapes it
  (``trackable_utils.escape_local_name``: ``.`` -> ``..``, then ``/`` ->
  ``.S``), ``checkpoint_key``. The escaping is injective, so two keys
  collide exactly when two local names do: a table ``x/accumulators``
  beside an Adagrad table ``x``. ``_sparse_core_table_layouts`` is the
  local name of ``TPUEmbeddingV2``'s layouts (reserved).
- Keras weights files (``layer_weights``): ``weights_key`` gives ``t`` and
  ``t.<slot>``, beside the layer's ``.step`` and ``.gradient_sink``. HDF5
  reads ``/`` as a group and cuts a name at NUL, so ``%``, ``/`` and a name
  of just ``.`` are percent-encoded (injective; names without them are
  unchanged). A table ``x.accumulators`` beside an Adagrad table ``x``
  collides there and is refused.
- A table's ``tf.Variable`` name is ``graph_name`` of its local name: a
  SavedModel refuses op names outside TensorFlow's pattern (``ü b``). The
  name is cosmetic (keys come from local names), so it is made safe rather
  than refused.
- Names appear in one-line error messages and HDF5 names: a control
  character or line separator is refused.
- SparseCore stacks are named after their tables joined by ``_``
  (``SparseCoreLayoutStacker::GetLayouts``), so stacks of ``a`` + ``b_c``
  and ``a_b`` + ``c`` are both ``a_b_c``: ``check_stack_names``, when a
  layout is computed.

Feature names become the input names of the serving signature that
``export`` writes; TensorFlow renames any other than ``[A-Za-z][A-Za-z0-9_]*``
(``function_type.sanitize_arg_name``, then the graph's op-name rule), and
``dense`` is the signature's float input: ``check_feature_names``.

TensorBoard tags and file names do not contain table or feature names
(learning-rate series are tagged by their TPU tag number).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Dict, Mapping, Optional, Sequence, Tuple

from tpu_embed_ext import errors
from tpu_embed_ext.spec import optimizers

__all__ = ["SLOT_NAMES", "LAYOUTS_NAME", "STEP_KEY", "SINK_KEY", "local_name",
           "escape_local_name", "variable_key", "checkpoint_key", "weights_key",
           "graph_name", "check_characters", "check_feature_names",
           "check_table_names", "check_stack_names"]

# Every slot name of the TPU optimizers.
SLOT_NAMES: Tuple[str, ...] = tuple(sorted(
    {s for cls in optimizers.TYPES.values() for s in cls.slot_names}))
LAYOUTS_NAME = "_sparse_core_table_layouts"  # tpu_embedding_v3_utils' local name
# The layer's own entries in a Keras weights file; a leading dot keeps them
# apart from ordinary table names.
STEP_KEY = ".step"
SINK_KEY = ".gradient_sink"
_PARAMETERS = "parameters"  # the table itself, in the engine's variable dicts


def local_name(table: str, slot: Optional[str] = None) -> str:
  """The name a table (``slot`` None or "parameters") or one of its slots is
  tracked under on the embedding object, as ``TPUEmbedding`` tracks it."""
  return table if slot in (None, _PARAMETERS) else f"{table}/{slot}"


def escape_local_name(name: str) -> str:
  """A local name as TensorFlow's object graph spells it inside a key.

  ``.`` doubles first, then ``/`` becomes ``.S`` (``trackable_utils``): a
  key's ``/`` then only ever separates objects, and no two names agree.
  """
  return name.replace(".", "..").replace("/", ".S")


def variable_key(prefix: str, name: str) -> str:
  """The bundle key of the variable tracked as local name ``name`` on the
  object at path ``prefix`` (``model/embedding/embedding``)."""
  return f"{prefix}/{escape_local_name(name)}/.ATTRIBUTES/VARIABLE_VALUE"


def checkpoint_key(prefix: str, table: str, slot: Optional[str] = None) -> str:
  """The bundle key of a table (``slot`` None) or one of its slots."""
  return variable_key(prefix, local_name(table, slot))


def _escape_h5(name: str) -> str:
  if name == ".":
    return "%2E"
  return name.replace("%", "%25").replace("/", "%2F")


def weights_key(table: str, slot: Optional[str] = None) -> str:
  """The key of a table or slot in a Keras weights file (``layer_weights``)."""
  key = _escape_h5(table)
  return key if slot in (None, _PARAMETERS) else f"{key}.{slot}"


_GRAPH_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\-]*(/[A-Za-z0-9_.\-]+)*$")


def graph_name(name: str) -> str:
  """``name`` as a ``tf.Variable``'s name: TensorFlow refuses op names
  outside ``[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*`` when a SavedModel copies
  the variable into its graph, and a trailing ``/`` is a name scope. Other
  characters become ``_``. Only cosmetic: checkpoint keys come from the
  local name, never from the variable's name.
  """
  if _GRAPH_NAME.match(name):
    return name
  parts = [re.sub(r"[^A-Za-z0-9_.\-]", "_", p) for p in name.split("/")]
  out = "/".join(p for p in parts if p) or "_"
  return out if re.match(r"[A-Za-z0-9.]", out) else "v" + out


def check_characters(kind: str, name: str) -> None:
  """ConfigError if ``name`` (of a table or feature) holds a control character
  or a line break: names appear in one-line messages, and HDF5 cuts a name at
  NUL. The error's key path leaves the name out, so that it stays one line."""
  for c in name:
    if unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp"):
      raise errors.ConfigError(
          f"{kind} name {name!r} contains the control character {c!r}: names "
          "appear in one-line messages and in HDF5 weights files, which cut "
          f"them there. Fix: rename the {kind} without control characters or "
          "line breaks.", path=f"{kind}s")


_SIGNATURE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
DENSE_INPUT = "dense"  # the serving signature's float input (job/export_serving.py)


def check_feature_names(names: Sequence[str]) -> None:
  """ConfigError unless every feature name is kept as is by a serving signature."""
  for name in names:
    check_characters("feature", name)
    if not _SIGNATURE_NAME.match(name):
      fixed = re.sub(r"[^A-Za-z0-9_]", "_", name)
      fixed = fixed if re.match(r"[A-Za-z]", fixed) else "f_" + fixed
      raise errors.ConfigError(
          f"feature name '{name}' is not kept by a serving signature: TensorFlow "
          "renames inputs other than letters, digits and '_' starting with a "
          f"letter, so clients would have to send another name. Fix: rename the "
          f"feature, e.g. '{fixed}'.", path="features")
    if name == DENSE_INPUT:
      raise errors.ConfigError(
          f"feature name '{name}' is the serving signature's input of the dense "
          "(float) features: the two would share one input. Fix: rename the "
          "feature, e.g. 'dense_ids'.", path="features")


def _what(table: str, slot: Optional[str]) -> str:
  return f"the table '{table}'" if slot is None else f"the {slot} slot of '{table}'"


def check_table_names(slots_by_table: Mapping[str, Sequence[str]]) -> None:
  """ConfigError if a table name is not usable or two tables share a key.

  ``slots_by_table``: ``{table: slot names}``. Checks the local names
  (variables, checkpoint keys) and the Keras weights keys; each refusal
  names both tables and the fix.
  """
  variables: Dict[str, Tuple[str, Optional[str]]] = {}
  weights: Dict[str, Tuple[str, Optional[str]]] = {
      STEP_KEY: ("", "table step"), SINK_KEY: ("", "gradient sink")}
  for table, slots in slots_by_table.items():
    if not isinstance(table, str) or not table:
      raise errors.ConfigError(
          f"table name {table!r} is not a non-empty string. Fix: name every "
          "table with a string such as \"users\".")
    check_characters("table", table)
    if table == LAYOUTS_NAME:
      raise errors.ConfigError(
          f"table name '{table}' is TPUEmbeddingV2's key for its SparseCore "
          "layouts: their checkpoint keys would collide. Fix: rename the table.",
          path=f"tables.{table}")
    for slot in (None, *slots):
      name = local_name(table, slot)
      if name in variables and variables[name][0] != table:
        other, other_slot = variables[name]
        raise errors.ConfigError(
            f"tables '{other}' and '{table}' both give TensorFlow the variable "
            f"name '{name}' ({_kind(other_slot)} of '{other}', {_kind(slot)} "
            f"of '{table}'): variables, slot variables and checkpoint keys "
            f"would collide. Fix: rename table '{table}' (a name without '/' "
            "cannot collide).", path=f"tables.{table}")
      variables.setdefault(name, (table, slot))
      key = weights_key(table, slot)
      if key in weights and weights[key][0] != table:
        other, other_slot = weights[key]
        if not other:
          raise errors.ConfigError(
              f"table '{table}' would be saved under the Keras weights key "
              f"'{key}', which holds EmbeddingLayer's {other_slot}. Fix: rename "
              f"table '{table}' (keys starting with '.' are the layer's own).",
              path=f"tables.{table}")
        raise errors.ConfigError(
            f"tables '{other}' and '{table}' both write the Keras weights key "
            f"'{key}' ({_what(other, other_slot)}, {_what(table, slot)}): "
            "save_weights would keep only one of them. Fix: rename table "
            f"'{table}' (a name ending in '.<slot name>' can collide).",
            path=f"tables.{table}")
      weights.setdefault(key, (table, slot))


def _kind(slot: Optional[str]) -> str:
  return "the table variable" if slot is None else "a slot variable"


def check_stack_names(layouts) -> None:
  """ConfigError if two SparseCore stacks got the same name.

  ``layouts``: ``sparsecore.layout.TableLayout``s. Within one real stack the
  tables' shard row offsets are distinct; two stacks under one name both have
  a table at offset 0.
  """
  seen: Dict[Tuple[str, int], str] = {}
  for l in layouts:
    key = (l.stack, l.row_offset)
    if key in seen:
      other = seen[key]
      raise errors.ConfigError(
          f"two SparseCore stacks are both named '{l.stack}' (TPUEmbeddingV2 "
          "names a stack after its tables joined by '_'): one holds table "
          f"'{other}', the other table '{l.table}'. Their variables and "
          "checkpoint keys would collide. Fix: rename one of the tables so "
          "that no '_'-joined list of names equals another (e.g. avoid '_' in "
          "table names that also appear as prefixes or suffixes).",
          path=f"tables.{l.table}")
    seen[key] = l.table
    if l.stack == LAYOUTS_NAME:
      raise errors.ConfigError(
          f"the SparseCore stack of table '{l.table}' is named '{l.stack}' "
          "(its tables joined by '_'), TPUEmbeddingV2's key for its layouts: "
          "their checkpoint keys would collide. Fix: rename the table.",
          path=f"tables.{l.table}")
  # A stack's slot variables are "<stack>/<slot>": no other stack may be
  # named so (tables "a", "b" stack as "a_b"; a table "a_b/momenta" alone).
  stacks = {l.stack: l.table for l in layouts}
  for stack, table in stacks.items():
    prefix, _, slot = stack.rpartition("/")
    if prefix in stacks and slot in SLOT_NAMES:
      raise errors.ConfigError(
          f"SparseCore stack '{stack}' (table '{table}') has the name of stack "
          f"'{prefix}''s {slot} slot variable (table '{stacks[prefix]}'): their "
          f"variables and checkpoint keys would collide. Fix: rename table "
          f"'{table}' (a name without '/' cannot collide).",
          path=f"tables.{table}")
