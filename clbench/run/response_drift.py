"""Response drift after a stage: how the answers to fixed probe prompts moved from the base model's.

The probe prompts are the first `items_per_column` evaluation items of every task column (the
same items in every row). The responses are the evaluation's own, read from the item records:
row 0's are the base model's, the stage's row the current model's (greedy under the default
decoding), so nothing is generated again. Per column:

- `kl`: KL(current || base) per token on the base model's responses, both models scoring the
  prompt and the base response (:func:`clbench.metrics.responses.mean_token_kl`), averaged over
  the response tokens. The base model is the student's architecture with the run's own base
  weights (`checkpoints/base-weights.safetensors`), built for the measurement and dropped after;
- `edit_similarity`: 1 - token edit distance / the longer length between the current and the
  base response (:func:`clbench.metrics.responses.edit_similarity`), averaged over the prompts.

Responses are compared as token ids of their texts (re-encoded), the same for both sides.

The base side is the same after every stage (the base weights on row 0's responses, scored in
the same batches), so a run keeps it from the first stage on (:class:`BaseScores`, in memory up
to `KEPT_BYTES`): later stages score only the current model, and build no base model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.adapters import merged_copy
from clbench.eval.records import read_records, records_path
from clbench.metrics.responses import edit_similarity, mean_token_kl

if TYPE_CHECKING:
    from clbench.run.context import RunContext
    from clbench.spec.schema import ResponseDriftSpec

#: Rows scored per forward pass (each holds [tokens, vocabulary] log-probs).
MICRO_BATCH = 4

#: The most memory :class:`BaseScores` holds (fp32 log-probs over the vocabulary at every
#: response token: the starter's 24 probes about 170 MB); past it the base side is scored again.
KEPT_BYTES = 512 * 2**20


class BaseScores:
    """The base model's log-distributions over the probe responses, by the exact batch they
    were scored in, kept between a run's stages while they fit in `limit` bytes; the base model
    itself is built from `weights` only when a batch is not kept."""

    def __init__(self, limit: int = KEPT_BYTES) -> None:
        self.limit = limit
        self.kept: dict[tuple, Any] = {}
        self.bytes = 0
        self.computed = 0  # batches scored on the base model (for tests and benchmarks)

    def logprobs(self, key: tuple, score: Callable[[], Any]) -> Any:
        """The kept log-probs of the batch `key`, else `score()`'s (kept if they fit)."""
        if key in self.kept:
            return self.kept[key]
        value = score()
        self.computed += 1
        size = value.numel() * value.element_size()
        if self.bytes + size <= self.limit:
            self.kept[key] = value
            self.bytes += size
        return value


def base_model_copy(model: Any, weights: Path) -> Any | None:
    """The student's architecture with the base weights from `weights`; None when the file is
    missing or lacks a parameter (written before every parameter was kept)."""
    from safetensors import safe_open

    from clbench.train.distributed import unwrap

    if not weights.is_file():
        return None
    base = merged_copy(unwrap(model))  # a plain model: the base weights fill its names
    names: dict[int, list[str]] = {}
    for name, p in base.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    with safe_open(str(weights), framework="pt") as stored:
        keys = set(stored.keys())
        for p in base.parameters():
            name = next((n for n in names[id(p)] if n in keys), None)
            if name is None:
                return None
            tensor = stored.get_tensor(name)
            if tensor.shape != p.shape:
                return None
            p.data.copy_(tensor)
    return base.eval()


def kl_sum(model: Any, base: Callable[[], Any], prompts: Sequence[list[int]],
           responses: Sequence[list[int]], kept: BaseScores | None = None
           ) -> tuple[float, int]:
    """(sum over response tokens of KL(model || base), number of tokens). `base()` gives the
    base model (asked only for the batches `kept` lacks)."""
    import torch

    from clbench.train.logprobs import completion_distributions

    def score_base(p: Sequence[list[int]], r: Sequence[list[int]]) -> Any:
        with torch.no_grad():
            return completion_distributions(base(), p, r).logprobs

    total, count = 0.0, 0
    for start in range(0, len(prompts), MICRO_BATCH):
        p, r = prompts[start:start + MICRO_BATCH], responses[start:start + MICRO_BATCH]
        with torch.no_grad():
            now = completion_distributions(model, p, r)
        before = score_base(p, r) if kept is None else kept.logprobs(
            (tuple(map(tuple, p)), tuple(map(tuple, r))), lambda p=p, r=r: score_base(p, r))
        tokens = int(now.mask.sum())
        total += mean_token_kl(now.logprobs, before.to(now.logprobs.device), now.mask) * tokens
        count += tokens
    return total, count


class _NoBaseModel(Exception):
    """The base weights file is missing or lacks a parameter: no KL is measured."""


def response_drift(ctx: RunContext, row: int, weights: Path, spec: ResponseDriftSpec,
                   kept: BaseScores | None = None) -> dict[str, Any]:
    """The response drift of `row` against row 0 (see the module docstring): per column and
    over all probe prompts; the base side taken from `kept` where it holds it."""
    from clbench.train.rollout import encode_chat

    def ids(text: str) -> list[int]:
        return list(ctx.tokenizer(text, add_special_tokens=False)["input_ids"])

    probes = []  # (column, prompt ids, base response ids, current response ids)
    for plan in ctx.plans:
        if plan.task is None:  # an lm-eval probe has no completions of ours
            continue
        try:
            now = read_records(records_path(ctx.run_dir, row, plan.name))
            base = read_records(records_path(ctx.run_dir, 0, plan.name))
        except (OSError, ValueError):
            continue
        current = {r.id: r.completion for r in now}
        original = {r.id: r.completion for r in base}
        for example in plan.examples[:spec.items_per_column]:
            if example.id in current and example.id in original:
                probes.append((plan.name, encode_chat(ctx.tokenizer, example.messages),
                               ids(original[example.id]), ids(current[example.id])))
    built: list[Any] = []  # the base model, once a batch needs it

    def base_model() -> Any:
        if not built:
            built.append(base_model_copy(ctx.model, weights))
        if built[0] is None:
            raise _NoBaseModel
        return built[0]

    columns: dict[str, dict[str, Any]] = {}
    kl_total, kl_tokens, measured = 0.0, 0, True
    for name in dict.fromkeys(p[0] for p in probes):
        mine = [p for p in probes if p[0] == name]
        entry: dict[str, Any] = {
            "prompts": len(mine),
            "edit_similarity": sum(edit_similarity(c, b) for _, _, b, c in mine) / len(mine)}
        scored = [(prompt, b) for _, prompt, b, _ in mine if b]  # an empty response has no token
        if scored and measured:
            try:
                total, tokens = kl_sum(ctx.model, base_model, [s[0] for s in scored],
                                       [s[1] for s in scored], kept)
            except _NoBaseModel:
                measured = False
            else:
                entry["kl"] = total / tokens
                kl_total, kl_tokens = kl_total + total, kl_tokens + tokens
        columns[name] = entry
    built.clear()  # the base model goes now, not with the closure
    out: dict[str, Any] = {"columns": columns}
    if probes:
        out["edit_similarity"] = sum(edit_similarity(c, b) for _, _, b, c in probes) / len(probes)
    if kl_tokens:
        out["kl"] = kl_total / kl_tokens
    return out
