"""Completion log-probs against a naive per-example computation, ragged batches, chunks, grads."""

from __future__ import annotations

import pytest
import torch
from toy import tiny

from clbench.train.logprobs import completion_distributions, completion_logprobs, pack_batch

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one torch thread


PROMPTS = [[1, 5, 9, 12], [3, 4], [7, 8, 9, 10, 11, 12, 13]]
COMPLETIONS = [[20, 21, 22], [30, 31, 32, 33, 34, 35], [40]]




@pytest.fixture(scope="module")
def model():
    return tiny("tiny-qwen2", seed=2)[0]


def naive_logits(model, prompt: list[int], completion: list[int], temperature: float = 1.0
                 ) -> torch.Tensor:
    """Logits predicting each completion token, from one unpadded forward pass."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float() / temperature
    return logits[len(prompt) - 1:len(prompt) - 1 + len(completion)]


def naive_logprobs(model, prompt, completion, temperature=1.0) -> torch.Tensor:
    logp = naive_logits(model, prompt, completion, temperature).log_softmax(-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("chunk_size,micro", [(128, None), (2, None), (1, 1), (4, 2)])
def test_ragged_batch_matches_one_example_at_a_time(model, chunk_size, micro) -> None:
    out = completion_logprobs(model, PROMPTS, COMPLETIONS, chunk_size=chunk_size,
                              micro_batch_size=micro)
    assert out.logprobs.shape == (3, 6) and out.mask.shape == (3, 6)
    assert out.mask.sum(1).tolist() == [3, 6, 1]
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
            torch.testing.assert_close(out.logprobs[i, :len(c)], naive_logprobs(model, p, c),
                                       atol=1e-5, rtol=1e-5)
    assert torch.all(out.logprobs[~out.mask] == 0)
    assert out.logprobs.requires_grad is False


def test_temperature_divides_the_logits(model) -> None:
    out = completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=0.5)
    with torch.no_grad():
        torch.testing.assert_close(out.logprobs[1], naive_logprobs(model, PROMPTS[1],
                                                                   COMPLETIONS[1], 0.5),
                                   atol=1e-5, rtol=1e-5)


def test_gradients_through_chunks_equal_the_naive_gradients(model) -> None:
    model.zero_grad()
    out = completion_logprobs(model, PROMPTS, COMPLETIONS, grad=True, chunk_size=2)
    (out.logprobs.sum()).backward()
    chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sum(naive_logprobs(model, p, c).sum() for p, c in zip(PROMPTS, COMPLETIONS)).backward()
    for got, want in zip(chunked, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    model.zero_grad()


def test_topk_and_indices_and_full_distributions(model) -> None:
    top = completion_distributions(model, PROMPTS, COMPLETIONS, topk=5, chunk_size=3)
    full = completion_distributions(model, PROMPTS, COMPLETIONS)
    at = completion_distributions(model, PROMPTS, COMPLETIONS, indices=top.indices)
    assert top.logprobs.shape == (3, 6, 5) and top.indices.shape == (3, 6, 5)
    assert full.indices is None and full.logprobs.shape == (3, 6, model.config.vocab_size)
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
            logp = naive_logits(model, p, c).log_softmax(-1)
            values, ids = logp.topk(5, dim=-1)
            torch.testing.assert_close(top.logprobs[i, :len(c)], values, atol=1e-5, rtol=1e-5)
            assert torch.equal(top.indices[i, :len(c)], ids)
            torch.testing.assert_close(full.logprobs[i, :len(c)], logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(at.logprobs, top.logprobs)
    torch.testing.assert_close(top.token_logprobs,
                               completion_logprobs(model, PROMPTS, COMPLETIONS).logprobs)


def test_pack_batch_layout_and_errors() -> None:
    packed = pack_batch([[1, 2], [3]], [[4], [5, 6]])
    assert packed.prompt_width == 2
    assert packed.input_ids.tolist() == [[1, 2, 4, 0], [0, 3, 5, 6]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 2], [0, 0, 1, 2]]
    assert packed.completion_mask.tolist() == [[True, False], [True, True]]
    with pytest.raises(ValueError, match="at least one token"):
        pack_batch([[]], [[1]])
    with pytest.raises(ValueError, match="2 contexts but 1 completions"):
        pack_batch([[1], [2]], [[3]])


def test_gradient_checkpointing_changes_memory_not_gradients() -> None:
    """Recomputing activations in backward (the default) gives bit-identical gradients, so
    turning it on or off never changes a result; it applies in train mode only."""
    from clbench.models import load_model
    from clbench.train.logprobs import completion_distributions
    from clbench.train.optim import OptimizerSettings, set_gradient_checkpointing

    assert OptimizerSettings().gradient_checkpointing
    grads = []
    for on in (False, True):
        model, _ = load_model("tiny-llama", device="cpu", dtype="float32", seed=0)
        set_gradient_checkpointing(model, OptimizerSettings(gradient_checkpointing=on))
        assert model.model.gradient_checkpointing is on
        model.train()
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 60, (20 - i,), generator=gen).tolist() for i in range(4)]
        completions = [torch.randint(3, 60, (6,), generator=gen).tolist() for _ in range(4)]
        dists = completion_distributions(model, prompts, completions, topk=5, grad=True)
        (dists.token_logprobs.sum() + dists.logprobs.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_checkpointing_set_up_again_leaves_one_hook_on_the_embeddings() -> None:
    """Each stage sets activation checkpointing up on the same model: the embeddings keep the
    one hook that makes their output require grad, not one more per stage."""
    from clbench.models import load_model
    from clbench.train.optim import OptimizerSettings, set_gradient_checkpointing

    model, _ = load_model("tiny-llama", device="cpu", dtype="float32", seed=0)
    for _ in range(3):
        set_gradient_checkpointing(model, OptimizerSettings(gradient_checkpointing=True))
    embeddings = model.get_input_embeddings()
    assert len(embeddings._forward_hooks) == 1
    embeddings.weight.requires_grad_(False)  # so that only the hook makes the output need grad
    assert embeddings(torch.tensor([[1, 2]])).requires_grad  # the hook still does its work
    model.disable_input_require_grads()
    assert not embeddings(torch.tensor([[1, 2]])).requires_grad
    set_gradient_checkpointing(model, OptimizerSettings(gradient_checkpointing=False))
    assert model.model.gradient_checkpointing is False


def test_the_scores_sdpo_gets_from_models_equal_scores_from_their_logits(model) -> None:
    """What the SDPO methods feed `sdpo_loss` (the student's top-k, the teacher read at the
    student's ids, by `completion_distributions`) equals `scores_from_logits` on the same
    logits, the path `sdpo_loss` is compared with TRL on: so that comparison covers the method."""
    from logit_losses import scores_from_logits

    from clbench.train.losses import DistillationScores, sdpo_loss

    teacher = tiny("tiny-qwen2", seed=3)[0]
    prompt, completion = PROMPTS[1], COMPLETIONS[1]
    with torch.no_grad():
        s = completion_distributions(model, [prompt], [completion], topk=5, chunk_size=2)
        t = completion_distributions(teacher, [prompt], [completion], indices=s.indices)
        ours = sdpo_loss(DistillationScores(s.token_logprobs, s.logprobs),
                         DistillationScores(t.token_logprobs, t.logprobs), s.mask)
        ids = torch.tensor([completion])
        ref = sdpo_loss(*scores_from_logits(naive_logits(model, prompt, completion)[None],
                                            naive_logits(teacher, prompt, completion)[None],
                                            ids, "topk", topk=5), s.mask)
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
    assert float(ours.loss) > 0  # the two models differ: the comparison is not of zeros
