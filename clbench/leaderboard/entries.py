"""The leaderboard's data: results files found, checked, grouped into entries and aggregated.

An **entry** is one method setting on one model on one suite: the complete runs of the same
suite (name, version and content hash, task source versions: :func:`comparison_groups`), the
same model and the same method settings, one per seed. Runs of different suite versions or
hashes are different suites and never share a table. Per entry, over its seeds:

- every metric's mean, standard deviation, n and 95% Student-t interval
  (:func:`clbench.metrics.aggregate.seed_interval`);
- the accuracy matrix's mean per cell, every column's score after each stage;
- the diagnostics per stage (parameter and response drift, rollout entropy, collapse and
  amplified patterns) as means, and flags when any seed collapsed or amplified a pattern;
- compute: tokens, wall time, hardware, peak memory; provenance of every seed's run.

Everything here is data (`leaderboard.json` is :func:`board` as JSON); the site renders it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clbench.errors import UserError
from clbench.leaderboard.ranking import rank_entries
from clbench.metrics.aggregate import SeedSummary, mean_of_numbers, seed_interval, summarise
from clbench.report.comparison import (
    addon_settings_in_force,
    code_version,
    comparison_groups,
    metric_order,
    settings_in_force,
)
from clbench.results import RunResult, read_results
from clbench.run.scores import recomputed_metrics

#: The metrics of the index table, in order (others appear on entry pages).
INDEX_METRICS = ("acc", "la", "bwt", "fwt", "forgetting", "ood_delta", "general_delta")

#: What each metric is, for the headers' tooltips (the variant is added where runs record one).
METRIC_HELP = {
    "acc": "average accuracy over the stream tasks after the last stage",
    "la": "learning accuracy: each stream task's score right after its own stage",
    "bwt": "backward transfer: change of earlier tasks' scores by the end (negative = forgetting)",
    "fwt": "forward transfer: a task's score before its stage, against the base model's",
    "forgetting": "mean drop from each earlier task's best score to its final one",
    "ood_delta": "change of the out-of-distribution probes from the base model",
    "general_delta": "change of the general-ability probes from the base model",
    "op": "overall performance", "aia": "average incremental accuracy",
    "intransigence": "gap to the joint reference on each task",
}


def find_results(paths: Sequence[str | Path], problems: list[str]) -> list[tuple[Path, RunResult]]:
    """Every readable results file among `paths` (files, or folders searched for
    `results.json` and other `*.json` files). A file that is not a valid results file is
    reported in `problems` (its path and why) and left out; a complete run whose stored
    metrics differ from its matrix's is reported there too, and shown with the recomputed ones
    (:func:`clbench.run.scores.recomputed_metrics`)."""
    found: list[tuple[Path, RunResult]] = []
    for path in map(Path, paths):
        if not path.exists():
            raise UserError(f"{path}: no such file or folder")
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*.json") if p.is_file() and _searched(p, path))
        for f in files:
            try:
                result = read_results(f)
            except UserError as exc:
                problems.append(str(exc))
                continue
            result.metrics, mismatches = recomputed_metrics(result)
            problems += [f"{f}: {line} (the recomputed value is shown)" for line in mismatches]
            found.append((f, result))
    return found


#: What a run folder holds besides its results: not searched for results.
RUN_FOLDER_FILES = frozenset({"run.json", "kept-time.json", "cells.json", "leaderboard.json"})
RUN_FOLDER_DIRS = frozenset({"items", "checkpoints", "stages", "work"})


def _searched(path: Path, root: Path) -> bool:
    return path.name not in RUN_FOLDER_FILES and not any(
        part in RUN_FOLDER_DIRS for part in path.relative_to(root).parts[:-1])


def model_name(result: RunResult) -> str:
    return str(result.model.spec.get("name") or "unrecorded")


def _slug(*parts: str) -> str:
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]
    name = re.sub(r"[^a-z0-9]+", "-", parts[-1].lower()).strip("-")[:40]
    return f"{name}-{digest}" if name else digest


def _summary_dict(summary: SeedSummary) -> dict[str, Any]:
    interval = seed_interval(summary)
    return {**summary.as_dict(), "low": interval[0] if interval else None,
            "high": interval[1] if interval else None}


def _matrix(runs: Sequence[RunResult]) -> dict[str, Any]:
    first = runs[0]
    longest = max(runs, key=lambda r: len(r.matrix))  # a collapsed seed stops early
    rows = len(longest.matrix)
    cells = [[summarise(r.matrix[i][j].score if i < len(r.matrix) and r.matrix[i][j] is not None
                        else None for r in runs)
              for j in range(len(first.columns))] for i in range(rows)]
    return {"rows": list(longest.row_labels) or [f"row {i}" for i in range(rows)],
            "columns": [{"name": c.name, "kind": c.kind, "stage": c.stage}
                        for c in first.columns],
            "mean": [[c.mean for c in row] for row in cells],
            "std": [[c.std for c in row] for row in cells]}


def _diagnostics(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per stage, means over the seeds of the headline diagnostics."""
    out = []
    stages = max(len(r.stages) for r in runs)
    for i in range(stages):
        records = [r.stages[i] for r in runs if i < len(r.stages)]
        d = [s.diagnostics for s in records]
        amplified = sorted({f"{column}: {pattern}" for x in d
                            for column, report in x.get("artifacts", {}).items()
                            for pattern in report.get("amplified", [])})
        def mean(*path: str, d: list[dict[str, Any]] = d) -> float | None:
            values = []
            for x in d:
                for key in path:
                    x = x.get(key, {}) if isinstance(x, dict) else {}
                values.append(x)
            return mean_of_numbers(values)

        out.append({
            "stage": records[0].index, "name": records[0].name,
            "nss_vs_base": mean("weight_drift", "vs_base", "all", "nss"),
            "angle_vs_base": mean("weight_drift", "vs_base", "all", "max_principal_angle"),
            "response_kl": mean("response_drift", "kl"),
            "edit_similarity": mean("response_drift", "edit_similarity"),
            "rollout_entropy": mean("rollouts", "entropy_last"),
            "collapsed_seeds": sum(bool(x.get("collapse")) for x in d),
            "amplified": amplified,
        })
    return out


def _examples(where: Path, result: RunResult) -> list[dict[str, Any]]:
    """A few graded completions of the last row: those the results file carries (schema 1.6),
    else the run folder's item records when they lie beside the file."""
    from clbench.eval.records import examples_of

    shown = result.examples or examples_of(where if where.is_dir() else where.parent, result)
    return [{"column": column, "id": x.id, "completion": x.completion, "correct": x.correct}
            for column, xs in shown.items() for x in xs]


def _provenance(result: RunResult) -> dict[str, Any]:
    settings = settings_in_force(result)
    sets = [f"--set method.{k}={json.dumps(v, default=str)}" for k, v in (settings or {}).items()]
    for name, addon in addon_settings_in_force(result).items():
        sets += [f"--addon {name}"] + [f"--set addon.{name}.{k}={json.dumps(v, default=str)}"
                                       for k, v in addon.items()]
    return {"seed": result.seed, "clbench": result.versions.get("clbench"),
            "git_revision": result.git_revision, "suite_hash": result.suite_hash,
            "versions": dict(sorted(result.versions.items())),
            "method_distribution": result.method.distribution,
            "method_version": result.method.version,
            "addons": [{"name": a.name, "distribution": a.distribution, "version": a.version}
                       for a in result.addons],
            "created": result.created.isoformat(), "updated": result.updated.isoformat(),
            "suite_version": result.suite.get("version"),
            "command": f"clbench run --suite {result.suite.get('name')} --method "
                       f"{result.method.name} --seed {result.seed}"
                       + "".join(f" {s}" for s in sets)}


def _entry(suite: str, label: str, runs: list[tuple[Path, RunResult]]) -> dict[str, Any]:
    runs = sorted(runs, key=lambda pr: pr[1].seed)
    results = [r for _, r in runs]
    first = results[0]
    names = metric_order({n for r in results for n in r.metrics})
    metrics = {}
    for name in names:
        values = [r.metrics[name] for r in results if name in r.metrics]
        metrics[name] = {**_summary_dict(summarise(v.value for v in values)),
                         "higher_is_better": values[0].higher_is_better,
                         "variant": values[0].variant}
    hardware = sorted({(r.compute.device or "unrecorded").split(":")[0] for r in results})
    tokens = [sum(r.compute.tokens.values()) for r in results]
    diagnostics = _diagnostics(results)
    diagnosed = any(r.stages and any(s.diagnostics for s in r.stages) for r in results)
    settings = settings_in_force(first)
    return {
        "id": _slug(suite, model_name(first), label), "suite": suite, "label": label,
        "method": first.method.name, "model": model_name(first),
        "settings": settings if settings is not None else first.method.config,
        "addons": [{"name": a.name, "config": a.config} for a in first.addons],
        "seeds": [r.seed for r in results], "n": len(results), "metrics": metrics,
        "matrix": _matrix(results), "diagnostics": diagnostics,
        "diagnosed": diagnosed,
        "flags": {"collapsed": any(r.status == "collapsed" for r in results)
                  or any(d["collapsed_seeds"] for d in diagnostics),
                  "amplified": any(d["amplified"] for d in diagnostics),
                  "not_measured": not diagnosed,
                  "mixed_code": len({code_version(r) for r in results}) > 1},
        "code": sorted({code_version(r) for r in results}),
        "compute": {"tokens": mean_of_numbers(tokens), "wall_time_s": mean_of_numbers(
                        [r.compute.wall_time_s or None for r in results]),
                    "hardware": hardware, "peak_memory_bytes": max(
                        (r.compute.peak_memory_bytes or 0 for r in results), default=0) or None},
        "date": max(r.updated for r in results).date().isoformat(),
        "provenance": [_provenance(r) for r in results],
        "examples": _examples(*runs[0]),
        "sources": [str(where) for where, _ in runs],
    }


def board(found: Sequence[tuple[Path, RunResult]], problems: list[str] | None = None
          ) -> dict[str, Any]:
    """`{"suites": [...], "left_out": [...]}`: every complete run in `found` in its suite's
    entry (collapsed runs count: a method that collapses is ranked, not hidden), with honest
    ranks (:mod:`.ranking`); the runs that are not shown, each with why (`left_out`). Suites
    are told apart by their hash as recorded, and one superseded by a later version or hash of
    the same suite says so. A second run of one entry's seed, or an entry whose files cannot
    be shown, is left out and said in `problems`: one bad file never takes the board down."""
    problems = [] if problems is None else problems
    contenders = [(p, r) for p, r in found if r.status in ("complete", "collapsed")
                  and not r.joint]
    ranked = {id(r) for _, r in contenders}
    left_out = [_left_out(p, r) for p, r in found if id(r) not in ranked]
    complete = [(p, r.model_copy(update={"status": "complete"})) for p, r in contenders]
    by_model: dict[str, list[tuple[Path, RunResult]]] = {}
    for path, result in complete:
        by_model.setdefault(model_name(result), []).append((path, result))
    original = {id(c[1]): o[1] for c, o in zip(complete, contenders)}
    suites: dict[str, dict[str, Any]] = {}
    shown: dict[str, list[RunResult]] = {}
    for _, runs in sorted(by_model.items(), key=lambda item: item[0]):
        where = {id(r): p for p, r in runs}
        groups = comparison_groups(runs, problems, suite_hash=lambda r: r.suite_hash)
        for suite, labels in groups.items():
            info = suites.setdefault(suite, _suite_info(suite, next(iter(labels.values()))[0]))
            for label, results in sorted(labels.items()):
                restored = [(where[id(r)], original[id(r)]) for r in results]
                try:
                    entry = _entry(suite, label, restored)
                except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError) as exc:
                    files = ", ".join(str(p) for p, _ in restored)
                    problems.append(f"{files}: left out, {label} cannot be shown "
                                    f"({type(exc).__name__}: {exc})")
                    continue
                info["entries"].append(entry)
                info["latest"] = max([info["latest"], *(r.updated for r in results)])
                shown[entry["id"]] = results
    for info in suites.values():
        rank_entries(info["entries"], shown, INDEX_METRICS)
        info["entries"].sort(key=lambda e: (e["rank"] or len(info["entries"]) + 1,
                                            -(e["metrics"].get("acc", {}).get("mean") or -1),
                                            e["label"], e["model"]))
        info["metric_variants"] = _variants(info["entries"])
        info["baselines"] = _baselines(info["entries"])
    _mark_superseded(list(suites.values()))
    ordered = sorted(suites.values(), key=lambda s: (s["superseded"], str(s["name"]),
                                                     -s["latest"].timestamp()))
    for info in ordered:
        info["latest"] = info["latest"].isoformat()
    return {"suites": ordered, "left_out": left_out}


def _baselines(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, the base model's ACC (row 0 of R, before any training: the mean of the
    stream columns, averaged over the entries' seeds), the line every entry is read against."""
    out: dict[str, list[float]] = {}
    for e in entries:
        matrix = e["matrix"]
        stream = [j for j, c in enumerate(matrix["columns"]) if c["kind"] == "stream"]
        row = [matrix["mean"][0][j] for j in stream] if matrix["mean"] else []
        if row and all(v is not None for v in row):
            out.setdefault(e["model"], []).append(sum(row) / len(row))
    return [{"model": m, "acc": sum(v) / len(v)} for m, v in sorted(out.items())]


def _left_out(where: Path, result: RunResult) -> dict[str, Any]:
    """A run the board does not rank, and why."""
    if result.joint:
        why = "a joint reference run (every stream task at once): a reference, not ranked"
    elif result.status == "failed":
        why = f"failed: {result.error or 'no reason recorded'}"
    else:
        rows = 1 + sum(c.kind == "stream" for c in result.columns)
        why = (f"{result.status}: {len(result.matrix)} of {rows} rows of the accuracy matrix; "
               "an entry averages complete runs only")
    return {"source": str(where), "suite": result.suite.get("name"),
            "version": result.suite.get("version"), "entry": result.entry_name(),
            "seed": result.seed, "status": result.status, "why": why}


def _suite_info(key: str, result: RunResult) -> dict[str, Any]:
    """A suite's header: as recorded, and as this installation ships it when it knows the
    suite by name (`current`: its version, hash and description)."""
    current = _current_suite(str(result.suite.get("name")))
    recorded = {"version": result.suite.get("version"), "hash": result.suite_hash,
                "description": result.suite.get("description") or ""}
    is_current = current is not None and current["hash"] == result.suite_hash
    return {"key": key, "id": _slug(key, str(result.suite.get("name"))),
            "name": result.suite.get("name"), **recorded, "recorded": recorded,
            "current": current, "is_current": is_current,
            "description": current["description"] if is_current else recorded["description"],
            "stages": [s.get("name") for s in _as_list(result.suite.get("stages"))
                       if isinstance(s, dict)],
            "entries": [], "superseded": False, "latest": result.updated}


def _as_list(value: Any) -> list[Any]:
    """`value` when a results file holds a list there, else nothing (a file is data)."""
    return value if isinstance(value, list) else []


def _current_suite(name: str) -> dict[str, Any] | None:
    """The suite `name` as this installation ships it (a named suite only: a results file's
    suite name is never read as a path), or None."""
    from clbench.spec.suites import list_suites, load_suite

    try:
        if name not in {info.name for info in list_suites()}:
            return None
        spec = load_suite(name)
    except (UserError, ValueError, OSError):
        return None
    return {"version": spec.version, "hash": spec.content_hash(),
            "description": spec.description or ""}


def _mark_superseded(suites: list[dict[str, Any]]) -> None:
    """Of the suites of one name, the one at the current hash (else the newest version, then
    the latest runs) leads; the others are `superseded`, with the lead's version and hash."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for info in suites:
        by_name.setdefault(str(info["name"]), []).append(info)
    for group in by_name.values():
        lead = max(group, key=lambda s: (s["is_current"], _version_key(s["version"]),
                                         s["latest"]))
        for info in group:
            info["superseded"] = info is not lead
            info["superseded_by"] = None if info is lead else \
                {"version": lead["version"], "hash": lead["hash"]}


def _version_key(version: Any) -> tuple[int, ...] | tuple[str]:
    parts = str(version).split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else (str(version),)


def _variants(entries: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Per metric, the variants its entries use (joined when they differ)."""
    out: dict[str, set[str]] = {}
    for entry in entries:
        for name, m in entry["metrics"].items():
            if m.get("variant"):
                out.setdefault(name, set()).add(m["variant"])
    return {name: " / ".join(sorted(v)) for name, v in out.items()}
