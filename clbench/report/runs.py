"""Presenting runs: the plan of a run before it starts, the matrix, metrics and cost of one run,
and `clbench report` (rich tables, JSON or Markdown) over runs found on disk.

Used by `clbench run --plan`, at the end of a run, by `clbench report` and by `clbench sweep`;
comparisons over seeds are computed in :mod:`clbench.report.comparison`. Pure presentation: nothing
here trains or evaluates.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clbench.errors import UserError
from clbench.progress import clock_time
from clbench.report.comparison import (
    comparison,
    comparison_groups,
    comparison_tables,
    cost_comparison,
    cost_tables,
    format_gib,
    metric_order,
    mixed_code,
    print_comparison,
    settings_line,
)
from clbench.report.diagnostics import diagnostic_tables
from clbench.report.intransigence import add_intransigence
from clbench.report.tables import md_escape, print_uncut
from clbench.results import RESULTS_FILENAME, RunResult, peak_memory_kind, read_results
from clbench.run.rundir import IDENTITY_FILE, run_is_live, what_is_saved


def _fmt(value: float | None, digits: int = 3) -> str:
    from clbench.metrics.aggregate import format_value

    return "—" if value is None else format_value(value, digits)


def run_title(result: RunResult) -> str:
    """`suite / method / seed N`, marked when the run is a joint reference."""
    joint = " (joint reference)" if result.joint else ""
    return f"{result.suite.get('name')} / {result.entry_name()}{joint} / seed {result.seed}"


def matrix_table(result: RunResult) -> Any:
    """R as a rich table: rows = base and after each stage, columns = tasks then probes."""
    from rich.table import Table

    table = Table(title=escape(f"R: {run_title(result)} ({result.status})"))
    table.add_column("after", style="bold")
    for c in result.columns:
        table.add_column(f"{escape(c.name)}\n[dim]{escape(c.kind)}[/]", justify="right")
    for label, row in zip(result.row_labels, result.matrix):
        table.add_row(escape(label), *[("—" if c is None or c.score is None else
                                        f"{c.score:.3f} [dim](n={c.n})[/]") for c in row])
    return table


def compute_summary(result: RunResult) -> str:
    """What the run cost so far, in one line: wall time (summed over resumed sessions), device,
    peak memory, optimizer steps and tokens."""
    c = result.compute
    if not c.device and not c.wall_time_s:
        return "not recorded"
    parts = [f"{clock_time(c.wall_time_s)} on {c.device or 'an unrecorded device'}"]
    if c.peak_memory_bytes:
        parts.append(f"peak {peak_memory_kind(c.device)} {format_gib(c.peak_memory_bytes)}")
    tokens = dict(c.tokens)
    if "optimizer_steps" in tokens:
        parts.append(f"{tokens.pop('optimizer_steps'):,} optimizer steps")
    named = [f"{tokens.pop(k):,} {k.removesuffix('_tokens')}" for k in
             ("generated_tokens", "trained_tokens", "teacher_tokens") if tokens.get(k)]
    if named:
        parts.append("tokens: " + ", ".join(named))
    return "; ".join(parts)


def compute_heading(result: RunResult) -> str:
    """`compute`, or for a run not complete `compute of the rows saved`: its training and the
    row in progress are not counted until saved."""
    return "compute" if result.status == "complete" else "compute of the rows saved"


def print_summary(console: Console, result: RunResult) -> None:
    """The matrix, then the headline metrics with their variants, then the compute."""
    from rich.table import Table

    print_uncut(console, matrix_table(result))
    console.print(f"[dim]method settings: {escape(settings_line(result))}[/]", soft_wrap=True)
    console.print(f"[dim]{compute_heading(result)}: {escape(compute_summary(result))}[/]",
                  soft_wrap=True)
    for table in diagnostic_tables(result):
        print_uncut(console, table)
    if not result.metrics:
        return
    table = Table(title="metrics (single run: n = 1)")
    for col in ("metric", "value", "variant"):
        table.add_column(col)
    for row in metric_rows(result):
        table.add_row(*map(escape, row))
    print_uncut(console, table)


def metric_rows(result: RunResult) -> list[list[str]]:
    """`[metric ↑/↓, value, variant]` of each metric of one run, headline metrics first; an
    undefined one says why (e.g. "— (needs at least 2 stages ...)")."""
    return [[f"{name} {'↑' if m.higher_is_better else '↓'}",
             _fmt(m.value) + (f" ({m.note})" if m.value is None and m.note else ""),
             m.variant or ""]
            for name, m in ((n, result.metrics[n]) for n in metric_order(result.metrics))]


def standing(run_dir: Path, result: RunResult) -> str | None:
    """Where a run that is not complete stands, in one line (None for a complete one): why a
    failed run stopped, whether a process is running it now, and what is saved, read from its
    folder when `run_dir` is one."""
    if result.status == "complete":
        return None
    rows = len(result.matrix)
    status, kept = result.status, f"{rows} row{'s' if rows != 1 else ''} of R"
    try:
        if (run_dir / IDENTITY_FILE).is_file():
            live = run_is_live(run_dir)
            kept = what_is_saved(run_dir, rows, len(result.columns), live)
            status += " (running now)" if live else ""
    except OSError:  # a folder this user cannot search: what the results file says
        pass
    return f"{status}: {f'{result.error}; ' if result.error else ''}{kept}"


def collect_results(run_dirs: Sequence[str | Path], skipped: list[str] | None = None,
                    corrected: list[str] | None = None) -> list[tuple[Path, RunResult]]:
    """Results of every run dir (a dir holding results.json, a results file itself, whatever
    its name, or a folder searched for them), checked: a file that cannot be read, or is not a
    valid results file, is left out and said in `skipped` (an error when `skipped` is not
    given, or when no file could be read); a complete run's metrics are recomputed from its
    matrix (:func:`clbench.run.scores.recomputed_metrics`), and a stored value that differs
    is said in `corrected` (the recomputed one is what is shown)."""
    from clbench.run.scores import recomputed_metrics

    found: list[tuple[Path, RunResult]] = []

    def read(where: Path, file: Path) -> None:
        try:
            result = read_results(file)
        except UserError as exc:
            if skipped is None:
                raise
            skipped.append(str(exc))
            return
        result.metrics, mismatches = recomputed_metrics(result)
        if corrected is not None:
            corrected.extend(f"{file}: {line}" for line in mismatches)
        found.append((where, result))

    for d in map(Path, run_dirs):
        if not d.exists():
            raise UserError(f"{d}: no such run directory")
        if d.is_file():  # a results file copied out of its run folder keeps its meaning
            read(d.parent if d.name == RESULTS_FILENAME else d, d)
            continue
        if (d / RESULTS_FILENAME).is_file():
            read(d, d / RESULTS_FILENAME)
            continue
        files = sorted(d.rglob(RESULTS_FILENAME)) if d.is_dir() else []
        if not files:
            raise UserError(f"{d}: no {RESULTS_FILENAME} in it or below (is this a run "
                            "directory?)")
        for f in files:
            read(f.parent, f)
    if not found and skipped:
        raise UserError(f"no readable {RESULTS_FILENAME} found: {skipped[0]}" + (
            f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""))
    return found


def report(run_dirs: Sequence[str | Path], as_json: bool = False,
           console: Console | None = None, as_markdown: bool = False,
           compare: bool = False) -> dict[str, Any]:
    """Print each run's matrix and metrics and the comparison over seeds (or JSON, or
    Markdown tables to paste into a paper or a README); with `compare`, each pair of methods'
    differences with their seed-and-item bootstrap intervals
    (:mod:`clbench.report.pairwise`)."""
    console = console or Console()
    skipped: list[str] = []
    corrected: list[str] = []
    found = collect_results(run_dirs, skipped, corrected)
    add_intransigence(found)
    as_tables = not as_json and not as_markdown
    if as_tables:  # first: a comparison refused below still leaves every run's tables shown
        for reason in skipped:
            console.print(f"[yellow]left out: {escape(reason)}[/]", soft_wrap=True)
        for line in corrected:
            console.print(f"[yellow]recomputed: {escape(line)}; the recomputed value is "
                          "shown[/]", soft_wrap=True)
        for d, r in found:
            print_summary(console, r)
            if (where := standing(d, r)) is not None:
                console.print(f"[yellow]{escape(where)}[/]", soft_wrap=True)
        incomplete = [str(d) for d, r in found if r.status != "complete"]
        if incomplete:
            console.print(f"[yellow]not complete (left out of the comparison): "
                          f"{escape(', '.join(incomplete))}[/]", soft_wrap=True)
    groups = comparison_groups(found)
    mixed = mixed_code(groups)
    if as_tables:
        for line in mixed:
            console.print(f"[yellow]{escape(line)}[/]", soft_wrap=True)
    data = {"runs": [{"dir": str(d), "suite": r.suite.get("name"), "method": r.method.name,
                      "addons": [a.name for a in r.addons], "seed": r.seed, "joint": r.joint,
                      "status": r.status, "row_labels": r.row_labels,
                      "columns": [c.name for c in r.columns], "matrix": r.score_matrix(),
                      "metrics": {k: v.value for k, v in r.metrics.items()},
                      "diagnostics": [{"stage": s.index, **s.diagnostics} for s in r.stages
                                      if s.diagnostics],
                      "standing": standing(d, r)}
                     for d, r in found],
            "comparison": comparison(groups), "cost": cost_comparison(groups)}
    pairwise_tables: list[tuple[str, list[str], list[list[str]]]] = []
    if compare:
        from clbench.report.comparison import suite_titles
        from clbench.report.pairwise import difference_tables, pairwise_differences

        data["pairwise"] = pairwise_differences(groups)
        pairwise_tables = difference_tables(data["pairwise"], suite_titles(data["pairwise"]))
    if skipped:
        data["skipped"] = skipped
    if mixed:
        data["mixed_code"] = mixed
    if corrected:
        data["recomputed"] = corrected
    if as_json:
        console.print_json(json.dumps(data))
    elif as_markdown:
        console.file.write(markdown_report(found, data["comparison"], [
            *(f"left out: {reason}" for reason in skipped),
            *(f"recomputed: {line}; the recomputed value is shown" for line in corrected),
            *mixed], data["cost"],
            pairwise_tables))
    else:
        print_comparison(console, data["comparison"], data["cost"], pairwise_tables)
    return data


def _md_table(headers: Sequence[str], rows: Iterable[Sequence[str]],
              right: Sequence[int] | None = None) -> list[str]:
    """A GitHub-flavoured Markdown table; the `right` columns (default: all but the first) are
    right-aligned. Cells are text (:func:`md_escape`: no markup, one line)."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(map(md_escape, cells)) + " |"

    right = range(1, len(headers)) if right is None else right
    rule = ["---:" if i in right else "---" for i in range(len(headers))]
    return [line(headers), "|" + "|".join(rule) + "|", *map(line, rows)]


def markdown_report(found: Sequence[tuple[Path, RunResult]], table_data: dict[str, Any],
                    notes: Sequence[str] = (), cost_data: dict[str, Any] | None = None,
                    extra_tables: Sequence[tuple[str, list[str], list[list[str]]]] = ()
                    ) -> str:
    """`clbench report --markdown`: each run's R, compute and metrics, then the comparison over
    seeds. R's cells are scores; the item count of each column is said under the table (a cell
    whose count differs from its column's says it in the cell). `notes` (runs left out or
    recomputed, entries mixing code versions) are quoted first."""
    out: list[str] = [f"> {md_escape(note)}" for note in notes]
    for where, r in found:
        out += ["", f"### R: {md_escape(run_title(r))} ({r.status}), {md_escape(where)}", ""]
        if not r.matrix or not r.columns:
            out += ["No row of R yet." if r.columns else "No columns."]
        else:
            counts = [max((row[i].n for row in r.matrix if row[i] is not None), default=0)
                      for i in range(len(r.columns))]

            def cell(c: Any, n: int) -> str:
                return "—" if c is None or c.score is None else \
                    _fmt(c.score) + ("" if c.n == n else f" (n={c.n})")

            out += _md_table(["after", *[f"{c.name} ({c.kind})" for c in r.columns]],
                             ([label, *[cell(c, n) for c, n in zip(row, counts)]]
                              for label, row in zip(r.row_labels, r.matrix)))
            out += ["", "Items per cell: " + ", ".join(
                f"{md_escape(c.name)} {n}" for c, n in zip(r.columns, counts)) + "."]
        out += ["", f"Method settings: {md_escape(settings_line(r))}.",
                "", f"{compute_heading(r).capitalize()}: {md_escape(compute_summary(r))}."]
        if (state := standing(where, r)) is not None:
            out += ["", f"Status: {md_escape(state)}."]
        if r.metrics:
            out += ["", *_md_table(["metric (n = 1)", "value", "variant"], metric_rows(r),
                                   right=[1])]
    incomplete = [str(d) for d, r in found if r.status != "complete"]
    if incomplete:
        out += ["", "Not complete (left out of the comparison): "
                    f"{md_escape(', '.join(incomplete))}."]
    for title, header, rows in [*comparison_tables(table_data), *cost_tables(cost_data or {}),
                                *extra_tables]:
        out += ["", f"### {md_escape(title)}", "", *_md_table(header, rows)]
    return "\n".join(out).strip() + "\n"


def _params(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in params.items())


def print_plan(console: Console, run: Any) -> None:
    """The validated plan of a run: stages and budgets, columns, model, method config and the
    add-ons'."""
    suite = run.suite
    console.print(f"[bold]suite[/] {escape(suite.name)} v{escape(suite.version)} "
                  f"({escape(run.suite_file or '')})  hash {suite.content_hash()[:19]}",
                  soft_wrap=True)
    console.print(f"[bold]method[/] {escape(run.method.name)}"
                  + "".join(f" + {escape(a.name)}" for a in run.addons)
                  + f"  [bold]seed[/] {run.seed}  "
                  f"[bold]device[/] {escape(run.device)}  [bold]out[/] {escape(run.out_dir)}"
                  + ("  [bold]joint reference run[/]" if run.joint else ""), soft_wrap=True)
    model = run.model
    console.print(f"[bold]model[/] {escape(model.name)} (dtype {model.dtype}"
                  + (f", revision {escape(model.revision)}" if model.revision else "")
                  + (f", generation {model.generation}" if model.generation != "loop" else "")
                  + ")")

    stages = Table(title="stages", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                   collapse_padding=True,
                   caption="train: items; prompts: per step; samples: per prompt; tokens: max "
                           "new tokens" + (" of each stage's items" if run.joint else "")
                           + "; lr -: the method's", caption_justify="left")
    stages.add_column("stage", no_wrap=True)
    stages.add_column("task", overflow="fold", min_width=12)
    for col in ("train", "steps", "prompts", "samples", "tokens", "temp", "lr"):
        stages.add_column(col, no_wrap=True, justify="right")
    for stage in run.training_stages():
        b = stage.budget
        source = " + ".join(s.task.source for s in suite.stages) if run.joint else \
            stage.task.source
        tokens = "/".join(str(s.budget.max_new_tokens) for s in suite.stages) if run.joint \
            else str(b.max_new_tokens)  # a joint run's items keep their own stage's cap
        stages.add_row(stage.name, escape(source),
                       str(stage.task.train_size), str(b.steps), str(b.prompts_per_step),
                       str(b.samples_per_prompt), tokens, f"{b.temperature:g}",
                       "-" if b.lr is None else f"{b.lr:g}")
    print_uncut(console, stages)

    title = "evaluation columns" if suite.protocol.split == "eval" else \
        "evaluation columns, scored on validation items (training-split items never trained on)"
    columns = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD,
                    show_edge=False, collapse_padding=True)
    for col in ("column", "kind", "source", "items"):
        columns.add_column(col, no_wrap=True)
    columns.add_column("params", overflow="fold", min_width=12)
    eval_size = suite.protocol.eval_size
    for stage in suite.stages:
        columns.add_row(stage.name, "stream", escape(stage.task.source),
                        str(stage.task.eval_size or eval_size), escape(_params(stage.task.params)))
    for probe in suite.probes:
        if probe.task is not None:
            columns.add_row(probe.name, probe.kind, escape(probe.task.source),
                            str(probe.task.eval_size or eval_size),
                            escape(_params(probe.task.params)))
        else:
            lm = probe.lm_eval
            columns.add_row(probe.name, probe.kind, escape(f"lm_eval:{lm.task}"),
                            str(lm.limit) if lm.limit else "all", f"metric={escape(lm.metric)}")
    print_uncut(console, columns)
    metrics = "none (a joint reference run)" if run.joint else ", ".join(suite.protocol.metrics)
    console.print(f"[bold]metrics[/] {metrics}; decoding "
                  f"temperature {suite.protocol.decoding.temperature:g}, max new tokens "
                  f"{suite.protocol.decoding.max_new_tokens}", soft_wrap=True)
    console.print("[bold]method config[/] " + escape(json.dumps(run.method.params, default=str)),
                  soft_wrap=True)
    for addon in run.addons:
        console.print(f"[bold]add-on[/] {escape(addon.name)} "
                      + escape(json.dumps(addon.params, default=str)), soft_wrap=True)


def print_resolution(console: Console, resolved: dict[str, Any]) -> None:
    """`clbench run --plan`: what `auto` device and precision resolve to on this machine."""
    console.print(f"[bold]on this machine[/] {_resolved(resolved)}", soft_wrap=True)


def _resolved(resolved: dict[str, Any]) -> str:
    threads = f", {resolved['cpu_threads']} threads" if "cpu_threads" in resolved else ""
    malloc = f", {escape(resolved['allocator'])} malloc" if "allocator" in resolved else ""
    return f"{escape(resolved['device'])}, {escape(resolved['precision'])}{threads}{malloc}"


def print_estimate(console: Console, estimate: Any, resolved: dict[str, Any],
                   calibration_seconds: float) -> None:
    """`clbench run --plan --estimate`: where the run's time will go on this machine, and its
    disk (:class:`clbench.run.estimate.RunEstimate`)."""
    console.print(f"[bold]estimate on this machine[/] {_resolved(resolved)} (calibrated in "
                  f"{clock_time(calibration_seconds)})", soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True,
                  caption="evaluation: each row evaluates every column's items at the measured "
                          "seconds of a batch; training: steps at the measured seconds of one",
                  caption_justify="left")
    for col, justify in (("part", "left"), ("work", "left"), ("time", "right")):
        table.add_column(col, no_wrap=True, justify=justify)  # type: ignore[arg-type]
    for c in estimate.columns:
        table.add_row(f"eval {escape(c.name)}", f"{estimate.rows} rows x {c.items} items, "
                      f"{c.batch_seconds:.1f} s per {c.batch_size}",
                      clock_time(estimate.rows * c.seconds))
    for s in estimate.stages:
        table.add_row(f"train {escape(s.name)}", f"{s.steps} steps x {s.step_seconds:.1f} s",
                      clock_time(s.seconds))
    if estimate.diagnostics_seconds:
        table.add_row("diagnostics", f"drift after {len(estimate.stages)} stages",
                      clock_time(estimate.diagnostics_seconds))
    table.add_row("[bold]total[/]", "", f"[bold]{clock_time(estimate.seconds)}[/]")
    print_uncut(console, table)
    console.print(f"[bold]disk[/] checkpoints at most {_size(estimate.disk_bytes)} (the last "
                  f"stage's, {_size(estimate.stage_checkpoint_bytes)}, and two of the stage in "
                  f"progress, {_size(estimate.step_checkpoint_bytes)} each)", soft_wrap=True)
    if estimate.not_estimated:
        console.print("[bold]not estimated[/] lm-eval probes: "
                      + ", ".join(escape(n) for n in estimate.not_estimated), soft_wrap=True)


def _size(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
