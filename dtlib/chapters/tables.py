"""Tables for the book's pages: rows of dicts rendered as a table.

Shared by every chapter's page code; it only formats.
"""

from __future__ import annotations

import html
from typing import Any, Sequence

__all__ = ["Table", "md_table"]


class Table:
    """Rows of dicts shown as a real table: HTML in a notebook and in the built book,
    aligned plain text when printed.

    Cell text is escaped, so ``|``, ``<`` or ``&`` in a header or a value stay text.
    """

    def __init__(self, rows: list[dict[str, Any]],
                 columns: Sequence[str] | None = None) -> None:
        if not rows and not columns:
            raise ValueError("rows is empty and no columns were given")
        self.columns = list(columns or rows[0])
        self.rows = [[_cell(r.get(c, "")) for c in self.columns] for r in rows]

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row)
                       + "</tr>" for row in self.rows)
        return (f'<table class="table dtlib-table"><thead><tr>{head}</tr></thead>'
                f"<tbody>{body}</tbody></table>")

    def __repr__(self) -> str:
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
                  for i, c in enumerate(self.columns)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(self.columns, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in self.rows]
        return "\n".join(lines)


def _cell(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def md_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> Table:
    """A list of dicts as a :class:`Table` (the name is historical: it renders as HTML).

    Args:
        rows: one dict per row; missing keys give empty cells.
        columns: the columns, in order (default: the first row's keys).
    """
    return Table(rows, columns)
