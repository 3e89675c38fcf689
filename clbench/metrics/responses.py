"""Response drift: how a model's answers to fixed probe prompts moved away from the base model's.

- :func:`mean_token_kl`: KL(current || base) per token, averaged over the tokens of the base
  model's greedy responses, from both models' log-probabilities at those positions (full
  vocabulary, or any common support that sums to one on each side);
- :func:`edit_similarity`: 1 - Levenshtein distance / the longer length, between the token ids
  of the current model's greedy response and the base model's (1: unchanged, 0: nothing in
  common), and :func:`mean_edit_similarity` over a probe set.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mean_token_kl(current_logprobs: torch.Tensor, base_logprobs: torch.Tensor,
                  mask: torch.Tensor | None = None) -> float:
    """Mean over the (masked) positions of KL(current || base) = sum_v p_c (log p_c - log p_b),
    from log-probabilities ``[..., V]`` of the two models at the same positions."""
    if current_logprobs.shape != base_logprobs.shape:
        raise ValueError(f"log-probs of two shapes: {tuple(current_logprobs.shape)} and "
                         f"{tuple(base_logprobs.shape)}")
    c, b = current_logprobs.double(), base_logprobs.double()
    kl = (c.exp() * (c - b)).sum(-1)
    if mask is not None:
        kl = kl[mask.bool()]
    return float(kl.mean()) if kl.numel() else 0.0


def edit_similarity(a: Sequence[int], b: Sequence[int]) -> float:
    """1 - Levenshtein(a, b) / max(len(a), len(b)); 1 for two empty sequences."""
    if not a and not b:
        return 1.0
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return 1.0 - previous[-1] / max(len(a), len(b))


def mean_edit_similarity(current: Sequence[Sequence[int]], base: Sequence[Sequence[int]]
                         ) -> float:
    """:func:`edit_similarity` averaged over pairs of responses to the same prompts."""
    if len(current) != len(base):
        raise ValueError(f"{len(current)} responses against {len(base)} base responses")
    return sum(edit_similarity(c, b) for c, b in zip(current, base)) / max(len(base), 1)
