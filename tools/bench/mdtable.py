"""Markdown cells and tables for the bench's reports. Its own module so that report.py and
the phase modules it renders (shapes.py) can share them without importing each other."""
from __future__ import annotations

import math


def fmt(x, spec: str = ".1f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:{spec}}{suffix}"


def table(header: list[str], rows: list[list[str]], text_cols: tuple[int, ...] = (0,)) -> str:
    """A GitHub Markdown table: text columns left-aligned, figures right-aligned."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(":---" if i in text_cols else "---:" for i in range(len(header)))
             + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
