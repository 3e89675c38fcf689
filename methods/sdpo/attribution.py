"""Where SDPO's divergence falls: on which tokens of the responses the dense loss spends itself.

Four kinds of token, as `clbench signal` reports them (and every step's record carries them):
tokens where the teacher's and the student's most likely next token differ (`disagree`: where
the teacher knows something the student does not, at the first wrong digit of a sum, say), the
answer's tokens (from the task's answer start on, the closing EOS left out), the closing EOS,
and the rest (agreeing tokens of the working: a shift of style costs there). Each step's record
holds ``divergence_<kind>``, that kind's part of ``divergence_mean`` (a token mean over the
same supervised tokens, so the parts add up over micro-batches and processes like the mean
does); a share is the part over the mean. The first three overlap.
"""

from __future__ import annotations

from typing import Any

import torch

from clbench.api import DistillationScores, opens_reasoning, response_prefix
from clbench_methods.sdpo.supervision import completion_supervision

KINDS = ("disagree", "answer", "eos", "rest")


def token_kinds(ctx: Any, batch: Any) -> dict[str, torch.Tensor]:
    """The answer and EOS tokens of each rollout of `batch` ([B, T] bool, as its completion
    mask); disagreement needs the scores and is found with the loss."""
    answer = torch.zeros_like(batch.completion_mask)
    eos = torch.zeros_like(batch.completion_mask)
    special = set(getattr(ctx.tokenizer, "all_special_ids", None) or [])
    n = batch.group_size
    for i, rollout in enumerate(batch.rollouts):
        example = batch.examples[i // n]
        row = completion_supervision(
            ctx.tokenizer, rollout.text, rollout.completion_ids, "final_line",
            ctx.task_for(example).answer_start_for(example), supervise_closing=False,
            opened=opens_reasoning(response_prefix(example.messages)))
        answer[i, :len(row)] = torch.tensor(row, dtype=torch.bool)
        if rollout.completion_ids and rollout.completion_ids[-1] in special:
            eos[i, rollout.num_tokens - 1] = True
    return {"answer": answer, "eos": eos}


def kind_masks(batch: Any, active: list[int], mask: torch.Tensor, student: DistillationScores,
               teacher: DistillationScores) -> dict[str, torch.Tensor]:
    """Each kind's tokens among `active` rows, shaped and placed as their supervision `mask`
    ([A, T] bool; `disagree` only when the loss compares distributions: not for
    ``sampled_token``)."""
    length = mask.shape[1]
    kinds = {k: batch.extra["token_kinds"][k][active][:, :length].to(mask.device)
             for k in ("answer", "eos")}
    if student.logprobs is not None and teacher.logprobs is not None:
        kinds["disagree"] = student.logprobs.detach().argmax(-1) != teacher.logprobs.argmax(-1)
    known = torch.zeros_like(mask)
    for value in kinds.values():
        known |= value
    kinds["rest"] = ~known
    return kinds


def restricted(batch: Any, kinds: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """`mask` kept to the batch's `loss_token_kind` when one is set (`clbench signal`'s
    per-kind gradients); a kind this loss cannot tell (`disagree` under ``sampled_token``)
    keeps nothing."""
    kind = batch.loss_token_kind
    if kind is None:
        return mask
    return mask & kinds[kind] if kind in kinds else torch.zeros_like(mask)


def divergence_parts(batch: Any, kinds: dict[str, torch.Tensor], mask: torch.Tensor,
                     divergence: torch.Tensor) -> dict[str, float]:
    """Each kind's part of the step's divergence mean, as this rank's term."""
    per_token = divergence.detach() * mask
    ones = torch.ones_like(per_token)
    return {f"divergence_{k}": float(batch.token_mean(per_token * v, ones))
            for k, v in kinds.items()}
