"""Comparing runs: complete runs grouped by suite and method setting, their metrics as mean ±
std over seeds, what they cost, and the tables and console rendering of both.

Used by `clbench report` (which also renders these tables as Markdown, in
:mod:`clbench.report.runs`) and at the end of `clbench sweep`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clbench import migrations
from clbench.errors import UserError
from clbench.report.tables import print_uncut
from clbench.results import RunResult, peak_memory_kind

#: Complete runs by suite key and method-setting label (:func:`comparison_groups`).
Groups = dict[str, dict[str, list[RunResult]]]

SUMMARY_METRICS = ("acc", "op", "la", "bwt", "fwt", "forgetting", "ood_delta", "general_delta",
                   "aia", "intransigence")


def metric_order(names: Iterable[str]) -> list[str]:
    """The headline metrics first, in their usual order, then any other metric a run has."""
    names = set(names)
    return [m for m in SUMMARY_METRICS if m in names] + sorted(names - set(SUMMARY_METRICS))


def suite_hash_as_read(result: RunResult) -> str:
    """The hash of the run's suite as the current schema reads it, so runs from before a field
    was added (at its default) group with runs from after; the stored hash if it no longer
    validates."""
    try:
        return result.suite_spec().content_hash()
    except ValueError:  # pydantic's ValidationError is a ValueError
        return result.suite_hash


def _versions_key(result: RunResult) -> str:
    """What tells runs of one suite apart by the versions of their task sources: nothing while
    every source is at version 1 (one without a version counts as 1), else a short digest of
    the versions."""
    import hashlib

    versions = sorted({(c.source, c.source_version or "1") for c in result.columns
                       if not c.source.startswith("lm_eval:")})
    if all(version == "1" for _, version in versions):
        return ""
    return "+" + hashlib.sha256(json.dumps(versions).encode()).hexdigest()[:6]


def method_settings(result: RunResult) -> Any:
    """The run's method config as recorded, in the current form: through
    :func:`clbench.migrations.method_config`, a field added since the run at the recorded
    defaults (as written when it is not a mapping). Read from the file alone: no plugin is
    imported to read a result."""
    config = migrations.method_config(result.method.name, result.method.config)
    if not isinstance(config, dict):
        return config
    return {**(result.method.defaults or {}), **config}


def recorded_settings(result: RunResult) -> Any:
    """A run's settings as one mapping: its method's (:func:`method_settings`), the adapter it
    trained instead of the whole model (`model.adapter`, when one), then each add-on's config
    under `NAME.FIELD`."""
    config = method_settings(result)
    if not isinstance(config, dict):
        return config
    adapter = (result.model.spec or {}).get("adapter") or {}
    # a value that is not a mapping is not one clbench writes: kept as read, so that the run
    # stands apart rather than beside runs that trained the whole model
    trained = {"model.adapter": adapter} \
        if not isinstance(adapter, dict) or adapter.get("kind", "none") != "none" else {}
    return {**config, **trained, **{f"{a.name}.{k}": v for a in result.addons
                                    for k, v in {**(a.defaults or {}), **a.config}.items()}}


def comparison_groups(found: Sequence[tuple[Path, RunResult]],
                      problems: list[str] | None = None,
                      suite_hash: Callable[[RunResult], str] = suite_hash_as_read) -> Groups:
    """The complete runs, by suite and method setting: `{suite key: {label: runs}}`.

    An entry is a method with its add-ons (`sdpo+ewc`); runs of one under different settings
    (e.g. another `lr`, another replay fraction) are apart, each labelled with the settings
    that tell it apart; settings are read from the file alone (:func:`recorded_settings`), so
    a run from before a field was added groups by what it did. A run found twice (the same
    results in two places) counts once; two different runs of one seed are refused (with
    `problems` given, the second is left out and said there instead). Suites are told apart by
    `suite_hash`: the hash as the current schema reads the suite (runs from before a field
    was added group with later ones), or, for the leaderboard, the hash as recorded."""
    entries = []
    configs: dict[tuple[str, str], dict[str, Any]] = {}
    for where, r in found:
        if r.status != "complete" or r.joint:  # a joint run is a reference, not a contender
            continue
        suite = f"{r.suite.get('name')}:{suite_hash(r)[:15]}{_versions_key(r)}"
        config = recorded_settings(r)
        key = json.dumps(config, sort_keys=True, default=str)
        configs.setdefault((suite, r.entry_name()), {})[key] = config
        entries.append((suite, key, where, r))
    groups: Groups = {}
    seen: dict[tuple[str, str, int], tuple[Path, RunResult]] = {}
    for suite, key, where, r in entries:
        label = _setting_label(r.entry_name(), key, configs[(suite, r.entry_name())])
        if (suite, label, r.seed) in seen:
            first, earlier = seen[(suite, label, r.seed)]
            if earlier.model_dump() == r.model_dump():
                continue  # one run, found in two places
            message = f"two different runs of {label} seed {r.seed}: {first} and {where}"
            if problems is None:
                raise UserError(f"{message}; name one of them")
            problems.append(f"{where}: left out, {message}")
            continue
        seen[(suite, label, r.seed)] = (where, r)
        groups.setdefault(suite, {}).setdefault(label, []).append(r)
    return groups


def mixed_code(groups: Groups) -> list[str]:
    """One line per entry whose runs were made by different code (clbench's commit, or the
    method's where it came from another checkout): their mean is over more than one version.
    A run that recorded no commit counts as a version of its own."""
    titles = suite_titles(groups)
    lines = []
    for suite, labels in groups.items():
        for label, runs in sorted(labels.items()):
            seeds: dict[str, list[int]] = {}
            for r in runs:
                seeds.setdefault(code_version(r), []).append(r.seed)
            if len(seeds) > 1:
                parts = "; ".join(f"{code}: seed{'s' if len(s) > 1 else ''} "
                                  f"{', '.join(map(str, sorted(s)))}"
                                  for code, s in sorted(seeds.items()))
                lines.append(f"{titles[suite]} / {label}: runs of different code ({parts})")
    return lines


def code_version(result: RunResult) -> str:
    """`clbench <commit>`, plus `method <commit>` when the method's checkout differs."""
    def short(revision: str | None) -> str:
        if not revision:
            return "not recorded"
        commit, _, dirty = revision.partition("+")
        return commit[:7] + (f"+{dirty}" if dirty else "")

    own, method = result.git_revision, result.method.git_revision
    text = f"clbench {short(own)}"
    return text if method is None or method == own else f"{text}, method {short(method)}"


def comparison(groups: Groups) -> dict[str, Any]:
    """Mean ± std over seeds of every headline metric, per suite and method setting
    (`groups` from :func:`comparison_groups`)."""
    from clbench.metrics.aggregate import aggregate_over_seeds

    out = {}
    for suite, labels in groups.items():
        runs = [{"method": label, "seed": r.seed,
                 "metrics": {k: {"value": v.value} for k, v in r.metrics.items()}}
                for label, results in labels.items() for r in results]
        out[suite] = {method: {name: s.as_dict() for name, s in metrics.items()}
                      for method, metrics in aggregate_over_seeds(runs).items()}
    return out


def cost_comparison(groups: Groups) -> dict[str, list[dict[str, Any]]]:
    """What the complete runs of each suite and method setting cost, per kind of hardware
    (device type and process count: wall times compare only on like hardware): runs, wall time
    per run (mean ± std over seeds, summed over resumed sessions) and the largest peak memory,
    which is GPU memory allocated on CUDA and the process's resident memory elsewhere."""
    from clbench.metrics.aggregate import summarise

    out: dict[str, list[dict[str, Any]]] = {}
    for suite, labels in groups.items():
        rows = out.setdefault(suite, [])
        for label, results in sorted(labels.items()):
            by_hardware: dict[str, list[RunResult]] = {}
            for r in results:
                by_hardware.setdefault(_hardware(r), []).append(r)
            for hardware, runs in sorted(by_hardware.items()):
                rows.append({
                    "method": label, "hardware": hardware, "runs": len(runs),
                    "wall_time_s": summarise(r.compute.wall_time_s or None
                                             for r in runs).as_dict(),
                    "peak_memory_bytes": max((r.compute.peak_memory_bytes or 0 for r in runs),
                                             default=0) or None,
                    "peak_memory_of": peak_memory_kind(hardware)})
    return out


def _hardware(result: RunResult) -> str:
    """`cpu`, `cuda`, `cuda x4` (four processes): what a run's wall time was measured on."""
    kind = (result.compute.device or "unrecorded").split(":")[0]
    processes = result.model.resolved.get("num_processes", 1) or 1
    return kind if processes == 1 else f"{kind} x{processes}"


def settings_in_force(result: RunResult) -> dict[str, Any] | None:
    """The run's method settings that differ from its method's defaults as the run recorded
    them (from the suite's `methods:` block or `--set method.X`); None when no defaults are
    recorded (the config then stands as written in results.json). Add-ons' settings:
    :func:`addon_settings_in_force`."""
    defaults, config = result.method.defaults, method_settings(result)
    if defaults is None or not isinstance(config, dict):
        return None
    return {k: v for k, v in config.items() if k not in defaults or v != defaults[k]}


def addon_settings_in_force(result: RunResult) -> dict[str, dict[str, Any]]:
    """Per add-on of the run, its settings that differ from its recorded defaults (all of
    them where none are recorded)."""
    return {a.name: {k: v for k, v in a.config.items()
                     if a.defaults is None or k not in a.defaults or v != a.defaults[k]}
            for a in result.addons}


def settings_line(result: RunResult) -> str:
    """`lr=3e-06, ...`, `the method's defaults`, or where they are recorded; then each add-on's
    (`; replay: fraction=0.5`, `; ewc: its defaults`)."""
    settings = settings_in_force(result)
    if settings is None:
        line = f"{result.method.name}'s settings as recorded in results.json (its defaults "\
            "are not recorded there)"
    elif not settings:
        line = f"{result.method.name}'s defaults"
    else:
        line = _assignments(settings)
    for name, addon in addon_settings_in_force(result).items():
        line += f"; {name}: {_assignments(addon) if addon else 'its defaults'}"
    return line


def _assignments(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in settings.items())


def _setting_label(name: str, key: str, configs: dict[str, Any]) -> str:
    """`sdpo`, or `sdpo (lr=1e-06)` when runs of `sdpo` differ in settings: the settings of
    the run with config `key` that are not the same in all of them."""
    if len(configs) < 2 or not all(isinstance(c, dict) for c in configs.values()):
        return name if len(configs) < 2 else f"{name} (settings {key[:12]})"
    fields = sorted({f for c in configs.values() for f in c})
    differing = [f for f in fields
                 if len({json.dumps(c.get(f), sort_keys=True) for c in configs.values()}) > 1]
    mine = configs[key]
    return f"{name} (" + ", ".join(f"{f}={json.dumps(mine.get(f))}" for f in differing) + ")"


def suite_titles(keys: Iterable[str]) -> dict[str, str]:
    """A title per suite key (`name:hash`): the name, with the hash when two suites share it
    (e.g. one of them run with another decoding batch)."""
    keys = list(keys)
    names = [key.split(":")[0] for key in keys]
    return {key: name if names.count(name) == 1 else f"{name} [{key.split(':', 1)[-1]}]"
            for key, name in zip(keys, names)}


def comparison_tables(table_data: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of each suite's comparison."""
    from clbench.metrics.aggregate import SeedSummary

    titles = suite_titles(table_data)
    tables = []
    for suite, methods in table_data.items():
        metrics_shown = metric_order({n for metrics in methods.values() for n in metrics})
        rows = [[method, *[SeedSummary(**metrics[n]).format() if n in metrics else "—"
                           for n in metrics_shown]] for method, metrics in sorted(methods.items())]
        tables.append((f"{titles[suite]}: mean ± std over seeds (n = seeds)",
                       ["method", *metrics_shown], rows))
    return tables


def cost_tables(cost_data: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of each suite's cost per run (:func:`cost_comparison`)."""
    from clbench.progress import clock_time

    def wall(summary: dict[str, Any]) -> str:
        mean, std, n = summary["mean"], summary["std"], summary["n"]
        if mean is None:
            return "—"
        spread = "" if std is None else f" ± {clock_time(std)}"
        return f"{clock_time(mean)}{spread} (n={n})"

    titles = suite_titles(cost_data)
    return [(f"{titles[suite]}: cost per run",
             ["method", "hardware", "runs", "wall time per run", "peak memory"],
             [[c["method"], c["hardware"], str(c["runs"]), wall(c["wall_time_s"]),
               "—" if not c["peak_memory_bytes"] else
               f"{format_gib(c['peak_memory_bytes'])} ({c['peak_memory_of']})"] for c in rows])
            for suite, rows in cost_data.items()]


def print_comparison(console: Console, table_data: dict[str, Any],
                     cost_data: dict[str, Any] | None = None,
                     extra_tables: Sequence[tuple[str, list[str], list[list[str]]]] = ()
                     ) -> None:
    for title, header, rows in [*comparison_tables(table_data), *cost_tables(cost_data or {}),
                                *extra_tables]:
        table = Table(title=escape(title))
        table.add_column(escape(header[0]), style="bold")
        for n in header[1:]:
            table.add_column(escape(n), justify="right")
        for row in rows:
            table.add_row(*map(escape, row))
        print_uncut(console, table)


def format_gib(size: int | None) -> str:
    """A memory size in GiB, one decimal; `—` when unknown."""
    return "—" if not size else f"{size / 2**30:.1f} GiB"
