"""Response drift and prompt distance as a run measures them: a model compared with itself has
KL 0 and edit similarity 1; a changed model's KL is the KL computed by hand from the two models;
the embeddings are sentence-transformers' own; nearer prompt sets have smaller MMD."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fakes import FakeAddition
from toy import tiny

from clbench.eval.records import ItemRecord, records_path, write_records
from clbench.metrics.responses import edit_similarity
from clbench.run.diagnostics import base_weights_path, keep_base_weights
from clbench.run.response_drift import base_model_copy, response_drift
from clbench.run.rows import ColumnPlan
from clbench.spec.schema import ResponseDriftSpec

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one torch thread


def _records(tmp_path: Path, row: int, examples, completions) -> None:
    write_records(records_path(tmp_path, row, "add"),
                  [ItemRecord(e.id, c, 0.0, False) for e, c in zip(examples, completions)])


def _context(tmp_path: Path, model, tok, examples) -> SimpleNamespace:
    return SimpleNamespace(run_dir=tmp_path, model=model, tokenizer=tok,
                           plans=[ColumnPlan("add", FakeAddition(), examples),
                                  ColumnPlan("general", probe=object())])


def test_a_model_compared_with_its_own_base_has_no_response_drift(tmp_path: Path) -> None:
    model, tok = tiny("tiny-llama", seed=2)
    keep_base_weights(tmp_path, model)
    examples = FakeAddition().examples("eval", 0, 3)
    answers = ["7 + 10 = 17", "Answer: 19", "no idea at all"]
    _records(tmp_path, 0, examples, answers)
    _records(tmp_path, 1, examples, answers)
    ctx = _context(tmp_path, model, tok, examples)
    found = response_drift(ctx, 1, base_weights_path(tmp_path),
                           ResponseDriftSpec(items_per_column=2))
    assert found["kl"] == pytest.approx(0.0, abs=1e-9)
    assert found["edit_similarity"] == 1.0
    assert found["columns"]["add"]["prompts"] == 2  # the first items_per_column items
    assert set(found["columns"]) == {"add"}  # an lm-eval probe has no responses of ours


def test_a_changed_model_drifts_by_the_kl_and_edit_similarity_computed_by_hand(
        tmp_path: Path) -> None:
    from clbench.metrics.responses import mean_token_kl
    from clbench.train.logprobs import completion_distributions
    from clbench.train.rollout import encode_chat

    model, tok = tiny("tiny-llama", seed=2)
    base = copy.deepcopy(model)
    keep_base_weights(tmp_path, model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    examples = FakeAddition().examples("eval", 0, 2)
    _records(tmp_path, 0, examples, ["12 + 3 = 15", "Answer: 19"])
    _records(tmp_path, 1, examples, ["12 + 4 = 16", "Answer: 19"])
    found = response_drift(_context(tmp_path, model, tok, examples), 1,
                           base_weights_path(tmp_path), ResponseDriftSpec())
    prompts = [encode_chat(tok, e.messages) for e in examples]
    responses = [tok("12 + 3 = 15", add_special_tokens=False)["input_ids"],
                 tok("Answer: 19", add_special_tokens=False)["input_ids"]]
    now = completion_distributions(model, prompts, responses)
    before = completion_distributions(base, prompts, responses)
    assert found["kl"] == pytest.approx(mean_token_kl(now.logprobs, before.logprobs, now.mask),
                                        rel=1e-6)
    assert found["kl"] > 0
    changed = tok("12 + 4 = 16", add_special_tokens=False)["input_ids"]
    assert found["edit_similarity"] == pytest.approx((edit_similarity(changed, responses[0])
                                                      + 1.0) / 2)


def test_the_base_side_is_kept_from_one_stage_to_the_next(tmp_path: Path, monkeypatch) -> None:
    """Later stages score only the current model: the same KL, bit for bit, as scoring the
    base model again, and no base model built; past the memory limit it is scored again."""
    from clbench.run import response_drift as module

    model, tok = tiny("tiny-llama", seed=2)
    keep_base_weights(tmp_path, model)
    examples = FakeAddition().examples("eval", 0, 6)
    _records(tmp_path, 0, examples, [f"{i} + 1 = {i + 1}" for i in range(6)])
    copies = []
    monkeypatch.setattr(module, "base_model_copy",
                        lambda *a: copies.append(1) or base_model_copy(*a))
    ctx, spec, weights = _context(tmp_path, model, tok, examples), ResponseDriftSpec(
        items_per_column=6), base_weights_path(tmp_path)
    kept, unkept = module.BaseScores(), module.BaseScores(limit=0)
    found = []
    for row, shift in ((1, 1), (2, 2)):  # each stage moves the model
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        _records(tmp_path, row, examples, [f"{i} + {shift} = {i + shift}" for i in range(6)])
        found.append((response_drift(ctx, row, weights, spec, kept)["kl"],
                      response_drift(ctx, row, weights, spec, unkept)["kl"],
                      response_drift(ctx, row, weights, spec)["kl"]))
    assert found[0][0] == found[0][1] == found[0][2] > 0
    assert found[1][0] == found[1][1] == found[1][2] > found[0][0]
    # two batches of 4 and 2 prompts, scored on the base once with the scores kept, each time
    # without; the base model built for every call but the kept one's second
    assert (kept.computed, unkept.computed, len(kept.kept), unkept.bytes) == (2, 4, 2, 0)
    assert len(copies) == 5


def test_the_base_copy_holds_the_base_weights_and_needs_every_parameter(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model, _ = tiny("tiny-llama", seed=2)
    keep_base_weights(tmp_path, model)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    base = base_model_copy(model, base_weights_path(tmp_path))
    assert all(torch.equal(p, original[n]) for n, p in base.named_parameters())
    stored = load_file(str(base_weights_path(tmp_path)))
    only_matrices = {n: t for n, t in stored.items() if t.dim() == 2}  # an older run's file
    save_file(only_matrices, str(tmp_path / "old.safetensors"))
    assert base_model_copy(model, tmp_path / "old.safetensors") is None
    assert base_model_copy(model, tmp_path / "missing.safetensors") is None


def test_embeddings_are_sentence_transformers_own() -> None:
    from sentence_transformers import SentenceTransformer

    from clbench.eval.embedding import embed, model_folder

    texts = ["What is 12 + 35?", "Which element has the symbol Fe?", "call the tool " * 200]
    reference = SentenceTransformer(str(model_folder()), device="cpu").encode(
        texts, convert_to_tensor=True)
    assert torch.allclose(embed(texts, batch_size=2), reference, atol=1e-5)


def test_prompts_of_the_same_kind_are_nearer_than_prompts_of_another() -> None:
    from clbench.eval.embedding import embed
    from clbench.metrics.distance import mmd

    sums = embed([f"What is {a} + {b}?" for a, b in zip(range(10, 30), range(40, 60))])
    more_sums = embed([f"What is {a} + {b}?" for a, b in zip(range(70, 90), range(3, 23))])
    elements = embed([f"Which element has atomic number {z}?" for z in range(1, 21)])
    assert mmd(sums, more_sums) < mmd(sums, elements)
