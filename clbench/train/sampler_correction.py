"""The sampler/trainer mismatch: importance weights for rollouts drawn by another engine.

An engine that samples outside the trained model (vLLM, with its own kernels, bf16 weights and
sampler) draws from a distribution slightly different from the policy the trainer scores, so
an on-policy loss computed as if the rollouts were the trainer's own is biased. The correction
is TRL's (`GRPOConfig.vllm_importance_sampling_*`): with `r = p_trainer / p_sampler` of each
completion token (the trainer's log-probs at generation time, before the update; the sampler's
as the engine reports them),

- `token_truncate`: each token's loss times ``clamp(r, clip_min, clip_max)``;
- `token_mask`: times ``r``, and 0 where ``r`` lies outside ``[clip_min, clip_max]``;
- `sequence_truncate` / `sequence_mask`: the same with one ratio per completion, the product
  of its tokens' ratios (the sum of the log-ratios);
- `none`: no correction.

The weights are constants of the loss (no gradient flows through them). Positions outside the
mask, and tokens the engine gave no log-prob for (NaN), contribute a log-ratio of 0 (ratio 1).
The decode loop of :mod:`clbench.train.rollout` samples from the trained weights themselves
and reports no sampler log-probs: nothing is corrected there.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

#: The modes of :func:`sampler_weights`, TRL's names.
SamplerCorrection = Literal["sequence_mask", "sequence_truncate", "token_mask",
                            "token_truncate", "none"]


def sampler_weights(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                    mask: torch.Tensor, mode: SamplerCorrection = "sequence_mask",
                    clip_max: float | None = 3.0, clip_min: float | None = None
                    ) -> torch.Tensor | None:
    """The importance weights of [N, T] completion tokens (see the module docstring): [N, T]
    for the token modes, [N, 1] for the sequence modes, None for `none`."""
    if mode == "none":
        return None
    diff = torch.nan_to_num((trainer_logprobs.detach().float() - sampler_logprobs.float())
                            * mask, nan=0.0)
    if mode.startswith("sequence_"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    if mode.endswith("_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"unknown sampler correction {mode!r}; one of sequence_mask, "
                     "sequence_truncate, token_mask, token_truncate, none")
