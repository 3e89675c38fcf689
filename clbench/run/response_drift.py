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
"""

from __future__ import annotations

from collections.abc import Sequence
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


def kl_sum(model: Any, base: Any, prompts: Sequence[list[int]],
           responses: Sequence[list[int]]) -> tuple[float, int]:
    """(sum over response tokens of KL(model || base), number of tokens)."""
    import torch

    from clbench.train.logprobs import completion_distributions

    total, count = 0.0, 0
    for start in range(0, len(prompts), MICRO_BATCH):
        p, r = prompts[start:start + MICRO_BATCH], responses[start:start + MICRO_BATCH]
        with torch.no_grad():
            now = completion_distributions(model, p, r)
            before = completion_distributions(base, p, r)
        tokens = int(now.mask.sum())
        total += mean_token_kl(now.logprobs, before.logprobs.to(now.logprobs.device),
                               now.mask) * tokens
        count += tokens
    return total, count


def response_drift(ctx: RunContext, row: int, weights: Path, spec: ResponseDriftSpec
                   ) -> dict[str, Any]:
    """The response drift of `row` against row 0 (see the module docstring): per column and
    over all probe prompts."""
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
    base_model = base_model_copy(ctx.model, weights) if probes else None
    columns: dict[str, dict[str, Any]] = {}
    kl_total, kl_tokens = 0.0, 0
    for name in dict.fromkeys(p[0] for p in probes):
        mine = [p for p in probes if p[0] == name]
        entry: dict[str, Any] = {
            "prompts": len(mine),
            "edit_similarity": sum(edit_similarity(c, b) for _, _, b, c in mine) / len(mine)}
        scored = [(prompt, b) for _, prompt, b, _ in mine if b]  # an empty response has no token
        if base_model is not None and scored:
            total, tokens = kl_sum(ctx.model, base_model, [s[0] for s in scored],
                                   [s[1] for s in scored])
            entry["kl"] = total / tokens
            kl_total, kl_tokens = kl_total + total, kl_tokens + tokens
        columns[name] = entry
    del base_model
    out: dict[str, Any] = {"columns": columns}
    if probes:
        out["edit_similarity"] = sum(edit_similarity(c, b) for _, _, b, c in probes) / len(probes)
    if kl_tokens:
        out["kl"] = kl_total / kl_tokens
    return out
