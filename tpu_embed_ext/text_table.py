"""Plain-text tables and byte counts, as ``plan`` prints them."""

from __future__ import annotations

from typing import List

__all__ = ["human_bytes", "lines"]


def lines(header, rows) -> List[str]:
  """Aligned columns; the last row is a total under a rule."""
  widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
  line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
  rule = line(tuple("-" * w for w in widths))
  return [line(header), rule] + [line(r) for r in rows[:-1]] + [rule, line(rows[-1])]


def human_bytes(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
    n /= 1024
