"""Export: every clbench task of a suite written as an lm-eval task.

Per column, a YAML and a JSONL of the eval items, plus a shared `utils.py` that loads the items
from beside itself and whose `process_results` calls the clbench grader, so anyone can score a
checkpoint on a suite with lm-eval itself, wherever the folder is copied. The opposite
direction, lm-eval tasks as probes, is :mod:`clbench.eval.lmeval`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from clbench.errors import UserError
from clbench.eval.lmeval_tasks import SHIPPED_TASK_DIR, TaggedScalar, TaskYamlDumper, TaskYamlLoader
from clbench.tasks.base import continuation, response_prefix, split_response_start

_UTILS = '''"""Data and grading of clbench tasks exported for lm-eval (grading needs `clbench`)."""

import os


def load_items(data_file, **unused):
    """The items of one task, read from beside this file (so the folder can be moved)."""
    import datasets

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), data_file)
    return datasets.load_dataset("json", data_files={"test": path})


def process_results(doc, results):
    from clbench.eval.lmeval_export import grade_exported_doc

    return grade_exported_doc(doc, results[0])
'''


def render_transcript(messages: Sequence[dict[str, str]]) -> str:
    """A chat as plain text with role labels, ending with the assistant's turn to speak (and
    the start of its response, when the chat holds one: the opened reasoning block of the
    `think` format)."""
    turns, start = split_response_start(list(messages))
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in turns]
    return "\n\n".join(parts) + "\n\nAssistant:" + (f" {start}" if start else "")


def export_lm_eval(suite: Any, out_dir: str | Path,
                   removed: list[Path] | None = None) -> list[Path]:
    """Write every clbench task of `suite` (stages and task probes) as an lm-eval task.

    Per column: `<suite>_<column>.yaml` and `<suite>_<column>.jsonl` (the same eval items the
    protocol evaluates), plus one shared `utils.py`. The tasks are `generate_until` with the
    protocol's greedy decoding; `process_results` grades with the clbench grader and reports
    `acc` (fraction correct) and `reward`. Returns the YAML paths.

    Each file is written atomically. The folder may hold other suites' exports; an earlier
    export of this suite's columns that the suite no longer has is deleted (its YAML and items;
    their paths are appended to `removed`), or the suite's tag would still run it.
    """
    import json

    from clbench.atomic import atomic_write_text
    from clbench.plugins import registry

    out = Path(out_dir).resolve()
    columns = [(s.name, s.task, f"stages[{i}].task.params") for i, s in enumerate(suite.stages)]
    columns += [(p.name, p.task, f"probes[{i}].task.params")
                for i, p in enumerate(suite.probes) if p.task is not None]
    decoding = suite.protocol.decoding
    names = {}
    for column, _, _ in columns:
        name = f"clbench_{suite.name}_{column}".replace("-", "_").replace(".", "_")
        if name in names.values():
            other = next(c for c, n in names.items() if n == name)
            raise UserError(f"columns {other!r} and {column!r} would both be exported as lm-eval "
                            f"task {name!r} (lm-eval names have no '-' or '.'); rename one")
        if name in _shipped_task_names():
            raise UserError(f"column {column!r} would be exported as lm-eval task {name!r}, the "
                            "name of a task shipped with clbench (probes see both); rename the "
                            "column or the suite")
        names[column] = name
    # Every column's items first: a task that cannot be built (a hub source offline) leaves
    # no half-written export behind.
    items = {column: registry.build_task(spec, where=where).examples(
                 "eval", spec.seed, spec.eval_size or suite.protocol.eval_size)
             for column, spec, where in columns}
    _refuse_others_files(out, [out / f"{n}.{ext}" for n in names.values()
                               for ext in ("yaml", "jsonl")] + [out / "utils.py"])
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for column, spec, _ in columns:
        name = names[column]
        data = out / f"{name}.jsonl"
        atomic_write_text(data, "".join(json.dumps({
            "id": ex.id, "prompt": render_transcript(ex.messages), "messages": ex.messages,
            "reference": ex.reference, "target": continuation(ex), "answer": ex.answer,
            "metadata": ex.metadata,
            "source": spec.source, "params": spec.params,
            # a task file's content grades its items (the file itself may not travel along)
            **({"definition": spec.definition.model_dump(mode="json")} if spec.definition
               else {})}, ensure_ascii=False) + "\n"
            for ex in items[column]))
        config = {
            "task": name, "tag": [f"clbench_{suite.name}".replace("-", "_")],
            # lm-eval would resolve a relative `data_files` against the working directory, so
            # utils.py loads the items from beside itself: the folder can be moved or shared.
            "custom_dataset": TaggedScalar("!function", "utils.load_items"),
            "dataset_kwargs": {"data_file": data.name},
            "test_split": "test", "output_type": "generate_until",
            "doc_to_text": "{{prompt}}", "doc_to_target": "{{target}}",
            # a prompt that ends inside the response (an opened reasoning block) is continued
            # as it is; lm-eval would put a space between it and a few-shot example's target
            "target_delimiter": "" if any(response_prefix(ex.messages)
                                          for ex in items[column]) else " ",
            "generation_kwargs": {"until": ["\nUser:", "\n\nUser:"], "do_sample": False,
                                  "max_gen_toks": decoding.max_new_tokens},
            "process_results": TaggedScalar("!function", "utils.process_results"),
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "reward", "aggregation": "mean",
                             "higher_is_better": True}],
            "metadata": {"version": 1.0, "suite": suite.name, "suite_version": suite.version,
                         "suite_hash": suite.content_hash(), "column": column},
        }
        path = out / f"{name}.yaml"
        atomic_write_text(path, _header(suite.name) + f"column {column!r}\n"
                          + yaml.dump(config, Dumper=TaskYamlDumper, sort_keys=False))
        written.append(path)
    atomic_write_text(out / "utils.py", _UTILS)
    for stale in sorted(out.glob("*.yaml")):
        if stale not in written and _first_line(stale).startswith(_header(suite.name)):
            for path in (stale, stale.with_suffix(".jsonl")):
                if path.exists():
                    path.unlink()
                    if removed is not None:
                        removed.append(path)
    return written


def _refuse_others_files(out: Path, paths: Sequence[Path]) -> None:
    """Refuse to write over a file an export of clbench did not write: a task YAML without the
    export's header (and the items beside it), a `utils.py` other than the export's own."""
    theirs = []
    for path in paths:
        if not path.exists() and not path.is_symlink():
            continue
        if path.suffix == ".py":
            ours = path.is_file() and _first_line(path) == _UTILS.splitlines(keepends=True)[0]
        else:
            yaml_path = path.with_suffix(".yaml")
            ours = path.is_file() and (not yaml_path.exists() or _first_line(
                yaml_path).startswith("# exported by clbench from suite "))
        if not ours:
            theirs.append(path)
    if theirs:
        raise UserError(f"{out} holds files that clbench did not export, which the export "
                        f"would write over: {', '.join(str(p) for p in theirs[:4])}"
                        + (f" and {len(theirs) - 4} more" if len(theirs) > 4 else "")
                        + "; export to another folder")


def _header(suite_name: str) -> str:
    """How an exported task's YAML starts (then `column '<name>'`): what marks an earlier
    export of the same suite."""
    return f"# exported by clbench from suite {suite_name!r}, "


def _first_line(path: Path) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.readline()
    except (OSError, UnicodeDecodeError):  # not an export of ours: left alone
        return ""


def _shipped_task_names() -> set[str]:
    """The `task:` names of the lm-eval tasks shipped with clbench."""
    return {yaml.load(p.read_text(encoding="utf-8"), Loader=TaskYamlLoader).get("task")
            for p in SHIPPED_TASK_DIR.glob("*.yaml")}


_GRADERS: dict[str, Any] = {}


def grade_exported_doc(doc: dict[str, Any], completion: str) -> dict[str, float]:
    """Grade an exported item with its clbench task source: `{"acc", "reward"}`."""
    import json

    from clbench.plugins import registry
    from clbench.spec.schema import TaskSpec
    from clbench.tasks.base import Example

    key = json.dumps([doc["source"], doc.get("params") or {}, doc.get("definition")],
                     sort_keys=True)
    if key not in _GRADERS:
        _GRADERS[key] = registry.build_task(TaskSpec(
            source=doc["source"], params=doc.get("params") or {},
            definition=doc.get("definition"), folder="." if doc.get("definition") else None))
    example = Example(id=doc["id"], messages=doc["messages"], reference=doc["reference"],
                      answer=doc["answer"], metadata=doc.get("metadata") or {})
    grade = _GRADERS[key].grade(example, completion)
    return {"acc": 1.0 if grade.correct else 0.0, "reward": float(grade.reward)}
