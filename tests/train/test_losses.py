"""Loss math: agreement with TRL's reference functions, hand-computed GRPO cases, signs."""

from __future__ import annotations

import math
import os

import pytest
import torch
from logit_losses import full_divergence, scores_from_logits, topk_divergence

from clbench.train import losses

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.sdpo import loss_utils as trl_sdpo

ATOL = 1e-6


def _logits(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale


# ---------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------

def test_group_advantages_subtract_group_mean_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = losses.group_advantages(rewards, group_size=4)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))
    grid = losses.group_advantages(rewards.view(2, 4))
    assert grid.shape == (2, 4) and torch.allclose(grid.reshape(-1), adv)


def test_group_advantages_std_scaling_uses_unbiased_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    std = math.sqrt((4 * 0.25) / 3)  # unbiased sample std of {1, 0, 0, 1}
    adv = losses.group_advantages(rewards, scale_std=True, eps=1e-4)
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-4))
    # an all-equal group gets no signal even with std scaling
    assert torch.equal(losses.group_advantages(torch.ones(1, 4), scale_std=True),
                       torch.zeros(1, 4))


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        losses.group_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        losses.group_advantages(torch.zeros(6))


def test_clipped_surrogate_hand_computed_cases():
    logp_old = torch.zeros(1, 4)
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.5]])
    advantages = torch.tensor([[1.0, -1.0, 2.0, 1.0]])
    loss = losses.clipped_surrogate(ratios.log(), logp_old, advantages)
    # 1.5 with A>0 is clipped at 1.28; 0.5 with A<0 at 0.8; 1.1 is inside the trust region;
    # 0.5 with A>0 is not clipped (min picks the unclipped, more pessimistic term).
    assert torch.allclose(loss, torch.tensor([[-1.28, 0.8, -2.2, -0.5]]), atol=ATOL)


def test_clipped_surrogate_dual_clip_caps_negative_advantage_loss():
    ratio = torch.tensor([[5.0, 5.0]])
    advantages = torch.tensor([[-1.0, 1.0]])
    plain = losses.clipped_surrogate(ratio.log(), torch.zeros(1, 2), advantages)
    dual = losses.clipped_surrogate(ratio.log(), torch.zeros(1, 2), advantages, dual_clip=3.0)
    assert torch.allclose(plain, torch.tensor([[5.0, -1.28]]), atol=ATOL)
    assert torch.allclose(dual, torch.tensor([[3.0, -1.28]]), atol=ATOL)
    with pytest.raises(ValueError, match="dual_clip"):
        losses.clipped_surrogate(ratio.log(), torch.zeros(1, 2), advantages, dual_clip=0.5)


def test_clipped_surrogate_matches_trl_grpo_formula_on_random_tensors():
    # TRL computes the GRPO surrogate inline in GRPOTrainer._compute_loss; this is its formula.
    gen = torch.Generator().manual_seed(1)
    logp_new = -torch.rand(4, 7, generator=gen) * 3
    logp_old = logp_new + torch.randn(4, 7, generator=gen) * 0.3
    adv = torch.randn(4, generator=gen)
    mask = (torch.rand(4, 7, generator=gen) > 0.3).float()
    coef_1 = torch.exp(logp_new - logp_old)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    trl_per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    trl_loss = (trl_per_token * mask).sum() / mask.sum()  # loss_type="dapo"
    ours = losses.token_mean(losses.clipped_surrogate(logp_new, logp_old, adv, mask), mask)
    assert torch.allclose(ours, trl_loss, atol=ATOL)


def test_clipped_surrogate_gradient_is_policy_gradient_on_policy():
    # With logp_old = sg(logp_new) the ratio is 1 and d loss / d logp = -A.
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([0.7])
    loss = losses.clipped_surrogate(logp, logp.detach(), adv).sum()
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.7, -0.7]]))


def test_kl_to_reference_k3_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -2.0, -0.2])
    d = ref - logp
    assert torch.allclose(losses.kl_to_reference(logp, ref), torch.exp(d) - d - 1)
    assert losses.kl_to_reference(logp, ref)[1] == 0.0
    assert (losses.kl_to_reference(logp, ref) >= 0).all()


def test_token_mean_counts_only_masked_tokens_and_supports_chunks():
    per_token = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert losses.token_mean(per_token, mask).item() == pytest.approx(2.0)
    chunks = [losses.token_mean(per_token[i:i + 1], mask[i:i + 1], normalizer=3) for i in (0, 1)]
    assert sum(chunks).item() == pytest.approx(2.0)
    empty = torch.zeros(2, 3, requires_grad=True)
    out = losses.token_mean(empty, torch.zeros(2, 3))
    out.backward()
    assert out.item() == 0.0 and torch.equal(empty.grad, torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------------
# SDPO divergences against TRL
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 1.0])
def test_generalized_jsd_matches_trl(alpha):
    s = torch.log_softmax(_logits(3, 5, 11, seed=2), -1)
    t = torch.log_softmax(_logits(3, 5, 11, seed=3), -1)
    ours = losses.generalized_jsd(s, t, alpha)
    ref = trl_sdpo.compute_divergence(s, t, alpha)
    assert torch.allclose(ours, ref, atol=ATOL)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False])
def test_topk_divergence_matches_trl(alpha, tail):
    student, teacher = _logits(2, 6, 64, seed=4), _logits(2, 6, 64, seed=5)
    ours = topk_divergence(student, teacher, k=10, alpha=alpha, tail=tail)
    ref = trl_sdpo.compute_topk_self_distillation_loss(
        student, teacher, distillation_topk=10, distillation_alpha=alpha,
        distillation_add_tail=tail)
    assert torch.allclose(ours, ref, atol=ATOL)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_full_divergence_matches_trl(alpha):
    student, teacher = _logits(2, 6, 64, seed=6), _logits(2, 6, 64, seed=7)
    ours = full_divergence(student, teacher, alpha=alpha)
    ref = trl_sdpo.compute_full_logit_self_distillation_loss(student, teacher,
                                                             distillation_alpha=alpha)
    assert torch.allclose(ours, ref, atol=ATOL)


def test_sampled_token_divergence_matches_trl_value_and_gradient():
    student = _logits(2, 6, 32, seed=8).requires_grad_(True)
    teacher = _logits(2, 6, 32, seed=9)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(10))
    ours = losses.divergence_per_token("sampled_token", *scores_from_logits(
        student, teacher, ids, "sampled_token"))
    (grad_ours,) = torch.autograd.grad(ours.sum(), student)
    ref = trl_sdpo.compute_sampled_token_self_distillation_loss(student, teacher, ids,
                                                                distillation_alpha=1.0)
    (grad_ref,) = torch.autograd.grad(ref.sum(), student)
    assert torch.allclose(ours, ref, atol=ATOL)
    assert torch.allclose(grad_ours, grad_ref, atol=ATOL)


def test_importance_weight_matches_trl_and_is_detached():
    gen = torch.Generator().manual_seed(11)
    per_token = torch.rand(3, 5, generator=gen)
    new = (-torch.rand(3, 5, generator=gen) * 2).requires_grad_(True)
    old = new.detach() + torch.randn(3, 5, generator=gen)
    ref = trl_sdpo.apply_importance_sampling_clipping(per_token, new, old, 2.0)
    ours = per_token * losses.importance_weight(new, old, 2.0)
    assert torch.allclose(ours, ref, atol=ATOL)
    assert not losses.importance_weight(new, old, 2.0).requires_grad
    assert losses.importance_weight(new, old, 2.0).max() <= 2.0
    assert torch.equal(losses.importance_weight(new, old, None), torch.ones(3, 5))


def _trl_trainer_loss(student: torch.Tensor, teacher: torch.Tensor, ids: torch.Tensor,
                     mask: torch.Tensor, old: torch.Tensor, mode: str, topk: int,
                     alpha: float) -> torch.Tensor:
    """TRL's `SDPOTrainer._compute_self_distillation_loss` itself on these tensors (a stand-in
    trainer holds just the settings and the logging it touches)."""
    from types import SimpleNamespace

    from trl.experimental.sdpo.sdpo_trainer import DistillationLogits, SDPOTrainer

    trl_mode = {"topk": "topk_logits", "full": "full_logits"}.get(mode, mode)
    trainer = SimpleNamespace(
        args=SimpleNamespace(distillation_mode=trl_mode, distillation_topk=topk,
                             distillation_alpha=alpha, distillation_add_tail=True,
                             distillation_is_clip=2.0),
        accelerator=SimpleNamespace(gather=lambda t: t),
        _log_self_distillation_metric=lambda mode, value: None)
    logits = DistillationLogits(completion_ids=ids, completion_mask=mask, loss_mask=mask,
                                student_logits=student, teacher_logits=teacher)
    model = SimpleNamespace(training=True)
    return SDPOTrainer._compute_self_distillation_loss(
        trainer, model, {"old_per_token_logps": old}, logits)


@pytest.mark.parametrize("mode, alpha", [("topk", 0.5), ("topk", 0.0), ("full", 0.5),
                                         ("full", 1.0), ("sampled_token", 1.0)])
def test_the_loss_sdpo_calls_equals_trls_trainer_loss(mode, alpha):
    """`sdpo_loss`, the function the SDPO methods call, against TRL 1.16's trainer on one
    constructed batch: 3 completions x 6 positions, masks with 4 supervised tokens each (TRL
    averages per sequence, the reference per token: the same with equal counts), a student that
    moved since sampling (importance weights between 0.37 and 2.7, some clipped at 2)."""
    gen = torch.Generator().manual_seed(12)
    student = _logits(3, 6, 40, seed=12).requires_grad_(True)
    teacher = _logits(3, 6, 40, seed=13)
    ids = torch.randint(0, 40, (3, 6), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0], [1, 0, 1, 0, 1, 1]])
    student_side, teacher_side = scores_from_logits(student, teacher, ids, mode, topk=8)
    old = (student_side.token_logprobs.detach()
           + torch.empty(3, 6).uniform_(-1.0, 1.0, generator=gen))
    ours = losses.sdpo_loss(student_side, teacher_side, mask, old_logprobs=old, divergence=mode,
                            alpha=alpha, is_clip=2.0)
    ref = _trl_trainer_loss(student, teacher, ids, mask, old, mode, 8, alpha)
    assert torch.allclose(ours.loss, ref, atol=ATOL)
    (grad_ours,) = torch.autograd.grad(ours.loss, student)
    (grad_ref,) = torch.autograd.grad(ref, student)
    assert torch.allclose(grad_ours, grad_ref, atol=ATOL)
    assert float(ours.weight.max()) == 2.0  # some weights were clipped


def test_sdpo_loss_is_a_token_mean_over_every_supervised_token():
    # sampled-token terms (log pS - log pT) * log pS with log pS = -1 and log pT = -1 - d:
    # -d for d = 1..6; on a mask of 2 + 1 tokens, weights 1 (no old log-probs), the token mean
    # -(1 + 2 + 4) / 3, not TRL's mean of per-sequence means -(1.5 + 4) / 2
    student = losses.DistillationScores(-torch.ones(2, 3))
    teacher = losses.DistillationScores(-1 - torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    terms = losses.sdpo_loss(student, teacher, mask, divergence="sampled_token")
    assert terms.loss.item() == pytest.approx(-7 / 3)
    assert torch.equal(terms.weight, torch.ones(2, 3))
    # a normalizer (the step's token count, over micro-batches and processes) divides instead
    assert losses.sdpo_loss(student, teacher, mask, divergence="sampled_token",
                            normalizer=7).loss.item() == pytest.approx(-1.0)


# ---------------------------------------------------------------------------------------------
# SDPO divergences by hand
# ---------------------------------------------------------------------------------------------

def test_alpha_endpoints_are_forward_and_reverse_kl_by_hand():
    p_s = torch.tensor([0.5, 0.3, 0.2])
    p_t = torch.tensor([0.2, 0.2, 0.6])
    forward = sum(t * math.log(t / s) for s, t in zip(p_s.tolist(), p_t.tolist()))
    reverse = sum(s * math.log(s / t) for s, t in zip(p_s.tolist(), p_t.tolist()))
    s_logits, t_logits = p_s.log(), p_t.log()
    assert full_divergence(s_logits, t_logits, alpha=0.0).item() == pytest.approx(forward)
    assert full_divergence(s_logits, t_logits, alpha=1.0).item() == pytest.approx(reverse)
    # alpha = 0.5 is the symmetric Jensen-Shannon divergence
    m = [(s + t) / 2 for s, t in zip(p_s.tolist(), p_t.tolist())]
    jsd = 0.5 * sum(s * math.log(s / mm) for s, mm in zip(p_s.tolist(), m)) + \
        0.5 * sum(t * math.log(t / mm) for t, mm in zip(p_t.tolist(), m))
    assert full_divergence(s_logits, t_logits, alpha=0.5).item() == pytest.approx(jsd)


def test_topk_with_full_support_equals_full_divergence():
    student, teacher = _logits(4, 16, seed=15), _logits(4, 16, seed=16)
    full = full_divergence(student, teacher, alpha=0.5)
    topk = topk_divergence(student, teacher, k=16, alpha=0.5, tail=False)
    assert torch.allclose(full, topk, atol=1e-5)


def test_topk_tail_bucket_by_hand():
    # k = 1: student puts 0.5 on token 0; teacher 0.2 -> buckets (0.5, 0.5) vs (0.2, 0.8)
    student = torch.tensor([0.5, 0.25, 0.25]).log()
    teacher = torch.tensor([0.2, 0.4, 0.4]).log()
    forward = 0.2 * math.log(0.2 / 0.5) + 0.8 * math.log(0.8 / 0.5)
    got = topk_divergence(student, teacher, k=1, alpha=0.0, tail=True)
    assert got.item() == pytest.approx(forward, abs=1e-6)


def test_divergences_are_zero_when_teacher_equals_student():
    logits = _logits(2, 3, 20, seed=17)
    ids = torch.zeros(2, 3, dtype=torch.long)
    for mode in ("topk", "full"):
        out = losses.divergence_per_token(
            mode, *scores_from_logits(logits, logits, ids, mode, topk=5), alpha=0.5)
        assert torch.allclose(out, torch.zeros(2, 3), atol=1e-6)


def test_divergence_errors_name_what_is_missing():
    tokens_only = losses.DistillationScores(torch.zeros(1, 2))
    with pytest.raises(ValueError, match="topk divergence needs both sides' `logprobs`"):
        losses.divergence_per_token("topk", tokens_only, tokens_only)
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        losses.divergence_per_token("kl", tokens_only, tokens_only)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        scores_from_logits(torch.zeros(1, 3), torch.zeros(1, 3),
                                  torch.zeros(1, dtype=torch.long), "kl")  # type: ignore
    with pytest.raises(ValueError, match="alpha"):
        losses.generalized_jsd(torch.zeros(3), torch.zeros(3), 1.5)


def test_teacher_logits_never_receive_gradient():
    student = _logits(2, 10, seed=18).requires_grad_(True)
    teacher = _logits(2, 10, seed=19).requires_grad_(True)
    ids = torch.zeros(2, dtype=torch.long)
    for mode in ("topk", "full"):
        losses.divergence_per_token(mode, *scores_from_logits(
            student, teacher, ids, mode, topk=4)).sum().backward()
    assert teacher.grad is None and student.grad is not None


# ---------------------------------------------------------------------------------------------
# The sign: a gradient step on the loss moves the student toward the teacher
# ---------------------------------------------------------------------------------------------

def _reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> float:
    return full_divergence(student_logits, teacher_logits, alpha=1.0).mean().item()


@pytest.mark.parametrize("mode", ["sampled_token", "topk", "full"])
def test_gradient_descent_moves_student_toward_teacher(mode):
    vocab = 12
    teacher = _logits(vocab, seed=20, scale=1.5)
    param = _logits(vocab, seed=21, scale=1.5).requires_grad_(True)
    opt = torch.optim.SGD([param], lr=1.0)
    gen = torch.Generator().manual_seed(22)
    before = _reverse_kl(param.detach(), teacher)
    for _ in range(30):
        # one position repeated: many tokens sampled from the current student (on-policy)
        student = param.expand(512, vocab)
        ids = torch.multinomial(torch.softmax(param.detach(), -1), 512, replacement=True,
                                generator=gen)
        scores = scores_from_logits(student, teacher.expand(512, vocab), ids, mode, topk=6)
        loss = losses.sdpo_loss(*scores, torch.ones(512), divergence=mode, alpha=0.5).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _reverse_kl(param.detach(), teacher)
    assert after < 0.6 * before, (mode, before, after)
