"""The decode loop: greedy tokens equal `model.generate`'s, ended rows leave the batch, stop
strings found from the newest tokens, sampling draws the temperature/nucleus distribution."""

from __future__ import annotations

import random

import pytest
import torch
from toy import tiny

from clbench.train.decoding import Sampling, StopScanner, pick_tokens
from clbench.train.rollout import HFGenerator, SamplingParams, encode_chat

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one torch thread


PROMPTS = [[{"role": "user", "content": f"prompt {i}: " + "x" * (3 * i)}] for i in range(6)]




def _plain_generate(model, tok, prompt_ids: list[list[int]], eos: list[int], n_new: int):
    """`model.generate`, greedy, on the same left-padded batch."""
    from transformers import GenerationConfig

    width = max(map(len, prompt_ids))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    config = GenerationConfig(max_new_tokens=n_new, do_sample=False, eos_token_id=eos,
                              pad_token_id=tok.pad_token_id, bos_token_id=None)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    rows = []
    for row in out[:, width:].tolist():  # up to and including the first end token
        cut = next((i for i, t in enumerate(row) if t in eos), len(row) - 1)
        rows.append(row[:cut + 1])
    return rows


def _varied_tiny():
    """The tiny model with larger random weights: a freshly initialised one repeats a single
    token greedily, and rows must differ to end at different steps."""
    model, tok = tiny("tiny-llama", seed=2)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in (p for p in model.parameters() if p.dim() == 2):
            weight.copy_(torch.randn(weight.shape, generator=gen) * 0.3)
    return model, tok


def test_greedy_tokens_are_model_generates_while_ended_rows_leave_the_batch(monkeypatch):
    from clbench.train import decoding

    monkeypatch.setattr(decoding, "PREFILL_FILL", 0.0)  # the six prompts in one prefill forward
    model, tok = _varied_tiny()
    prompt_ids = [encode_chat(tok, p) for p in PROMPTS]
    free = HFGenerator(model, tok, batch_size=6).generate(
        PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=24))
    # Two tokens the rows emit become end tokens, chosen so that rows end at several steps.
    free_ids = [r.completion_ids for r in free]
    ends = max(_token_pairs_of(free_ids), key=lambda pair: len(set(_lengths_of(free_ids, pair))))
    assert len(set(_lengths_of(free_ids, ends))) >= 3
    batch_sizes: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: batch_sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, *ends]
    try:
        ours = HFGenerator(model, tok, batch_size=6).generate(
            PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=24))
    finally:
        model.generation_config.eos_token_id = saved
        hook.remove()
    expected = _plain_generate(model, tok, prompt_ids, [tok.eos_token_id, *ends], 24)
    assert [r.completion_ids for r in ours] == expected
    lengths = sorted(len(r.completion_ids) for r in ours)
    # one prefill of 6 rows, then one forward per step with only the rows still going
    assert batch_sizes[0] == 6
    assert batch_sizes[1:] == [sum(n > step for n in lengths) for step in range(1, lengths[-1])]


def test_the_stop_scanner_fires_at_the_first_token_that_completes_a_stop_string():
    _, tok = tiny("tiny-llama")
    rng = random.Random(0)
    letters, hits = "ab \n", 0
    for _ in range(200):
        ids = tok(''.join(rng.choice(letters) for _ in range(40)),
                  add_special_tokens=False)["input_ids"]
        stop = ("ab\na", " b ")
        scanner = StopScanner(tok, stop)
        first_full = next((k for k in range(1, len(ids) + 1) if any(
            s in tok.decode(ids[:k], skip_special_tokens=True) for s in stop)), None)
        first_tail = next((k for k in range(1, len(ids) + 1) if scanner.hit(ids[:k])), None)
        assert first_tail == first_full
        hits += first_full is not None
    assert hits > 50  # many strings hold a stop string somewhere


def test_sampling_draws_the_nucleus_distribution_at_the_temperature():
    from transformers.generation.logits_process import TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20, generator=gen) * 2
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)]:
        sampling = Sampling(temperature, top_p)
        kept = TopPLogitsWarper(top_p)(None, logits / temperature) > -float("inf")
        expected = torch.softmax((logits / temperature).masked_fill(~kept, -float("inf")), -1)
        draws = 100_000
        uniforms = torch.rand(3 * draws, generator=gen, dtype=torch.float64)
        tokens = pick_tokens(logits.repeat_interleave(draws, 0), sampling, uniforms)
        for row in range(3):
            counts = torch.bincount(tokens[row * draws:(row + 1) * draws], minlength=20)
            observed = counts.double() / draws
            assert (counts[~kept[row]] == 0).all()  # nothing outside the nucleus
            # within 5 standard errors of the exact probability, token by token
            se = (expected[row].double() * (1 - expected[row].double()) / draws).sqrt()
            assert ((observed - expected[row]).abs() <= 5 * se + 1e-9).all()
    assert pick_tokens(logits, Sampling(0.0), None).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("capacity", [3, 64])  # 3: the buffers grow past the prompt
def test_a_preallocated_cache_decodes_what_a_dynamic_cache_decodes(capacity: int) -> None:
    from clbench.train.decoding import RowPlan, attention_cache, decode

    model, tok = _varied_tiny()
    prompt_ids = [encode_chat(tok, p) for p in PROMPTS]
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    free = decode(model, ids, mask, RowPlan(range(6), [20] * 6, frozenset()), Sampling(0.0),
                  attention_cache(model))
    ends = frozenset(max(_token_pairs_of(free), key=lambda p: len(set(_lengths_of(free, p)))))
    # rows of two prompts x 3 samples: shared prefill (rows copied), rows dropped as they end
    rows = [0, 0, 0, 3, 3, 3]
    torch.manual_seed(0)
    dynamic = decode(model, ids[rows], mask[rows], RowPlan(rows, [20] * 6, ends),
                     Sampling(1.0, 0.9), attention_cache(model))
    cache = attention_cache(model, capacity=capacity)
    assert {type(layer).__name__ for layer in cache.layers} == {"PreallocatedLayer"}
    torch.manual_seed(0)
    assert decode(model, ids[rows], mask[rows], RowPlan(rows, [20] * 6, ends),
                  Sampling(1.0, 0.9), cache) == dynamic
    assert len({len(r) for r in dynamic}) > 1 and len({tuple(r) for r in dynamic}) > 2
    assert cache.get_seq_length() <= width + 20


def test_rows_that_leave_a_preallocated_cache_leave_its_buffers_in_place() -> None:
    """Ended rows leave by moving the kept rows down within the same buffers (no new buffer per
    ended row); any other order of rows is a gather."""
    from clbench.train.decoding import _preallocated_layer

    layer = _preallocated_layer()(capacity=8)
    keys, values = torch.randn(5, 2, 3, 4), torch.randn(5, 2, 3, 4)
    layer.update(keys, values)
    storage = layer.key_buffer.untyped_storage().data_ptr()
    layer.batch_select_indices(torch.tensor([1, 3, 4]))
    assert layer.key_buffer.untyped_storage().data_ptr() == storage
    assert torch.equal(layer.keys, keys[[1, 3, 4]]) and torch.equal(layer.values, values[[1, 3, 4]])
    new_keys, new_values = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    layer.update(new_keys, new_values)  # the next token lands after the kept rows' columns
    assert torch.equal(layer.keys, torch.cat([keys[[1, 3, 4]], new_keys], dim=2))
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.values, torch.cat([values[[4, 1]], new_values[[2, 0]]], dim=2))


def _token_pairs_of(rows: list[list[int]]) -> list[list[int]]:
    tokens = sorted({t for r in rows for t in r})
    return [[a, b] for i, a in enumerate(tokens) for b in tokens[i + 1:]]


def _lengths_of(rows: list[list[int]], ends: list[int]) -> list[int]:
    return [next((k + 1 for k, t in enumerate(r) if t in ends), len(r)) for r in rows]


def test_the_samplers_entropy_follows_temperature_and_nucleus_by_hand():
    import math

    from clbench.train.decoding import sampler_entropy

    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert float(sampler_entropy(logits, Sampling(1.0))) == pytest.approx(1.5 * math.log(2))
    # the nucleus of 0.5 is the first token alone; of 0.6 the first two, renormalised to 2/3, 1/3
    assert float(sampler_entropy(logits, Sampling(1.0, top_p=0.5))) == pytest.approx(0.0)
    two = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert float(sampler_entropy(logits, Sampling(1.0, top_p=0.6))) == pytest.approx(two)
    # temperature 0.5 squares the probabilities (renormalised): 4/6, 1/6, 1/6
    sharp = -(4 / 6 * math.log(4 / 6) + 2 * (1 / 6) * math.log(1 / 6))
    assert float(sampler_entropy(logits, Sampling(0.5))) == pytest.approx(sharp, rel=1e-6)
    assert float(sampler_entropy(logits, Sampling(0.0))) == 0.0


def _left_padded(tok, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    return ids, mask


def _prefilled(monkeypatch, model, ids, mask, rows, sampling, preallocate=True, **settings):
    """Under the decoding module's `settings`: the prefill's forwards (their input shapes, and
    whether each ran without a padding mask), its logits, cache keys and mask, and the tokens
    :func:`decode` gives (seeded) for the rows; `preallocate=False`: with dynamic caches, the
    whole left-padded batch in one forward."""
    from clbench.train import decoding

    settings.setdefault("PREFILL_FILL", 0.0)  # segments of any length share a prefill group
    for name, value in settings.items():
        monkeypatch.setattr(decoding, name, value)
    forwards = []
    real = decoding.forward_logits

    def spy(model, ids, mask, positions, cache, at=None):
        if at is not None:  # a prefill's forward, not a decoding step's
            forwards.append((tuple(ids.shape), bool(mask.all())))
        return real(model, ids, mask, positions, cache, at)

    monkeypatch.setattr(decoding, "forward_logits", spy)
    capacity = ids.shape[1] + 12 if preallocate else None
    cache = decoding.attention_cache(model, capacity=capacity)
    logits, cache_mask = decoding.prefill(model, ids[rows], mask[rows], rows, cache)
    keys = [layer.keys.clone() for layer in cache.layers]
    prefills = list(forwards)  # the decode below prefills again
    torch.manual_seed(0)
    tokens = decoding.decode(model, ids[rows], mask[rows],
                             decoding.RowPlan(rows, [12] * len(rows), frozenset()), sampling,
                             decoding.attention_cache(model, capacity=capacity))
    return prefills, logits, keys, cache_mask, tokens


def _assert_same_prefill(ours: tuple, theirs: tuple) -> None:
    """(logits, keys, cache mask) of two prefills: the same logits and, row by row and layer
    by layer, the same keys in the columns each mask keeps."""
    (our_logits, our_keys, our_mask), (logits, keys, mask) = ours, theirs
    torch.testing.assert_close(our_logits, logits)
    for ours_row, theirs_row in zip(_kept_keys(our_keys, our_mask), _kept_keys(keys, mask)):
        for ours_layer, theirs_layer in zip(ours_row, theirs_row):
            torch.testing.assert_close(ours_layer, theirs_layer)


def _kept_keys(keys, cache_mask):
    """Each row's keys at its unmasked columns, in order: a cache's content whatever its layout."""
    return [[layer[row][:, keep.bool()] for layer in keys] for row, keep in enumerate(cache_mask)]


def test_prefill_in_groups_of_rows_fills_the_cache_a_single_forward_fills(monkeypatch) -> None:
    """Rows prefilled in groups within PREFILL_TOKENS, each right-padded to its own longest
    prompt (no padding mask), then stacked: the same next-token logits, cached keys and decoded
    tokens as one forward over the left-padded batch (fp32), with rows of one prompt sharing
    its prefill."""
    model, tok = _varied_tiny()
    prompt_ids = sorted((encode_chat(tok, p) for p in PROMPTS), key=len, reverse=True)
    ids, mask = _left_padded(tok, prompt_ids)
    width = ids.shape[1]
    assert len({len(p) for p in prompt_ids}) == 6  # each group cut to a different width
    rows = [0, 1, 1, 2, 3, 4, 5, 5]  # two prompts sampled twice: their rows share a prefill
    greedy, sampled = Sampling(0.0), Sampling(1.0, 0.9)
    apart = {"SHARED_PREFIX_TOKENS": 10_000}  # every row prefilled whole

    whole, logits, keys, whole_mask, tokens = _prefilled(
        monkeypatch, model, ids, mask, rows, greedy, preallocate=False)
    assert whole == [((6, width), False)]  # the distinct prompts in one forward, masked
    assert torch.equal(whole_mask, mask[rows])
    for tokens_per_group, groups in ((10_000, [((6, width), True)]),
                                     (2 * width, [((2, len(prompt_ids[0])), True),
                                                  ((2, len(prompt_ids[2])), True),
                                                  ((2, len(prompt_ids[4])), True)])):
        ours, our_logits, our_keys, our_mask, our_tokens = _prefilled(
            monkeypatch, model, ids, mask, rows, greedy, PREFILL_TOKENS=tokens_per_group, **apart)
        assert ours == groups
        # each row: padding, its prompt, padding
        assert our_mask.sum(-1).tolist() == mask[rows].sum(-1).tolist()
        for row, row_mask in zip(rows, our_mask.tolist()):
            start = row_mask.index(1)
            assert row_mask[start:start + len(prompt_ids[row])] == [1] * len(prompt_ids[row])
        _assert_same_prefill((our_logits, our_keys, our_mask), (logits, keys, whole_mask))
        assert our_tokens == tokens
    assert _prefilled(monkeypatch, model, ids, mask, rows, sampled, PREFILL_TOKENS=2 * width,
                      **apart)[4] == _prefilled(monkeypatch, model, ids, mask, rows, sampled,
                                                preallocate=False)[4]


def test_a_prefix_every_prompt_shares_is_prefilled_once_with_the_same_logits_and_tokens(
        monkeypatch) -> None:
    """The leading tokens common to every prompt computed once, each row's own tokens on top of
    a copy (in groups too): the logits and decoded tokens of whole prompts (fp32), the cache's
    mask covering the prefix and each row's own tokens."""
    model, tok = _varied_tiny()
    instructions = [{"role": "system", "content": "Answer in one word, then stop. " * 3}]
    prompts = [instructions + p for p in PROMPTS]
    prompt_ids = sorted((encode_chat(tok, p) for p in prompts), key=len, reverse=True)
    ids, mask = _left_padded(tok, prompt_ids)
    prefix = next(i for i in range(len(prompt_ids[-1]))
                  if len({p[i] for p in prompt_ids}) > 1)
    assert prefix >= 20
    rows = [0, 1, 2, 2, 3, 4, 5]
    greedy, sampled = Sampling(0.0), Sampling(1.0, 0.9)
    forwards, logits, _, _, tokens = _prefilled(monkeypatch, model, ids, mask, rows, greedy,
                                                preallocate=False)
    assert forwards == [((6, ids.shape[1]), False)]
    own = [len(p) - prefix for p in prompt_ids]
    for groups, settings in ((1, {"PREFILL_TOKENS": 10_000}),
                             (3, {"PREFILL_TOKENS": 2 * own[0]})):
        forwards, ours, _, cache_mask, our_tokens = _prefilled(
            monkeypatch, model, ids, mask, rows, greedy, SHARED_PREFIX_TOKENS=20, **settings)
        assert forwards[0] == ((1, prefix), True) and len(forwards) == 1 + groups
        assert sum(shape[0] for shape, _ in forwards[1:]) == 6
        assert all(unmasked for _, unmasked in forwards)
        torch.testing.assert_close(ours, logits)
        assert our_tokens == tokens
        # each row: padding, the shared prefix, its own tokens, padding
        for row, row_mask in zip(rows, cache_mask.tolist()):
            start = row_mask.index(1)
            assert row_mask[start:start + len(prompt_ids[row])] == [1] * len(prompt_ids[row])
            assert sum(row_mask) == len(prompt_ids[row])
        assert _prefilled(monkeypatch, model, ids, mask, rows, sampled, SHARED_PREFIX_TOKENS=20,
                          **settings)[4] == _prefilled(monkeypatch, model, ids, mask, rows,
                                                       sampled, preallocate=False)[4]


def test_prefixes_shared_by_some_prompts_are_prefilled_once_as_a_tree(monkeypatch) -> None:
    """Prompts sharing nested prefixes (instructions; then, for some, the same listing): each
    shared segment computed once on top of its ancestors' keys, every token once in all; the
    logits, the cache (in the batch's left-padded layout) and the decoded tokens are those of
    whole prompts (fp32)."""
    from clbench.train.prefix_tree import prefix_tree

    model, tok = _varied_tiny()
    instructions = {"role": "system", "content": "Answer in one word, then stop. " * 2}
    listings = ["tools: alpha beta gamma delta " * 2, "tools: omega sigma kappa " * 2]
    prompts = [[instructions, {"role": "user", "content": listings[i % 2] + "q" * i}]
               for i in range(5)] + [[{"role": "user", "content": "something else " * 4}]]
    prompt_ids = sorted((encode_chat(tok, p) for p in prompts), key=len, reverse=True)
    ids, mask = _left_padded(tok, prompt_ids)
    tree = prefix_tree(prompt_ids, 20)
    # the instructions and the prompt without them; each listing below the instructions; the
    # five prompts' own tokens below their listing
    assert [len([n for n in tree if n.depth == d]) for d in range(4)] == [2, 2, 5, 0]
    assert sum(n.length for n in tree) < 0.6 * sum(map(len, prompt_ids))
    rows = [0, 1, 2, 3, 3, 4, 5]
    greedy, sampled = Sampling(0.0), Sampling(1.0, 0.9)
    _, logits, keys, whole_mask, tokens = _prefilled(monkeypatch, model, ids, mask, rows,
                                                     greedy, preallocate=False)
    forwards, ours, our_keys, our_mask, our_tokens = _prefilled(
        monkeypatch, model, ids, mask, rows, greedy, SHARED_PREFIX_TOKENS=20)
    computed = sum(rows * width for (rows, width), _ in forwards)  # padding included
    assert sum(n.length for n in tree) <= computed < 0.8 * sum(map(len, prompt_ids))
    assert len(forwards) == 3  # one forward per depth of the tree
    assert torch.equal(our_mask, whole_mask)  # the batch's own layout
    _assert_same_prefill((ours, our_keys, our_mask), (logits, keys, whole_mask))
    assert our_tokens == tokens
    assert _prefilled(monkeypatch, model, ids, mask, rows, sampled, SHARED_PREFIX_TOKENS=20
                      )[4] == _prefilled(monkeypatch, model, ids, mask, rows, sampled,
                                         preallocate=False)[4]
