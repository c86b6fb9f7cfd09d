"""The TPU's tags for dynamic learning rates, and the rules they obey.

TensorFlow assigns tags by callable identity, in table order (``RateBinder``
in tf/rates.py hands out one callable per distinct rate). The rules of
``DynamicLearningRate`` (optimization_parameters.proto) are checked by
``check_tag_rules``: tags are 0..n-1 with none skipped, n is at most the
number of tables, and tables that share a tag share the rate.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from tpu_embed_ext import errors

__all__ = ["assign_tags", "check_tag_rules"]


def assign_tags(table_names: Sequence[str], rates: Sequence[Any]
                ) -> Dict[str, Optional[int]]:
  """Tags as TensorFlow assigns them: distinct callables in first-use order."""
  order: Dict[int, int] = {}
  tags = {}
  for name, rate in zip(table_names, rates):
    if callable(rate):
      tags[name] = order.setdefault(id(rate), len(order))
    else:
      tags[name] = None
  return tags


def check_tag_rules(tags: Mapping[str, Optional[int]],
                    rates: Mapping[str, Any]) -> None:
  """Raises ConfigError unless ``tags`` obey the DynamicLearningRate rules."""
  used = sorted({t for t in tags.values() if t is not None})
  if used != list(range(len(used))):
    raise errors.ConfigError(
        f"dynamic learning-rate tags must be 0..n-1 with none skipped, got "
        f"{used}. Fix: renumber the tags.")
  if len(used) > len(tags):
    raise errors.ConfigError(
        f"{len(used)} tags for {len(tags)} tables: at most one tag per table.")
  owner: Dict[int, Tuple[str, Any]] = {}
  for table, tag in tags.items():
    if tag is None:
      if callable(rates[table]):
        raise errors.ConfigError(
            f"table '{table}' has a dynamic learning rate but no tag.")
      continue
    if not callable(rates[table]):
      raise errors.ConfigError(
          f"table '{table}' has tag {tag} but a constant rate {rates[table]!r}.")
    if tag in owner and owner[tag][1] is not rates[table]:
      raise errors.ConfigError(
          f"tables '{owner[tag][0]}' and '{table}' share tag {tag} but not the "
          "learning rate: the TPU would apply one rate to both. Fix: give "
          "them one schedule, or separate tags.")
    owner.setdefault(tag, (table, rates[table]))
