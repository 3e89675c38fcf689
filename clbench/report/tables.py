"""Printing tables: rich tables whole (on a terminal rich fits a table to the window; into a file
or a pipe, a run log or `clbench report ... > report.txt`, no width limits it, so nothing is cut),
and text from results files as text, never as markup (:func:`md_escape` for Markdown; rich's
`escape` for the console).
"""

from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table

# A width no table reaches: what the natural width of a table is measured against.
UNLIMITED_WIDTH = 1 << 20


def print_uncut(console: Console, table: Table) -> None:
    """Print a table with no header or cell cut short. On a terminal rich fits it to the
    window; into a file or a pipe (a run log, `clbench report ... > report.txt`), where rich
    would assume 80 columns and end cells with `…` or break names, at the table's natural
    width."""
    if console.is_terminal:
        console.print(table)
        return
    options = console.options.update_width(UNLIMITED_WIDTH)
    natural = console.measure(table, options=options).maximum
    fitted = console.width  # not a terminal: a width rich assumed ($COLUMNS, or 80)
    console.width = max(fitted, natural)
    try:
        console.print(table)
    finally:
        console.width = fitted


_MD_SYNTAX = re.compile(r"[\\`*\[\]|#!~]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def md_escape(text: object) -> str:
    """`text` as literal inline Markdown on one line: HTML's `&`, `<` and `>` as entities and
    Markdown's syntax characters backslash-escaped (an underscore inside a word, as in
    `tool_use`, is no syntax and stays), line breaks as spaces. What a results file says is
    shown as written; none of it becomes a heading, a link, a table cell or markup."""
    flat = " ".join(str(text).splitlines())
    flat = flat.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SYNTAX.sub(lambda m: "\\" + m.group(0), flat)
