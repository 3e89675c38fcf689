"""The diagnostics of one run as tables: drift and collapse, responses, transfer against distance.

Each table has one row per stage whose record carries diagnostics (:mod:`clbench.run.diagnostics`
writes them); a table none of whose stages measured its part is left out. Values that were not
measured print as "—".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table

from clbench.metrics.aggregate import mean_of_numbers
from clbench.results import RunResult

DRIFT_HEADERS = ("stage", "NSS vs base", "max angle vs base", "changed vs base",
                 "mask overlap vs base", "NSS vs previous", "amplified", "collapse")
RESPONSE_HEADERS = ("stage", "KL vs base /token", "edit similarity", "eval never ended",
                    "length ×", "rollout entropy", "rollouts never ended")


def _num(value: Any, digits: int = 3) -> str:
    return "—" if not isinstance(value, (int, float)) else f"{value:.{digits}g}"


def diagnostic_rows(result: RunResult) -> list[list[str]]:
    """Drift against the base and the previous stage (all 2-D weights), the patterns amplified
    per column, and why the row collapsed."""
    def drift(record: dict[str, Any], side: str, key: str) -> str:
        return _num(record.get("weight_drift", {}).get(side, {}).get("all", {}).get(key))

    rows = []
    for stage in result.stages:
        d = stage.diagnostics
        if not d:
            continue
        amplified = [f"{column}: {' / '.join(report.get('amplified', []))}"
                     for column, report in d.get("artifacts", {}).items()
                     if report.get("amplified")]
        angle = drift(d, "vs_base", "max_principal_angle")
        rows.append([f"{stage.index} {stage.name}", drift(d, "vs_base", "nss"),
                     angle if angle == "—" else f"{angle}°",
                     drift(d, "vs_base", "changed_fraction"),
                     drift(d, "vs_base", "mask_overlap"), drift(d, "vs_previous", "nss"),
                     "; ".join(amplified) or "none", "; ".join(d.get("collapse", [])) or "no"])
    return rows


def response_rows(result: RunResult) -> list[list[str]]:
    """Response drift on the probe prompts, the evaluation responses that never ended and their
    length against row 0 (means over task columns), and the rollouts' entropy (first -> last
    step) and share that never ended (last step)."""
    rows = []
    for stage in result.stages:
        d = stage.diagnostics
        responses, rollouts = d.get("response_drift", {}), d.get("rollouts", {})
        artifacts = list(d.get("artifacts", {}).values())
        if not (responses or rollouts or artifacts):
            continue
        entropy = "—"
        if "entropy_first" in rollouts:
            entropy = f"{_num(rollouts['entropy_first'])} → {_num(rollouts['entropy_last'])}"
        rows.append([f"{stage.index} {stage.name}", _num(responses.get("kl")),
                     _num(responses.get("edit_similarity")),
                     _num(mean_of_numbers([a.get("never_ended_share") for a in artifacts])),
                     _num(mean_of_numbers([a.get("length_inflation") for a in artifacts])), entropy,
                     _num(rollouts.get("never_ended_share_last"))])
    return rows


def distance_rows(result: RunResult) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): per stage and task column, the MMD between the stage's training prompts
    and the column's evaluation prompts, and the column's change over the stage."""
    columns = [c.name for c in result.columns
               if any(c.name in s.diagnostics.get("distance", {}).get("columns", {})
                      for s in result.stages)]
    rows = []
    for stage in result.stages:
        measured = stage.diagnostics.get("distance", {}).get("columns", {})
        if not measured:
            continue
        cells = []
        for name in columns:
            entry = measured.get(name)
            if entry is None:
                cells.append("—")
                continue
            change = entry.get("change")
            cells.append(f"{_num(entry.get('mmd'), 2)} "
                         f"({'—' if change is None else f'{change:+.2f}'})")
        rows.append([f"{stage.index} {stage.name}", *cells])
    return ["stage", *columns], rows


def _table(title: str, headers: Sequence[str], rows: list[list[str]],
           left: Sequence[str] = ("stage",)) -> Table:
    table = Table(title=title)
    for col in headers:
        table.add_column(escape(col), justify="left" if col in left else "right")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    return table


def diagnostic_tables(result: RunResult) -> list[Table]:
    """The tables that have rows."""
    tables = []
    rows = diagnostic_rows(result)
    if rows:
        tables.append(_table("diagnostics after each stage (drift of all 2-D weights; patterns "
                             "amplified in the completions)", DRIFT_HEADERS, rows,
                             left=("stage", "amplified", "collapse")))
    rows = response_rows(result)
    if rows:
        tables.append(_table("responses after each stage (drift on the probe prompts against "
                             "the base model; eval means over task columns)", RESPONSE_HEADERS,
                             rows))
    headers, rows = distance_rows(result)
    if rows:
        tables.append(_table("transfer against distance: MMD to the stage's training prompts "
                             "(change over the stage)", headers, rows))
    return tables
