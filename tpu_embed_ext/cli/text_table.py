"""Plain-text tables, as ``plan`` prints them."""

from __future__ import annotations

from typing import List

__all__ = ["lines"]


def lines(header, rows) -> List[str]:
  """Aligned columns; the last row is a total under a rule."""
  widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
  line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
  rule = line(tuple("-" * w for w in widths))
  return [line(header), rule] + [line(r) for r in rows[:-1]] + [rule, line(rows[-1])]
