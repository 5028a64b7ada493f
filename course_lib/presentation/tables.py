"""Rows as an HTML table for a notebook: JupyterLab fits a table's columns to the window, where fixed-width text
of 140 characters wraps mid-word (a planner's answers, a table of published runs)."""

import html

from IPython.display import HTML

CELL = "text-align:left; vertical-align:top"


def table_html(header: list[str], rows: list[list], caption: str | None = None) -> str:
    """The HTML text of a table of ``rows`` (each cell shown with str()) under ``header``, with an optional
    caption (plan.Plan draws its answers with it too)."""
    def line(cells, tag):
        return "<tr>" + "".join(f"<{tag} style='{CELL}'>{html.escape(str(c))}</{tag}>" for c in cells) + "</tr>"
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells, one per column of {header}")
    head = f"<caption style='{CELL}'>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{head}{line(header, 'th')}{''.join(line(row, 'td') for row in rows)}</table>"


def table(header: list[str], rows: list[list], caption: str | None = None) -> HTML:
    """table_html, shown by a notebook: ``display(table(...))``."""
    return HTML(table_html(header, rows, caption))
