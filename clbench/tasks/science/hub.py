"""Science hub adapters: letter multiple choice from SciKnowEval, GPQA and SciQ.

`science.sciknoweval` (`hicai-zju/SciKnowEval`, L3 by default, per discipline),
`science.gpqa` (`Idavidrein/gpqa`, gated, evaluation only) and `science.sciq` (`allenai/sciq`),
zero-shot and graded on the answer letter with the offline MCQ's grader
(:func:`clbench.tasks.science.generated.grade_choice`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from clbench.tasks.base import Example, Grade, Messages, seeded_rng
from clbench.tasks.hub import HubItem, HubParams, HubSource, stable_key
from clbench.tasks.science.generated import LETTERS, MCQ_INSTRUCTION, grade_choice


def mcq_prompt(question: str, options: list[str]) -> str:
    """Question, lettered options and the paper's `<answer>X</answer>` instruction."""
    lines = "\n".join(f"{LETTERS[i]}. {str(o).strip()}" for i, o in enumerate(options))
    return f"{question.strip()}\n{lines}\n{MCQ_INSTRUCTION}"


class HubMCQ(HubSource):
    """Zero-shot lettered multiple choice; gold is the correct letter."""

    domain = "science"

    def messages(self, item: HubItem) -> Messages:
        return [{"role": "user", "content": item.question}]

    def grade(self, example: Example, completion: str) -> Grade:
        return grade_choice(example.answer, completion, self.params.reveal_answer_in_feedback,
                            letters=example.metadata.get("letters", LETTERS))

    def shuffled_item(self, key: str, question: str, correct: str, wrong: list[str],
                      metadata: dict[str, Any]) -> HubItem:
        """Options in a seeded order fixed per record (datasets that list the answer first)."""
        options = [correct] + wrong
        seeded_rng("options", key).shuffle(options)
        letter = LETTERS[options.index(correct)]
        return HubItem(key=key, question=mcq_prompt(question, options), answer=letter,
                       reference=f"<answer>{letter}</answer>",
                       metadata={**metadata, "letters": LETTERS[:len(options)]})


class SciKnowEvalParams(HubParams):
    level: str = Field(default="L3", pattern=r"^L[1-5]$", description="SciKnowEval level kept.")


class SciKnowEval(HubMCQ):
    name = "science.sciknoweval"
    description = "SciKnowEval multiple-choice questions of one level (default L3) and discipline."
    license = "MIT"
    hub_path, hub_name = "hicai-zju/SciKnowEval", "Chemistry"
    split_policy = "hash"
    hub_splits: ClassVar[dict[str, str]] = {"source": "test"}
    Params = SciKnowEvalParams
    params: SciKnowEvalParams

    def to_item(self, record: dict[str, Any]) -> HubItem | None:
        details = record.get("details") or {}
        if not str(record.get("type", "")).startswith("mcq") or \
                details.get("level") != self.params.level:
            return None
        choices = record["choices"]
        labels, texts = list(choices["label"]), list(choices["text"])
        if record.get("answerKey") not in labels:
            return None
        question = mcq_prompt(record["question"], texts) if labels == list(
            LETTERS[:len(labels)]) else None
        if question is None:
            return None
        key = stable_key(record["question"], *texts)
        return HubItem(key=key, question=question, answer=record["answerKey"],
                       reference=f"<answer>{record['answerKey']}</answer>",
                       metadata={"letters": "".join(labels), "task": details.get("task"),
                                 "subtask": details.get("subtask"),
                                 "domain": record.get("domain")})


class GPQA(HubMCQ):
    name = "science.gpqa"
    description = "GPQA graduate-level science questions (Idavidrein/gpqa, gated), evaluation only."
    license = "CC-BY-4.0"
    hub_path, hub_name = "Idavidrein/gpqa", "gpqa_diamond"
    split_policy = "eval_only"
    hub_splits: ClassVar[dict[str, str]] = {"source": "train"}

    def to_item(self, record: dict[str, Any]) -> HubItem | None:
        wrong = [record[f"Incorrect Answer {i}"] for i in (1, 2, 3)]
        key = str(record.get("Record ID") or stable_key(record["Question"]))
        return self.shuffled_item(key, record["Question"], record["Correct Answer"], wrong,
                                  {"domain": record.get("High-level domain"),
                                   "subdomain": record.get("Subdomain")})


class SciQ(HubMCQ):
    name = "science.sciq"
    description = "SciQ crowd-sourced science exam questions (allenai/sciq)."
    license = "CC-BY-NC-3.0"
    hub_path = "allenai/sciq"
    split_policy = "native"
    hub_splits: ClassVar[dict[str, str]] = {"train": "train", "eval": "test"}

    def to_item(self, record: dict[str, Any]) -> HubItem | None:
        wrong = [record["distractor1"], record["distractor2"], record["distractor3"]]
        key = stable_key(record["question"], record["correct_answer"])
        return self.shuffled_item(key, record["question"], record["correct_answer"], wrong, {})
