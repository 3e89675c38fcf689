"""Column evaluation: batching, grading, cell summary, per-item records on disk."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from rich.console import Console
from rich.progress import Progress

from clbench.eval.column import evaluate_column, summarise_cell
from clbench.eval.records import ItemRecord, read_records, records_path, write_records
from clbench.tasks.base import Example, Grade, Messages, TaskSource


class EchoAddition(TaskSource):
    """`a + b`; the right answer is the last line of the completion."""

    name = "test.echo-addition"
    description = "addition for evaluation tests"
    domain = "math"

    def build(self, split: str, seed: int, size: int) -> list[Example]:
        return [Example(id=f"{split}-{i}", messages=[{"role": "user", "content": f"{i} + 1"}],
                        reference=str(i + 1), answer=i + 1) for i in range(size)]

    def grade(self, example: Example, completion: str) -> Grade:
        ok = completion.strip() == str(example.answer)
        return Grade(1.0 if ok else 0.25, ok, None if ok else f"expected {example.answer}")


class Calculator:
    """Answers `i + 1` right for even i and wrong for odd i; records batch sizes."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.seen: list[list[str]] = []

    def __call__(self, prompts: Sequence[Messages]) -> list[str]:
        self.batches.append(len(prompts))
        self.seen.append([p[-1]["content"] for p in prompts])
        out = []
        for p in prompts:
            i = int(p[-1]["content"].split(" + ")[0])
            out.append(str(i + 1) if i % 2 == 0 else "no idea")
        return out


def test_evaluate_column_batches_grades_and_summarises() -> None:
    task = EchoAddition()
    examples = task.examples("eval", 0, 10)
    gen = Calculator()
    with Progress(console=Console(quiet=True)) as progress:
        cell = evaluate_column("add", task, examples, gen, batch_size=4, bootstrap_samples=500,
                               progress=progress)
        assert progress.tasks == []  # the per-column bar is removed when done
    assert gen.batches == [4, 4, 2]
    assert cell.n == 10
    assert cell.score == pytest.approx(0.5)
    assert cell.mean_reward == pytest.approx((5 * 1.0 + 5 * 0.25) / 10)
    assert cell.interval is not None and cell.interval["low"] < 0.5 < cell.interval["high"]
    assert [r.id for r in cell.records] == [f"eval-{i}" for i in range(10)]  # items' order
    assert cell.records[1] == ItemRecord("eval-1", "no idea", 0.25, False, "expected 2")
    assert cell.summary()["n"] == 10 and "records" not in cell.summary()


def test_batches_hold_prompts_of_similar_length_longest_first() -> None:
    task = EchoAddition()
    examples = task.examples("eval", 0, 12)  # "0 + 1" .. "9 + 1", then "10 + 1", "11 + 1"
    gen = Calculator()
    cell = evaluate_column("add", task, examples, gen, batch_size=4, bootstrap_samples=100)
    assert gen.seen == [["10 + 1", "11 + 1", "0 + 1", "1 + 1"],
                        ["2 + 1", "3 + 1", "4 + 1", "5 + 1"], ["6 + 1", "7 + 1", "8 + 1", "9 + 1"]]
    assert [r.id for r in cell.records] == [f"eval-{i}" for i in range(12)]
    assert [r.correct for r in cell.records] == [i % 2 == 0 for i in range(12)]


def test_generator_returning_wrong_count_is_an_error() -> None:
    task = EchoAddition()
    with pytest.raises(RuntimeError, match="1 completions for 3 prompts"):
        evaluate_column("add", task, task.examples("eval", 0, 3), lambda ps: ["1"],
                        batch_size=8)


def test_empty_cell_has_no_score() -> None:
    cell = summarise_cell("x", [])
    assert cell.score is None and cell.n == 0 and cell.interval is None


def test_records_round_trip_as_jsonl(tmp_path) -> None:
    records = [ItemRecord("a", "x\ny \u00e9", 1.0, True), ItemRecord("b", "", 0.0, False, "no")]
    path = records_path(tmp_path, 2, "math")
    write_records(path, records)
    assert path == tmp_path / "items" / "row2" / "math.jsonl"
    assert read_records(path) == records
    assert len(path.read_text(encoding="utf-8").splitlines()) == 2


def test_tiny_model_evaluation_is_deterministic_and_graded_by_the_task() -> None:
    from clbench.eval.column import make_generate_fn
    from clbench.models import load_model
    from clbench.spec.schema import DecodingSpec

    model, tokenizer = load_model("tiny-llama", device="cpu", dtype="float32", seed=1)
    task = EchoAddition()
    examples = task.examples("eval", 0, 5)
    decoding = DecodingSpec(max_new_tokens=6, batch_size=2)
    cells = [evaluate_column("add", task, examples, make_generate_fn(model, tokenizer, decoding),
                             batch_size=decoding.batch_size, bootstrap_samples=0)
             for _ in range(2)]
    assert cells[0].records == cells[1].records
    assert all(len(r.completion) <= 6 for r in cells[0].records)  # char model: 1 char per token
    assert cells[0].score == sum(r.completion.strip() == str(i + 1)
                                 for i, r in enumerate(cells[0].records)) / 5
    assert cells[0].interval is None  # bootstrap disabled


def test_sampled_evaluation_draws_afresh_in_every_batch_and_repeats_per_seed() -> None:
    from clbench.eval.column import make_generate_fn
    from clbench.models import load_model
    from clbench.spec.schema import DecodingSpec

    model, tokenizer = load_model("tiny-llama", device="cpu", dtype="float32", seed=1)
    prompt = [{"role": "user", "content": "Say something."}]
    decoding = DecodingSpec(temperature=1.0, max_new_tokens=12, batch_size=1)

    def batches(seed: int) -> list[str]:  # the same prompt in four batches of one
        generate = make_generate_fn(model, tokenizer, decoding, seed=seed)
        return [generate([prompt])[0] for _ in range(4)]

    first = batches(seed=7)
    assert len(set(first)) > 1  # not the same random numbers in every batch
    assert batches(seed=7) == first  # and the same seed samples the same again
    assert batches(seed=8) != first


def test_the_settings_help_quotes_the_cpu_batch_size_that_auto_uses() -> None:
    from clbench.spec.schema import AUTO_BATCH_GROWTH, CPU_BATCH_TOKENS, DecodingSpec, ModelSpec

    help_text = ModelSpec.model_fields["eval_batching"].description
    assert f"{CPU_BATCH_TOKENS:,} tokens" in help_text
    assert f"up to {AUTO_BATCH_GROWTH}x" in help_text
    assert f"up to {AUTO_BATCH_GROWTH}x this" in DecodingSpec.model_fields["batch_size"].description


def test_a_run_batches_evaluation_by_tokens_on_a_cpu_and_by_the_protocol_elsewhere() -> None:
    from clbench.eval.column import CPU_BATCH_TOKENS, EvalBatching, run_generate_fn
    from clbench.models import load_model
    from clbench.spec.schema import DecodingSpec, ModelSpec

    decoding = DecodingSpec(batch_size=16)
    assert EvalBatching.of(decoding, "auto", "cpu") == EvalBatching(128, CPU_BATCH_TOKENS)
    assert EvalBatching.of(decoding, "auto", "cuda") == EvalBatching(16, None)  # not measured
    assert EvalBatching.of(decoding, "suite", "cpu") == EvalBatching(16, None)
    model, tokenizer = load_model("tiny-llama", device="cpu", dtype="float32", seed=1)
    _, prompts = run_generate_fn(model, tokenizer, decoding, ModelSpec(name="tiny-llama"))
    assert prompts == 128
    _, prompts = run_generate_fn(model, tokenizer, decoding,
                                 ModelSpec(name="tiny-llama", eval_batching="suite"))
    assert prompts == 16
