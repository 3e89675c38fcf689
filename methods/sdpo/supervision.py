"""Which completion tokens receive a distillation target: the response/reasoning split and masks.

Definitions (also in ``docs/methods.md``)
------------------------------------------
A completion is a token sequence ``y_1..y_n`` whose decoded text is ``text``. Each token ``y_i``
covers a character span of ``text`` ending at ``end_i``: the length of the text decoded from the
prefix ``y_1..y_i`` (made non-decreasing, see :func:`token_char_ends`). Special tokens such as
EOS decode to nothing, so their span is empty and ends where the previous token ended.

A supervision mode names a character offset ``a`` where the supervised part starts; token ``i``
is supervised iff ``end_i > a``: every token holding at least one character from ``a`` on,
including a token that straddles the boundary (``" 37"`` when ``a`` points at ``3``). A token
that ends exactly at ``a`` (``</think>`` itself, the newline before the last line) is not.
``a = 0`` supervises the whole completion.

- ``response`` (the paper's SDPO, which supervises the answer): ``a`` = just after the last
  ``</think>``; a completion without one is all response (``a = 0``), unless its prompt opened
  the block (the `think` format, reasoning models' templates): then all of it is reasoning
  (``a = len(text)``). The reasoning block gets no target, everything after it does.
- ``all`` (the paper's SDPO^CoT): every token of the completion, reasoning included (``a = 0``).
  This is the span the reference code (lasgroup/SDPO) supervises for SDPO itself: its loss
  mask is the whole generated response; the paper's answer-only SDPO has no public code.
- ``final_line`` (an ablation; earlier runs recorded it as ``answer``): ``a`` = the task's
  answer start, ``task.answer_start_for(example)(text)`` (after ``</think>``, else the start of
  the last non-empty line; math starts at the line holding the last ``\boxed``, tool use at the
  call).
  On arithmetic this leaves the line that computes the number without a target, so the teacher
  can only say "box another number" (docs/methods.md has the measured effect).

The special tokens that close a completion (EOS) are supervised in every mode by default: the
decision to stop is part of the response, and without it a completion that stops before its
supervised part (``a = len(text)``, e.g. an empty one or one ending with ``</think>``) would get
no signal at all. ``supervise_closing=False`` (SDPO's ``supervise_eos: false``) leaves them out.

Supervision density is the fraction of completion tokens that are supervised.

Random token mask (``mask_ratio``, as in the SDPO-CL fork): each supervised token is
independently dropped with probability ``mask_ratio`` (kept iff ``u >= mask_ratio``,
``u ~ U[0, 1)``), drawn from a seeded generator so runs are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import torch

from clbench.api import THINK_CLOSE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Supervision = Literal["response", "all", "final_line"]
SUPERVISION_MODES: tuple[str, ...] = ("response", "all", "final_line")


def response_start(text: str, opened: bool = False) -> int:
    """Character offset of the response: just after the last ``</think>``; without one, 0 (a
    completion without a reasoning block is all response), or ``len(text)`` when the prompt
    `opened` the block and the completion never closed it (all of it is reasoning, so only
    the closing EOS, if any, is supervised)."""
    end = text.rfind(THINK_CLOSE)
    if end >= 0:
        return end + len(THINK_CLOSE)
    return len(text) if opened else 0


def supervised_start(text: str, mode: Supervision, answer_start: Callable[[str], int],
                     opened: bool = False) -> int:
    """The offset ``a`` from which `mode` supervises `text`, clamped to ``[0, len(text)]`` so a
    task returning an out-of-range offset cannot select phantom tokens. `answer_start` is the
    task's final-line rule, used by ``final_line`` only; `opened`: the prompt opened a reasoning
    block that the completion continues (:func:`response_start`)."""
    if mode == "all":
        return 0
    if mode == "response":
        return response_start(text, opened)
    if mode == "final_line":
        return min(max(int(answer_start(text)), 0), len(text))
    raise ValueError(f"unknown supervision {mode!r}; expected one of "
                     f"{', '.join(SUPERVISION_MODES)}")


def token_char_ends(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int], *,
                    skip_special_tokens: bool = True) -> list[int]:
    """End offset of each token's span in ``decode(token_ids)``, by incremental decoding.

    ``end_i = len(decode(token_ids[:i+1]))``, then made non-decreasing from the right
    (``end_i <- min(end_i, end_{i+1})``): a prefix that ends inside a multi-byte character
    decodes to a replacement character that the full text does not have, and that token is
    attributed to the character it helps complete. Incremental decoding (rather than a fast
    tokenizer's ``offset_mapping``) works for every tokenizer and for sampled ids that would not
    re-tokenise to themselves. Prefixes are decoded in one ``batch_decode`` call.
    """
    ids = list(token_ids)
    if not ids:
        return []
    prefixes = [ids[:i + 1] for i in range(len(ids))]
    texts = tokenizer.batch_decode(prefixes, skip_special_tokens=skip_special_tokens)
    return monotone_ends([len(t) for t in texts])


def first_answer_token(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int],
                       answer_start: int, *, window: int = 8,
                       skip_special_tokens: bool = True) -> int:
    """Index of the first token with ``end_i > answer_start`` (``len(token_ids)`` if none).

    Same result as scanning :func:`token_char_ends`, with O(log n + window) prefix decodes
    instead of n: bisect on the raw prefix lengths, then apply the exact (monotone) definition in
    a window around the boundary. Raw lengths only break monotonicity inside a multi-byte
    character (at most 4 byte tokens), so a window of 8 tokens on each side is exact. Long
    completions (thousands of tokens) need this: decoding every prefix is quadratic.
    """
    ids = list(token_ids)
    n = len(ids)

    def raw(i: int) -> int:
        return len(tokenizer.decode(ids[:i + 1], skip_special_tokens=skip_special_tokens))

    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if raw(mid) > answer_start:
            hi = mid
        else:
            lo = mid + 1
    start, stop = max(0, lo - window), min(n, lo + window + 1)
    local = [len(t) for t in tokenizer.batch_decode(
        [ids[:i + 1] for i in range(start, stop)], skip_special_tokens=skip_special_tokens)]
    if stop < n:
        local.append(raw(stop))  # stands in for min(raw[stop:]), monotone beyond the window
    ends = monotone_ends(local)[:stop - start]
    for offset, end in enumerate(ends):
        if end > answer_start:
            return start + offset
    return stop


def monotone_ends(raw_ends: Sequence[int]) -> list[int]:
    """Make span ends non-decreasing by taking, for each token, the min over it and later ones."""
    out = list(raw_ends)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def answer_token_mask(token_ends: Sequence[int], answer_start: int,
                      closing_tokens: int = 0) -> list[bool]:
    """Token i is supervised iff its span ends after `answer_start` (``end_i > a``) or it is one
    of the last `closing_tokens` tokens (the EOS that ends the completion); ``a = 0`` means the
    whole completion (every token, even one whose span is empty)."""
    n = len(token_ends)
    if answer_start <= 0:
        return [True] * n
    return [end > answer_start or i >= n - closing_tokens for i, end in enumerate(token_ends)]


def supervision_mask(text: str, token_ends: Sequence[int], mode: Supervision,
                     answer_start: Callable[[str], int], closing_tokens: int = 0,
                     opened: bool = False) -> list[bool]:
    """Per-token supervision of one completion under `mode` (``response``, ``all`` or
    ``final_line``; see the module docstring), from every token's span end.

    `answer_start` is the task's ``answer_start(text) -> char offset`` (``final_line`` only).
    `closing_tokens` is the number of special tokens ending the completion (1 for an EOS).
    `opened`: the prompt opened a reasoning block (:func:`response_start`).
    """
    return answer_token_mask(token_ends, supervised_start(text, mode, answer_start, opened),
                             closing_tokens)


def completion_supervision(tokenizer: PreTrainedTokenizerBase, text: str,
                           token_ids: Sequence[int], mode: Supervision,
                           answer_start: Callable[[str], int],
                           supervise_closing: bool = True, opened: bool = False) -> list[bool]:
    """:func:`supervision_mask` with token spans from the completion's token ids.

    `text` must be the completion text the grader saw (``decode(ids, skip_special_tokens=True)``,
    possibly cut at a stop string: tokens past the cut then count as ending after the start).
    The special tokens at the end of `token_ids` (the tokenizer's ``all_special_ids``: EOS) are
    the closing tokens: supervised in every mode unless `supervise_closing` is off (then the
    decision to stop gets no target). Uses :func:`first_answer_token` (logarithmic in the
    completion length); with the closing tokens supervised, the result equals
    :func:`supervision_mask` on :func:`token_char_ends`. `opened`: the prompt opened a
    reasoning block that the completion continues (:func:`response_start`).
    """
    start = supervised_start(text, mode, answer_start, opened)
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    n = len(token_ids)
    closing = 0
    while closing < n and token_ids[n - 1 - closing] in special:
        closing += 1
    first = first_answer_token(tokenizer, token_ids, start) if n and start > 0 else 0
    return [(i >= first or i >= n - closing) and (supervise_closing or i < n - closing)
            for i in range(n)]


def random_token_mask(mask: torch.Tensor, mask_ratio: float,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Drop each True entry of `mask` with probability `mask_ratio` (the fork's ``mask_ratio``).

    Returns a bool tensor of `mask`'s shape. ``mask_ratio = 0`` returns `mask` unchanged (no
    random numbers drawn); ``1`` drops everything.
    """
    if not 0.0 <= mask_ratio <= 1.0:
        raise ValueError(f"mask_ratio must lie in [0, 1], got {mask_ratio}")
    mask = mask.bool()
    if mask_ratio == 0.0:
        return mask
    u = torch.rand(mask.shape, generator=generator, device="cpu").to(mask.device)
    return mask & (u >= mask_ratio)
