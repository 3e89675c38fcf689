"""The measurements behind docs/findings.md, from complete runs of one suite.

    python benchmarks/findings.py leaderboard/results/starter/*.json

Prints, as Markdown, one row per run (scores, tokens trained, cost, provenance), then one table per
claim of the paper (docs/findings.md has the claims): the methods' means over seeds, and for the
pairs a claim compares the difference with a 95% seed-and-item bootstrap interval (seeds resampled,
every cell redrawn as a binomial at its score and item count, as `clbench report --compare` does).
Weight drift has no items: its difference gets an exact permutation test over seeds instead. Methods
are labelled as `clbench report` labels them (`sdpo (teacher="ema")` for the EMA variant). Claim 5
fits a quadratic to each run's points of column change over a stage against the column's MMD to that
stage's training prompts (every column not trained by then: the held-out probes and the later
stages' tasks) and bootstraps its curvature: an inverted U has curvature below 0 and its peak inside
the measured distances. Each cell is redrawn on its own, though consecutive rows score the same
items: the item noise of a change between rows is overstated, so "within noise" verdicts on changes
are conservative.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable, Sequence

import numpy as np

from clbench.progress import clock_time
from clbench.report.comparison import comparison_groups, format_gib
from clbench.report.runs import collect_results
from clbench.results import RunResult

SAMPLES = 2000


def _matrix(run: RunResult) -> tuple[np.ndarray, np.ndarray]:
    scores = np.array([[np.nan if v is None else v for v in row] for row in run.score_matrix()])
    counts = np.array([[0 if c is None else c.n for c in row] for row in run.matrix])
    return scores, counts


def _draws(runs: Sequence[RunResult], value: Callable[[RunResult, np.ndarray], float | None],
           rng: np.random.Generator) -> np.ndarray:
    """One method's mean of `value(run, redrawn matrix)` over resampled seeds, per draw."""
    out = np.full(SAMPLES, np.nan)
    mats = [_matrix(r) for r in runs]
    for b in range(SAMPLES):
        values = []
        for i in rng.integers(0, len(runs), size=len(runs)):
            p, n = mats[i]
            p = np.where(n > 0, rng.binomial(np.maximum(n, 1), np.nan_to_num(p))
                         / np.maximum(n, 1), np.nan)
            v = value(runs[i], p)
            if v is not None and not np.isnan(v):
                values.append(v)
        if values:
            out[b] = float(np.mean(values))
    return out


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3g} (n=1)"
    return f"{_zeroed(statistics.mean(values)):.3g} ± {statistics.stdev(values):.2g} " \
        f"(n={len(values)})"


def _zeroed(x: float) -> float:
    """`x`, with the rounding residue of shares that cancel (-3e-18) shown as the 0 it is."""
    return 0.0 if abs(x) < 1e-12 else x


def _difference(a: Sequence[RunResult], b: Sequence[RunResult],
                fn: Callable[[RunResult, np.ndarray], float | None], items: bool,
                rng: np.random.Generator) -> str:
    """`a - b`'s mean difference and its interval, with a verdict. With one seed on a side the
    interval holds the items' noise alone and says so; a measure without items (weight drift)
    gets a permutation test over seeds instead of an interval."""
    va, vb = _values(a, fn), _values(b, fn)
    if not va or not vb:
        return "n/a"
    if not items:
        return _permutation(va, vb)
    one_seed = len(a) < 2 or len(b) < 2
    return _interval(statistics.mean(va) - statistics.mean(vb),
                     _draws(a, fn, rng) - _draws(b, fn, rng), one_seed)


def _values(runs: Sequence[RunResult], fn: Callable[[RunResult, np.ndarray], float | None]
            ) -> list[float]:
    return [v for r in runs if r.matrix and (v := fn(r, _matrix(r)[0])) is not None]


def _permutation(a: list[float], b: list[float]) -> str:
    """`mean(a) - mean(b)` with the exact two-sided permutation p over seeds, for a measure
    without items (weight drift): a bootstrap of two or three seeds per side would give an
    interval far narrower than the seeds can support. Every split of the pooled seeds counts;
    the smallest p is 2 / C(n_a + n_b, n_a) (0.1 at three seeds each), so at so few seeds no
    drift difference can be beyond noise, whatever its size."""
    diff = statistics.mean(a) - statistics.mean(b)
    if len(a) < 2 or len(b) < 2:
        return f"{diff:+.3g} (one seed: no test)"
    pooled, total = a + b, sum(a) + sum(b)
    splits = list(itertools.combinations(range(len(pooled)), len(a)))
    extreme = 0
    for chosen in splits:
        part = sum(pooled[i] for i in chosen)
        split = part / len(a) - (total - part) / len(b)
        extreme += abs(split) >= abs(diff) * (1 - 1e-9)
    p = extreme / len(splits)
    verdict = "beyond noise" if p < 0.05 else "within noise"
    return f"{diff:+.3g} (permutation p = {p:.2g}, smallest possible " \
        f"{2 / len(splits):.2g}) {verdict}"


def _mean(runs: Sequence[RunResult], fn: Callable[[RunResult, np.ndarray], float | None]
          ) -> float | None:
    values = _values(runs, fn)
    return float(np.mean(values)) if values else None


def _interval(point: float, draws: np.ndarray, one_seed: bool) -> str:
    """`point` with the 95% interval of `draws` and whether it excludes 0."""
    draws = draws[~np.isnan(draws)]
    point = _zeroed(point)
    lo, hi = np.percentile(draws, [2.5, 97.5])
    verdict = "beyond noise" if lo > 0 or hi < 0 else "within noise"
    return f"{point:+.3g} [{lo:+.3g}, {hi:+.3g}] {verdict}" + \
        (" (items only: one seed)" if one_seed else "")


def _column(run: RunResult, name: str) -> int | None:
    names = [c.name for c in run.columns]
    return names.index(name) if name in names else None


def cell(column: str, row: int = -1) -> Callable[[RunResult, np.ndarray], float | None]:
    def value(run: RunResult, p: np.ndarray) -> float | None:
        j = _column(run, column)
        return None if j is None else float(p[row][j])
    return value


def lost(column: str, after: int) -> Callable[[RunResult, np.ndarray], float | None]:
    """How much `column` fell from the row after stage `after` to the last row."""
    def value(run: RunResult, p: np.ndarray) -> float | None:
        j = _column(run, column)
        return None if j is None else float(p[after][j] - p[-1][j])
    return value


def ood_delta(run: RunResult, p: np.ndarray) -> float | None:
    ood = [j for j, c in enumerate(run.columns) if c.kind == "ood"]
    return float(np.nanmean(p[-1][ood] - p[0][ood])) if ood else None


def drift(key: str) -> Callable[[RunResult, np.ndarray], float | None]:
    def value(run: RunResult, p: np.ndarray) -> float | None:
        record = run.stages[-1].diagnostics.get("weight_drift", {}) if run.stages else {}
        v = record.get("vs_base", {}).get("all", {}).get(key)
        return None if v is None else float(v)
    return value


def transfer_points(run: RunResult, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(MMD, change) over every stage and every column the run has not trained on by the end
    of that stage (the held-out probes and the later stages' tasks; a trained column's change
    is learning or forgetting, not transfer): how far the column's probes are from the stage's
    training prompts, and how much the column moved over that stage in the (possibly redrawn)
    matrix `p`."""
    mmd, change = [], []
    for stage in run.stages:
        columns = stage.diagnostics.get("distance", {}).get("columns", {})
        for name, point in columns.items():
            j = _column(run, name)
            trained_by = None if j is None else run.columns[j].stage
            if (j is not None and (trained_by is None or trained_by > stage.index)
                    and point.get("mmd") is not None and stage.index < len(p)):
                mmd.append(point["mmd"])
                change.append(p[stage.index][j] - p[stage.index - 1][j])
    return np.array(mmd, dtype=float), np.array(change, dtype=float)


def curvature(run: RunResult, p: np.ndarray) -> float | None:
    """The x^2 coefficient of a least-squares quadratic through the run's (MMD, change) points:
    below 0 for an inverted U (None with fewer than three distinct distances)."""
    x, y = transfer_points(run, p)
    keep = ~np.isnan(y)
    if len(np.unique(x[keep])) < 3:
        return None
    return float(np.polyfit(x[keep], y[keep], 2)[0])


def distance_table(groups: dict[str, list[RunResult]], rng: np.random.Generator) -> None:
    """Claim 5: per method and over all runs, the quadratic's curvature with its interval, and
    the vertex of the quadratic through all the group's points (a peak when it curves down)."""
    print("\n### 5. OOD change against training-to-probe distance is an inverted U\n")
    print("| method | points | MMD range | curvature | vertex of the fit at MMD |")
    print("|---|---:|---:|---:|---:|")
    everyone = [r for runs in groups.values() for r in runs]
    for label, runs in [*groups.items(), ("all runs (methods resampled as seeds)", everyone)]:
        points = [transfer_points(r, _matrix(r)[0]) for r in runs if r.matrix]
        x = np.concatenate([pt[0] for pt in points]) if points else np.zeros(0)
        y = np.concatenate([pt[1] for pt in points]) if points else np.zeros(0)
        x, y = x[~np.isnan(y)], y[~np.isnan(y)]
        point = _mean(runs, curvature)
        if point is None or len(np.unique(x)) < 3:
            print(f"| {label} | {len(x)} | n/a | n/a | n/a |")
            continue
        c, b, _ = np.polyfit(x, y, 2)
        if abs(c) < 1e-9:
            where = "none (a straight line)"
        else:
            vertex = -b / (2 * c)
            where = f"{vertex:.2f} ({'peak' if c < 0 else 'trough'}" + \
                (")" if x.min() <= vertex <= x.max() else ", outside the range)")
        shown = _interval(point, _draws(runs, curvature, rng), len(runs) < 2)
        print(f"| {label} | {len(x)} | {x.min():.2f}-{x.max():.2f} | {shown} | {where} |")


def runs_table(groups: dict[str, list[RunResult]]) -> None:
    """One row per run: what it scored, what it trained and what it cost, and the code and
    thread count it ran with (the provenance a reader checks before comparing two rows)."""
    print("\n### The runs\n")
    print("| method | seed | ACC | BWT | OOD delta | math by row | tokens trained per stage "
          "| wall time | peak memory | threads | clbench |")
    print("|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|")
    for label, runs in groups.items():
        for run in sorted(runs, key=lambda r: r.seed):
            metric = {k: ("n/a" if m.value is None else f"{m.value:+.3f}" if k != "acc"
                          else f"{m.value:.3f}") for k, m in run.metrics.items()}
            i = _column(run, "math")
            math = "n/a" if i is None else " → ".join(
                "n/a" if row[i] is None else f"{row[i]:.2f}" for row in run.score_matrix())
            trained = " / ".join(f"{s.counters.get('trained_tokens', 0):,}" for s in run.stages)
            print(f"| {label} | {run.seed} | {metric.get('acc', 'n/a')} | "
                  f"{metric.get('bwt', 'n/a')} | {metric.get('ood_delta', 'n/a')} | {math} | "
                  f"{trained} | {clock_time(run.compute.wall_time_s)} | "
                  f"{format_gib(run.compute.peak_memory_bytes)} | "
                  f"{run.model.resolved.get('cpu_threads', '—')} | "
                  f"{(run.git_revision or '—')[:7]} |")


def table(title: str, groups: dict[str, list[RunResult]],
          measures: dict[str, tuple[Callable[[RunResult, np.ndarray], float | None], bool]],
          pairs: Sequence[tuple[str, str]]) -> None:
    rng = np.random.default_rng(0)
    print(f"\n### {title}\n")
    print("| method | " + " | ".join(measures) + " |")
    print("|---|" + "---:|" * len(measures))
    for label, runs in groups.items():
        cells = [_mean_sd(_values(runs, fn)) for fn, _ in measures.values()]
        print(f"| {label} | " + " | ".join(cells) + " |")
    present = [(a, b) for a, b in pairs if a in groups and b in groups]
    if not present:
        return
    print("\n| pair | " + " | ".join(measures) + " |")
    print("|---|" + "---:|" * len(measures))
    for a, b in present:
        cells = []
        for fn, items in measures.values():
            cells.append(_difference(groups[a], groups[b], fn, items, rng))
        print(f"| {a} − {b} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.json files or run folders")
    args = parser.parse_args()
    groups = comparison_groups(collect_results(args.results))
    for suite, labels in groups.items():
        print(f"## {suite}")
        runs_table(labels)
        ema = next((k for k in labels if "ema" in k), None)
        frozen = next((k for k in labels if k.startswith("sdpo (") and "frozen" in k), "sdpo")
        table("1. SDPO forgets more than GRPO over the stream", labels,
              {"math after its stage": (cell("math", 1), True), "final math": (cell("math"), True),
               "math lost since": (lost("math", 1), True), "OOD delta": (ood_delta, True)},
              [(frozen, "grpo"), ("stable-sdpo", "grpo"), ("sdpo-cot", "grpo")])
        table("2. SDPO drifts further than GRPO (after the last stage, against the base)",
              labels, {"NSS": (drift("nss"), False),
                       "max principal angle (deg)": (drift("max_principal_angle"), False)},
              [(frozen, "grpo"), ("sdpo-cot", frozen)])
        if ema is not None:
            table("3. An EMA-5% teacher is worse than a frozen or refresh-and-freeze one",
                  labels, {"math after its stage": (cell("math", 1), True),
                           "final math": (cell("math"), True)},
                  [(ema, frozen), (ema, "stable-sdpo")])
        table("4. Chain-of-thought supervision helps tool use and hurts math", labels,
              {"math after its stage": (cell("math", 1), True),
               "tool_use after its stage": (cell("tool_use", 3), True)},
              [("sdpo-cot", frozen)])
        distance_table(labels, np.random.default_rng(0))


if __name__ == "__main__":
    main()
