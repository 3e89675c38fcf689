"""The shipped hub tasks (task files in clbench/data/tasks) on small local files in each
dataset's record format (no network).

Every fixture in tests/fixtures/hub uses the real field names of its dataset; the task files read
them through the same `datasets.load_dataset` path as hub data (JSON, JSONL and CSV builders).
"""

from __future__ import annotations

import pytest
from where import FIXTURES

from clbench.errors import UserError
from clbench.tasks.hub import HubDataError
from clbench.tasks.shipped import AIME24, AIME25, GPQA, GSM8K, MATH500, DAPOMath, SciKnowEval, SciQ

FIXTURES = FIXTURES / "hub"


def fx(name: str) -> str:
    return str(FIXTURES / name)


GSM8K_FILES = {"train": fx("gsm8k_train.jsonl"), "eval": fx("gsm8k_test.jsonl")}
SCIQ_FILES = {"train": fx("sciq_train.jsonl"), "eval": fx("sciq_test.jsonl")}

ADAPTERS = [
    (GSM8K, {"data_files": GSM8K_FILES}),
    (MATH500, {"data_files": fx("math500_test.jsonl")}),
    (DAPOMath, {"data_files": fx("dapo_math_17k.jsonl")}),
    (AIME24, {"data_files": fx("aime24_test.jsonl")}),
    (AIME25, {"data_files": fx("aime25_test.jsonl")}),
    (SciKnowEval, {"data_files": fx("sciknoweval_chemistry.jsonl")}),
    (GPQA, {"data_files": fx("gpqa_diamond.csv")}),
    (SciQ, {"data_files": SCIQ_FILES}),
]
IDS = [cls.name for cls, _ in ADAPTERS]


@pytest.mark.parametrize("cls, params", ADAPTERS, ids=IDS)
def test_references_grade_correct_and_wrong_answers_do_not(cls, params) -> None:
    src = cls(params)
    assert src.origin == "hub"
    items = src.examples("eval", 0, 100)
    assert items
    for ex in items:
        assert src.grade(ex, ex.reference).correct, (ex.id, ex.reference)
        assert not src.grade(ex, "I am not sure.").correct
        assert ex.messages[-1]["role"] == "user"


@pytest.mark.parametrize("cls, params", ADAPTERS, ids=IDS)
def test_selection_is_deterministic_and_splits_are_disjoint(cls, params) -> None:
    src = cls(params)
    evals = src.examples("eval", 3, 100)
    assert evals == cls(params).examples("eval", 3, 100)
    if src.definition.splits.train is None:  # an evaluation-only benchmark
        with pytest.raises(HubDataError, match="evaluation-only"):
            src.examples("train", 0, 4)
        return
    train = src.examples("train", 3, 100)
    assert train and not {e.id for e in train} & {e.id for e in evals}


def test_gsm8k_answers_and_references() -> None:
    src = GSM8K({"data_files": GSM8K_FILES})
    by_question = {e.messages[-1]["content"].split("\n")[0]: e for e in src.examples("eval", 0, 10)}
    ex = by_question["Ana saves $2,500 a month. How much does she save in a year?"]
    assert ex.answer == "30000"                       # thousands separator removed
    assert "<<" not in ex.reference and ex.reference.endswith("\\boxed{30000}")
    assert src.grade(ex, "So \\boxed{30,000}").correct
    assert "Please reason step by step" in ex.messages[-1]["content"]


def test_math500_symbolic_answers_use_math_verify() -> None:
    src = MATH500({"data_files": fx("math500_test.jsonl")})
    ex = {e.answer: e for e in src.examples("eval", 0, 10)}
    assert src.grade(ex["\\frac{5}{6}"], "\\boxed{5/6}").correct
    assert src.grade(ex["x^2+2x+1"], "\\boxed{(x+1)^2}").correct
    assert src.grade(ex["2\\sqrt{3}"], "\\boxed{\\sqrt{12}}").correct
    assert not src.grade(ex["6"], "\\boxed{5}").correct
    assert ex["6"].metadata["subject"] == "Number Theory"


def test_dapo_prompt_loses_its_answer_line_instruction() -> None:
    src = DAPOMath({"data_files": fx("dapo_math_17k.jsonl")})
    ex = src.examples("train", 0, 1)[0]
    text = ex.messages[-1]["content"]
    assert text.startswith("Find the sum of all integers")
    assert "Answer:" not in text and text.endswith("\\boxed{}.")
    assert ex.metadata["index"].startswith("9a1c")


def test_dapo_repeated_prompts_count_once(tmp_path) -> None:
    import json

    lines = (FIXTURES / "dapo_math_17k.jsonl").read_text().splitlines()
    repeated = []
    for copy in range(3):                    # the release repeats prompts under new indices
        for line in lines:
            record = json.loads(line)
            record["extra_info"]["index"] += f"-{copy}"
            repeated.append(json.dumps(record))
    path = tmp_path / "dapo_repeated.jsonl"
    path.write_text("\n".join(repeated) + "\n")
    src = DAPOMath({"data_files": str(path)})
    once = DAPOMath({"data_files": fx("dapo_math_17k.jsonl")})
    assert len(src.items("train")) == len(once.items("train"))
    assert len(src.items("eval")) == len(once.items("eval"))


def test_aime24_reads_the_answer_from_the_boxed_solution() -> None:
    src = AIME24({"data_files": fx("aime24_test.jsonl")})
    assert sorted(e.answer for e in src.examples("eval", 0, 10)) == ["24", "9"]
    assert sorted(e.answer for e in AIME25({"data_files": fx("aime25_test.jsonl")})
                  .examples("eval", 0, 10)) == ["16", "400"]


def test_sciknoweval_keeps_only_multiple_choice_of_the_level() -> None:
    src = SciKnowEval({"data_files": fx("sciknoweval_chemistry.jsonl")})
    items = src.examples("eval", 0, 100) + src.examples("train", 0, 100)
    assert len(items) == 17                                    # L1 and open-ended dropped
    assert all(e.metadata["task"] == "reaction_prediction" for e in items)
    ex = next(e for e in items if e.metadata["letters"] == "ABCD")
    assert "<answer>X</answer>" in ex.messages[-1]["content"]
    assert src.grade(ex, f"<answer>{ex.answer}</answer>").correct
    two = next(e for e in items if e.metadata["letters"] == "AB")
    assert "C. " not in two.messages[-1]["content"]
    assert src.grade(two, "<answer>B</answer>").correct
    assert src.grade(two, "<answer>C</answer>").feedback.startswith("No option letter")
    level1 = SciKnowEval({"data_files": fx("sciknoweval_chemistry.jsonl"), "level": "L1"})
    assert len(level1.items("eval") + level1.items("train")) == 1


def test_gpqa_options_are_shuffled_per_record_but_stable() -> None:
    src = GPQA({"data_files": fx("gpqa_diamond.csv")})
    items = src.examples("eval", 0, 10)
    assert len(items) == 6
    for ex in items:
        prompt = ex.messages[-1]["content"]
        line = next(ln for ln in prompt.splitlines() if ln.startswith(f"{ex.answer}. "))
        assert line.startswith(f"{ex.answer}. energy")
    assert len({e.answer for e in items}) > 1                  # the answer is not always "A"


def test_sciq_uses_its_native_splits() -> None:
    src = SciQ({"data_files": SCIQ_FILES})
    assert len(src.examples("train", 0, 10)) == 3
    evals = src.examples("eval", 0, 10)
    assert len(evals) == 2
    ex = next(e for e in evals if "formula of water" in e.messages[-1]["content"])
    assert f"{ex.answer}. H2O" in ex.messages[-1]["content"]


def test_missing_local_file_is_a_user_error() -> None:
    src = GSM8K({"data_files": {"train": fx("nope.jsonl"), "eval": fx("gsm8k_test.jsonl")}})
    with pytest.raises(UserError, match="nope.jsonl does not exist"):
        src.examples("train", 0, 2)


def test_unreachable_hub_says_how_to_work_offline(monkeypatch) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(HubDataError) as info:
        AIME25({"revision": "v-test-unreachable"}).examples("eval", 0, 5)
    message = str(info.value)
    assert "math-ai/aime25" in message and "data_files" in message
    assert "ConnectionError" in message
