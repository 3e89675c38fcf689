"""Reading results back: the matrix and metrics of one run, and comparisons over seeds.

Used at the end of a run, by `clbench report` and by `clbench sweep`. Pure presentation: nothing
here trains or evaluates.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from clbench.errors import UserError
from clbench.results import RESULTS_FILENAME, RunResult, read_results


SUMMARY_METRICS = ("acc", "la", "bwt", "fwt", "forgetting", "ood_delta", "general_delta",
                   "aia", "intransigence")


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def matrix_table(result: RunResult) -> Any:
    """R as a rich table: rows = base and after each stage, columns = tasks then probes."""
    from rich.table import Table

    table = Table(title=f"R: {result.suite.get('name')} / {result.method.name} / seed "
                        f"{result.seed} ({result.status})")
    table.add_column("after", style="bold")
    for c in result.columns:
        table.add_column(f"{c.name}\n[dim]{c.kind}[/]", justify="right")
    for label, row in zip(result.row_labels, result.matrix):
        table.add_row(label, *[("—" if c is None else f"{c.score:.3f} [dim](n={c.n})[/]")
                               for c in row])
    return table


def print_summary(console: Console, result: RunResult) -> None:
    """The matrix, then the headline metrics with their variants."""
    from rich.table import Table

    console.print(matrix_table(result))
    if not result.metrics:
        return
    table = Table(title="metrics (single run: n = 1)")
    for col in ("metric", "value", "variant"):
        table.add_column(col)
    for name in SUMMARY_METRICS:
        if name in result.metrics:
            m = result.metrics[name]
            arrow = "↑" if m.higher_is_better else "↓"
            table.add_row(f"{name} {arrow}", _fmt(m.value), m.variant or "")
    console.print(table)


def collect_results(run_dirs: Sequence[str | Path]) -> list[tuple[Path, RunResult]]:
    """Results of every run dir (a dir holding results.json, or a folder of such dirs)."""
    found: list[tuple[Path, RunResult]] = []
    for d in run_dirs:
        d = Path(d)
        files = [d / RESULTS_FILENAME] if (d / RESULTS_FILENAME).is_file() else \
            sorted(d.rglob(RESULTS_FILENAME))
        if not files:
            raise UserError(f"{d}: no {RESULTS_FILENAME} found (is this a run directory?)")
        found += [(f.parent, read_results(f)) for f in files]
    return found


def comparison(results: Sequence[RunResult]) -> dict[str, Any]:
    """Mean ± std over seeds of every headline metric, per (suite, method)."""
    from clbench.metrics.aggregate import aggregate_over_seeds

    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r.status != "complete":
            continue
        key = f"{r.suite.get('name')}:{r.suite_hash[:15]}"
        groups.setdefault(key, []).append({
            "method": r.method.name, "seed": r.seed,
            "metrics": {k: {"value": v.value} for k, v in r.metrics.items()}})
    return {suite: {method: {name: s.as_dict() for name, s in metrics.items()}
                    for method, metrics in aggregate_over_seeds(runs).items()}
            for suite, runs in groups.items()}


def print_comparison(console: Console, table_data: dict[str, Any]) -> None:
    from rich.table import Table

    from clbench.metrics.aggregate import SeedSummary

    for suite, methods in table_data.items():
        names = [m for m in SUMMARY_METRICS if any(m in v for v in methods.values())]
        table = Table(title=f"{suite.split(':')[0]}: mean ± std over seeds (n = seeds)")
        table.add_column("method", style="bold")
        for n in names:
            table.add_column(n, justify="right")
        for method, metrics in sorted(methods.items()):
            table.add_row(method, *[SeedSummary(**metrics[n]).format() if n in metrics else "—"
                                    for n in names])
        console.print(table)


def report(run_dirs: Sequence[str | Path], as_json: bool = False,
           console: Console | None = None) -> dict[str, Any]:
    """Print each run's matrix and metrics and the comparison over seeds (or JSON)."""
    console = console or Console()
    found = collect_results(run_dirs)
    data = {"runs": [{"dir": str(d), "suite": r.suite.get("name"), "method": r.method.name,
                      "seed": r.seed, "status": r.status, "row_labels": r.row_labels,
                      "columns": [c.name for c in r.columns], "matrix": r.score_matrix(),
                      "metrics": {k: v.value for k, v in r.metrics.items()}}
                     for d, r in found],
            "comparison": comparison([r for _, r in found])}
    if as_json:
        console.print_json(json.dumps(data))
        return data
    for _, r in found:
        print_summary(console, r)
    incomplete = [str(d) for d, r in found if r.status != "complete"]
    if incomplete:
        console.print(f"[yellow]not complete (left out of the comparison): "
                      f"{', '.join(incomplete)}[/]")
    print_comparison(console, data["comparison"])
    return data
