"""General-ability probes through lm-evaluation-harness, on the model in memory.

A probe column names an lm-eval task (a built-in one such as `mmlu`, one from an
``include_path`` folder, or a task YAML path). It runs in-process: lm-eval's HF wrapper is put
around the model being trained, so no checkpoint is written. clbench ships one small offline task,
``clbench_general_mc`` (``clbench/data/lmeval/``), so the path works without the hub.

lm-eval resolves relative ``data_files`` against the working directory, not the YAML's folder, so
every include folder is copied into a temporary folder with those paths made absolute first.

The inverse direction, :func:`export_lm_eval`, writes every clbench task of a suite as an
lm-eval task (YAML + JSONL of the eval items + a `utils.py` whose `process_results` calls the
clbench grader), so anyone can score a checkpoint on a suite with lm-eval itself.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from clbench.errors import UserError
from clbench.evaluation import CellResult, ItemRecord, summarise_cell

if TYPE_CHECKING:
    from clbench.specs import LmEvalProbe

SHIPPED_TASK_DIR = Path(__file__).resolve().parent / "data" / "lmeval"
OFFLINE_TASK = "clbench_general_mc"


class LmEvalProbeError(UserError):
    """An lm-eval probe cannot run: unknown task, missing metric, unreadable task folder."""


# ---------------------------------------------------------------------------------------------
# Task folders with their data paths resolved
# ---------------------------------------------------------------------------------------------

class _Tagged:
    """A YAML node with a custom tag (lm-eval's `!function`), kept verbatim on a round trip."""

    def __init__(self, tag: str, value: str) -> None:
        self.tag, self.value = tag, value


class _Loader(yaml.SafeLoader):
    """Safe loader that keeps tags such as lm-eval's `!function` as opaque values (never run)."""


class _Dumper(yaml.SafeDumper):
    """Safe dumper that writes those opaque tagged values back unchanged."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: _Tagged(
    "!" + suffix, loader.construct_scalar(node)))
_Dumper.add_representer(_Tagged, lambda dumper, obj: dumper.represent_scalar(obj.tag, obj.value))


def _absolute(value: Any, folder: Path) -> Any:
    """Make a `data_files` value (str, list or split mapping) absolute against `folder`."""
    if isinstance(value, str):
        if "://" in value or Path(value).expanduser().is_absolute():
            return value
        return str((folder / value).resolve())
    if isinstance(value, list):
        return [_absolute(v, folder) for v in value]
    if isinstance(value, dict):
        return {k: _absolute(v, folder) for k, v in value.items()}
    return value


def resolve_task_folder(source: Path, dest: Path) -> list[str]:
    """Copy `source` (a folder of lm-eval YAMLs) to `dest` with relative data files resolved.

    Returns the task names the folder defines. Helper modules (`!function utils.f`) and
    `include:` files keep working because the whole tree is copied.
    """
    if not source.is_dir():
        raise LmEvalProbeError(f"lm-eval include_path {source} is not a folder")
    shutil.copytree(source, dest, dirs_exist_ok=True)
    names: list[str] = []
    for path in sorted(dest.rglob("*.y*ml")):
        original = source / path.relative_to(dest)
        try:
            doc = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506
        except yaml.YAMLError as exc:
            raise LmEvalProbeError(f"{original}: not valid YAML: {exc}") from None
        if not isinstance(doc, dict):
            continue
        if isinstance(doc.get("task"), str):
            names.append(doc["task"])
        kwargs = doc.get("dataset_kwargs")
        if isinstance(kwargs, dict) and "data_files" in kwargs:
            kwargs["data_files"] = _absolute(kwargs["data_files"], original.parent)
            path.write_text(yaml.dump(doc, Dumper=_Dumper, sort_keys=False), encoding="utf-8")
    return names


@contextmanager
def prepared_tasks(probe: LmEvalProbe, base_dir: Path | None = None
                   ) -> Iterator[tuple[str, list[str], bool]]:
    """Yield (task name, include folders, whether lm-eval's built-in tasks are needed).

    The shipped folder is always included; ``probe.include_path`` and a task given as a YAML
    path are resolved against ``base_dir`` (the suite file's folder).
    """
    base = base_dir or Path.cwd()
    sources = [SHIPPED_TASK_DIR]
    task = probe.task
    if task.endswith((".yaml", ".yml")):
        yaml_path = _resolve(task, base)
        if not yaml_path.is_file():
            raise LmEvalProbeError(f"lm-eval task file {yaml_path} does not exist")
        doc = yaml.load(yaml_path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506
        if not isinstance(doc, dict) or not isinstance(doc.get("task"), str):
            raise LmEvalProbeError(f"{yaml_path}: an lm-eval task YAML needs a `task:` name")
        task = doc["task"]
        sources.append(yaml_path.parent)
    if probe.include_path:
        sources.append(_resolve(probe.include_path, base))
    with tempfile.TemporaryDirectory(prefix="clbench-lmeval-") as tmp:
        folders, known = [], []
        for i, src in enumerate(sources):
            dest = Path(tmp) / f"include{i}"
            known += resolve_task_folder(src, dest)
            folders.append(str(dest))
        yield task, folders, task not in known


def user_task_folders(probe: LmEvalProbe, base_dir: Path | None = None) -> list[Path]:
    """The folders a probe brings besides the shipped one (a task YAML's folder, `include_path`),
    resolved as :func:`prepared_tasks` resolves them."""
    base = base_dir or Path.cwd()
    folders = []
    if probe.task.endswith((".yaml", ".yml")):
        folders.append(_resolve(probe.task, base).parent)
    if probe.include_path:
        folders.append(_resolve(probe.include_path, base))
    return folders


def _resolve(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


# ---------------------------------------------------------------------------------------------
# Running a probe
# ---------------------------------------------------------------------------------------------

def run_probe(column: str, model: Any, tokenizer: Any, probe: LmEvalProbe, *,
              batch_size: int = 8, base_dir: Path | None = None, seed: int = 0,
              bootstrap_samples: int = 1000, bootstrap_seed: int = 0) -> CellResult:
    """Score the in-memory model on one lm-eval task; one record per evaluated document.

    The score is the task's ``probe.metric`` (e.g. ``acc``); records carry the per-document
    metric so the cell's bootstrap interval is over the same items as the score. `seed` seeds
    lm-eval (few-shot sampling and the like), `bootstrap_seed` the interval.
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    was_training = model.training
    device = str(next(model.parameters()).device)
    with prepared_tasks(probe, base_dir) as (task, folders, need_defaults), \
            _quiet_lm_eval():
        manager = TaskManager(include_path=folders, include_defaults=need_defaults)
        if task not in manager.all_tasks:
            raise LmEvalProbeError(
                f"lm-eval task {task!r} is unknown (offline task shipped with clbench: "
                f"{OFFLINE_TASK!r}; add a folder of task YAMLs with `include_path`)")
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
        out = simple_evaluate(model=lm, tasks=[task], num_fewshot=probe.num_fewshot,
                              limit=probe.limit, task_manager=manager, log_samples=True,
                              bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
                              torch_random_seed=seed, fewshot_random_seed=seed)
    model.train(was_training)  # the wrapper switches the model to eval mode
    if out is None:
        raise RuntimeError("lm-eval returned no results")
    results = out["results"].get(task, {})
    key = f"{probe.metric},none"
    if key not in results:
        metrics = sorted({k.split(",")[0] for k in results if "," in k and "stderr" not in k})
        raise LmEvalProbeError(f"lm-eval task {task!r} has no metric {probe.metric!r}; it "
                               f"reports: {', '.join(metrics) or 'nothing'}")
    records = [_record(s, probe.metric) for s in out["samples"].get(task, [])]
    cell = summarise_cell(column, records, bootstrap_samples, bootstrap_seed)
    cell.source = "lm_eval"
    cell.score = float(results[key])  # lm-eval's own aggregate (not always a plain mean)
    cell.mean_reward = cell.score
    return cell


def probe_higher_is_better(metric: str) -> bool:
    """lm-eval's convention: perplexities and error rates go down, everything else up."""
    return not any(k in metric for k in ("perplexity", "ppl", "bits_per_byte", "ter"))


def _record(sample: dict[str, Any], metric: str) -> ItemRecord:
    value = sample.get(metric)
    score = float(value) if isinstance(value, (int, float)) else 0.0
    return ItemRecord(id=str(sample.get("doc_id")), completion=_response_text(sample),
                      reward=min(max(score, 0.0), 1.0), correct=score >= 1.0)


def _response_text(sample: dict[str, Any]) -> str:
    """The chosen continuation (multiple choice) or the generated text (generate_until)."""
    resps = sample.get("filtered_resps") or []
    args = sample.get("arguments") or []
    if resps and isinstance(resps[0], (list, tuple)) and len(args) == len(resps):
        best = max(range(len(resps)), key=lambda i: float(resps[i][0]))
        arg = args[best]
        return str(arg[1] if isinstance(arg, (list, tuple)) and len(arg) > 1 else arg)
    if resps and isinstance(resps[0], str):
        return resps[0]
    return str(resps[0]) if resps else ""


@contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval logs every step at INFO/WARNING; keep the run's console readable."""
    logger = logging.getLogger("lm_eval")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def shipped_tasks() -> Sequence[str]:
    """Names of the offline lm-eval tasks shipped with clbench."""
    with tempfile.TemporaryDirectory() as tmp:
        return resolve_task_folder(SHIPPED_TASK_DIR, Path(tmp) / "shipped")


# ---------------------------------------------------------------------------------------------
# Export: clbench tasks -> lm-eval tasks
# ---------------------------------------------------------------------------------------------

_UTILS = '''"""Grading of clbench tasks exported for lm-eval (needs `clbench` installed)."""

from clbench.lmeval import grade_exported_doc


def process_results(doc, results):
    return grade_exported_doc(doc, results[0])
'''


def render_transcript(messages: Sequence[dict[str, str]]) -> str:
    """A chat as plain text with role labels, ending with the assistant's turn to speak."""
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


def export_lm_eval(suite: Any, out_dir: str | Path) -> list[Path]:
    """Write every clbench task of `suite` (stages and task probes) as an lm-eval task.

    Per column: `<suite>_<column>.yaml` and `<suite>_<column>.jsonl` (the same eval items the
    protocol evaluates), plus one shared `utils.py`. The tasks are `generate_until` with the
    protocol's greedy decoding; `process_results` grades with the clbench grader and reports
    `acc` (fraction correct) and `reward`. Returns the YAML paths.
    """
    import json

    from clbench import registry

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    columns = [(s.name, s.task, f"stages[{i}].task.params") for i, s in enumerate(suite.stages)]
    columns += [(p.name, p.task, f"probes[{i}].task.params")
                for i, p in enumerate(suite.probes) if p.task is not None]
    decoding = suite.protocol.decoding
    written = []
    for column, spec, where in columns:
        task = registry.build_task(spec, where=where)
        size = spec.eval_size or suite.protocol.eval_size
        name = f"clbench_{suite.name}_{column}".replace("-", "_").replace(".", "_")
        data = out / f"{name}.jsonl"
        with open(data, "w", encoding="utf-8") as fh:
            for ex in task.examples("eval", spec.seed, size):
                fh.write(json.dumps({
                    "id": ex.id, "prompt": render_transcript(ex.messages),
                    "messages": ex.messages, "reference": ex.reference, "answer": ex.answer,
                    "metadata": ex.metadata, "source": spec.source, "params": spec.params},
                    ensure_ascii=False) + "\n")
        config = {
            "task": name, "tag": [f"clbench_{suite.name}".replace("-", "_")],
            "dataset_path": "json",
            # lm-eval does not resolve relative data files against this folder: absolute path.
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "generate_until",
            "doc_to_text": "{{prompt}}", "doc_to_target": "{{reference}}",
            "generation_kwargs": {"until": ["\nUser:", "\n\nUser:"], "do_sample": False,
                                  "max_gen_toks": decoding.max_new_tokens},
            "process_results": _Tagged("!function", "utils.process_results"),
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "reward", "aggregation": "mean",
                             "higher_is_better": True}],
            "metadata": {"version": 1.0, "suite": suite.name, "suite_version": suite.version,
                         "suite_hash": suite.content_hash(), "column": column},
        }
        path = out / f"{name}.yaml"
        path.write_text(f"# exported by clbench from suite {suite.name!r}, column {column!r}\n"
                        + yaml.dump(config, Dumper=_Dumper, sort_keys=False), encoding="utf-8")
        written.append(path)
    (out / "utils.py").write_text(_UTILS, encoding="utf-8")
    return written


_GRADERS: dict[str, Any] = {}


def grade_exported_doc(doc: dict[str, Any], completion: str) -> dict[str, float]:
    """Grade an exported item with its clbench task source: `{"acc", "reward"}`."""
    import json

    from clbench import registry
    from clbench.specs import TaskSpec
    from clbench.tasks.base import Example

    key = json.dumps([doc["source"], doc.get("params") or {}], sort_keys=True)
    if key not in _GRADERS:
        _GRADERS[key] = registry.build_task(TaskSpec(source=doc["source"],
                                                     params=doc.get("params") or {}))
    example = Example(id=doc["id"], messages=doc["messages"], reference=doc["reference"],
                      answer=doc["answer"], metadata=doc.get("metadata") or {})
    grade = _GRADERS[key].grade(example, completion)
    return {"acc": 1.0 if grade.correct else 0.0, "reward": float(grade.reward)}
