"""Logit front-ends of clbench's distillation losses, for tests against TRL (whose functions take
logits). clbench computes the same quantities from log-probs gathered chunk by chunk from a model
(:mod:`clbench.train.logprobs`); these compute them from full logits ``[..., V]`` at hand.

Import from tests as `from logit_losses import ...` (pytest puts `tests/` on the path).
"""

from __future__ import annotations

import torch

from clbench.train.losses import (
    DIVERGENCES,
    DistillationScores,
    Divergence,
    generalized_jsd,
    topk_logprob_divergence,
)


def topk_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, k: int = 100,
                    alpha: float = 0.5, tail: bool = True) -> torch.Tensor:
    """Divergence on the student's top-k support plus one tail bucket (the SDPO reference).

    The support is the k tokens the student ranks highest; the teacher's log-probs are read at
    the same tokens. Logits ``[..., V]`` -> loss ``[...]``; see :func:`topk_logprob_divergence`
    (which :func:`sdpo_loss` uses, on log-probs gathered by :mod:`clbench.train.logprobs`).
    """
    if k < 1:
        raise ValueError(f"topk must be >= 1, got {k}")
    student_logits = student_logits.float()
    teacher_logits = teacher_logits.detach().float()
    k = min(k, student_logits.shape[-1])
    top_logits, top_ids = torch.topk(student_logits, k=k, dim=-1)
    s = top_logits - torch.logsumexp(student_logits, dim=-1, keepdim=True)
    t = (torch.gather(teacher_logits, -1, top_ids)
         - torch.logsumexp(teacher_logits, dim=-1, keepdim=True))
    return topk_logprob_divergence(s, t, alpha=alpha, tail=tail)


def full_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *,
                    alpha: float = 0.5) -> torch.Tensor:
    """:func:`generalized_jsd` over the full vocabulary. Logits ``[..., V]`` -> loss ``[...]``."""
    return generalized_jsd(torch.log_softmax(student_logits.float(), dim=-1),
                           torch.log_softmax(teacher_logits.detach().float(), dim=-1), alpha)


def scores_from_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                       token_ids: torch.Tensor, mode: Divergence, topk: int = 100
                       ) -> tuple[DistillationScores, DistillationScores]:
    """Both sides' :class:`DistillationScores` from full logits ``[B, T, V]`` and the sampled
    `token_ids` ``[B, T]`` (what :mod:`clbench.train.logprobs` computes chunk by chunk from a
    model, here from tensors at hand). The teacher's side carries no gradient."""
    if mode not in DIVERGENCES:
        raise ValueError(f"unknown divergence {mode!r}; expected one of {', '.join(DIVERGENCES)}")
    s = torch.log_softmax(student_logits.float(), dim=-1)
    t = torch.log_softmax(teacher_logits.detach().float(), dim=-1)
    ids = token_ids.long().unsqueeze(-1)
    student = DistillationScores(torch.gather(s, -1, ids).squeeze(-1))
    teacher = DistillationScores(torch.gather(t, -1, ids).squeeze(-1))
    if mode == "topk":
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        top_logp, top_ids = torch.topk(s, k=min(topk, s.shape[-1]), dim=-1)
        student.logprobs, teacher.logprobs = top_logp, torch.gather(t, -1, top_ids)
    elif mode == "full":
        student.logprobs, teacher.logprobs = s, t
    return student, teacher
