"""clbench's public API: everything a method, add-on or task plugin builds on.

Plugins, the built-in ones included, import from clbench only this module (CI checks it with an
import-linter contract). Names here keep their meaning across minor versions; everything else in
clbench may move. `docs/plugins.md` walks through a complete plugin of each kind.

- **Methods** (`clbench.methods` entry points): a :class:`Method` with a documented
  :class:`MethodConfig` (inherit :class:`OptimizerSettings`, or :class:`OnPolicySettings` for
  sampled rollouts) whose `hooks(ctx)` returns its step logic for one stage, a
  :class:`StepHooks` run by the shared :class:`TrainingLoop` (on-policy methods subclass
  :class:`Objective`, which makes the rollout batches), or which overrides `train_stage(ctx)`.
- **Add-ons** (`clbench.addons`): an :class:`AddOn` with an :class:`AddOnConfig`; it acts on
  any method's loop through the same hook protocol, :class:`TrainingHooks`.
- **Tasks** (`clbench.tasks`): a :class:`TaskSource` that yields :class:`Example` items and
  grades completions into a :class:`Grade`, with the grading helpers below; or a task file
  (YAML, no code) shipped in the package, registered as :func:`task_from_file`'s class.
- **The built-in methods and their configs**, to subclass: :class:`SFT`, :class:`GRPO`,
  :class:`SDPO` and the rest (imported on first use, since they build on this module).
"""

from __future__ import annotations

import importlib
from typing import Any

from clbench.errors import UserError
from clbench.tasks.base import (
    THINK_CLOSE,
    THINK_OPEN,
    THINK_PREFIX,
    Example,
    Grade,
    Messages,
    Split,
    TaskParams,
    TaskSizeError,
    TaskSource,
    continuation,
    default_answer_start,
    draw_distinct,
    one_shot,
    opens_reasoning,
    reasoned,
    response_prefix,
    seeded_rng,
    split_of,
    split_response_start,
)
from clbench.tasks.declared import task_from_file
from clbench.tasks.grading import (
    extract_answer_line,
    extract_boxed,
    extract_choice,
    extract_tag,
    math_equivalent,
    normalize_answer,
    parse_number,
)
from clbench.train.addons import AddOn, AddOnConfig
from clbench.train.api import (
    STAGE_KEY,
    Method,
    MethodConfig,
    StageContext,
    StageReport,
)
from clbench.train.copies import frozen_copy, module_state, parameter_snapshot
from clbench.train.logprobs import (
    CompletionDistributions,
    TokenLogprobs,
    completion_distributions,
    completion_logprobs,
    pack_batch,
)
from clbench.train.loop import StepBatch, StepHooks, TrainingHooks, TrainingLoop
from clbench.train.losses import (
    DistillationScores,
    clipped_surrogate,
    generalized_jsd,
    group_advantages,
    kl_to_reference,
    sdpo_loss,
    token_mean,
    topk_logprob_divergence,
)
from clbench.train.onpolicy import Objective, OnPolicySettings, RolloutBatch, batch_summary
from clbench.train.optim import OptimizerSettings, step_examples
from clbench.train.rollout import (
    Generator,
    HFGenerator,
    Rollout,
    SamplingParams,
    encode_chat,
    encode_reference,
)

#: The built-in methods' classes, imported from their plugin package on first use (they import
#: this module, so it cannot import them as it loads).
_BUILT_INS = {
    "SFT": "clbench_methods.sft", "SFTConfig": "clbench_methods.sft",
    "SFTHooks": "clbench_methods.sft", "ReferenceBatch": "clbench_methods.sft",
    "GRPO": "clbench_methods.grpo", "GRPOConfig": "clbench_methods.grpo",
    "GRPOObjective": "clbench_methods.grpo",
    "SDPO": "clbench_methods.sdpo.method", "SDPOConfig": "clbench_methods.sdpo.method",
    "SDPOObjective": "clbench_methods.sdpo.method",
    "SDPOCoT": "clbench_methods.sdpo.method", "SDPOCoTConfig": "clbench_methods.sdpo.method",
    "StableSDPO": "clbench_methods.sdpo.method",
    "StableSDPOConfig": "clbench_methods.sdpo.method",
}


def __getattr__(name: str) -> Any:
    if name in _BUILT_INS:
        return getattr(importlib.import_module(_BUILT_INS[name]), name)
    raise AttributeError(f"module 'clbench.api' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "STAGE_KEY", "THINK_CLOSE", "THINK_OPEN", "THINK_PREFIX", "AddOn", "AddOnConfig",
    "CompletionDistributions", "DistillationScores", "Example", "Generator", "Grade",
    "HFGenerator", "Messages", "Method", "MethodConfig", "Objective", "OnPolicySettings",
    "OptimizerSettings", "Rollout", "RolloutBatch", "SamplingParams", "Split", "StageContext",
    "StageReport", "StepBatch", "StepHooks", "TaskParams", "TaskSizeError", "TaskSource",
    "TokenLogprobs", "TrainingHooks", "TrainingLoop", "UserError", "batch_summary",
    "clipped_surrogate", "completion_distributions", "completion_logprobs", "continuation",
    "default_answer_start", "draw_distinct", "encode_chat", "encode_reference",
    "extract_answer_line", "extract_boxed", "extract_choice", "extract_tag", "frozen_copy",
    "generalized_jsd", "group_advantages", "kl_to_reference", "math_equivalent",
    "module_state", "normalize_answer", "one_shot", "opens_reasoning", "pack_batch",
    "parameter_snapshot", "parse_number", "reasoned", "response_prefix", "sdpo_loss",
    "seeded_rng", "split_of", "split_response_start", "step_examples", "task_from_file",
    "token_mean", "topk_logprob_divergence",
    *_BUILT_INS,
]
