"""`clbench leaderboard build` and `serve`: the static leaderboard site from results files."""

from __future__ import annotations

import click
from rich.markup import escape

from clbench.cli.app import ClbenchGroup, cli, stdout_console


@cli.group("leaderboard", cls=ClbenchGroup)
def leaderboard_group() -> None:
    """Build and preview the leaderboard: a static site generated from results files.

    \b
    Example:
      clbench leaderboard build leaderboard/results runs/ --out site
      clbench leaderboard serve site
    """


@leaderboard_group.command("build")
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="The site's folder: new, empty, or a site built before (replaced).")
@click.option("--strict", is_flag=True, help="Fail on a results file that cannot be used "
              "instead of skipping it.")
def build_command(results: tuple[str, ...], out: str, strict: bool) -> None:
    """Build the site from RESULTS: results files, or folders searched for them (`results.json`
    of run folders and any other `*.json` results file). Runs are grouped by suite (name,
    version, content hash), then by method, model and settings; each group is aggregated over
    its seeds. A file that is not a valid results file is named with the reason and skipped.

    \b
    Example:
      clbench leaderboard build leaderboard/results --out site
    """
    from clbench.leaderboard.site import build

    data, problems = build(results, out, strict=strict)
    console = stdout_console()
    for problem in problems:
        console.print(f"[yellow]skipped[/] {escape(problem)}", soft_wrap=True)
    for run in data["left_out"]:
        console.print(f"[dim]not ranked[/] {escape(run['source'])}: {escape(run['why'])}",
                      soft_wrap=True)
    entries = sum(len(s["entries"]) for s in data["suites"])
    console.print(f"wrote {escape(out)}: {len(data['suites'])} suite(s), {entries} entries "
                  f"(open {escape(out)}/index.html, or `clbench leaderboard serve {escape(out)}`)",
                  soft_wrap=True)


@leaderboard_group.command("serve")
@click.argument("site", type=click.Path(exists=True, file_okay=False))
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
              help="Port on 127.0.0.1.")
def serve_command(site: str, port: int) -> None:
    """Preview a built site on http://127.0.0.1:PORT (Ctrl-C stops).

    \b
    Example:
      clbench leaderboard serve site --port 8000
    """
    from clbench.leaderboard.site import serve

    stdout_console().print(f"serving {escape(site)} on http://127.0.0.1:{port}/ (Ctrl-C stops)")
    serve(site, port)
