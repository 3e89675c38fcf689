"""Rollouts: batching and left padding, n samples, seeding, greedy, EOS, stop strings, max
tokens."""

from __future__ import annotations

import pytest
from toy import tiny

from clbench.train.rollout import HFGenerator, SamplingParams, encode_chat, finish_completion

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one torch thread


PROMPTS = [[{"role": "user", "content": "hi"}],
           [{"role": "user", "content": "a much longer prompt than the first one"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "why?"}]]




@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny("tiny-llama", seed=1)


def greedy(n_tokens: int = 12) -> SamplingParams:
    return SamplingParams(n=1, temperature=0.0, max_new_tokens=n_tokens)


def test_left_padded_batch_gives_the_same_greedy_output_as_one_by_one(model_and_tokenizer):
    model, tok = model_and_tokenizer
    batched = HFGenerator(model, tok, batch_size=8).generate(PROMPTS, greedy())
    for i, prompt in enumerate(PROMPTS):
        single = HFGenerator(model, tok, batch_size=1).generate([prompt], greedy())[0]
        assert batched[i].completion_ids == single.completion_ids
        assert batched[i].prompt_ids == encode_chat(tok, prompt)


def test_max_new_tokens_bounds_unfinished_rollouts(model_and_tokenizer):
    model, tok = model_and_tokenizer
    rollouts = HFGenerator(model, tok).generate(PROMPTS, greedy(5))
    assert [len(r.completion_ids) for r in rollouts] == [5, 5, 5]
    assert not any(r.finished for r in rollouts)
    assert all(r.text == tok.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts)


def test_n_samples_per_prompt_come_out_prompt_major_and_seeded(model_and_tokenizer):
    model, tok = model_and_tokenizer
    gen = HFGenerator(model, tok, batch_size=4)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=5)
    first = gen.generate(PROMPTS, params)
    assert [(r.prompt_index, r.sample_index) for r in first] == [
        (p, s) for p in range(3) for s in range(3)]
    again = gen.generate(PROMPTS, params)
    assert [r.completion_ids for r in first] == [r.completion_ids for r in again]
    other = gen.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=6))
    assert [r.completion_ids for r in first] != [r.completion_ids for r in other]
    # Samples of one prompt differ from each other (they are samples, not copies).
    assert len({tuple(r.completion_ids) for r in first[:3]}) == 3


def test_tiny_nucleus_is_greedy(model_and_tokenizer):
    model, tok = model_and_tokenizer
    gen = HFGenerator(model, tok)
    sampled = gen.generate(PROMPTS, SamplingParams(n=1, temperature=1.0, top_p=1e-6,
                                                   max_new_tokens=8, seed=3))
    assert [r.completion_ids for r in sampled] == [
        r.completion_ids for r in gen.generate(PROMPTS, greedy(8))]


def test_eos_ends_the_completion_and_is_kept_in_ids_only(model_and_tokenizer):
    model, tok = model_and_tokenizer
    reference = HFGenerator(model, tok).generate(PROMPTS[:1], greedy(12))[0].completion_ids
    eos = reference[3]
    cut = reference.index(eos)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, eos]  # declare it an end token
    try:
        rollout = HFGenerator(model, tok).generate(PROMPTS[:1], greedy(12))[0]
    finally:
        model.generation_config.eos_token_id = saved
    assert rollout.finished
    assert rollout.completion_ids == reference[:cut + 1]
    assert rollout.text == tok.decode(reference[:cut], skip_special_tokens=True)


def test_stop_string_cuts_text_before_it_and_ids_after_it(model_and_tokenizer):
    model, tok = model_and_tokenizer
    reference = HFGenerator(model, tok).generate(PROMPTS[1:2], greedy(16))[0]
    stop = reference.text[4:6]
    at = reference.text.index(stop)
    rollout = HFGenerator(model, tok).generate(
        PROMPTS[1:2], SamplingParams(n=1, temperature=0.0, max_new_tokens=16, stop=(stop,)))[0]
    assert rollout.finished
    assert rollout.text == reference.text[:at]
    ids = rollout.completion_ids
    assert ids == reference.completion_ids[:len(ids)]
    assert stop in tok.decode(ids, skip_special_tokens=True)
    assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)


def test_finish_completion_takes_the_earliest_of_eos_and_stop():
    from clbench.models import build_char_tokenizer

    tok = build_char_tokenizer()
    ids = tok("abc\nUser: x", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    # EOS before the stop string: EOS wins and stays in the ids.
    assert finish_completion(ids[:2] + [eos] + ids[2:], tok, {eos}, ["User:"]) == (
        ids[:2] + [eos], "ab", True)
    # Stop string before EOS: text cut before it, ids through its last character.
    out_ids, text, finished = finish_completion(ids + [eos, 0, 0], tok, {eos}, ["\nUser:"])
    assert (text, finished) == ("abc", True)
    assert out_ids == ids[:9]
    # Neither: everything, unfinished; padding after EOS is dropped.
    assert finish_completion(ids, tok, {eos}, ["zzz"]) == (ids, "abc\nUser: x", False)


def test_sampling_params_validate_and_follow_budgets():
    from clbench.spec.schema import Budget, DecodingSpec

    params = SamplingParams.from_budget(Budget(steps=1, samples_per_prompt=8, max_new_tokens=48,
                                               temperature=0.7), seed=2)
    assert (params.n, params.temperature, params.max_new_tokens, params.seed) == (8, 0.7, 48, 2)
    assert SamplingParams.from_decoding(DecodingSpec()).greedy
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(stop=("",))
    with pytest.raises(ValueError, match=r"each prompt's max_new_tokens must lie in \[1, 8\]"):
        SamplingParams(max_new_tokens=8, prompt_max_new_tokens=(3, 9))


def test_a_prompt_cap_gives_the_first_tokens_of_an_uncapped_rollout(model_and_tokenizer):
    """Per-prompt caps (the joint reference's items keep their stage's cap): each row stops at
    its own cap, and what it holds is exactly the start of what the same seed and batch give
    without the cap, marked unfinished when the cap cut it."""
    model, tok = model_and_tokenizer
    gen = HFGenerator(model, tok, batch_size=6)
    uncapped = gen.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10, seed=3))
    capped = gen.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10, seed=3,
                                                  prompt_max_new_tokens=(3, 10, 6)))
    caps = [3, 3, 10, 10, 6, 6]
    assert [len(r.completion_ids) for r in capped] == [
        min(cap, len(full.completion_ids)) for cap, full in zip(caps, uncapped)]
    assert sum(len(r.completion_ids) < cap for r, cap in zip(capped, caps)) >= 1  # an EOS
    for full, cut, cap in zip(uncapped, capped, caps):
        assert cut.completion_ids == full.completion_ids[:len(cut.completion_ids)]
        assert cut.finished == (full.finished and len(full.completion_ids) <= cap)
        assert cut.text == tok.decode(cut.completion_ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="2 prompt caps for 3 prompts"):
        gen.generate(PROMPTS, SamplingParams(max_new_tokens=10, prompt_max_new_tokens=(3, 4)))


def test_a_chat_holding_the_start_of_the_response_is_encoded_to_continue_it(
        model_and_tokenizer):
    """A final assistant turn is the start of the response (the reasoning format's opened
    block): written after the generation header as it is, not closed as a finished turn."""
    model, tok = model_and_tokenizer
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    opened = question + [{"role": "assistant", "content": "<think>\n"}]
    header = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    assert tok.decode(encode_chat(tok, opened)) == header + "<think>\n"
    assert encode_chat(tok, opened)[:len(encode_chat(tok, question))] == \
        encode_chat(tok, question)
    # rollouts continue it: the prompt ids hold the prefix, the completion text does not
    rollout = HFGenerator(model, tok).generate([opened], SamplingParams(max_new_tokens=4))[0]
    assert rollout.prompt_ids == encode_chat(tok, opened)


def _greedy_ids(model, tok) -> list[list[int]]:
    return [r.completion_ids for r in HFGenerator(model, tok, batch_size=8).generate(
        PROMPTS, greedy(16))]


def test_under_mixed_precision_generation_casts_weights_once_with_the_same_output(
        model_and_tokenizer, monkeypatch):
    import contextlib

    import torch

    from clbench.train import rollout

    model, tok = model_and_tokenizer
    cache_on: list[bool] = []
    hook = model.lm_head.register_forward_hook(
        lambda *_: cache_on.append(torch.is_autocast_cache_enabled()))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            cached = _greedy_ids(model, tok)
            assert cache_on and all(cache_on)  # every decoding forward reused the casts
            assert not torch.is_autocast_cache_enabled()  # the run's setting is back
            monkeypatch.setattr(rollout, "weights_cast_once",
                                lambda _device: contextlib.nullcontext())
            cache_on.clear()
            recast = _greedy_ids(model, tok)
            assert cache_on and not any(cache_on)
    finally:
        hook.remove()
    assert cached == recast


def test_a_generation_after_an_update_sees_the_new_weights_not_a_cached_cast():
    import copy

    import torch

    model, tok = tiny("tiny-llama", seed=1)
    other = copy.deepcopy(model)
    with torch.no_grad():  # MLPs that dominate the residual stream: other greedy tokens
        for layer in other.model.layers:
            layer.mlp.down_proj.weight.mul_(-30)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        before = _greedy_ids(model, tok)
        with torch.no_grad():  # an in-place update, as an optimizer step makes
            for p, q in zip(model.parameters(), other.parameters()):
                p.copy_(q)
        after = _greedy_ids(model, tok)
        expected = _greedy_ids(other, tok)
    assert after == expected
    assert after != before


def test_samples_of_a_prompt_share_one_prefill_and_draw_what_separate_prefills_draw(
        model_and_tokenizer, monkeypatch):
    from clbench.train import decoding

    model, tok = model_and_tokenizer
    monkeypatch.setattr(decoding, "PREFILL_FILL", 0.0)  # a batch's prompts in one forward
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3)
    generator = HFGenerator(model, tok, batch_size=8)  # a batch holds 2 prompts x 4 samples
    prefills: list[int] = []

    def count_prefills(_module, _args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:  # a prefill, not a decoding step
            prefills.append(ids.shape[0])

    hook = model.get_decoder().register_forward_pre_hook(count_prefills, with_kwargs=True)
    try:
        shared = generator.generate(PROMPTS, params)
        assert prefills == [2, 1]  # one row per distinct prompt, not one per sample
        prefill = decoding.prefill  # each row its own prompt: one prefill per sample
        monkeypatch.setattr(decoding, "prefill", lambda model, ids, mask, rows, cache: prefill(
            model, ids, mask, range(len(rows)), cache))
        monkeypatch.setattr(decoding, "SHARED_PREFIX_TOKENS", 10_000)  # nor a shared prefix
        prefills.clear()
        separate = generator.generate(PROMPTS, params)
        assert prefills == [8, 4]
    finally:
        hook.remove()
    assert [r.completion_ids for r in shared] == [r.completion_ids for r in separate]
    assert len({tuple(r.completion_ids) for r in shared}) > 3  # the samples do differ


def test_a_checkpoints_generation_settings_never_reach_the_sampler(model_and_tokenizer,
                                                                   monkeypatch):
    model, tok = model_and_tokenizer
    plain = _greedy_ids(model, tok)
    sampled = HFGenerator(model, tok, batch_size=8).generate(
        PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4))
    for name, value in {"repetition_penalty": 50.0, "no_repeat_ngram_size": 1,
                        "cache_implementation": "static"}.items():
        monkeypatch.setattr(model.generation_config, name, value, raising=False)
    assert _greedy_ids(model, tok) == plain  # a penalty of 50 would change every repeat
    again = HFGenerator(model, tok, batch_size=8).generate(  # with its shared prefill
        PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4))
    assert [r.completion_ids for r in again] == [r.completion_ids for r in sampled]
    assert model.generation_config.repetition_penalty == 50.0  # given back afterwards


def test_each_rollout_carries_the_samplers_entropy_per_generated_token(model_and_tokenizer):
    import torch

    from clbench.train.logprobs import completion_distributions
    from clbench.train.onpolicy import rollout_entropy

    model, tok = model_and_tokenizer
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=3)
    rollouts = HFGenerator(model, tok, batch_size=4).generate(PROMPTS, params)
    scored = completion_distributions(model, [r.prompt_ids for r in rollouts],
                                      [r.completion_ids for r in rollouts], temperature=0.7)
    logp = scored.logprobs.double()
    per_token = -(logp.exp() * logp).sum(-1)  # [B, T]
    for i, r in enumerate(rollouts):
        expected = float(per_token[i, :r.num_tokens].mean())
        assert r.metadata["entropy"] == pytest.approx(expected, rel=1e-4)
    tokens = sum(r.num_tokens for r in rollouts)
    assert rollout_entropy(rollouts)["rollout_entropy"] == pytest.approx(
        sum(r.metadata["entropy"] * r.num_tokens for r in rollouts) / tokens)
    assert torch.isfinite(torch.tensor([r.metadata["entropy"] for r in rollouts])).all()
    greedy_rollouts = HFGenerator(model, tok).generate(PROMPTS, greedy(4))
    assert rollout_entropy(greedy_rollouts) == {"rollout_entropy": 0.0}


def test_the_static_cache_engine_gives_the_decode_loops_greedy_tokens(model_and_tokenizer):
    model, tok = model_and_tokenizer
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10, stop=("ab",),
                            prompt_max_new_tokens=[10, 4, 7])
    loop = HFGenerator(model, tok, batch_size=4).generate(PROMPTS, params)
    static = HFGenerator(model, tok, batch_size=4, engine="static").generate(PROMPTS, params)
    assert [r.completion_ids for r in static] == [r.completion_ids for r in loop]
    assert [r.text for r in static] == [r.text for r in loop]
    assert [r.num_tokens for r in static] == [r.num_tokens for r in loop]  # caps, stops
    sampled = HFGenerator(model, tok, batch_size=4, engine="static").generate(
        PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1))
    assert len(sampled) == 6 and all(0 < r.num_tokens <= 6 for r in sampled)
    assert all("entropy" not in r.metadata for r in sampled)  # generate measures none
    with pytest.raises(ValueError, match="engine must be one of loop, static"):
        HFGenerator(model, tok, engine="compiled")


def test_row_batches_fill_a_token_budget_with_short_rows_and_keep_long_rows_few() -> None:
    from clbench.train.rollout import row_batches

    # fixed batches without a budget
    assert row_batches([9, 8, 7, 6, 5], max_rows=2) == [(0, 2), (2, 4), (4, 5)]
    # rows sorted longest first: 3 x 100 = 300 fits, 4 x 100 does not; then 40s fit 7 a batch
    # (7 x 40 = 280) but max_rows stops at 5
    lengths = [100, 100, 90, 90, 40, 40, 40, 40, 40, 40, 40]
    assert row_batches(lengths, max_rows=5, token_budget=300) == [
        (0, 3), (3, 6), (6, 11)]
    # the batch's longest row sets its width: 90 + a row of 200 would be 400 > 300
    assert row_batches([90, 200, 10], max_rows=8, token_budget=300) == [(0, 1), (1, 2), (2, 3)]
    # a row longer than the budget still gets a batch of its own
    assert row_batches([500], max_rows=4, token_budget=300) == [(0, 1)]
    assert row_batches([], max_rows=4, token_budget=300) == []


def test_a_token_budget_changes_the_batches_not_the_greedy_tokens(model_and_tokenizer,
                                                                 monkeypatch):
    from clbench.train import decoding

    monkeypatch.setattr(decoding, "PREFILL_FILL", 0.0)  # a batch's prompts in one forward
    model, tok = model_and_tokenizer
    calls: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _module, _args, kwargs: calls.append(kwargs["input_ids"].shape[1] > 1),
        with_kwargs=True)
    try:
        fixed = HFGenerator(model, tok, batch_size=8).generate(PROMPTS * 3, greedy(6))
        prefills_fixed, calls[:] = sum(calls), []
        budgeted = HFGenerator(model, tok, batch_size=8, token_budget=60).generate(
            PROMPTS * 3, greedy(6))
        prefills_budgeted = sum(calls)
    finally:
        hook.remove()
    assert [r.completion_ids for r in fixed] == [r.completion_ids for r in budgeted]
    assert prefills_fixed == 2 and prefills_budgeted > 2  # 9 rows: 8 + 1, then smaller


def test_greedy_decoding_in_compute_weights_is_the_bf16_model_and_leaves_the_masters(
        model_and_tokenizer):
    import copy

    import torch

    model, tok = model_and_tokenizer
    masters = [p.data for p in model.parameters()]
    values = [m.clone() for m in masters]
    seen: list[tuple[torch.dtype, bool]] = []
    hook = model.lm_head.register_forward_hook(lambda module, *_: seen.append(
        (module.weight.dtype, torch.is_autocast_enabled("cpu"))))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            compute = HFGenerator(model, tok, batch_size=8, greedy_weights="compute").generate(
                PROMPTS, greedy(16))
            assert torch.is_autocast_enabled("cpu")  # the run's autocast is back
    finally:
        hook.remove()
    assert seen and all(s == (torch.bfloat16, False) for s in seen)
    # the same tensors, untouched: an optimizer holding them sees nothing change
    assert all(p.data_ptr() == m.data_ptr() and p.dtype == torch.float32
               for p, m in zip(model.parameters(), masters))
    assert all(torch.equal(m, v) for m, v in zip(masters, values))
    # exactly what a bf16 copy of the model decodes without autocast
    expected = HFGenerator(copy.deepcopy(model).to(torch.bfloat16), tok, batch_size=8).generate(
        PROMPTS, greedy(16))
    assert [r.completion_ids for r in compute] == [r.completion_ids for r in expected]


def test_sampled_rollouts_keep_the_master_weights_whatever_greedy_decoding_does(
        model_and_tokenizer):
    import torch

    model, tok = model_and_tokenizer
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=4)
    dtypes: list[torch.dtype] = []
    hook = model.lm_head.register_forward_hook(lambda module, *_: dtypes.append(
        module.weight.dtype))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            master = HFGenerator(model, tok, greedy_weights="master").generate(PROMPTS, params)
            compute = HFGenerator(model, tok, greedy_weights="compute").generate(PROMPTS, params)
    finally:
        hook.remove()
    assert set(dtypes) == {torch.float32}
    assert [r.completion_ids for r in master] == [r.completion_ids for r in compute]


def test_compute_weights_outside_mixed_precision_change_nothing(model_and_tokenizer):
    model, tok = model_and_tokenizer
    plain = HFGenerator(model, tok, batch_size=8).generate(PROMPTS, greedy(16))
    compute = HFGenerator(model, tok, batch_size=8, greedy_weights="compute").generate(
        PROMPTS, greedy(16))
    assert [r.completion_ids for r in plain] == [r.completion_ids for r in compute]


def test_generator_settings_are_checked(model_and_tokenizer):
    model, tok = model_and_tokenizer
    with pytest.raises(ValueError, match="greedy_weights must be one of master, compute"):
        HFGenerator(model, tok, greedy_weights="fp16")
    with pytest.raises(ValueError, match="token_budget must be >= 1"):
        HFGenerator(model, tok, token_budget=0)
