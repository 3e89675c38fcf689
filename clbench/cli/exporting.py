"""`clbench export-lm-eval` and `export-model`: a suite's tasks and a run's model in the forms
other tools read (lm-eval tasks, a Hugging Face model folder)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click
from rich.markup import escape

from clbench.cli.app import cli, parse_sets, stdout_console
from clbench.errors import UserError
from clbench.results import RESULTS_FILENAME, read_results


@cli.command("export-lm-eval")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--suite", "suite_ref", required=True, metavar="NAME|FILE",
              help="A named suite or a suite file.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Suite override (repeatable), e.g. --set protocol.eval_size=100.")
def export_lm_eval_command(out_dir: str, suite_ref: str, sets: tuple[str, ...]) -> None:
    """Export a suite's clbench tasks as lm-eval tasks (YAML + JSONL + grader hook).

    Score any Hugging Face model folder with lm-eval itself (clbench must be installed for the
    grader), e.g. a run's trained model written by `clbench export-model`:

    \b
    Example:
      clbench export-lm-eval lmeval_tasks --suite starter
      clbench export-model runs/starter/sdpo/s0 models/starter-sdpo-s0
      lm_eval --model hf --model_args pretrained=models/starter-sdpo-s0 \\
          --include_path lmeval_tasks --tasks clbench_starter
    """
    from clbench.eval.lmeval_export import export_lm_eval
    from clbench.plugins.runspec import validate_suite_plugins
    from clbench.spec.suites import load_suite, resolve_suite

    path = resolve_suite(suite_ref)
    suite = load_suite(path, parse_sets(sets))
    validate_suite_plugins(suite, path)
    removed: list[Path] = []
    written = export_lm_eval(suite, out_dir, removed)
    console = stdout_console()
    for p in written:
        console.print(f"wrote {p}")
    for p in removed:
        console.print(f"removed {p} (an earlier export of a column the suite no longer has)")
    console.print(f"{len(written)} lm-eval tasks (tag clbench_{suite.name.replace('-', '_')}) "
                  f"in {out_dir}")


@cli.command("export-model")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--trust-remote-code", is_flag=True,
              help="Let the model's hub repository run its own Python code to rebuild it. Only "
                   "this flag allows it: what a run folder recorded never does.")
@click.option("--adapter-only", is_flag=True,
              help="For a run that trained a LoRA adapter: write the adapter alone in peft's "
                   "format (PeftModel.from_pretrained(base, OUT_DIR) loads it) instead of the "
                   "model with the adapter merged in.")
def export_model_command(run_dir: str, out_dir: str, trust_remote_code: bool,
                         adapter_only: bool) -> None:
    """Write a run's trained model (after its last trained stage) as a Hugging Face model
    folder: config, safetensors weights, tokenizer. `from_pretrained` and lm-eval load it.
    A run that trained an adapter is written with it merged in (or alone: --adapter-only).
    A run stopped while evaluating a stage has that stage's model: its row of R is not in the
    results yet.

    \b
    Example:
      clbench export-model runs/starter/sdpo/s0 models/starter-sdpo-s0
    """
    from clbench.run.model_export import export_model

    out, stage = export_model(run_dir, out_dir, trust_remote_code=trust_remote_code,
                              adapter_only=adapter_only)
    note = ""
    with contextlib.suppress(UserError):
        if len(read_results(Path(run_dir) / RESULTS_FILENAME).matrix) <= stage:
            note = " (trained; the run stopped before its row of R was complete)"
    what = "the adapter" if adapter_only else "the model"
    stdout_console().print(f"wrote {what} after stage {stage}{note} of {escape(run_dir)} to "
                           f"{escape(str(out))}", soft_wrap=True)
