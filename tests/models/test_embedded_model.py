"""The embedded SmolLM2-135M-Instruct: loads from the cache, answers sensibly, trains one step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from toy import toy_context

from clbench.models import EMBEDDED_MODEL, embedded_model_dir, load_model
from clbench.train.rollout import HFGenerator, SamplingParams
from clbench_methods.grpo import GRPO
from clbench_methods.sft import SFT

pytestmark = [pytest.mark.embedded, pytest.mark.usefixtures("single_thread")]


@pytest.fixture(scope="module")
def embedded():
    return load_model(EMBEDDED_MODEL, device="cpu", dtype="float32")


def test_embedded_model_loads_as_the_instruct_model(embedded) -> None:
    model, tok = embedded
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    assert (embedded_model_dir() / "model.safetensors").is_file()


def test_embedded_model_knows_the_capital_of_france(embedded) -> None:
    model, tok = embedded
    rollout = HFGenerator(model, tok).generate(
        [[{"role": "user", "content": "What is the capital of France?"}]],
        SamplingParams(n=1, temperature=0.0, max_new_tokens=16))[0]
    assert "Paris" in rollout.text


@pytest.mark.parametrize("method", [SFT({"lr": 1e-5}), GRPO({"lr": 1e-5})], ids=["sft", "grpo"])
def test_one_training_step_moves_the_embedded_model(embedded, method, tmp_path: Path) -> None:
    model, tok = embedded
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    ctx = toy_context(model, tok, tmp_path, steps=1, prompts_per_step=2, samples_per_prompt=2,
                      max_new_tokens=8)
    report = method.train_stage(ctx)
    assert len(report.steps) == 1 and torch.isfinite(torch.tensor(report.steps[0]["loss"]))
    # (for GRPO this seed's batch has reward variance, so the gradient is not zero)
    assert report.steps[0]["grad_norm"] > 0
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)


def test_greedy_rows_end_one_by_one_with_model_generates_tokens(embedded) -> None:
    """The decode loop drops rows as they end; on the real model the tokens are still those of
    `model.generate` on the same batch."""
    from transformers import GenerationConfig

    from clbench.train.rollout import encode_chat

    model, tok = embedded
    prompts = [[{"role": "user", "content": q}] for q in (
        "Say yes.", "What is 2 + 2? Answer with a number.", "Name a colour.",
        "Write one sentence about the sea.")]
    ours = HFGenerator(model, tok, batch_size=4).generate(
        prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=24))
    ids = [encode_chat(tok, p) for p in prompts]
    width = max(map(len, ids))
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, bos_token_id=None)
    with torch.no_grad():
        plain = model.generate(
            input_ids=torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in ids]),
            attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids]),
            generation_config=config)[:, width:].tolist()
    for rollout, row in zip(ours, plain):
        end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        assert rollout.completion_ids == row[:end]
    assert len({len(r.completion_ids) for r in ours}) > 1  # the rows did end at different steps


def test_stop_strings_are_found_from_the_newest_tokens_of_a_bpe_tokenizer(embedded) -> None:
    import random

    from clbench.train.decoding import StopScanner

    _, tok = embedded
    pieces = ["Question", ":", " answer", "\n", "\n\n", "é", "日本", " </", "tool_call", ">",
              "ab", " ", "42"]
    stop = ("\n\n", "Question:", "</tool_call>", "日本")
    scanner, rng, hits = StopScanner(tok, stop), random.Random(0), 0
    for _ in range(100):
        ids = tok("".join(rng.choice(pieces) for _ in range(12)), add_special_tokens=False
                  )["input_ids"]
        first_full = next((k for k in range(1, len(ids) + 1) if any(
            s in tok.decode(ids[:k], skip_special_tokens=True) for s in stop)), None)
        assert next((k for k in range(1, len(ids) + 1) if scanner.hit(ids[:k])), None) \
            == first_full
        hits += first_full is not None
    assert hits > 50
