"""Plain-text tables for people: the probe's report and the CLI's listings."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["cell", "grid"]


def cell(value: object) -> str:
    """``value`` as a table shows it: ``-`` for nothing, ``yes``/``no``, lists and dicts joined."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={cell(v)}" for k, v in value.items()) or "-"
    return str(value)


def grid(header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "    ") -> list[str]:
    """``rows`` under ``header`` in left-aligned columns two spaces apart, each line indented (the probe's and
    the CLI's tables)."""
    cells = [list(header)] + [[cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
