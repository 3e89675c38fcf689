"""ToolAlpaca source (Tang et al. 2023): API records with instances or instructions and answers.

`tool_use.toolalpaca` reads ToolAlpaca's records (its GitHub release or local files in that record
format; see :mod:`clbench.tasks.hub` for the loading rules), prompts for ReAct-style
Thought / Action / Action Input calls and grades them on the golden actions through the shared
tool-use base (:class:`clbench.tasks.tool_use.generated.ToolUseSource`).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from clbench.tasks.base import TaskParams
from clbench.tasks.hub import _CACHE as _HUB_CACHE
from clbench.tasks.hub import HubDataError, HubItem, HubSource, stable_key
from clbench.tasks.tool_use.generated import ToolUseSource, reference_arguments

_TOOLALPACA_DATA = "https://raw.githubusercontent.com/tangqiaoyu/ToolAlpaca/main/data/"
TOOLALPACA_FILES = {"train": [_TOOLALPACA_DATA + "train_data.json"],
                    "eval": [_TOOLALPACA_DATA + "eval_simulated.json",
                             _TOOLALPACA_DATA + "eval_real.json"]}
REACT_FORMAT = ("Write your reasoning after \"Thought:\", then each call on two lines:\n"
                "Action: <function name>\nAction Input: <the arguments as a JSON object>")
_PARAM_TYPES = {"string": "string", "integer": "integer", "number": "number", "float": "number",
                "boolean": "boolean", "array": "array", "object": "object"}


def toolalpaca_schema(name: str, description: str) -> dict:
    """A function declaration from ToolAlpaca's natural-language description.

    Its "Parameters:" line is a JSON object of `"param": "[Required. ]type. [One of: [a, b].]
    text"` strings; types and enums become JSON Schema, so the grader can check them.
    """
    props: dict[str, dict] = {}
    required: list[str] = []
    at = description.find("Parameters:")
    params: Any = None
    if at >= 0:
        text = description[at + len("Parameters:"):].lstrip()
        try:
            params = json.JSONDecoder().raw_decode(text)[0]
        except ValueError:
            params = None
    for pname, desc in (params.items() if isinstance(params, dict) else []):
        desc = str(desc)
        if desc.startswith("Required."):
            required.append(pname)
            desc = desc[len("Required."):].lstrip()
        declared = desc.split(".", 1)[0].strip().lower()
        prop: dict[str, Any] = {"description": desc}
        if declared in _PARAM_TYPES:
            prop["type"] = _PARAM_TYPES[declared]
        if "One of: [" in desc:
            options = desc.split("One of: [", 1)[1].split("]", 1)[0]
            prop["enum"] = [o.strip() for o in options.split(",") if o.strip()]
        props[pname] = prop
    return {"name": name, "parameters": {"type": "object", "properties": props,
                                         "required": required}}


def _golden_calls(actions: list[tuple[str, str]]) -> list[dict] | None:
    """Expected calls from (action, JSON input) pairs; `""`/null gold values mean optional.
    None when an input is not a JSON object (a broken record)."""
    calls = []
    for action, raw in actions:
        try:
            args = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        calls.append({"name": action, "arguments": {
            k: [""] if v in ("", None) else [v] for k, v in args.items()}})
    return calls


def _toolalpaca_rows(record: dict) -> list[dict]:
    """One row per instance (train format) or per instruction with golden answers (eval)."""
    rows = []
    for inst in record.get("Instances") or []:
        steps = inst.get("intermediate_steps") or []
        actions = [(str(s[0][0]), str(s[0][1])) for s in steps
                   if isinstance(s, list) and s and isinstance(s[0], list) and len(s[0]) >= 2]
        rows.append({"api": record, "instruction": inst.get("input") or "", "actions": actions})
    golds = record.get("Golden_Answers") or []
    for instruction, gold in zip(record.get("Instructions") or [], golds):
        actions = [(str(g.get("Action", "")), str(g.get("Action_Input", ""))) for g in gold or []]
        rows.append({"api": record, "instruction": instruction, "actions": actions})
    return rows


class ToolAlpaca(ToolUseSource, HubSource):
    """ToolAlpaca: answer an API request with Thought / Action / Action Input calls."""

    name: ClassVar[str] = "tool_use.toolalpaca"
    description: ClassVar[str] = ("ToolAlpaca (400+ simulated APIs): ReAct-style calls graded "
                                  "on the golden actions")
    license: ClassVar[str] = "Apache-2.0"
    hub_path: ClassVar[str] = "tangqiaoyu/ToolAlpaca"
    hub_splits: ClassVar[dict[str, str]] = {"train": "train", "eval": "eval", "source": "train"}

    def __init__(self, params: TaskParams | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        # The release ships train and eval files (eval on unseen APIs); a single local file or
        # list of files is split by a hash of each instruction instead.
        files = self.params.data_files
        self.split_policy = "hash" if isinstance(files, (str, list)) else "native"

    def _records(self, which: str) -> list[dict[str, Any]]:
        p = self.params
        if p.data_files is None and p.path is None:
            records = self._release_records(which)
        else:
            records = super()._records(which)
        return [row for record in records for row in _toolalpaca_rows(record)]

    def _release_records(self, which: str) -> list[dict[str, Any]]:
        files = TOOLALPACA_FILES["train" if which == "source" else which]
        key = ("toolalpaca-release", which)
        if key not in _HUB_CACHE:
            import datasets

            try:
                ds = datasets.load_dataset("json", data_files=files, split="train")
            except Exception as exc:
                raise HubDataError(
                    f"cannot load ToolAlpaca from {files[0]}: {type(exc).__name__}: "
                    f"{str(exc)[:200]}. Offline, download the data files of "
                    "github.com/tangqiaoyu/ToolAlpaca and set the task's `data_files` to "
                    "them (a mapping {train: ..., eval: ...} keeps the release's split).") from None
            _HUB_CACHE[key] = [dict(r) for r in ds]
        return _HUB_CACHE[key]

    def to_item(self, row: dict[str, Any]) -> HubItem | None:
        actions = [(a, i) for a, i in row["actions"] if a != "getDetails"]  # a help tool
        instruction = row["instruction"].rsplit("\nHint: ", 1)[0].strip()
        calls = _golden_calls(actions) if actions and instruction else None
        if not calls:
            return None
        api = row["api"]
        descriptions = {k: v for k, v in (api.get("Function_Description") or {}).items()
                        if k != "components" and isinstance(v, str)}
        names = {c["name"] for c in calls}
        reference = "\n".join(
            f"Thought: I need to call {c['name']}.\nAction: {c['name']}\nAction Input: "
            + json.dumps(reference_arguments(c["arguments"]), ensure_ascii=False)
            for c in calls)
        return HubItem(
            key=stable_key(api.get("Name"), instruction),
            question=instruction,
            answer={"calls": calls,
                    "schemas": [toolalpaca_schema(n, d) for n, d in descriptions.items()
                                if n in names],
                    "api": api.get("Name"), "functions": descriptions},
            reference=reference,
            metadata={"api": api.get("Name"), "n_calls": len(calls)})

    def messages(self, item: HubItem) -> list[dict[str, str]]:
        docs = "\n\n".join(f"{n}: {d}" for n, d in item.answer["functions"].items())
        system = (f"You answer requests by calling the functions of the {item.answer['api']} "
                  f"API.\n{REACT_FORMAT}\n\nFunctions:\n{docs}")
        return [{"role": "system", "content": system},
                {"role": "user", "content": item.question}]
