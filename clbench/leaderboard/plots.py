"""The leaderboard's figures: matplotlib drawings as inline SVG, the same bytes on every build.

- :func:`heatmap`: an accuracy matrix, rows the stages (row 0 the base model), columns the tasks;
- :func:`curves`: every column's score after each stage, one line per column (forgetting shows
  as a line that falls after its own stage), or one line per entry for one column (comparison).

Determinism: the Agg backend, no date in the metadata, a fixed hash salt for the SVG ids, text
kept as text (no font glyphs embedded), and fixed sizes. Labels are passed to matplotlib as
plain text (`usetex` off, mathtext disabled by escaping `$`), and the SVG is inlined in pages
whose other content is escaped by the templates; matplotlib escapes text in the SVG it writes.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

_STYLE = {"svg.hashsalt": "clbench", "svg.fonttype": "none", "font.size": 9,
          "font.family": "sans-serif", "axes.spines.top": False, "axes.spines.right": False,
          "text.usetex": False}


def _plain(text: str) -> str:
    """Text shown as written: `$` would start mathtext."""
    return str(text).replace("$", r"\$")


def _svg(figure: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None},
                   bbox_inches="tight")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # inline: no XML declaration or doctype


def heatmap(matrix: Sequence[Sequence[float | None]], rows: Sequence[str],
            columns: Sequence[str], title: str = "") -> str:
    """The matrix as a heatmap (0 to 1), each cell annotated; missing cells blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    values = np.array([[math.nan if v is None else float(v) for v in row] for row in matrix])
    with plt.rc_context(_STYLE):
        width = 1.6 + 0.9 * max(len(columns), 1)
        height = 0.9 + 0.45 * max(len(rows), 1)
        figure, axes = plt.subplots(figsize=(width, height))
        image = axes.imshow(np.ma.masked_invalid(values), vmin=0.0, vmax=1.0, cmap="viridis",
                            aspect="auto")
        axes.set_xticks(range(len(columns)), [_plain(c) for c in columns], rotation=30,
                        ha="right")
        axes.set_yticks(range(len(rows)), [_plain(r) for r in rows])
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    axes.text(j, i, f"{v:.2f}", ha="center", va="center",
                              color="white" if v < 0.6 else "black", fontsize=8)
        figure.colorbar(image, ax=axes, fraction=0.04, pad=0.02)
        if title:
            axes.set_title(_plain(title))
        return _svg(figure)


def curves(lines: dict[str, Sequence[float | None]], steps: Sequence[str],
           title: str = "", ylabel: str = "score") -> str:
    """One line per name over `steps` (the x axis: base, then each stage); gaps where a value
    is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context(_STYLE):
        figure, axes = plt.subplots(figsize=(6.4, 3.4))
        for name, values in lines.items():
            ys = [math.nan if v is None else float(v) for v in values]
            axes.plot(range(len(ys)), ys, marker="o", markersize=3, label=_plain(name))
        axes.set_xticks(range(len(steps)), [_plain(s) for s in steps], rotation=20, ha="right")
        axes.set_ylim(-0.02, 1.02)
        axes.set_ylabel(_plain(ylabel))
        axes.grid(axis="y", alpha=0.3)
        if lines:
            axes.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False,
                        fontsize=8)
        if title:
            axes.set_title(_plain(title))
        return _svg(figure)
