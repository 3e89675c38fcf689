"""Prompt-lookup drafts in greedy decoding: the drafts found, and the greedy tokens kept."""

from __future__ import annotations

import pytest
from toy import tiny

from clbench.train.prompt_lookup import NgramIndex
from clbench.train.rollout import HFGenerator, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one torch thread

PROMPTS = [[{"role": "user", "content": "abcabcabc abcabc"}],
           [{"role": "user", "content": "a much longer prompt than the first one, longer"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "why?"}]]


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_last_tokens() -> None:
    index = NgramIndex([1, 2, 3, 9, 1, 2])
    assert index.draft(2) == [3, 9]      # (9, 1, 2) never occurred before; (1, 2) ended at 2
    assert index.draft(0) == []
    index.append(3)                       # now (1, 2, 3) occurred before, ending at 3
    assert index.draft(8) == [9, 1, 2, 3]
    index.append(7)                       # (3, 7) and (2, 3, 7) never did
    assert index.draft(4) == []
    assert NgramIndex([5]).draft(3) == [] and NgramIndex([]).draft(3) == []
    repeated = NgramIndex([4, 4, 4])      # the latest earlier occurrence, not the first
    assert repeated.draft(3) == [4]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    """A tiny model whose rows differ: one ends early, one repeats a letter, one a newline (a
    freshly initialised one answers newlines only)."""
    import torch

    model, tok = tiny("tiny-llama", seed=1)
    draw = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=draw) * 0.1)
    return model, tok


@pytest.fixture(autouse=True)
def one_prefill_forward_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's prompts prefilled in one forward, which :func:`_forwards` counts apart."""
    from clbench.train import decoding

    monkeypatch.setattr(decoding, "PREFILL_FILL", 0.0)


def _forwards(model, run) -> tuple[list, int, int]:
    """What `run()` returns, the number of decoding forwards and of tokens they scored."""
    seen: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True)
    try:
        out = run()
    finally:
        hook.remove()
    return out, len(seen) - 1, sum(seen[1:])  # the first forward is the prefill


@pytest.mark.parametrize("stop", [(), ("ff",)])
def test_drafted_greedy_decoding_gives_the_token_by_token_greedy_tokens_in_fewer_forwards(
        model_and_tokenizer, stop) -> None:
    model, tok = model_and_tokenizer
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=32, stop=stop,
                            prompt_max_new_tokens=(32, 9, 20))
    plain, plain_forwards, _ = _forwards(
        model, lambda: HFGenerator(model, tok, batch_size=3).generate(PROMPTS, params))
    drafted, forwards, scored = _forwards(
        model, lambda: HFGenerator(model, tok, batch_size=3, drafts=4).generate(PROMPTS,
                                                                                 params))
    assert [(r.completion_ids, r.text, r.finished) for r in drafted] == \
        [(r.completion_ids, r.text, r.finished) for r in plain]
    assert forwards < plain_forwards  # drafts were kept: several tokens per forward
    assert scored > forwards  # and forwards scored more than one position a row
    assert [len(r.completion_ids) for r in drafted][1] <= 9  # its own cap
    if stop:  # the repeating row ends at its stop string, the others run on
        assert any(r.finished for r in drafted) and not all(r.finished for r in drafted)


def test_drafts_end_a_row_at_its_eos_and_its_cap_as_token_by_token_decoding_does(
        model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=40)
    plain = HFGenerator(model, tok, batch_size=3).generate(PROMPTS, params)
    # a token of the repeating row becomes EOS
    eos = plain[1].completion_ids[3]
    model.generation_config.eos_token_id = eos
    try:
        ended = HFGenerator(model, tok, batch_size=3).generate(PROMPTS, params)
        drafted = HFGenerator(model, tok, batch_size=3, drafts=6).generate(PROMPTS, params)
    finally:
        model.generation_config.eos_token_id = None
    assert [r.completion_ids for r in drafted] == [r.completion_ids for r in ended]
    assert any(r.finished and r.completion_ids[-1] == eos for r in drafted)


def test_sampled_decoding_never_drafts(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3)
    plain = HFGenerator(model, tok, batch_size=6).generate(PROMPTS, params)
    drafted, forwards, scored = _forwards(
        model, lambda: HFGenerator(model, tok, batch_size=6, drafts=4).generate(PROMPTS, params))
    assert [r.completion_ids for r in drafted] == [r.completion_ids for r in plain]
    assert scored <= 6 * forwards  # one position per row per forward
