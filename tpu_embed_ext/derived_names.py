"""Names the package and TensorFlow derive from user names must never collide.

From a table name ``t`` TensorFlow derives its variable ``t`` and one slot
variable ``t/<slot>`` per optimizer slot (``TPUEmbedding``'s trackable
children, the checkpoint keys ``t/.ATTRIBUTES/...`` and ``t/<slot>`` spelled
``t.S<slot>``); a table named ``x/accumulators`` beside an Adagrad table
``x`` is then tracked twice under one name, and TensorFlow fails deep inside
``_track_trackable``. SparseCore stacks are named after their tables joined by
``_`` (``SparseCoreLayoutStacker::GetLayouts``), so stacks of ``a`` + ``b_c``
and ``a_b`` + ``c`` are both ``a_b_c``.

``check_table_names`` runs when a spec is made and when ``CPUEmbedding`` is
built from TensorFlow ``FeatureConfig``s; ``check_stack_names`` when a
SparseCore layout is computed. Each names both colliding names and the fix.
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence, Tuple

from tpu_embed_ext import errors

__all__ = ["check_table_names", "check_stack_names", "derived_table_names"]

# Every slot name of the TPU optimizers (optimizers.py, slot_names).
_SLOT_NAMES = ("accumulators", "momenta", "velocities", "linears")


def derived_table_names(table: str, slots: Sequence[str]) -> Tuple[str, ...]:
  """The variable names TensorFlow gives a table and its slots."""
  return (table,) + tuple(f"{table}/{slot}" for slot in slots)


def check_table_names(slots_by_table: Mapping[str, Sequence[str]]) -> None:
  """ConfigError if two tables' derived names (variables, slot variables,
  checkpoint keys) are equal. ``slots_by_table``: ``{table: slot names}``."""
  owner: Dict[str, Tuple[str, str]] = {}
  for table, slots in slots_by_table.items():
    if not isinstance(table, str) or not table:
      raise errors.ConfigError(
          f"table name {table!r} is not a non-empty string. Fix: name every "
          "table with a string such as \"users\".")
    for derived in derived_table_names(table, slots):
      if derived in owner and owner[derived][0] != table:
        other, what = owner[derived]
        this = _kind(table, derived)
        raise errors.ConfigError(
            f"tables '{other}' and '{table}' both give TensorFlow the variable "
            f"name '{derived}' ({what} of '{other}', {this} of '{table}'): "
            "variables, slot variables and checkpoint keys would collide. Fix: "
            f"rename table '{table}' (a name without '/' cannot collide).",
            path=f"tables.{table}")
      owner.setdefault(derived, (table, _kind(table, derived)))


def _kind(table: str, derived: str) -> str:
  return "the table variable" if derived == table else "a slot variable"


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
  # A stack's slot variables are "<stack>/<slot>": no other stack may be
  # named so (tables "a", "b" stack as "a_b"; a table "a_b/momenta" alone).
  stacks = {l.stack: l.table for l in layouts}
  for stack, table in stacks.items():
    prefix, _, slot = stack.rpartition("/")
    if prefix in stacks and slot in _SLOT_NAMES:
      raise errors.ConfigError(
          f"SparseCore stack '{stack}' (table '{table}') has the name of stack "
          f"'{prefix}''s {slot} slot variable (table '{stacks[prefix]}'): their "
          f"variables and checkpoint keys would collide. Fix: rename table "
          f"'{table}' (a name without '/' cannot collide).",
          path=f"tables.{table}")
