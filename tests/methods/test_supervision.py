"""The response / reasoning / final-line token split and the random token mask, on concrete
completions."""

from __future__ import annotations

import pytest
import torch

from clbench.models import build_char_tokenizer
from clbench.tasks.base import default_answer_start
from clbench.tasks.math.generated import boxed_answer_start
from clbench_methods.sdpo import supervision as sv


@pytest.fixture(scope="module")
def char_tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def bpe_tok():
    """A byte-level BPE trained in-process: multi-character tokens, multi-byte characters split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The answer is 37.", "14 + 23 = 37", "Answer: 37", "so the sum is 37"] * 50
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")


def _ids(tok, text: str, eos: bool = True) -> list[int]:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids + ([tok.eos_token_id] if eos else [])


def _supervised_text(tok, ids: list[int], mask: list[bool]) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)


def test_response_supervision_starts_after_the_reasoning_block(char_tok):
    text = "<think>6*7 is 42</think>The answer is 42."
    ids = _ids(char_tok, text)
    mask = sv.completion_supervision(char_tok, text, ids, "response", default_answer_start)
    assert _supervised_text(char_tok, ids, mask) == "The answer is 42."
    assert mask[-1] is True  # EOS is supervised (stopping is part of the response)
    assert sum(mask) == len("The answer is 42.") + 1
    assert all(sv.completion_supervision(char_tok, text, ids, "all", default_answer_start))


def test_response_supervision_without_a_reasoning_block_is_the_whole_completion(char_tok):
    # the reference's span: every response token, not only the line that copies the result
    text = "14 + 23 = 37.\n\\boxed{37}"
    ids = _ids(char_tok, text)
    response = sv.completion_supervision(char_tok, text, ids, "response", boxed_answer_start)
    assert response == [True] * len(ids)
    final = sv.completion_supervision(char_tok, text, ids, "final_line", boxed_answer_start)
    assert _supervised_text(char_tok, ids, final) == "\\boxed{37}"
    assert sum(final) == len("\\boxed{37}") + 1  # the EOS too


def test_the_last_reasoning_block_ends_the_reasoning(char_tok):
    text = "<think>a</think>b<think>c</think>\nAnswer: 7"
    ids = _ids(char_tok, text)
    mask = sv.completion_supervision(char_tok, text, ids, "response", default_answer_start)
    assert _supervised_text(char_tok, ids, mask) == "\nAnswer: 7"
    assert sv.response_start(text) == text.rindex("</think>") + len("</think>")


def test_a_block_the_prompt_opened_and_the_completion_never_closed_is_all_reasoning(char_tok):
    """In the reasoning format the prompt opens the block: a completion cut (or stopped)
    before `</think>` is reasoning only, so `response` supervises nothing but its EOS; without
    an opened block the same text is an answer, supervised whole."""
    text = "56 + 71 = 127.\n\\boxed{127}"
    ids = _ids(char_tok, text)
    opened = sv.completion_supervision(char_tok, text, ids, "response", default_answer_start,
                                       opened=True)
    assert opened == [False] * len(text) + [True]
    assert not any(sv.completion_supervision(char_tok, text, ids[:-1], "response",
                                             default_answer_start, opened=True))  # cut: nothing
    assert all(sv.completion_supervision(char_tok, text, ids, "response", default_answer_start))
    # `all` supervises the reasoning anyway; a closed block starts the response after it
    assert all(sv.completion_supervision(char_tok, text, ids, "all", default_answer_start,
                                         opened=True))
    closed = "56 + 71 = 127.\n</think>\n\\boxed{127}"
    mask = sv.completion_supervision(char_tok, closed, _ids(char_tok, closed), "response",
                                     default_answer_start, opened=True)
    assert _supervised_text(char_tok, _ids(char_tok, closed), mask) == "\n\\boxed{127}"
    assert sv.response_start("<think>still thinking") == 0
    assert sv.response_start("still thinking", opened=True) == len("still thinking")


def test_the_stop_decision_can_be_left_unsupervised(char_tok):
    text = "<think>6*7 is 42</think>The answer is 42."
    ids = _ids(char_tok, text)
    mask = sv.completion_supervision(char_tok, text, ids, "final_line", default_answer_start,
                                     supervise_closing=False)
    assert _supervised_text(char_tok, ids, mask) == "The answer is 42." and mask[-1] is False
    assert sum(mask) == len("The answer is 42.")
    every = sv.completion_supervision(char_tok, text, ids, "all", default_answer_start,
                                      supervise_closing=False)
    assert every == [True] * len(text) + [False]
    truncated = ids[:-1]  # no EOS: nothing to leave out
    assert all(sv.completion_supervision(char_tok, text, truncated, "all", default_answer_start,
                                         supervise_closing=False))


def test_without_think_the_last_line_is_the_answer(char_tok):
    text = "14 + 23 = 37.\nAnswer: 37"
    ids = _ids(char_tok, text)
    mask = sv.completion_supervision(char_tok, text, ids, "final_line", default_answer_start)
    assert _supervised_text(char_tok, ids, mask) == "Answer: 37"
    assert mask[text.index("\n")] is False  # the newline ends exactly at the answer start


def test_tool_call_after_thought(char_tok):
    text = ('Thought: I need the weather.\nAction: get_weather\n'
            'Action Input: {"city": "Paris"}')
    ids = _ids(char_tok, text)
    default = sv.completion_supervision(char_tok, text, ids, "final_line", default_answer_start)
    assert _supervised_text(char_tok, ids, default) == 'Action Input: {"city": "Paris"}'
    # a tool task that starts the answer at the first `Action:` supervises the whole call

    def tool_answer_start(t: str) -> int:
        return max(t.find("Action:"), 0)

    tool = sv.completion_supervision(char_tok, text, ids, "final_line", tool_answer_start)
    assert _supervised_text(char_tok, ids, tool) == text[text.index("Action:"):]


def test_single_line_answer_is_all_answer(char_tok):
    text = "Answer: 37"
    ids = _ids(char_tok, text)
    assert all(sv.completion_supervision(char_tok, text, ids, "final_line", default_answer_start))


def test_empty_answer_supervises_only_the_stop_decision(char_tok):
    eos_only = [char_tok.eos_token_id]
    assert sv.completion_supervision(char_tok, "", eos_only, "final_line",
                                     default_answer_start) == [True]
    assert sv.completion_supervision(char_tok, "", [], "final_line", default_answer_start) == []
    # a completion that ends with </think> has an empty answer part: only its EOS is a target
    text = "<think>hmm</think>"
    ids = _ids(char_tok, text)
    mask = sv.completion_supervision(char_tok, text, ids, "final_line", default_answer_start)
    assert mask == [False] * len(text) + [True]
    assert sv.completion_supervision(char_tok, text, ids, "response", default_answer_start) == mask
    # truncated (no EOS): nothing
    assert not any(sv.completion_supervision(char_tok, text, ids[:-1], "final_line",
                                             default_answer_start))


def test_bpe_token_straddling_the_answer_start_is_supervised(bpe_tok):
    text = "so the sum is 37"
    ids = _ids(bpe_tok, text, eos=False)
    ends = sv.token_char_ends(bpe_tok, ids)
    assert ends[-1] == len(text) and ends == sorted(ends)
    # the answer starts at the "3" of " 37"; the token holding " 37" (or "3") ends after it
    start = text.index("37")
    mask = sv.supervision_mask(text, ends, "final_line", lambda t: start)
    covered = _supervised_text(bpe_tok, ids, mask)
    assert covered.strip().endswith("37") and covered.endswith("37")
    assert len(covered) <= len(text) - start + 1  # at most the straddling space on top
    first = mask.index(True)
    assert ends[first - 1] <= start < ends[first]


def test_multibyte_characters_get_monotone_spans(bpe_tok):
    text = "cost \u20ac5: 37"  # the euro sign is three bytes, split over several tokens
    ids = _ids(bpe_tok, text, eos=False)
    ends = sv.token_char_ends(bpe_tok, ids)
    assert ends == sorted(ends) and ends[-1] == len(text)
    euro = text.index("\u20ac")
    euro_tokens = [i for i, e in enumerate(ends) if e == euro + 1]
    assert len(euro_tokens) >= 2  # every partial byte token is attributed to the euro sign
    # an answer starting at the euro sign takes all of its byte tokens
    mask = sv.supervision_mask(text, ends, "final_line", lambda t: euro)
    assert _supervised_text(bpe_tok, ids, mask) == "\u20ac5: 37"
    assert all(mask[i] for i in euro_tokens)


@pytest.mark.parametrize("text", [
    "<think>6*7 is 42</think>The answer is 42.",
    "so the sum is 37\nAnswer: 37",
    "cost \u20ac5: \u4e2d\u6587 caf\u00e9 37 " * 3,
])
def test_bisected_boundary_equals_the_exact_definition_for_every_answer_start(bpe_tok, char_tok,
                                                                             text):
    for tok in (bpe_tok, char_tok):
        ids = _ids(tok, text)
        decoded = tok.decode(ids, skip_special_tokens=True)
        ends = sv.token_char_ends(tok, ids)
        for a in range(len(decoded) + 1):
            def answer_at(text: str, a: int = a) -> int:
                return a

            exact = sv.supervision_mask(decoded, ends, "final_line", answer_at, closing_tokens=1)
            fast = sv.completion_supervision(tok, decoded, ids, "final_line", answer_at)
            assert fast == exact, (tok, a)


def test_monotone_ends_takes_the_minimum_to_the_right():
    assert sv.monotone_ends([1, 3, 2, 5, 4, 4]) == [1, 2, 2, 4, 4, 4]


def test_out_of_range_answer_start_is_clamped(char_tok):
    text = "abc"
    ends = sv.token_char_ends(char_tok, _ids(char_tok, text, eos=False))
    assert sv.supervision_mask(text, ends, "final_line", lambda t: -5) == [True] * 3
    assert sv.supervision_mask(text, ends, "final_line", lambda t: 99) == [False] * 3
    with pytest.raises(ValueError, match="unknown supervision 'cot'"):
        sv.supervision_mask(text, ends, "cot", default_answer_start)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected one of response, all, final_line"):
        sv.completion_supervision(char_tok, text, _ids(char_tok, text), "answer",  # type: ignore
                                  default_answer_start)


def test_random_token_mask_drops_the_requested_fraction_reproducibly():
    mask = torch.ones(200, 50, dtype=torch.bool)
    mask[:, 40:] = False
    kept = sv.random_token_mask(mask, 0.25, torch.Generator().manual_seed(0))
    again = sv.random_token_mask(mask, 0.25, torch.Generator().manual_seed(0))
    assert torch.equal(kept, again)
    assert not kept[:, 40:].any()  # never adds tokens
    assert float(kept[:, :40].float().mean()) == pytest.approx(0.75, abs=0.02)
    assert torch.equal(sv.random_token_mask(mask, 0.0), mask)
    assert not sv.random_token_mask(mask, 1.0, torch.Generator().manual_seed(1)).any()
    with pytest.raises(ValueError, match="mask_ratio"):
        sv.random_token_mask(mask, 1.5)
