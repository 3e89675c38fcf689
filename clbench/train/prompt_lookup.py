"""Greedy decoding with prompt-lookup drafts: several tokens per forward where the answer copies.

A greedy answer often copies from its prompt (a tool call repeats a function's name and its
argument names from the listed tools; an answer repeats the numbers of its question). After
each token, a row looks for the most recent earlier occurrence of its last few tokens in its
own prompt and completion (:class:`NgramIndex`) and drafts the tokens that followed it there.
One forward then scores the row's new token and its drafts together; a draft is kept while it
is the argmax after the tokens before it, and the first position where it is not gives the
next token. In exact arithmetic these are the tokens of token-by-token greedy decoding
(:func:`clbench.train.decoding.decode`); in bf16 a forward over several positions rounds
differently from one over one position, so a near-tie can flip (docs/performance.md counts
how often).

Why it pays on a CPU: a decoding step over long prompts reads the whole KV cache and every
weight once whatever the number of new positions, so scoring five positions costs little more
than scoring one. Rejected drafts stay in the KV cache as positions every later query is masked
from (rows accept different numbers of drafts, and the cache is one rectangle); each row's
rotary positions count only the tokens it kept.

Only greedy decoding drafts: sampled rollouts keep token-by-token sampling from the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from clbench.train.decoding import RowPlan, forward_logits, keep_rows, prefill, row_ended

if TYPE_CHECKING:
    import torch

#: The longest and shortest n-grams looked up (a single token matches too much to pay).
NGRAM_SIZES = (3, 2)


class NgramIndex:
    """Where each n-gram of a token sequence last ended, so the tokens after the latest earlier
    occurrence of the sequence's own last n tokens are found in O(1) per token."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        # the n-grams ending at the old end become earlier occurrences for the new suffix
        end = len(self.tokens)
        for n in NGRAM_SIZES:
            if end >= n:
                self.ends[tuple(self.tokens[end - n:end])] = end
        self.tokens.append(token)

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        suffix found (n-grams of :data:`NGRAM_SIZES`); none when none occurred before."""
        if limit <= 0:
            return []
        for n in NGRAM_SIZES:
            if len(self.tokens) < n:
                continue
            end = self.ends.get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end:end + limit]
        return []


def decode_with_drafts(model: Any, input_ids: torch.Tensor, attention: torch.Tensor,
                       plan: RowPlan, cache: Any, drafts: int, pad_id: int
                       ) -> list[list[int]]:
    """Greedy ids of each row of a left-padded batch, as :func:`clbench.train.decoding.decode`
    gives them (each ending with the token that ended it), up to `drafts` prompt-lookup drafts
    scored with each new token. `cache`: an empty KV cache (:func:`decoding.attention_cache`)."""
    import torch

    rows = input_ids.shape[0]
    generated: list[list[int]] = [[] for _ in range(rows)]
    indexes = [NgramIndex(ids[mask.bool()].tolist()) for ids, mask in zip(input_ids, attention)]
    live = list(range(rows))
    logits, mask = prefill(model, input_ids, attention, plan.prompts, cache)
    position = attention.long().sum(-1) - 1  # each row's last kept token's position
    while True:
        tokens = logits.argmax(dim=-1).tolist()
        going = []
        for j, (row, token) in enumerate(zip(live, tokens)):
            if _keep(generated[row], indexes[row], token, row, plan):
                going.append(j)
        if not going:
            break
        if len(going) < len(live):
            live, (mask, position) = keep_rows(going, live, cache, mask, position)
            tokens = [tokens[j] for j in going]
        proposed = [indexes[row].draft(min(drafts, plan.caps[row] - len(generated[row])))
                    for row in live]
        width = 1 + max(len(d) for d in proposed)
        ids = torch.tensor([[t, *d] + [pad_id] * (width - 1 - len(d))
                            for t, d in zip(tokens, proposed)], device=mask.device)
        mask = torch.cat([mask, mask.new_ones((len(live), width))], dim=1)
        steps = torch.arange(1, width + 1, device=mask.device)
        out = forward_logits(model, ids, mask, position[:, None] + steps, cache)
        if width == 1:
            logits, position = out[:, -1], position + 1
            continue
        predicted = out.argmax(dim=-1).tolist()
        kept = []
        for j, (row, draft) in enumerate(zip(live, proposed)):
            accepted = 0
            while accepted < len(draft) and predicted[j][accepted] == draft[accepted]:
                accepted += 1
                if not _keep(generated[row], indexes[row], draft[accepted - 1], row, plan):
                    break  # ended on a draft: the row leaves at the next step's check
            kept.append(accepted)
        accepted_at = torch.tensor(kept, device=mask.device)
        # the positions after each row's kept tokens were never its tokens: masked for good
        rejected = steps[None, :] > accepted_at[:, None] + 1
        mask[:, -width:] = mask[:, -width:].masked_fill(rejected, 0)
        position = position + accepted_at + 1
        # a row that ended on a draft leaves at the next check (:func:`_keep` refuses it)
        logits = out[torch.arange(len(live), device=out.device), accepted_at]
    return generated


def _keep(ids: list[int], index: NgramIndex, token: int, row: int, plan: RowPlan) -> bool:
    """Append `token` to a row (unless it has ended); whether the row goes on after it."""
    if ids and row_ended(ids, row, plan):
        return False
    ids.append(token)
    index.append(token)
    return not row_ended(ids, row, plan)

