"""Log-probabilities of completion tokens under a context, for ragged batches, in bounded memory.

Every method scores completions the same way: the context (a prompt's token ids: the student's
prompt, or a teacher's prompt with a demonstration) is followed by the completion's token ids, and
we want, for each completion position t, the model's next-token distribution given context +
completion[:t].

Layout (shared by all functions here): contexts are left padded to a common width P and
completions right padded to a common length T, so every completion starts at column P and the
predicting hidden states are the contiguous slice [P-1, P-1+T). Position ids follow the attention
mask, exactly as generation computes them, so scores match what the sampler saw.

Memory: the vocabulary projection is applied `chunk_size` positions at a time, and with grad each
chunk is recomputed in the backward pass (activation checkpointing) so the full [B, T, V] logits
never live at once; `micro_batch_size` bounds the rows of one transformer forward.

Returned tensors are float32, padded positions hold 0 and are False in `mask`.

`model` is a causal LM, or the prepared student (`StageContext.train_model`): then the forward
goes through it, so that DDP all-reduces the gradients, and the projection runs inside that
forward (where a sharded student has its output embedding gathered).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from clbench.train.distributed import is_prepared

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class PackedBatch:
    """Contexts left padded to width P, completions right padded to length T, on one device."""

    input_ids: torch.Tensor        # [B, P + T]
    attention_mask: torch.Tensor   # [B, P + T]
    position_ids: torch.Tensor     # [B, P + T]
    completion_ids: torch.Tensor   # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool
    prompt_width: int              # P

    def rows(self, start: int, stop: int) -> PackedBatch:
        return PackedBatch(self.input_ids[start:stop], self.attention_mask[start:stop],
                           self.position_ids[start:stop], self.completion_ids[start:stop],
                           self.completion_mask[start:stop], self.prompt_width)


@dataclass
class TokenLogprobs:
    """log p(completion token t | context, completion[:t]) and which positions are real."""

    logprobs: torch.Tensor  # [B, T] float32
    mask: torch.Tensor      # [B, T] bool


@dataclass
class CompletionDistributions:
    """Next-token distributions at completion positions.

    `logprobs[b, t, k]` is the log-softmax (over the whole vocabulary) at token `indices[b, t, k]`;
    when `indices` is None, `logprobs` covers the whole vocabulary ([B, T, V]).
    `token_logprobs` is the log-prob of the completion token itself.
    """

    token_logprobs: torch.Tensor      # [B, T]
    logprobs: torch.Tensor            # [B, T, K] or [B, T, V]
    indices: torch.Tensor | None      # [B, T, K] long, or None for the full vocabulary
    mask: torch.Tensor                # [B, T] bool


def pack_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
               device: torch.device | str = "cpu", pad_id: int = 0) -> PackedBatch:
    """Lay out a ragged batch of (context, completion) pairs (see the module docstring)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} contexts but {len(completion_ids)} completions")
    if not prompt_ids:
        raise ValueError("empty batch")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every context needs at least one token (the first completion token "
                         "is predicted from the last context token)")
    width = max(len(p) for p in prompt_ids)
    length = max(1, max(len(c) for c in completion_ids))
    b = len(prompt_ids)
    input_ids = torch.full((b, width + length), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width + length), dtype=torch.long)
    completions = torch.full((b, length), pad_id, dtype=torch.long)
    cmask = torch.zeros((b, length), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, width - len(p):width] = torch.tensor(list(p), dtype=torch.long)
        attention[i, width - len(p):width + len(c)] = 1
        if len(c):
            input_ids[i, width:width + len(c)] = torch.tensor(list(c), dtype=torch.long)
            completions[i, :len(c)] = torch.tensor(list(c), dtype=torch.long)
            cmask[i, :len(c)] = True
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    dev = torch.device(device)
    return PackedBatch(input_ids.to(dev), attention.to(dev), positions.to(dev),
                       completions.to(dev), cmask.to(dev), width)


def completion_logprobs(model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]],
                        completion_ids: Sequence[Sequence[int]], *, grad: bool = False,
                        temperature: float = 1.0, chunk_size: int = 128,
                        micro_batch_size: int | None = None) -> TokenLogprobs:
    """Per-token log-probs of each completion given its context.

    `temperature` divides the logits first (use the sampling temperature so the scores describe
    the sampler). With `grad=True` the result carries a graph into the model's parameters.
    """
    packed = pack_batch(prompt_ids, completion_ids, device=_device_of(model))
    parts = [_score_rows(model, rows, grad, temperature, chunk_size, mode="token")[0]
             for rows in _row_slices(packed, micro_batch_size)]
    return TokenLogprobs(torch.cat(parts), packed.completion_mask)


def completion_distributions(model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]],
                             completion_ids: Sequence[Sequence[int]], *, topk: int | None = None,
                             indices: torch.Tensor | None = None, grad: bool = False,
                             temperature: float = 1.0, chunk_size: int = 128,
                             micro_batch_size: int | None = None) -> CompletionDistributions:
    """Next-token log-distributions at completion positions (for distillation divergences).

    - `topk=k`: the k most likely tokens at each position (their log-probs and ids);
    - `indices=[B, T, K]`: log-probs at given token ids (e.g. the teacher scored on the
      student's top-k support); its T may be shorter or longer than this batch's T only if the
      completions are the same, so pass completions identical to the ones that produced it;
    - neither: the full vocabulary, [B, T, V] (memory grows with V: use for small models).
    """
    if topk is not None and indices is not None:
        raise ValueError("give `topk` or `indices`, not both")
    if topk is not None and topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    packed = pack_batch(prompt_ids, completion_ids, device=_device_of(model))
    if indices is not None and indices.shape[:2] != packed.completion_ids.shape:
        raise ValueError(f"indices have shape {tuple(indices.shape)}, expected "
                         f"[{packed.completion_ids.shape[0]}, {packed.completion_ids.shape[1]}, K]")
    token_parts, dist_parts, index_parts = [], [], []
    for start, rows in zip(range(0, len(packed.input_ids), micro_batch_size or 1 << 30),
                           _row_slices(packed, micro_batch_size)):
        sub_indices = None
        if indices is not None:
            sub_indices = indices[start:start + len(rows.input_ids)].to(rows.input_ids.device)
        mode = "topk" if topk is not None else ("indices" if indices is not None else "full")
        tok, dist, idx = _score_rows(model, rows, grad, temperature, chunk_size, mode=mode,
                                     k=topk, indices=sub_indices)
        token_parts.append(tok)
        dist_parts.append(dist)
        index_parts.append(idx)
    out_indices = None
    if topk is not None:
        out_indices = torch.cat(index_parts)
    elif indices is not None:
        out_indices = indices.to(packed.completion_ids.device)
    return CompletionDistributions(torch.cat(token_parts), torch.cat(dist_parts), out_indices,
                                   packed.completion_mask)


# ---------------------------------------------------------------------------------------------

def _device_of(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def _row_slices(packed: PackedBatch, micro_batch_size: int | None) -> list[PackedBatch]:
    n = len(packed.input_ids)
    step = micro_batch_size or n
    return [packed.rows(i, min(i + step, n)) for i in range(0, n, step)]


def _completion_hidden(hidden: torch.Tensor, rows: PackedBatch) -> torch.Tensor:
    """The final hidden states at the positions that predict completion tokens: [b, T, d]."""
    p, t = rows.prompt_width, rows.completion_ids.shape[1]
    return hidden[:, p - 1:p - 1 + t]


def _chunk_logprobs(lm: PreTrainedModel, hidden: torch.Tensor, temperature: float
                    ) -> torch.Tensor:
    """log-softmax over the vocabulary of one chunk of positions, in float32."""
    logits = lm.get_output_embeddings()(hidden).float()
    cap = getattr(lm.config, "final_logit_softcapping", None)
    if cap:  # models that squash logits (Gemma 2) must be scored as they generate
        logits = torch.tanh(logits / cap) * cap
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def _score_rows(model: PreTrainedModel, rows: PackedBatch, grad: bool, temperature: float,
                chunk_size: int, mode: str, k: int | None = None,
                indices: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score, got {temperature}")

    def project_chunks(lm: PreTrainedModel, hidden: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        hidden = _completion_hidden(hidden, rows)
        targets = rows.completion_ids
        token_parts, dist_parts, index_parts = [], [], []
        for s in range(0, targets.shape[1], chunk_size):
            e = min(s + chunk_size, targets.shape[1])
            chunk_idx = indices[:, s:e] if indices is not None else None
            args = (hidden[:, s:e], targets[:, s:e]) + ((chunk_idx,) if chunk_idx is not None
                                                        else ())

            def project(h: torch.Tensor, tgt: torch.Tensor, idx: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, ...]:
                logp = _chunk_logprobs(lm, h, temperature)
                tok = logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
                if mode == "token":
                    return (tok,)
                if mode == "full":
                    return tok, logp
                if mode == "topk":
                    values, top = logp.topk(k, dim=-1)
                    return tok, values, top
                return tok, logp.gather(-1, idx)

            if grad:
                from torch.utils.checkpoint import checkpoint

                # Recompute the projection in backward instead of keeping [b, chunk, V] logits.
                result = checkpoint(project, *args, use_reentrant=False)
            else:
                result = project(*args)
            token_parts.append(result[0])
            if mode != "token":
                dist_parts.append(result[1])
            if mode == "topk":
                index_parts.append(result[2])
        mask = rows.completion_mask
        zero = torch.zeros((), device=mask.device)
        token = torch.where(mask, torch.cat(token_parts, dim=1), zero)
        dist = (torch.where(mask.unsqueeze(-1), torch.cat(dist_parts, dim=1), zero)
                if dist_parts else None)
        index = torch.cat(index_parts, dim=1) if index_parts else None
        return token, dist, index

    inputs = {"input_ids": rows.input_ids, "attention_mask": rows.attention_mask,
              "position_ids": rows.position_ids, "use_cache": False}
    with torch.set_grad_enabled(grad):
        if is_prepared(model):
            # the projection runs inside the prepared forward: a sharded student (FSDP2) holds
            # its output embedding gathered only there
            return model(hidden_only=True, then=project_chunks, **inputs)
        return project_chunks(model, model.get_decoder()(**inputs).last_hidden_state)
