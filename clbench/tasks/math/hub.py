"""Math hub adapters: GSM8K, MATH-500, DAPO-Math-17k and AIME, zero-shot with the paper's prompt.

`openai/gsm8k`, `HuggingFaceH4/MATH-500`, `BytedTsinghua-SIA/DAPO-Math-17k`, `math-ai/aime24`,
`math-ai/aime25`; graded on `\\boxed{}` with the offline families' grader
(:func:`clbench.tasks.math.generated.grade_boxed`).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from clbench.tasks.base import Example, Grade, Messages
from clbench.tasks.grading import extract_boxed
from clbench.tasks.hub import HubItem, HubSource, stable_key
from clbench.tasks.math.generated import boxed_answer_start, grade_boxed

PAPER_MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class HubMath(HubSource):
    """Zero-shot math from the hub with the paper's prompt; gold answers graded on `\\boxed{}`."""

    domain = "math"

    def messages(self, item: HubItem) -> Messages:
        return [{"role": "user", "content": f"{item.question}\n\n{PAPER_MATH_INSTRUCTION}"}]

    def grade(self, example: Example, completion: str) -> Grade:
        return grade_boxed(example.answer, completion, self.params.reveal_answer_in_feedback)

    def answer_start(self, completion: str) -> int:
        return boxed_answer_start(completion)


class GSM8K(HubMath):
    name = "math.gsm8k"
    description = "Grade-school word problems (openai/gsm8k, config `main`)."
    license = "MIT"
    hub_path, hub_name = "openai/gsm8k", "main"
    split_policy = "native"
    hub_splits: ClassVar[dict[str, str]] = {"train": "train", "eval": "test"}

    def to_item(self, record: dict[str, Any]) -> HubItem | None:
        solution, _, final = str(record["answer"]).rpartition("####")
        answer = final.strip().replace(",", "")
        if not answer:
            return None
        # Calculator annotations <<48/2=24>> are artefacts of the dataset, not reasoning.
        steps = re.sub(r"<<[^<>]*>>", "", solution).strip()
        return HubItem(key=_hash(record["question"]), question=record["question"], answer=answer,
                       reference=f"{steps}\n\\boxed{{{answer}}}")


class MATH500(HubMath):
    name = "math.math500"
    description = "MATH-500 competition problems (HuggingFaceH4/MATH-500), evaluation only."
    license = "MIT"
    hub_path = "HuggingFaceH4/MATH-500"
    split_policy = "eval_only"
    hub_splits: ClassVar[dict[str, str]] = {"source": "test"}

    def to_item(self, record: dict[str, Any]) -> HubItem | None:
        return HubItem(key=str(record.get("unique_id") or _hash(record["problem"])),
                       question=record["problem"], answer=str(record["answer"]),
                       reference=record.get("solution") or f"\\boxed{{{record['answer']}}}",
                       metadata={"subject": record.get("subject"), "level": record.get("level")})


_DAPO_PREFIX = re.compile(r"^Solve the following math problem step by step\..*?\n\n", re.S)
_DAPO_SUFFIX = re.compile(
    r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$")


class DAPOMath(HubMath):
    name = "math.dapo17k"
    description = "DAPO-Math-17k competition problems with integer answers (training set)."
    license = "Apache-2.0"
    hub_path = "BytedTsinghua-SIA/DAPO-Math-17k"
    split_policy = "hash"
    hub_splits: ClassVar[dict[str, str]] = {"source": "train"}

    def to_item(self, record: dict[str, Any]) -> HubItem | None:
        prompt = record["prompt"]
        text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
        # The dataset wraps each problem in an "Answer:"-format instruction; we ask for \boxed{}.
        question = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", text)).strip()
        answer = str(record["reward_model"]["ground_truth"]).strip()
        index = (record.get("extra_info") or {}).get("index")
        # Keyed by the problem text: the release repeats each prompt many times under
        # different indices, and repeats must fall in one split and count once.
        return HubItem(key=_hash(question), question=question, answer=answer,
                       reference=f"\\boxed{{{answer}}}", metadata={"index": index})


class AIME24(HubMath):
    name = "math.aime24"
    description = "AIME 2024 (math-ai/aime24), 30 problems, evaluation only."
    license = "Apache-2.0"
    hub_path = "math-ai/aime24"
    split_policy = "eval_only"
    hub_splits: ClassVar[dict[str, str]] = {"source": "test"}

    def to_item(self, record: dict[str, Any]) -> HubItem | None:
        # This dataset has no answer column: the solution field ends in the boxed answer.
        solution = str(record.get("solution") or "")
        answer = record.get("answer") or extract_boxed(solution) or solution.strip()
        if not answer:
            return None
        return HubItem(key=str(record.get("id") or _hash(record["problem"])),
                       question=record["problem"], answer=str(answer),
                       reference=solution if "\\boxed" in solution else f"\\boxed{{{answer}}}")


class AIME25(HubMath):
    name = "math.aime25"
    description = "AIME 2025 (math-ai/aime25), 30 problems, evaluation only."
    license = "Apache-2.0"
    hub_path = "math-ai/aime25"
    split_policy = "eval_only"
    hub_splits: ClassVar[dict[str, str]] = {"source": "test"}

    def to_item(self, record: dict[str, Any]) -> HubItem | None:
        answer = str(record["answer"]).strip()
        return HubItem(key=str(record.get("id") or _hash(record["problem"])),
                       question=record["problem"], answer=answer,
                       reference=f"\\boxed{{{answer}}}")


def _hash(text: str) -> str:
    return stable_key(text)
