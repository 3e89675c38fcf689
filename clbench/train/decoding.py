"""The decode loop behind :class:`clbench.train.rollout.HFGenerator`: prefill, one token per
live row per step, and rows dropped from the batch as soon as they end.

transformers' `generate` keeps every row of a batch in every forward until the last row ends
(an ended row decodes padding), checks stop strings through a criteria object that sees whole
sequences, and prefills each sample of a prompt on its own. This loop does the same work for
the rows that are still going and nothing more:

- **one prefill per distinct prompt**: the samples of a prompt share its KV cache and its
  first-token logits (rows are copied, not recomputed);
- **each shared prefix prefilled once**: the prompts of a batch as a tree of the prefixes they
  share (:mod:`clbench.train.prefix_tree`; segments of :data:`SHARED_PREFIX_TOKENS` tokens or
  more), each segment computed once on top of its ancestors' keys and values;
- **prefills of a few thousand tokens**: a tree's segments of one depth are prefilled in groups
  within :data:`PREFILL_TOKENS` tokens, each padded on the right to its own longest segment
  (padding no real token attends to), then each prompt's path of segments stacked into the
  batch's KV cache (a CPU prefills 1.5x faster per token at that size than over a whole batch
  of tool-use prompts);
- **ended rows leave the batch**: EOS, the row's own token cap, or a stop string in its newest
  tokens; the KV cache keeps only the live rows (moved down within buffers allocated once per
  batch), and the loop ends when none is left;
- **stop strings on the newest tokens only** (:class:`StopScanner`), not the whole completion
  decoded at every step;
- **a row's draws depend on its own logits alone**: each step draws one uniform number per row
  of the batch, live or not, and samples by inverting the row's CDF, so a row's sample does not
  depend on which other rows have ended (a prompt cap cuts a row; it never changes what another
  row draws).

Greedy decoding picks the argmax, as `generate` does: on the same weights and dtype the tokens
are those of `model.generate` (tests/train/test_rollout.py). Sampling is the same distribution as
`generate`'s (temperature, then nucleus `top_p` with the same keep rule) with different draws.

It needs a model whose forward takes a dynamic attention KV cache (every decoder-only
transformers LM with the default cache); :func:`attention_cache` says when it does not
(recurrent layers), and the generator falls back to `generate`.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class RowPlan:
    """What each row of a batch decodes: its prompt (rows of one prompt share a prefill), its
    token cap, and when it ends (EOS ids, stop strings)."""

    prompts: Sequence[int]
    caps: Sequence[int]
    eos_ids: frozenset[int]
    stops: StopScanner | None = None


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy when `temperature` is 0, else a draw at that
    temperature from the nucleus of mass `top_p`."""

    temperature: float
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def decode(model: Any, input_ids: torch.Tensor, attention: torch.Tensor, plan: RowPlan,
           sampling: Sampling, cache: Any, entropy: list[float] | None = None
           ) -> list[list[int]]:
    """The generated ids of each row of a left-padded batch, each ending with the token that
    ended it (EOS, the last under its cap, or the one that completed a stop string).

    `cache`: an empty dynamic KV cache for `model` (:func:`attention_cache`). Random draws come
    from torch's global generator (the caller seeds it). `entropy`, when given (one zero per
    row), gets each row's sum over its generated tokens of the entropy of the distribution the
    token was drawn from (:func:`sampler_entropy`)."""
    import torch

    rows = input_ids.shape[0]
    generated: list[list[int]] = [[] for _ in range(rows)]
    live = list(range(rows))
    logits, mask = prefill(model, input_ids, attention, plan.prompts, cache)
    position = attention.long().sum(-1, keepdim=True) - 1  # last prompt token's position
    for _ in range(max(plan.caps)):
        uniforms = None if sampling.greedy else torch.rand(rows, device=logits.device,
                                                           dtype=torch.float64)
        tokens = pick_tokens(logits, sampling, None if uniforms is None else uniforms[live])
        if entropy is not None and not sampling.greedy:  # greedy: 0 (evaluation's hot path)
            for row, h in zip(live, sampler_entropy(logits, sampling).tolist()):
                entropy[row] += h
        going = []
        for j, (row, token) in enumerate(zip(live, tokens.tolist())):
            generated[row].append(token)
            if not row_ended(generated[row], row, plan):
                going.append(j)
        if not going:
            break
        if len(going) < len(live):
            live, (tokens, mask, position) = keep_rows(going, live, cache, tokens, mask,
                                                       position)
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
        position = position + 1
        logits = forward_logits(model, tokens[:, None], mask, position, cache)[:, -1]
    return generated


def keep_rows(going: list[int], live: list[int], cache: Any, *batch: torch.Tensor
              ) -> tuple[list[int], list[torch.Tensor]]:
    """The rows `going` (positions in the batch) of the live rows, of the KV cache (in place)
    and of each tensor of `batch`: ended rows leave."""
    import torch

    keep = torch.tensor(going, device=batch[0].device)
    cache.batch_select_indices(keep)
    return [live[j] for j in going], [t[keep] for t in batch]


def row_ended(ids: list[int], row: int, plan: RowPlan) -> bool:
    """Whether a row's ids end it: EOS, its token cap, or a stop string in its newest tokens."""
    return (ids[-1] in plan.eos_ids or len(ids) >= plan.caps[row]
            or (plan.stops is not None and plan.stops.hit(ids)))


#: Tokens (rows x padded segment width) per prefill forward: the segments of a batch's prefix
#: tree (:mod:`clbench.train.prefix_tree`) are prefilled in groups within this many tokens, each
#: group padded only to its own longest segment. On the embedded model a CPU prefills fastest
#: at 4-5 thousand tokens a forward (3,600 tokens/s against ~2,400 for tool use's 17 x 637-token
#: batches); large GPU engines chunk prefills at similar sizes.
PREFILL_TOKENS = 4096

#: The shortest segment a prefill group takes, as a share of the group's longest: segments are
#: padded to the longest, and padding costs what tokens cost. On the starter's tool-use column
#: (this CPU, bf16) 0.9 prefilled in 25 s what 0.75 did in 28-32 s and 0.95 in 29 s.
PREFILL_FILL = 0.9


#: The fewest tokens a segment shared by several prompts of a batch must have to be prefilled
#: once for all of them (a node of the batch's prefix tree: a column's chat template and
#: instructions, the functions several tool-use items list); a shorter one is prefilled with
#: each branch below it, which costs less than a node of its own.
SHARED_PREFIX_TOKENS = 32


def prefill(model: Any, input_ids: torch.Tensor, attention: torch.Tensor,
            row_prompts: Sequence[int], cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits of every row after its prompt, the cache filled with every row's
    prompt, and the attention mask of that cache's columns (masked columns are padding, wherever
    they lie). Each distinct prompt is computed once and copied to the rows that repeat it.
    Where the cache is preallocated, the prefixes the prompts share are computed once, as a
    tree (:func:`clbench.train.prefix_tree.prefill_tree`), and the cache keeps the batch's
    left-padded layout; otherwise the left-padded batch goes through one forward under its
    padding mask."""
    import torch

    first: dict[int, int] = {}  # prompt index -> its first row
    for i, prompt in enumerate(row_prompts):
        first.setdefault(prompt, i)
    shared = len(first) < len(row_prompts)
    if shared:
        distinct = torch.tensor(list(first.values()), device=input_ids.device)
        input_ids, attention = input_ids[distinct], attention[distinct]
    if preallocated(cache):
        from clbench.train.prefix_tree import prefill_tree

        logits, mask = prefill_tree(model, input_ids, attention, cache), attention
    else:
        positions = (attention.long().cumsum(-1) - 1).masked_fill(attention == 0, 0)
        last = attention.new_full((input_ids.shape[0],), input_ids.shape[1] - 1)
        logits, mask = forward_logits(model, input_ids, attention, positions, cache, at=last), \
            attention
    if shared:
        order = {prompt: k for k, prompt in enumerate(first)}
        copies = torch.tensor([order[p] for p in row_prompts], device=input_ids.device)
        cache.reorder_cache(copies)
        logits, mask = logits[copies], mask[copies]
    return logits, mask


def row_batches(lengths: Sequence[int], max_rows: int, token_budget: int | None = None
                ) -> list[tuple[int, int]]:
    """`(start, stop)` of each batch of consecutive rows, whose `lengths` are their tokens
    (prompt plus token cap for a decoding batch, prompt alone for a prefill group): `max_rows`
    rows each, or, with a `token_budget`, as many rows (at most `max_rows`, at least one) as keep
    rows x the batch's longest length within the budget, so a batch of short prompts holds more
    rows than one of long prompts (the KV cache and the prefill grow with both)."""
    batches: list[tuple[int, int]] = []
    start = 0
    while start < len(lengths):
        stop, longest = start + 1, lengths[start]
        while stop < len(lengths) and stop - start < max_rows:
            widest = max(longest, lengths[stop])
            if token_budget is not None and (stop - start + 1) * widest > token_budget:
                break
            stop, longest = stop + 1, widest
        batches.append((start, stop))
        start = stop
    return batches


def forward_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                   cache: Any, at: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits (fp32, as `generate` processes them): at every position, or with `at`
    (one position per row) each row's logits there alone, computed for those positions only
    where the model can skip the others (a vocabulary row per prompt token)."""
    import torch

    params = _forward_parameters(type(model))
    cache_name = "cache" if "cache" in params else "past_key_values"
    extra, kept = {}, None
    if at is not None and "logits_to_keep" in params:
        kept, at = at.unique(return_inverse=True)
        extra = {"logits_to_keep": kept}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{cache_name: cache}, **extra)
    logits = out.logits
    if at is not None:
        logits = logits[torch.arange(len(at), device=logits.device), at]
    return logits.float()


@functools.cache
def _forward_parameters(model_type: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_type.forward).parameters)


def pick_tokens(logits: torch.Tensor, sampling: Sampling,
                uniforms: torch.Tensor | None) -> torch.Tensor:
    """One token per row of `logits` (rows x vocabulary): the argmax when greedy, else the
    token where the row's `uniforms` value falls in its CDF at `temperature`, restricted to the
    nucleus: the most probable tokens, in order, while the mass before each is under `top_p`
    (the same set transformers' top-p warper keeps; at least one token)."""
    import torch

    if sampling.greedy:
        # the first maximum, as argmax gives it, in a third of argmax's time on a CPU
        return logits.max(dim=-1).indices
    assert uniforms is not None
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    order = None
    if sampling.top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(before >= sampling.top_p, 0.0)
    cdf = probs.double().cumsum(-1)  # float64: the CDF over ~50k tokens keeps small masses
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    picked = torch.searchsorted(cdf, targets, right=True).clamp_(max=cdf.shape[-1] - 1)
    return picked.squeeze(-1) if order is None else order.gather(-1, picked).squeeze(-1)


def sampler_entropy(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Per row, the entropy (nats) of the distribution :func:`pick_tokens` draws from: the
    softmax at `temperature`, restricted to the nucleus and renormalised; 0 when greedy (one
    token has all the mass)."""
    import torch

    if sampling.greedy:
        return logits.new_zeros(logits.shape[0])
    logp = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        logp, _ = logp.sort(dim=-1, descending=True)
        probs = logp.exp()
        outside = probs.cumsum(-1) - probs >= sampling.top_p
        logp = logp.masked_fill(outside, float("-inf"))
        logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)
    probs = logp.exp()
    return -(probs * logp.masked_fill(probs == 0, 0.0)).sum(-1)


def attention_cache(model: Any, capacity: int | None = None) -> Any:
    """An empty dynamic KV cache for `model`, or None where the loop cannot run it: recurrent
    layers, or a model without transformers' default dynamic cache.

    With a `capacity` (prompt width + new tokens), each full-attention layer writes into
    buffers of that length (:func:`_preallocated_layer`) instead of concatenating: a dynamic
    layer copies its whole cache at every new token, which on a CPU took a quarter of a
    decoding step over 600-token prompts."""
    from transformers import DynamicCache

    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports is None or not supports():
        return None
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers before the cache took the model's config
        cache = DynamicCache()
    if any(getattr(cache, "is_linear", None) or ()):
        return None
    if capacity is not None:
        _preallocate(cache, capacity)
    return cache


def _preallocate(cache: Any, capacity: int) -> None:
    """Swap the cache's plain full-attention layers (sliding-window and other kinds stay) for
    preallocated ones; nothing where the transformers version builds its layers otherwise."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            layers[i] = _preallocated_layer()(capacity)


def whole_buffers(layer: Any) -> tuple[Any, Any] | None:
    """The whole key and value buffers (rows, heads, capacity, dim) of a preallocated cache
    layer, None for any other layer. Their columns past the filled part hold zeros or keys and
    values of rows cut back (finite either way), so attention over the whole buffers with those
    columns masked is attention over the filled part: a matrix multiply reads the buffers
    in place, where the filled part, a view with gaps between rows, would be copied first."""
    if not isinstance(layer, _preallocated_layer()) or not layer.is_initialized:
        return None
    return layer.key_buffer, layer.value_buffer


def preallocated(cache: Any) -> bool:
    """Whether every layer of `cache` writes into preallocated buffers (so the caches of groups
    of rows prefilled apart can be stacked into it)."""
    layers = getattr(cache, "layers", None)
    return isinstance(layers, list) and bool(layers) and all(
        isinstance(layer, _preallocated_layer()) for layer in layers)


@functools.cache
def _preallocated_layer() -> type:
    """A dynamic cache layer that writes new keys and values into buffers allocated once
    (grown by doubling if ever exceeded) and exposes the filled part as views; the same
    values as a dynamic layer's, without its copy of the whole cache per token. The buffers
    start as zeros, so the columns past the filled part are finite (:func:`whole_buffers`)."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any
                   ) -> tuple[Any, Any]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                shape = (*key_states.shape[:2], self.capacity, key_states.shape[-1])
                self.key_buffer = key_states.new_zeros(shape)
                self.value_buffer = value_states.new_zeros(
                    (*shape[:3], value_states.shape[-1]))
            end = self.length + key_states.shape[-2]
            if end > self.key_buffer.shape[-2]:
                self._resize(max(end, 2 * self.key_buffer.shape[-2]))
            self.key_buffer[:, :, self.length:end] = key_states
            self.value_buffer[:, :, self.length:end] = value_states
            self.length = end
            self._expose()
            return self.keys, self.values

        def stack(self, parts: Sequence[tuple[Any, Any]], width: int) -> None:
            """Fill this empty layer with the rows of each `(keys, values)` part in turn, each
            left-padded with zeros (masked columns) to `width` tokens."""
            keys, values = parts[0]
            rows = sum(k.shape[0] for k, _ in parts)
            self.lazy_initialization(keys, values)
            shape = (rows, keys.shape[1], max(self.capacity, width), keys.shape[-1])
            self.key_buffer = keys.new_zeros(shape)
            self.value_buffer = values.new_zeros((*shape[:3], values.shape[-1]))
            start = 0
            for k, v in parts:
                stop, pad = start + k.shape[0], width - k.shape[-2]
                for buffer, part in ((self.key_buffer, k), (self.value_buffer, v)):
                    buffer[start:stop, :, pad:width] = part
                start = stop
            self.length = width
            self._expose()

        def _resize(self, capacity: int) -> None:
            def grown(buffer: Any) -> Any:
                out = buffer.new_zeros((*buffer.shape[:2], capacity, buffer.shape[-1]))
                out[:, :, :self.length] = buffer[:, :, :self.length]
                return out

            self.key_buffer, self.value_buffer = grown(self.key_buffer), grown(self.value_buffer)

        def _expose(self) -> None:
            self.keys = self.key_buffer[:, :, :self.length]
            self.values = self.value_buffer[:, :, :self.length]

        def _rows(self, select: Callable[[Any], Any]) -> None:
            if self.is_initialized and self.length:
                self.key_buffer, self.value_buffer = select(self.key_buffer), select(
                    self.value_buffer)
                self._expose()

        def batch_select_indices(self, indices: Any) -> None:
            """Keep the rows `indices`. In increasing order (the decode loop's rows that go
            on), each kept row moves down within the same buffers, its filled columns copied:
            the cache is allocated once per batch, not again (whole, past its filled part) each
            time rows end, which spread a column's allocations over the heap."""
            order = indices.tolist()
            if not all(a < b for a, b in itertools.pairwise(order)):
                self._rows(lambda buffer: buffer[indices])
                return
            if self.is_initialized and self.length:
                for row, kept in enumerate(order):
                    if row != kept:
                        for buffer in (self.key_buffer, self.value_buffer):
                            buffer[row, :, :self.length].copy_(buffer[kept, :, :self.length])
                self.key_buffer = self.key_buffer[:len(order)]
                self.value_buffer = self.value_buffer[:len(order)]
                self._expose()

        def reorder_cache(self, beam_idx: Any) -> None:
            self._rows(lambda buffer: buffer.index_select(0, beam_idx.to(buffer.device)))

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._rows(lambda buffer: buffer.repeat_interleave(repeats, dim=0))

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError("crop takes the (negative) number of tokens to remove")
            if self.is_initialized and tokens_to_remove:
                self.length = max(0, self.length + tokens_to_remove)
                self._expose()

        def reset(self) -> None:
            self.length = 0
            super().reset()

    return PreallocatedLayer


class StopScanner:
    """Whether a completion has just produced a stop string, from its newest tokens.

    A stop string completed by the newest token lies within the last (its length in bytes)
    tokens, since every token adds at least one byte; a few more tokens of margin absorb what
    decoding a fragment can lose at its start (a leading space, a split multi-byte character).
    The text is cut exactly afterwards (:func:`clbench.train.rollout.finish_completion`); this
    only ends the row, so decoding stays linear in the completion's length."""

    MARGIN = 4

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.window = max(len(s.encode("utf-8")) for s in self.stop) + self.MARGIN

    def hit(self, completion_ids: Sequence[int]) -> bool:
        tail = self.tokenizer.decode(list(completion_ids[-self.window:]),
                                     skip_special_tokens=True)
        return any(s in tail for s in self.stop)
