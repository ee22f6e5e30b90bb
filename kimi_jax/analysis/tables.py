"""Rows (dicts) as a GitHub-markdown table: how the notebooks display what the other analysis modules return
(``IPython.display.Markdown(markdown_table(rows))``)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


def markdown_table(rows: Sequence[Mapping], columns: Mapping[str, str] | None = None, *, floatfmt: str = ".2f") -> str:
    """A GitHub-markdown table of ``rows`` (dicts). ``columns``: key -> header (default: the keys of row 0)."""
    if not rows:
        raise ValueError("markdown_table: no rows")
    columns = columns or {k: k for k in rows[0]}

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, (float, np.floating)):
            return format(float(v), floatfmt)
        return str(v)

    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in columns) + " |" for r in rows]
    return "\n".join(lines)
