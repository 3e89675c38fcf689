"""The fused decoding forward computes the model's own layers: the same logits as transformers'
forward in fp32 (prefill, decoding steps over a cache with padding, a shared prefix), the same
greedy tokens through the decode loop, the same dtypes under autocast; models it cannot compute
exactly keep transformers' forward."""

from __future__ import annotations

import pytest
import torch
from toy import tiny

from clbench.train import decoding, fused_forward
from clbench.train.fused_forward import fused_decoder
from clbench.train.prefix_tree import prefix_tree
from clbench.train.rollout import HFGenerator, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

# fp32, summed in another order (fused projections, bmm instead of SDPA): differences of about
# 1e-5 on logits of order 1 were seen with the lowest supported torch
FP32 = {"atol": 1e-4, "rtol": 1e-4}

PROMPTS = [[{"role": "user", "content": f"prompt {i}: " + "xy" * (4 * i)}] for i in range(5)]


def _varied(name: str):
    """A tiny model with larger random weights (and biases where it has them), so that rows
    differ and greedy tokens depend on every part of the computation."""
    model, tok = tiny(name, seed=3)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 2 else 0.1)
                    + (1.0 if p.dim() == 1 and p.shape[0] == model.config.hidden_size else 0.0))
    return model.eval(), tok


def _left_padded(tok, prompts):
    from clbench.train.rollout import encode_chat

    ids = [encode_chat(tok, p) for p in prompts]
    width = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return input_ids, mask


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_logits_are_the_models_at_prefill_and_at_each_decoding_step(name: str) -> None:
    model, tok = _varied(name)
    fused = fused_decoder(model)
    assert fused is not None
    input_ids, mask = _left_padded(tok, PROMPTS)
    rows, width = input_ids.shape
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [decoding.attention_cache(model, capacity=width + 8) for _ in range(2)]
    with torch.no_grad():
        # a left-padded batch under its padding mask, then steps over the padded cache
        theirs = decoding.forward_logits(model, input_ids, mask, positions, caches[0])
        ours = decoding.forward_logits(fused, input_ids, mask, positions, caches[1])
        real = mask.bool()
        torch.testing.assert_close(ours[real], theirs[real], **FP32)
        for a, b in zip(caches[0].layers, caches[1].layers):
            torch.testing.assert_close(b.keys.transpose(1, 2)[real], a.keys.transpose(1, 2)[real],
                                       **FP32)
        tokens, position = theirs[:, -1].argmax(-1, keepdim=True), positions[:, -1:]
        for _ in range(4):
            mask = torch.cat([mask, mask.new_ones((rows, 1))], 1)
            position = position + 1
            theirs = decoding.forward_logits(model, tokens, mask, position, caches[0])
            ours = decoding.forward_logits(fused, tokens, mask, position, caches[1])
            torch.testing.assert_close(ours, theirs, **FP32)
            tokens = theirs[:, -1].argmax(-1, keepdim=True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_a_prefill_through_the_prefix_tree_gives_the_models_logits(name: str) -> None:
    """The decode loop's prefill: a shared prefix prefilled once (no past: the causal kernel),
    the prompts' own tokens on top of it (past keys under a mask)."""
    model, tok = _varied(name)
    fused = fused_decoder(model)
    prompts = [[{"role": "system", "content": "the same long instructions " * 3},
                {"role": "user", "content": "q" * (i + 1)}] for i in range(4)]
    input_ids, mask = _left_padded(tok, prompts)
    capacity = input_ids.shape[1] + 4
    with torch.no_grad():
        out = {}
        for key, m in (("model", model), ("fused", fused)):
            cache = decoding.attention_cache(model, capacity=capacity)
            logits, cache_mask = decoding.prefill(m, input_ids, mask, [0, 1, 2, 3], cache)
            out[key] = logits, cache_mask, cache.layers[-1].keys
    tree = prefix_tree([ids[m.bool()].tolist() for ids, m in zip(input_ids, mask)],
                       decoding.SHARED_PREFIX_TOKENS)
    assert len(tree) == 5 and tree[-1].depth == 1  # the shared prefix, then each prompt's own
    torch.testing.assert_close(out["fused"][0], out["model"][0], **FP32)
    assert torch.equal(out["fused"][1], out["model"][1])
    real = out["model"][1].bool()
    torch.testing.assert_close(out["fused"][2].transpose(1, 2)[real],
                               out["model"][2].transpose(1, 2)[real], **FP32)


def test_greedy_completions_through_the_generator_are_the_models() -> None:
    model, tok = _varied("tiny-llama")
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
    ours = HFGenerator(model, tok, batch_size=5, fused=True).generate(PROMPTS, params)
    theirs = HFGenerator(model, tok, batch_size=5, fused=False).generate(PROMPTS, params)
    assert [r.completion_ids for r in ours] == [r.completion_ids for r in theirs]
    assert len({len(r.completion_ids) for r in ours} | {r.text for r in ours}) > 2  # varied


def test_sampled_rollouts_through_the_generator_are_the_models() -> None:
    """The same seeded draws from the same distribution: in fp32 the same tokens."""
    model, tok = _varied("tiny-llama")
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=12, seed=5)
    ours = HFGenerator(model, tok, batch_size=15, fused=True).generate(PROMPTS, params)
    theirs = HFGenerator(model, tok, batch_size=15, fused=False).generate(PROMPTS, params)
    assert [r.completion_ids for r in ours] == [r.completion_ids for r in theirs]
    assert len({tuple(r.completion_ids) for r in ours}) > 5  # varied draws, not one answer


def test_under_autocast_it_computes_in_the_dtypes_transformers_does() -> None:
    """bf16 matrix multiplies over weights cast once, the residual stream in fp32, as
    transformers' layers give under the same autocast; the cache holds the keys as attention
    reads them under autocast (bf16), where transformers keeps them in fp32 and casts them at
    every step."""
    model, tok = _varied("tiny-llama")
    input_ids, mask = _left_padded(tok, PROMPTS[:2])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [decoding.attention_cache(model, capacity=input_ids.shape[1]) for _ in range(2)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = fused_decoder(model, torch.bfloat16)
        assert fused is not None and fused.layers[0].qkv.dtype == torch.bfloat16
        theirs = decoding.forward_logits(model, input_ids, mask, positions, caches[0])
        ours = decoding.forward_logits(fused, input_ids, mask, positions, caches[1])
    assert caches[0].layers[0].keys.dtype == torch.float32
    assert caches[1].layers[0].keys.dtype == caches[1].layers[0].values.dtype == torch.bfloat16
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() < 0.05 * theirs[real].abs().max()


def _prefill_and_steps(model, fused, input_ids, mask, steps: int = 5):
    """The logits of a prefill of the left-padded batch and of `steps` greedy decoding steps
    after it through `fused`, and the cache they filled."""
    rows, width = input_ids.shape
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = decoding.attention_cache(model, capacity=width + steps + 1)
    logits = [decoding.forward_logits(fused, input_ids, mask, positions, cache)]
    step_mask, position = mask, positions[:, -1:]
    tokens = logits[0][:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        step_mask = torch.cat([step_mask, step_mask.new_ones((rows, 1))], 1)
        position = position + 1
        logits.append(decoding.forward_logits(fused, tokens, step_mask, position, cache))
        tokens = logits[-1][:, -1].argmax(-1, keepdim=True)
    return logits, cache


def test_under_autocast_keys_cast_once_change_no_value(monkeypatch) -> None:
    """Queries and keys cast to the compute dtype once, before attention, give exactly what
    autocast gives casting fp32 ones at every attention call: the same logits, bit for bit, at
    the prefill and at every decoding step."""
    model, tok = _varied("tiny-llama")
    input_ids, mask = _left_padded(tok, PROMPTS)
    steps = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for cast_once in (True, False):
            monkeypatch.setattr(fused_forward, "CAST_KEYS_ONCE", cast_once)
            fused = fused_decoder(model, torch.bfloat16)
            logits, cache = _prefill_and_steps(model, fused, input_ids, mask)
            steps.append((logits, cache.layers[0].keys.dtype))
    (cast, cast_dtype), (before, before_dtype) = steps
    assert (cast_dtype, before_dtype) == (torch.bfloat16, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(cast, before))
    assert len({tuple(t[:, -1].argmax(-1).tolist()) for t in cast}) > 1  # varied steps


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_packed_weights_change_no_value_where_onednn_packs_them(name: str, monkeypatch) -> None:
    """Decoding steps over weights packed for oneDNN (bf16, a CPU with bf16 support) give
    exactly what the plain weights give, bit for bit, at the prefill and at every step, with
    and without biases; where oneDNN has no bf16, nothing is packed."""
    model, tok = _varied(name)
    input_ids, mask = _left_padded(tok, PROMPTS)
    supported = torch.backends.mkldnn.is_available() and \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    steps = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for packed_rows in (fused_forward.PACKED_ROWS, 0):
            monkeypatch.setattr(fused_forward, "PACKED_ROWS", packed_rows)
            fused = fused_decoder(model, torch.bfloat16)
            assert fused is not None
            packed = [p.packed is not None for layer in fused.layers
                      for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            assert all(packed) == (bool(packed_rows) and supported) and len(set(packed)) == 1
            steps.append(_prefill_and_steps(model, fused, input_ids, mask)[0])
    assert all(torch.equal(a, b) for a, b in zip(*steps))
    assert len({tuple(t[:, -1].argmax(-1).tolist()) for t in steps[0]}) > 1  # varied steps


def test_a_model_set_up_for_training_keeps_the_fused_forward() -> None:
    """Activation checkpointing hooks the embeddings (transformers' `enable_input_require_grads`),
    a module this forward calls: the hook runs, the fused forward stays (a run's rollouts and
    the rows after the first stage)."""
    from clbench.train.optim import OptimizerSettings, set_gradient_checkpointing

    model, tok = _varied("tiny-llama")
    set_gradient_checkpointing(model, OptimizerSettings(gradient_checkpointing=True))
    embeddings = model.model.embed_tokens
    assert embeddings._forward_hooks  # transformers' hook, as in every run's training
    fused = fused_decoder(model)
    assert fused is not None
    calls = []
    extra = embeddings.register_forward_hook(lambda *_: calls.append(1))
    norm = model.model.layers[0].input_layernorm.register_forward_pre_hook(
        lambda *_: calls.append(2))
    input_ids, mask = _left_padded(tok, PROMPTS[:2])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        cache = decoding.attention_cache(model, capacity=input_ids.shape[1])
        ours = decoding.forward_logits(fused, input_ids, mask, positions, cache)
        assert calls == [1, 2]  # the hooks on the modules it calls ran
        extra.remove()
        norm.remove()
        theirs = decoding.forward_logits(model.eval(), input_ids, mask, positions, None)
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], **FP32)


def test_models_it_cannot_compute_exactly_keep_transformers_forward() -> None:
    model, _ = tiny("tiny-llama")
    assert fused_decoder(model) is not None

    class Wrapped(torch.nn.Linear):
        """A projection of another type, as an adapter or a quantized layer wraps one."""

    layer = model.model.layers[1].self_attn
    original = layer.v_proj
    layer.v_proj = Wrapped(original.in_features, original.out_features, bias=False)
    assert fused_decoder(model) is None
    layer.v_proj = original
    model.config.hidden_act = "gelu"
    assert fused_decoder(model) is None
    model.config.hidden_act = "silu"
    hook = model.model.layers[0].mlp.register_forward_hook(lambda *_: None)
    assert fused_decoder(model) is None  # whoever hooked a module expects it to run
    hook.remove()
    assert fused_decoder(model) is not None
    hook = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda *_: None)
    assert fused_decoder(model) is None
    hook.remove()

    class Sharded(torch.nn.Parameter):
        """A parameter of another type, as FSDP2's DTensor parameters are not plain tensors."""

    mlp = model.model.layers[0].mlp
    weight = mlp.up_proj.weight
    mlp.up_proj.weight = Sharded(weight.detach().clone())
    assert fused_decoder(model) is None  # its weights are not all here to concatenate
    mlp.up_proj.weight = weight
    assert fused_decoder(model) is not None
    model.config._attn_implementation = "eager"
    assert fused_decoder(model) is None
