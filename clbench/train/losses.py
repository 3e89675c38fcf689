"""Loss math of the on-policy methods: pure tensor functions, no model, no optimizer.

Owns the GRPO pieces (group-relative advantages, the clipped surrogate, the k3 KL estimator)
and the SDPO pieces (per-token divergences between student and teacher next-token
distributions, the clipped importance weight, token-mean aggregation), put together in
:func:`sdpo_loss`: the one SDPO objective, called by the SDPO methods and compared with TRL's
trainer on the same inputs.

Conventions
-----------
- Tensors of per-token quantities have shape ``[B, T]`` (rollouts x completion positions); a
  ``mask`` of the same shape (bool or 0/1) marks the positions that count.
- Every function upcasts to fp32 before exponentials and log-sum-exps, so bf16 inputs are safe;
  results are fp32.
- "Loss" means the quantity to *minimise*.

The SDPO divergences agree with ``trl.experimental.sdpo.loss_utils`` (TRL 1.16) and the
``verl`` fork of the paper on identical inputs (tested); the GRPO surrogate agrees with TRL's
GRPO trainer and verl's dual-clip PPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Divergence = Literal["sampled_token", "topk", "full"]
DIVERGENCES: tuple[str, ...] = ("sampled_token", "topk", "full")

# exp() of a log-ratio beyond this is numerically meaningless and would overflow in fp32.
_LOG_RATIO_LIMIT = 20.0


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------

def token_mean(per_token: torch.Tensor, mask: torch.Tensor,
               normalizer: float | None = None) -> torch.Tensor:
    """sum(per_token * mask) / max(sum(mask), 1): the mean over every counted token of the batch.

    This is verl's ``token-mean`` (and TRL's ``dapo``/``bnpo``) aggregation: long completions
    weigh more than short ones, and a batch with no counted token gives 0 (with a gradient of 0
    that still reaches the graph, so ``backward()`` works). When a batch is processed in chunks,
    pass the whole batch's token count as `normalizer` so the chunks' losses add up to the mean.
    """
    mask = mask.to(torch.float32)
    denom = mask.sum().clamp(min=1.0) if normalizer is None else max(float(normalizer), 1.0)
    return (per_token.float() * mask).sum() / denom


# ---------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, group_size: int | None = None, *,
                     scale_std: bool = False, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages A_i = r_i - mean_group(r) (optionally / (std_group + eps)).

    `rewards` is ``[G, n]`` (G prompts x n samples) or flat ``[G*n]`` with the samples of one
    prompt contiguous, in which case `group_size` = n is required. The result has the shape of
    `rewards`. The std is the unbiased sample std (as TRL's); ``scale_std=False`` is the
    reference's Dr.GRPO-style default. A group whose rewards are all equal gets A = 0 (no signal).
    """
    rewards = rewards.float()
    flat = rewards.dim() == 1
    if flat:
        if group_size is None or group_size < 1:
            raise ValueError("flat rewards need group_size (samples per prompt)")
        if rewards.numel() % group_size:
            raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
        grouped = rewards.view(-1, group_size)
    elif rewards.dim() == 2:
        grouped = rewards
    else:
        raise ValueError(f"rewards must be [G*n] or [G, n], got shape {tuple(rewards.shape)}")
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_std:
        std = grouped.std(dim=1, keepdim=True) if grouped.shape[1] > 1 else torch.zeros_like(adv)
        adv = adv / (std + eps)
    return adv.reshape(-1) if flat else adv


def clipped_surrogate(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor | None = None, *, eps_low: float = 0.2,
                      eps_high: float = 0.28, dual_clip: float | None = None) -> torch.Tensor:
    """Per-token PPO/GRPO loss -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A), rho = p_new/p_old.

    `advantages` is per rollout (``[B]`` or ``[B, 1]``) or per token (``[B, T]``).
    With ``dual_clip = c > 1`` (Ye et al. 2019, verl's ``clip_ratio_c``) the loss of tokens with
    A < 0 is additionally capped at -c A, so a huge ratio on a bad token cannot blow up the
    update. Positions outside `mask` are set to 0; aggregate with :func:`token_mean`.

    Example: rho = 1.5, A = +1 -> loss -1.28 (clipped at 1 + 0.28); rho = 0.5, A = -1 -> +0.8.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    log_ratio = (logp_new.float() - logp_old.float()).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    if mask is not None:
        loss = loss * mask.to(loss.dtype)
    return loss


def kl_to_reference(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(d) - d - 1 with d = logp_ref - logp.

    Non-negative, unbiased for tokens sampled from pi, and the estimator TRL's GRPO uses for its
    ``beta`` term. Gradient flows through `logp` only if it requires grad.
    """
    delta = (logp_ref.float() - logp.float()).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return torch.exp(delta) - delta - 1.0


# ---------------------------------------------------------------------------------------------
# SDPO divergences
# ---------------------------------------------------------------------------------------------

def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                    alpha: float) -> torch.Tensor:
    """Divergence between two distributions given as log-probs over the last dim; sums it.

    - alpha = 0: forward KL(T || S) = sum_v pT (log pT - log pS);
    - alpha = 1: reverse KL(S || T) = sum_v pS (log pS - log pT);
    - otherwise: with the mixture M = (1 - alpha) S + alpha T,
      (1 - alpha) KL(S || M) + alpha KL(T || M), the generalised Jensen-Shannon divergence of the
      SDPO reference (alpha = 0.5 is the symmetric JSD).

    Note the endpoints are special cases, not limits of the mixture formula (whose value goes to 0
    at both ends); this matches the reference code.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    s = student_logp.float()
    t = teacher_logp.float()
    if alpha == 0.0:
        per_entry = torch.exp(t) * (t - s)
    elif alpha == 1.0:
        per_entry = torch.exp(s) * (s - t)
    else:
        mixture = torch.logsumexp(torch.stack([s + math.log(1.0 - alpha), t + math.log(alpha)]),
                                  dim=0)
        kl_student = torch.exp(s) * (s - mixture)
        kl_teacher = torch.exp(t) * (t - mixture)
        per_entry = (1.0 - alpha) * kl_student + alpha * kl_teacher
    return per_entry.sum(-1)


def with_tail_bucket(logp: torch.Tensor) -> torch.Tensor:
    """Append one category holding 1 - sum(exp(logp)) to log-probs over a subset of the vocab.

    The captured mass is clamped just below 1 so the tail stays finite.
    """
    log_captured = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logp, torch.log(-torch.expm1(log_captured))], dim=-1)


def sampled_token_divergence(student_logp: torch.Tensor,
                             teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per-token loss sg(log pS(y) - log pT(y)) * log pS(y) on the sampled tokens y.

    Its gradient, sg(log pS - log pT) grad log pS, is a single-sample estimate of the gradient of
    the reverse KL(S || T) when y ~ S: it pushes down tokens the student overrates relative to
    the teacher. TRL's default SDPO objective. Inputs are per-token log-probs ``[B, T]``.
    """
    s = student_logp.float()
    return (s - teacher_logp.float()).detach() * s


def topk_logprob_divergence(student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor, *,
                            alpha: float = 0.5, tail: bool = True) -> torch.Tensor:
    """The top-k divergence from log-probs already gathered on the student's top-k tokens.

    Both inputs are full-vocabulary log-softmax values at the same k token ids ``[..., k]`` (what
    :func:`clbench.train.logprobs.completion_distributions` returns with ``topk=`` for the
    student and ``indices=`` for the teacher). With ``tail=True`` a (k+1)-th category holds each
    side's remaining mass, so both are proper distributions; with ``tail=False`` both are
    renormalised over the k tokens. Then :func:`generalized_jsd`.
    """
    s = student_topk_logp.float()
    t = teacher_topk_logp.detach().float()
    if tail:
        s, t = with_tail_bucket(s), with_tail_bucket(t)
    else:
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
    return generalized_jsd(s, t, alpha)


def importance_weight(logp_new: torch.Tensor, logp_old: torch.Tensor,
                      clip: float | None = 2.0) -> torch.Tensor:
    """Detached min(exp(logp_new - logp_old), clip): corrects for the student having moved since
    the rollout was sampled (1 on the first update of a batch). ``clip=None`` gives all-ones."""
    if clip is None:
        return torch.ones_like(logp_new, dtype=torch.float32)
    log_ratio = (logp_new.detach().float() - logp_old.detach().float())
    return torch.exp(log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)).clamp(max=clip)


# ---------------------------------------------------------------------------------------------
# The SDPO objective
# ---------------------------------------------------------------------------------------------

@dataclass
class DistillationScores:
    """One side's scores (student or teacher) at the completion positions.

    `token_logprobs` ``[B, T]``: the log-prob of each sampled token. `logprobs`: full-vocabulary
    log-softmax values, either on the student's top-k token ids ``[B, T, K]`` (the teacher read
    at the STUDENT's ids) for ``topk``, or over the whole vocabulary ``[B, T, V]`` for ``full``;
    None for ``sampled_token``, which needs the sampled tokens only.
    """

    token_logprobs: torch.Tensor
    logprobs: torch.Tensor | None = None


@dataclass
class SDPOLossTerms:
    """:func:`sdpo_loss`'s result: the scalar to minimise and its per-token parts."""

    loss: torch.Tensor        # token_mean(divergence * weight, mask)
    divergence: torch.Tensor  # [B, T] per-token divergence (with the student's graph)
    weight: torch.Tensor      # [B, T] detached importance weight


def divergence_per_token(mode: Divergence, student: DistillationScores,
                         teacher: DistillationScores, alpha: float = 0.5) -> torch.Tensor:
    """The SDPO divergence `mode` at every completion position ``[B, T]``: ``sampled_token``
    (:func:`sampled_token_divergence`, reverse KL by construction: `alpha` is ignored),
    ``topk`` (:func:`topk_logprob_divergence`, with the tail bucket) or ``full``
    (:func:`generalized_jsd` over the vocabulary)."""
    if mode == "sampled_token":
        return sampled_token_divergence(student.token_logprobs, teacher.token_logprobs)
    if mode not in DIVERGENCES:
        raise ValueError(f"unknown divergence {mode!r}; expected one of {', '.join(DIVERGENCES)}")
    if student.logprobs is None or teacher.logprobs is None:
        raise ValueError(f"the {mode} divergence needs both sides' `logprobs` (distributions), "
                         "not only the sampled tokens'")
    if mode == "topk":
        return topk_logprob_divergence(student.logprobs, teacher.logprobs, alpha=alpha)
    return generalized_jsd(student.logprobs, teacher.logprobs.detach(), alpha)


def sdpo_loss(student: DistillationScores, teacher: DistillationScores, mask: torch.Tensor, *,
              old_logprobs: torch.Tensor | None = None, divergence: Divergence = "topk",
              alpha: float = 0.5, is_clip: float | None = 2.0,
              normalizer: float | None = None,
              sampler_weights: torch.Tensor | None = None) -> SDPOLossTerms:
    """The SDPO objective, the one function the SDPO methods call:
    ``token_mean(divergence(student, teacher) * min(p_new / p_old, is_clip), mask)``.

    `old_logprobs` are the sampling policy's log-probs of the tokens (None: the student's own,
    detached, so every weight is 1: one update per batch). `normalizer` is the token count of
    the mean when `mask` covers only part of it (micro-batches, several processes). The
    aggregation is the reference's token mean over every supervised token of the batch; TRL's
    trainer averages per sequence first (equal when every sequence has as many supervised
    tokens, which is how the two are compared in the tests). `sampler_weights` ([B, T] or
    [B, 1]) multiply each token's loss when another engine drew the rollouts
    (:mod:`clbench.train.sampler_correction`).
    """
    per_token = divergence_per_token(divergence, student, teacher, alpha)
    new = student.token_logprobs
    old = new.detach() if old_logprobs is None else old_logprobs
    weight = importance_weight(new, old, is_clip)
    weighted = per_token * weight
    if sampler_weights is not None:
        weighted = weighted * sampler_weights
    return SDPOLossTerms(token_mean(weighted, mask, normalizer), per_token, weight)
