"""`clbench leaderboard build`: the static site, from :mod:`clbench.leaderboard.entries`' data.

The site is self-contained and relative: `index.html` (per suite a sortable, filterable table),
`entries/<id>.html` (an entry's metrics with intervals, its accuracy matrix as a heatmap, every
column's curve over the stages, diagnostics, example completions, settings, provenance and its
raw results files under `raw/`), `compare/<suite>.html` (every entry of a suite on one plot per
column), `leaderboard.json` (the data) and `assets/` (a stylesheet and the sorting script). No
file refers to anything outside the folder, so it works from `file://` and any static host.

Safety: the templates (the `clbench_leaderboard` package, top-level `leaderboard/` in the
repository) are rendered by Jinja2 with autoescaping and strict undefined variables, so every
string from a results file (method names, settings, completions) is escaped; every link is built
here from slugs of `[a-z0-9-]` and the site's own file names, never from a results file. A
rebuild from the same files writes the same bytes (plots included: :mod:`.plots`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clbench.atomic import atomic_dir
from clbench.errors import UserError
from clbench.leaderboard import plots
from clbench.leaderboard.entries import INDEX_METRICS, METRIC_HELP, board, find_results
from clbench.metrics.aggregate import format_value
from clbench.report.comparison import format_gib

#: The file that marks a folder as a site this command wrote (and may replace).
DATA_FILE = "leaderboard.json"


def _templates() -> Path:
    import clbench_leaderboard

    return Path(clbench_leaderboard.__file__).resolve().parent


def _fmt(value: Any, digits: int = 3) -> str:
    return "—" if not isinstance(value, (int, float)) else format_value(float(value), digits)


def _clock(seconds: Any) -> str:
    from clbench.progress import clock_time

    return "—" if not isinstance(seconds, (int, float)) else clock_time(seconds)


def _short_hash(value: Any) -> str:
    """A content hash's first 12 hex digits, without its `sha256:` prefix."""
    return str(value).removeprefix("sha256:")[:12]


def _count(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "—"
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


def _environment() -> Any:
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    env = Environment(loader=FileSystemLoader(str(_templates() / "templates")), autoescape=True,
                      undefined=StrictUndefined, keep_trailing_newline=True)
    env.globals.update(fmt=_fmt, clock=_clock, count=_count, gib=format_gib, help=METRIC_HELP,
                       short_hash=_short_hash)
    return env


def _column_lines(entry: dict[str, Any]) -> dict[str, list[float | None]]:
    matrix = entry["matrix"]
    return {c["name"]: [row[j] for row in matrix["mean"]]
            for j, c in enumerate(matrix["columns"])}


def _prepare_out(out: str | Path, inputs: Sequence[str | Path]) -> Path:
    """`out` as an absolute path with `..` resolved: an empty or missing folder, or a site this
    command built (replaced whole); anything else is refused rather than overwritten: a file,
    a folder of other files, the working folder, a folder that holds or is inside what is
    read."""
    given, out = out, Path(os.path.abspath(out))
    if out == Path.cwd() or out == out.parent:
        raise UserError(f"--out {given}: the working folder (or the root); name a folder for the "
                        "site, e.g. --out site")
    for source in map(lambda p: Path(os.path.abspath(p)), inputs):
        if out == source or out in source.parents or source in out.parents:
            raise UserError(f"--out {given}: it holds, or is inside, results read ({source}); "
                            "name a folder apart from them")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {given}: a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / DATA_FILE).is_file():
        raise UserError(f"--out {given}: a folder that holds other files and no {DATA_FILE}; "
                        "name an empty or new folder (an earlier site is replaced)")
    return out


def build(paths: Sequence[str | Path], out: str | Path, strict: bool = False
          ) -> tuple[dict[str, Any], list[str]]:
    """Build the site into `out` from the results files found in `paths`; returns the data
    and the problems with files that were skipped (`strict`: a problem is an error). The
    site is built beside `out` and renamed into place: an earlier site stays whole until then."""
    from clbench import __version__

    out = _prepare_out(out, paths)
    problems: list[str] = []
    found = find_results(paths, problems)
    data = board(found, problems)
    if problems and strict:
        raise UserError(f"{len(problems)} results file(s) cannot be used (--strict), each "
                        "named with the reason:\n" + "\n".join(f"  - {p}" for p in problems))
    common = {"clbench_version": __version__, "run_count": len(found)}
    with atomic_dir(out) as staging:
        public = _write_site(staging, data, problems, _environment(), common)
    return public, problems


def _write_site(staging: Path, data: dict[str, Any], problems: list[str], env: Any,
                common: dict[str, Any]) -> dict[str, Any]:
    """Every page, plot, raw results file and the data of the site into `staging`; the data
    as `leaderboard.json` holds it."""
    from markupsafe import Markup

    raw_names: dict[str, list[str]] = {}
    for suite in data["suites"]:
        for e in suite["entries"]:
            raw_names[e["id"]] = [f"raw/{e['id']}/s{p['seed']}.json" for p in e["provenance"]]
    (staging / "entries").mkdir(parents=True)
    (staging / "compare").mkdir()
    shutil.copytree(_templates() / "assets", staging / "assets")
    higher = {m: True for m in INDEX_METRICS}
    for suite in data["suites"]:
        for e in suite["entries"]:
            higher.update({m: s["higher_is_better"] for m, s in e["metrics"].items()})
    _write(staging / "index.html", env.get_template("index.html").render(
        root="", suites=data["suites"], metrics=INDEX_METRICS, higher=higher,
        left_out=data["left_out"], problems=problems, **common))
    for suite in data["suites"]:
        for e in suite["entries"]:
            steps = e["matrix"]["rows"]
            columns = [c["name"] for c in e["matrix"]["columns"]]
            page = env.get_template("entry.html").render(
                root="../", suite=suite, e=e, raw=raw_names[e["id"]],
                settings_json=json.dumps(e["settings"], indent=2, sort_keys=True, default=str),
                heatmap_svg=Markup(plots.heatmap(e["matrix"]["mean"], steps, columns)),
                curves_svg=Markup(plots.curves(_column_lines(e), steps)), **common)
            _write(staging / "entries" / f"{e['id']}.html", page)
            for source, name in zip(e["sources"], raw_names[e["id"]]):
                target = staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
        charts = []
        for j, column in enumerate(suite["entries"][0]["matrix"]["columns"]
                                   if suite["entries"] else []):
            lines = {e["label"] + ("" if len({x["model"] for x in suite["entries"]}) == 1
                                   else f" ({e['model']})"): [row[j] for row in e["matrix"]["mean"]]
                     for e in suite["entries"] if j < len(e["matrix"]["columns"])}
            charts.append({"column": column["name"], "kind": column["kind"],
                           "svg": Markup(plots.curves(lines, suite["entries"][0]["matrix"]["rows"],
                                                      ylabel=column["name"]))})
        _write(staging / "compare" / f"{suite['id']}.html", env.get_template("compare.html").render(
            root="../", suite=suite, charts=charts, **common))
    public = {"clbench_version": common["clbench_version"], "problems": problems,
              "left_out": data["left_out"],
              "suites": [{**s, "entries": [{k: v for k, v in e.items() if k != "sources"}
                                           for e in s["entries"]]} for s in data["suites"]]}
    _write(staging / DATA_FILE, json.dumps(public, indent=1, sort_keys=True, default=str) + "\n")
    return public


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def preview_server(site: str | Path, port: int = 8000) -> Any:
    """An HTTP server of `site` on 127.0.0.1:`port` (0: any free port), not yet serving; its
    `server_address` says where. A port in use is a UserError."""
    import functools
    import http.server

    site = Path(site)
    if not (site / "index.html").is_file():
        raise UserError(f"{site}: no index.html (build the site with `clbench leaderboard build "
                        "RESULTS --out SITE` first)")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # one line per request: noise
            return None

        def log_error(self, format: str, *args: Any) -> None:  # a 404 is the client's business
            return None

    class QuietServer(http.server.ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            # a browser that closes a connection mid-answer is no error of the site's
            if isinstance(sys.exc_info()[1], ConnectionError):
                return
            super().handle_error(request, client_address)

    handler = functools.partial(Quiet, directory=str(site))
    try:
        return QuietServer(("127.0.0.1", port), handler)
    except OSError as exc:
        raise UserError(f"cannot serve on port {port}: {exc.strerror}; choose another with "
                        "--port") from None


def serve(site: str | Path, port: int = 8000) -> None:
    """Serve `site` on http://127.0.0.1:`port` until interrupted."""
    with preview_server(site, port) as server:
        server.serve_forever()
