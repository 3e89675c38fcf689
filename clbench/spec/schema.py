"""Declarative specifications: the pydantic models of suites, stages, probes, protocols and runs.

Everything a user writes in a suite YAML (or passes with `--set`) is validated here. Models are
strict (`extra="forbid"`) and every field carries a description, which is what `clbench schema`
and the CLI help show. Plugin parameters (a task source's or a method's) are validated against
the plugin's own config model by :mod:`clbench.plugins.registry`, not here, so that this module
never imports a plugin. Reading files and overrides, and turning validation errors into messages, is
:mod:`clbench.spec.reading`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from clbench.seeding import MAX_SEED
from clbench.spec.base import NAME_PATTERN, Spec
from clbench.spec.taskfile import TaskFile, is_task_file

DEVICE_PATTERN = r"^(auto|cpu|mps|cuda(:\d+)?)$"
#: Experiment trackers a run can log to, through accelerate (`clbench.run.trackers`).
Tracker = Literal["tensorboard", "wandb", "mlflow"]

SUITE_SCHEMA_VERSION = 1

# Bounds of every count a suite states, so that reading or validating any file ends in seconds:
# items drawn per task (and per step, per batch), rollouts per prompt, tokens per answer, steps.
MAX_ITEMS = 100_000
MAX_SAMPLES = 1_024
MAX_TOKENS = 1_048_576
MAX_COUNT = 10_000_000

#: Under `model.eval_batching: auto` on a CPU (:class:`clbench.eval.column.EvalBatching`), the
#: tokens (prompt, padded to the batch's longest, plus the token cap) one evaluation batch holds:
#: measured fastest on a 2-core CPU with AVX512-BF16 for the starter's columns once prefills ran
#: in groups of rows (a decoding step is bound by reading the weights, so more rows share each
#: read: 46 tool-use prompts of 700 tokens a batch; docs/performance.md, "Evaluation batches").
#: Here, not in the evaluation layer, so that the settings' descriptions quote them.
CPU_BATCH_TOKENS = 32_768
#: ... and at most this many times `protocol.decoding.batch_size` prompts (128 math prompts).
AUTO_BATCH_GROWTH = 8


class TaskSpec(Spec):
    """A task: a registered task source, its parameters, and how many items each split holds."""

    source: str = Field(max_length=1_000, description="Name of a task source registered in "
                        "the `clbench.tasks` entry-point group (see `clbench list tasks`), e.g. "
                        "`math.arithmetic`, or a task file (`.yaml`, relative to the suite "
                        "file), e.g. `tasks/units.yaml` (docs/tasks.md, \"Write a task\").")
    params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the task "
                                   "source, validated against that source's own config model.")
    train_size: int = Field(default=512, ge=0, le=MAX_ITEMS,
                            description="Number of training items drawn from "
                            "the source's train split.")
    eval_size: int | None = Field(default=None, ge=1, le=MAX_ITEMS,
                                  description="Number of evaluation items; "
                                  "defaults to the protocol's `eval_size`.")
    seed: int = Field(default=1234, description="Data seed: which items are drawn. Fixed per "
                      "suite so that every method and run seed sees the same items.")
    definition: TaskFile | None = Field(default=None, description="The content of the task "
                                        "file `source` names, with its data file's SHA-256: "
                                        "filled in when the suite is read (part of its hash), "
                                        "never written by hand.")
    folder: str | None = Field(default=None, description="The folder of the task file `source` "
                               "names (its data paths are relative to it): filled in when the "
                               "suite is read; not part of the suite's hash.")
    suite_folder: str | None = Field(default=None, description="The folder of the suite file, "
                                     "which relative `data_files` in `params` resolve against: "
                                     "filled in when the suite is read; not part of its hash.")

    @property
    def name(self) -> str:
        """The task's name: the registered source's, or the task file's `name`."""
        return self.definition.name if self.definition is not None else self.source

    @property
    def is_file(self) -> bool:
        """Whether `source` names a task file."""
        return is_task_file(self.source)


class Budget(Spec):
    """What one stage may spend: optimizer steps, prompts per step, samples per prompt, tokens."""

    steps: int = Field(ge=1, le=MAX_COUNT, description="Optimizer steps in the stage.")
    prompts_per_step: int = Field(default=4, ge=1, le=MAX_ITEMS,
                                  description="Distinct prompts per optimizer "
                                  "step (SFT uses this many reference solutions per step).")
    samples_per_prompt: int = Field(default=4, ge=1, le=MAX_SAMPLES,
                                    description="Rollouts per prompt for "
                                    "on-policy methods (the GRPO group size).")
    max_new_tokens: int = Field(default=64, ge=1, le=MAX_TOKENS,
                                description="Maximum tokens generated per "
                                "rollout.")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature of the "
                               "training rollouts.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold "
                         "of the training rollouts.")
    lr: float | None = Field(default=None, gt=0.0, description="Learning-rate override for this "
                             "stage; the method's own default applies when unset.")


class StageSpec(Spec):
    """One stage of the stream: a task to learn under a budget."""

    name: str = Field(pattern=NAME_PATTERN, description="Column name of the stage's task in the "
                      "accuracy matrix, e.g. `math`.")
    task: TaskSpec = Field(description="The task learned in this stage.")
    budget: Budget = Field(description="Training budget of the stage.")

    @field_validator("task")
    @classmethod
    def _has_training_items(cls, task: TaskSpec) -> TaskSpec:
        if task.train_size < 1:  # a probe's task may have none; a stage trains on them
            raise ValueError("train_size must be at least 1: a stage trains on its task's "
                             "training items")
        return task


#: lm-eval metrics that cannot be a column of R (lower is better, not bounded by 1).
LOWER_IS_BETTER_LM_EVAL_METRICS = frozenset({
    "perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "ter", "brier_score"})


class LmEvalProbe(Spec):
    """A general-ability probe run through lm-evaluation-harness on the in-memory model."""

    task: str = Field(description="lm-eval task or group name (e.g. `mmlu`) or a path to a "
                      "task YAML; a group is scored by lm-eval's aggregate over its tasks.")
    metric: str = Field(default="acc", description="lm-eval result used as score, `metric` or "
                        "`metric,filter` (e.g. `exact_match,strict-match` for gsm8k). A bare "
                        "metric means its `none` filter, or its only filter; name the filter "
                        "when the task reports several.")
    include_path: str | None = Field(default=None, description="Folder of extra lm-eval task "
                                     "YAMLs; relative paths are resolved against the suite file.")
    num_fewshot: int | None = Field(default=None, ge=0, le=MAX_SAMPLES,
                                    description="Few-shot examples.")
    limit: int | None = Field(default=None, ge=1, le=MAX_ITEMS,
                              description="Evaluate at most this many items.")

    @field_validator("metric")
    @classmethod
    def _a_fraction_higher_is_better(cls, metric: str) -> str:
        # A cell of R is a fraction in [0, 1] where higher is better: the metrics' deltas and
        # the per-item records assume it. lm-eval's perplexities and error rates are neither.
        name = metric.split(",", 1)[0].strip()
        if name in LOWER_IS_BETTER_LM_EVAL_METRICS:
            raise ValueError(f"{name!r} is lower-is-better and not a fraction; a probe column "
                             "is scored like an accuracy (e.g. acc, acc_norm, exact_match)")
        return metric


class ProbeSpec(Spec):
    """A held-out column: an OOD task (never trained on) or an lm-eval general-ability probe."""

    name: str = Field(pattern=NAME_PATTERN, description="Column name of the probe.")
    kind: Literal["ood", "general"] = Field(default="ood", description="`ood`: a distribution-"
                                            "shifted task; `general`: general ability.")
    task: TaskSpec | None = Field(default=None, description="A clbench task (give this or "
                                  "`lm_eval`).")
    lm_eval: LmEvalProbe | None = Field(default=None, description="An lm-eval task (give this "
                                        "or `task`).")

    @model_validator(mode="after")
    def _one_source(self) -> ProbeSpec:
        if (self.task is None) == (self.lm_eval is None):
            raise ValueError("give exactly one of `task` or `lm_eval`")
        return self


class DecodingSpec(Spec):
    """Decoding used to evaluate every column (the same for every method)."""

    temperature: float = Field(default=0.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus threshold when "
                         "sampling.")
    max_new_tokens: int = Field(default=96, ge=1, le=MAX_TOKENS,
                                description="Maximum tokens per answer.")
    batch_size: int = Field(default=16, ge=1, le=MAX_ITEMS,
                            description="Prompts per generation batch (on a CPU, "
                            "`model.eval_batching: auto` sizes batches by tokens instead, up to "
                            f"{AUTO_BATCH_GROWTH}x this).")


MetricName = Literal["acc", "op", "aia", "la", "bwt", "fwt", "forgetting", "ood_delta",
                     "general_delta", "intransigence"]


class WeightDriftSpec(Spec):
    """Parameter drift of every 2-D weight after each stage (:mod:`clbench.metrics.drift`)."""

    enabled: bool = Field(default=True, description="Measure it after every stage.")
    k: int = Field(default=16, ge=1, le=MAX_SAMPLES,
                   description="Singular directions of the compared "
                   "subspaces (principal angles) and of the rank-k reconstruction (mask).")
    rtol: float = Field(default=1e-3, gt=0.0, description="An entry counts as changed when "
                        "|W1 - W0| > rtol * max(|W0|, |W1|).")
    mask_fraction: float = Field(default=0.1, gt=0.0, le=1.0, description="Share of a matrix's "
                                 "entries in its principal mask.")


class ArtifactSpec(Spec):
    """Repeated patterns and length of the evaluation completions against row 0's
    (:mod:`clbench.metrics.artifacts`)."""

    enabled: bool = Field(default=True, description="Look for them after every stage.")
    n: int = Field(default=4, ge=1, le=MAX_SAMPLES, description="Words per pattern (n-gram).")
    top: int = Field(default=5, ge=1, le=MAX_SAMPLES,
                     description="Most frequent patterns reported per column.")
    growth: float = Field(default=3.0, gt=1.0, description="A pattern is amplified when its "
                          "rate per response grew by this factor since row 0 (and it occurs at "
                          "least twice per response).")
    repeat_limit: int = Field(default=4, ge=2, le=MAX_COUNT,
                              description="A response is repetitive when one "
                              "pattern occurs in it this many times.")


class ResponseDriftSpec(Spec):
    """How far the answers to fixed probe prompts moved from the base model's
    (:mod:`clbench.metrics.responses`)."""

    enabled: bool = Field(default=True, description="Measure it after every stage.")
    items_per_column: int = Field(default=4, ge=1, le=MAX_ITEMS,
                                  description="The probe prompts: the first "
                                  "this many evaluation items of each task column; the "
                                  "responses compared are the evaluation's own (greedy by "
                                  "default) in row 0 and in the stage's row.")


class DistanceSpec(Spec):
    """Distance between each stage's training prompts and each column's evaluation prompts
    (:mod:`clbench.metrics.distance`), recorded beside the column's change."""

    enabled: bool = Field(default=True, description="Measure it for every stage.")
    max_prompts: int = Field(default=256, ge=2, le=MAX_ITEMS,
                             description="Prompts embedded per side at "
                             "most (the first ones of the stage's training items and of the "
                             "column's evaluation items).")


class CollapseSpec(Spec):
    """When a row counts as collapsed, and what the run then does."""

    score_floor: float = Field(default=0.02, ge=0.0, le=1.0, description="Collapsed when every "
                               "stream column scores below this...")
    degenerate_share: float = Field(default=0.5, gt=0.0, le=1.0, description="... or when in "
                                    "every task column at least this share of the responses "
                                    "is repetitive or never ends.")
    stop: bool = Field(default=False, description="Stop a collapsed run after the row that "
                       "collapsed (status `collapsed`, the rows so far kept, the evidence in "
                       "results.json) instead of training the remaining stages.")


class DiagnosticsSpec(Spec):
    """What is measured besides the scores after every stage. None of it changes R (only
    `collapse.stop` can end a run early), so it is not part of the suite's content hash."""

    weight_drift: WeightDriftSpec = Field(default_factory=WeightDriftSpec,
                                          description="Parameter drift.")
    artifacts: ArtifactSpec = Field(default_factory=ArtifactSpec, description="Artifacts in "
                                    "the evaluation completions.")
    response_drift: ResponseDriftSpec = Field(default_factory=ResponseDriftSpec,
                                              description="Response drift on probe prompts.")
    distance: DistanceSpec = Field(default_factory=DistanceSpec, description="Training-to-"
                                   "evaluation prompt distance (transfer against distance).")
    collapse: CollapseSpec = Field(default_factory=CollapseSpec, description="Collapse.")


class MetricVariants(Spec):
    """Which published variant each metric uses; results record the choice."""

    bwt: Literal["t_minus_1", "t"] = Field(default="t_minus_1", description="Normaliser of BWT: "
                                           "1/(T-1) (GEM's paper) or 1/T (GEM's code).")
    fwt: Literal["base", "none"] = Field(default="base", description="FWT reference b[j]: the "
                                         "base model's score R[0][j], or none (b = 0).")
    forgetting: Literal["max", "diagonal"] = Field(default="max", description="Forgetting "
                                                   "reference: max over earlier stages "
                                                   "(Chaudhry 2018) or R[j][j] (Avalanche).")


class ProtocolSpec(Spec):
    """How a run is measured: metrics and variants, evaluation sizes, decoding, diagnostics."""

    metrics: list[MetricName] = Field(
        default=["acc", "la", "bwt", "fwt", "forgetting", "ood_delta", "general_delta"],
        description="Metrics computed from the accuracy matrix.")
    variants: MetricVariants = Field(default_factory=MetricVariants, description="Metric "
                                     "variants.")
    eval_size: int = Field(default=200, ge=1, le=MAX_ITEMS,
                           description="Evaluation items per column unless "
                           "a task sets `eval_size`.")
    nonfinite_loss: Literal["stop", "skip"] = Field(
        default="stop", description="A training step whose loss or gradient norm is NaN or "
        "infinite: `stop` ends the run there, marked failed with the stage and step named (its "
        "completed rows kept); `skip` leaves that step's update out (its schedule still "
        "advances) and counts it in the stage's `skipped_steps`.")
    split: Literal["eval", "validation"] = Field(
        default="eval", description="Which items score the task columns: `eval`, the tasks' "
        "evaluation split, or `validation`, items of their training split that the run never "
        "trains on (a stage's drawn after its `train_size` items; a probe's first ones): for "
        "choosing hyperparameters without touching evaluation items, e.g. `clbench sweep ... "
        "--set protocol.split=validation`.")
    decoding: DecodingSpec = Field(default_factory=DecodingSpec, description="Evaluation "
                                   "decoding.")
    diagnostics: DiagnosticsSpec = Field(default_factory=DiagnosticsSpec, description="Drift, "
                                         "artifact and collapse diagnostics after each stage.")
    bootstrap_samples: int = Field(default=1000, ge=0, le=MAX_ITEMS,
                                   description="Cell intervals: on when "
                                   "above 0 (0 disables them). A cell's interval is the Wilson "
                                   "score interval of its fraction correct, which keeps a width "
                                   "at 0 and 1 where a percentile bootstrap has none.")


    @field_validator("diagnostics", mode="before")
    @classmethod
    def _a_mapping(cls, diagnostics: Any) -> Any:
        if isinstance(diagnostics, list):  # the shape a guess at the field takes most often
            raise ValueError("diagnostics is a mapping of weight_drift, artifacts, "
                             "response_drift, distance and collapse settings, e.g. "
                             "{weight_drift: {k: 8}}")
        return diagnostics


class AdapterSpec(Spec):
    """A parameter-efficient adapter trained instead of the whole model (`clbench.adapters`)."""

    kind: Literal["none", "lora"] = Field(
        default="none", description="`none`: full fine-tuning; `lora`: LoRA layers (peft, "
        "`pip install clbench[peft]`) on `target_modules`, the rest of the model frozen.")
    r: int = Field(default=16, ge=1, description="LoRA rank.")
    alpha: float = Field(default=32.0, gt=0.0, description="LoRA alpha: the update is scaled "
                         "by alpha / r.")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA "
                           "path's input while training.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default="all-linear", description="The modules that get an adapter: names or name "
        "suffixes (`[q_proj, v_proj]`), or `all-linear` (every linear layer but the output "
        "head), as peft reads them.")
    scope: Literal["run", "stage"] = Field(
        default="run", description="`run`: one adapter trained across the stages; `stage`: "
        "each stage's adapter merged into the weights at the stage's end, a fresh one for the "
        "next (both are used in the continual-learning literature).")


#: The most prompt-lookup drafts a greedy decoding step scores (`ModelSpec.eval_drafts`).
MAX_DRAFTS = 16


class ModelSpec(Spec):
    """The model a run starts from."""

    name: str = Field(default="smollm2-135m", min_length=1,
                      description="`smollm2-135m` (the embedded "
                      "default), a `tiny-*` test model, a hub id or a local folder (a run "
                      "records it as an absolute path).")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        default="auto", description="`auto`: bf16 where the device supports it, else fp32. "
        "(float16 cannot be trained without loss scaling, which clbench does not do.)")
    mixed_precision: bool = Field(
        default=True, description="Keep fp32 master weights and autocast forwards to `dtype` "
        "(when it is 16-bit); false stores the weights in `dtype` itself (half the memory, but "
        "updates below its resolution are lost).")
    generation: Literal["loop", "static", "vllm"] = Field(
        default="loop", description="How rollouts and evaluation decode: `loop`, clbench's decode "
        "loop (ended rows leave the batch, a prompt's samples share its prefill: the fast path on "
        "a CPU); `static`, transformers' `generate` over a static KV cache, whose decoding step "
        "it compiles with CUDA graphs on a GPU (where a small model is bound by kernel launches). "
        "Greedy tokens match uncompiled; sampled draws differ. `vllm`: training rollouts from a "
        "vLLM engine colocated in each process (`pip install clbench[vllm]`, a CUDA GPU), "
        "corrected for its sampler by the method's `sampler_correction`; evaluation keeps the "
        "decode loop.")
    eval_weights: Literal["compute", "master"] = Field(
        default="compute", description="How greedy evaluation holds the weights under mixed "
        "precision: `compute`, in the compute dtype (bf16) for the call, computed without "
        "autocast (no activation casts; norms, residual stream and KV cache in bf16 too: "
        "1.1-1.2x faster on a CPU, scores within a near-tie of `master`'s, docs/performance.md); "
        "`master`, the fp32 weights under autocast, as training computes. Sampled decoding "
        "(rollouts, sampled evaluation) always uses the master weights.")
    eval_batching: Literal["auto", "suite"] = Field(
        default="auto", description="How evaluation batches a column's prompts: `auto`, on a "
        f"CPU, as many as fit {CPU_BATCH_TOKENS:,} tokens of prompt and answer (up to "
        f"{AUTO_BATCH_GROWTH}x "
        "`protocol.decoding.batch_size`: short prompts in large batches, long ones in small; "
        "measured fastest there, docs/performance.md), elsewhere the protocol's batch size; "
        "`suite`, always `protocol.decoding.batch_size`. In bf16 a batch of another composition "
        "rounds a near-tie differently; scores are unchanged within that.")
    eval_drafts: int = Field(
        default=0, ge=0, le=MAX_DRAFTS, description="Prompt-lookup decoding for greedy "
        "evaluation with the decode loop: up to this many tokens drafted from each item's own "
        "prompt and answer (where its last tokens occurred before) are scored with each new "
        "token in one forward, and kept while they are the greedy choice; the greedy tokens in "
        "exact arithmetic (bf16 rounds several positions at once differently: a near-tie may "
        "flip). 0: one token per forward.")
    adapter: AdapterSpec = Field(default_factory=AdapterSpec, description="Train a LoRA "
                                 "adapter instead of the whole model (`kind: lora`).")
    revision: str | None = Field(default=None, description="Hub revision (branch, tag, commit).")
    trust_remote_code: bool = Field(default=False, description="Allow code from the model "
                                    "repository to run; only set for repositories you trust.")

    @model_validator(mode="after")
    def _adapter_engine(self) -> ModelSpec:
        if self.adapter.kind != "none" and self.generation == "vllm":
            raise ValueError("model.adapter with model.generation: vllm is not supported: the "
                             "engine is handed the model's weights by their plain names; use "
                             "the `loop` or `static` engine with an adapter")
        return self

    @field_validator("dtype", mode="before")
    @classmethod
    def _no_float16(cls, value: Any) -> Any:
        # said here, so `validate` and `run --plan` refuse what a run would refuse
        if value in ("float16", "fp16", "half"):
            raise ValueError("float16 cannot be trained by clbench (fp16 needs loss scaling); "
                             "use bfloat16 where the device supports it, or float32")
        return value


class AddOnSpec(Spec):
    """A continual-learning add-on: a plugin from the `clbench.addons` group and its settings.
    In a suite's `addons:` list a bare name stands for the add-on at its defaults."""

    name: str = Field(min_length=1, description="Add-on name (see `clbench list addons`), "
                      "e.g. `replay`.")
    params: dict[str, Any] = Field(default_factory=dict, description="Add-on settings, "
                                   "validated against the add-on's config "
                                   "(`clbench addons show NAME`).")

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


def unique_addons(addons: list[AddOnSpec]) -> list[AddOnSpec]:
    """`addons` refused (ValueError) when one name is listed twice: each add-on acts once."""
    names = [a.name for a in addons]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"add-on {twice[0]!r} is listed twice; list each add-on once (its "
                         "settings in one entry)")
    return addons


def entry_name(method: str, addons: list[str] | tuple[str, ...] = ()) -> str:
    """What a run's method with its add-ons is called in folders, tables and the leaderboard:
    `sdpo`, `sdpo+ewc`, `grpo+replay+lwf` (the add-ons in the order they compose)."""
    return "+".join([method, *addons])


#: What a suite's content hash leaves out: prose, the per-method settings and the add-ons (a run
#: records those in force with its method), the diagnostics (they measure R, they do not change
#: it), the generation engine (the same greedy tokens; like the device, how a machine runs
#: the suite) and the folders a task's files were read from.
MEASURED_EXCLUDES: dict[str, Any] = {"description": True, "methods": True, "addons": True,
                                     "model": {"generation": True, "eval_weights": True,
                                               "eval_batching": True, "eval_drafts": True},
                                     "protocol": {"diagnostics": True},
                                     # where this machine keeps a task's files, not what they hold
                                     "stages": {"__all__": {"task": {"folder", "suite_folder"}}},
                                     "probes": {"__all__": {"task": {"folder", "suite_folder"}}}}


#: Fields added after suites were first hashed, at a default that measures what runs before them
#: measured: hashed only when a suite sets another value, so adding them orphans no result.
HASHED_WHEN_CHANGED: tuple[tuple[str, str, Any], ...] = (
    ("protocol", "nonfinite_loss", "stop"),
    ("model", "adapter", AdapterSpec().model_dump(mode="json")))


class SuiteSpec(Spec):
    """A continual-learning suite: an ordered stream of stages, held-out probes and a protocol."""

    schema_version: int = Field(default=SUITE_SCHEMA_VERSION, description="Version of this "
                                "suite format.")
    name: str = Field(pattern=NAME_PATTERN, description="Suite name.")
    version: str = Field(default="1", description="Version of the suite's content; bump it when "
                         "items or budgets change.")
    description: str = Field(default="", description="What the suite measures.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="Default model.")
    stages: list[StageSpec] = Field(min_length=1, description="The stream, in training order.")
    probes: list[ProbeSpec] = Field(default_factory=list, description="Held-out columns.")
    protocol: ProtocolSpec = Field(default_factory=ProtocolSpec, description="Measurement "
                                   "protocol.")
    methods: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Settings per method, applied when that method runs, "
        "e.g. `{sdpo: {lr: 3e-6}, grpo: {lr: 1e-6}}`: each block is validated against its "
        "method's config (`clbench methods show NAME`); `--set method.X` wins over it. A run "
        "records the settings in force in its method config; they are not part of the suite's "
        "hash.")
    addons: list[AddOnSpec] = Field(
        default_factory=list, description="Continual-learning add-ons applied to every run of "
        "the suite, in the order they compose, e.g. `[replay, {name: ewc, params: "
        "{strength: 100}}]` (`clbench list addons`); `--addon NAME` appends one and `--set "
        "addon.NAME.FIELD=V` sets a field. A run records them beside its method; they are not "
        "part of the suite's hash.")

    @field_validator("addons")
    @classmethod
    def _each_addon_once(cls, addons: list[AddOnSpec]) -> list[AddOnSpec]:
        return unique_addons(addons)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != SUITE_SCHEMA_VERSION:
            raise ValueError(f"this clbench reads suite schema_version {SUITE_SCHEMA_VERSION}")
        return v

    @field_validator("model")
    @classmethod
    def _no_model_code(cls, model: ModelSpec) -> ModelSpec:
        if model.trust_remote_code:
            raise ValueError("trust_remote_code: a suite cannot let a model run its own code; "
                             "pass --trust-remote-code to clbench run or sweep if you trust the "
                             "model's repository")
        return model

    @model_validator(mode="after")
    def _unique_columns(self) -> SuiteSpec:
        seen: set[str] = set()
        for col in [s.name for s in self.stages] + [p.name for p in self.probes]:
            if col in seen:
                raise ValueError(f"column name {col!r} is used twice; stage and probe names "
                                 "must be unique")
            seen.add(col)
        return self

    def content_hash(self) -> str:
        """A stable hash of the suite's content (canonical JSON, key order independent).

        The `description` is prose about the suite, not part of what is measured: rewording it
        does not make another suite (nor turn a run folder into another run's). Nor do the
        per-method `methods` settings (a run's method config records those in force) or the
        diagnostics (see :data:`MEASURED_EXCLUDES`)."""
        content = self.model_dump(mode="json", exclude=MEASURED_EXCLUDES)
        for task in _task_dumps(content):
            if task.get("definition") is None:  # a registered source: hashed as before
                task.pop("definition", None)
        for section, name, default in HASHED_WHEN_CHANGED:
            if content.get(section, {}).get(name) == default:
                del content[section][name]
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _task_dumps(content: dict[str, Any]) -> list[dict[str, Any]]:
    """The task dicts of a dumped suite, its stages' then its probes'."""
    return [s["task"] for s in content.get("stages", [])] + \
        [p["task"] for p in content.get("probes", []) if p.get("task")]


class MethodSpec(Spec):
    """A training method: a plugin from the `clbench.methods` group and its parameters."""

    name: str = Field(description="Method name (see `clbench list methods`).")
    params: dict[str, Any] = Field(default_factory=dict, description="Method parameters, "
                                   "validated against the method's config model.")


class RunSpec(Spec):
    """One run: a suite, a method and its add-ons, a model, a seed and where the results go."""

    suite: SuiteSpec
    method: MethodSpec
    addons: list[AddOnSpec] = Field(default_factory=list, description="The continual-learning "
                                    "add-ons on the method, in the order they compose.")

    @field_validator("addons")
    @classmethod
    def _each_addon_once(cls, addons: list[AddOnSpec]) -> list[AddOnSpec]:
        return unique_addons(addons)
    model: ModelSpec = Field(description="The model trained (the suite's default unless "
                             "overridden).")
    seed: int = Field(default=0, ge=-MAX_SEED, le=MAX_SEED,
                      description="Run seed: rollout sampling, data order, init.")
    out_dir: str = Field(min_length=1, description="Run directory: results, checkpoints, logs.")
    report_to: list[Tracker] = Field(default_factory=list, description="Experiment trackers "
                                     "the run also logs to (`--report-to`; files under the run "
                                     "folder's `trackers/`): steps, rows of R, metrics, config. "
                                     "Not part of what the run is: a resumed run may log to "
                                     "others.")
    device: str = Field(default="auto", pattern=DEVICE_PATTERN,
                        description="`auto`, `cpu`, `mps`, `cuda`, `cuda:N`.")
    reuse_base_row: bool = Field(default=True, description="Take row 0 (the base model's "
                                 "scores) from the cache when an earlier run computed the same "
                                 "row (same items, model, decoding, versions); see "
                                 "`clbench.run.baserow`.")
    checkpoint_minutes: float = Field(default=15.0, ge=0.0, description="Minutes between "
                                      "checkpoints in the middle of a stage (the student, the "
                                      "method's optimizer and teacher), so a stopped run loses "
                                      "at most that much training; 0: after every step (or "
                                      "batch, when a batch serves several steps). A stage is "
                                      "always checkpointed once trained.")
    joint: bool = Field(default=False, description="Train one stage, `joint`, on every stream "
                        "task at once (their training items mixed, the stages' steps summed) "
                        "instead of stage by stage, then evaluate every column: the joint "
                        "(multi-task) reference whose scores give other runs' intransigence "
                        "(`clbench report`).")
    allow_task_code: bool = Field(default=False, description="The lm-eval task folders of the "
                                  "suite's probes may run their Python (the CLI's "
                                  "--allow-task-code; never from a file).")
    suite_file: str | None = Field(default=None, description="The suite file the run was "
                                   "built from; relative paths in the suite (e.g. an lm-eval "
                                   "`include_path`) resolve against its folder.")

    def entry_name(self) -> str:
        """The method with its add-ons, as tables and the leaderboard name it (`sdpo+ewc`)."""
        return entry_name(self.method.name, [a.name for a in self.addons])

    def folder_name(self) -> str:
        """:func:`run_folder_name` of this run."""
        return run_folder_name(self.method.name, [a.name for a in self.addons], self.joint)

    def training_stages(self) -> list[StageSpec]:
        """What the run trains, in order: the suite's stages, or the joint stage of a joint run
        (:func:`joint_stage`)."""
        return [joint_stage(self.suite.stages)] if self.joint else list(self.suite.stages)


def run_folder_name(method: str, addons: list[str], joint: bool) -> str:
    """The folder a run goes to under its suite's (or a sweep's) root: its entry name, with
    `-joint` for a joint reference run."""
    return entry_name(method, addons) + ("-joint" if joint else "")


#: Budget fields that every stage must share for a joint run (its one stage has one budget).
JOINT_SHARED_BUDGET = ("prompts_per_step", "samples_per_prompt", "temperature", "top_p", "lr")


def joint_stage(stages: list[StageSpec]) -> StageSpec:
    """The one stage of a joint run: every stage's task (training items mixed), their steps
    summed, the longest `max_new_tokens` (each item's rollouts keep its own stage's cap:
    :class:`clbench.run.joint.MixedTasks`). The rest of the budget must agree across the stages
    (ValueError naming the field otherwise)."""
    budgets = [s.budget for s in stages]
    for name in JOINT_SHARED_BUDGET:
        values = [getattr(b, name) for b in budgets]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"{s.name}: {v}" for s, v in zip(stages, values))
            raise ValueError(f"a joint run trains every stage's task in one stage with one "
                             f"budget, so the stages must agree on `budget.{name}` ({shown})")
    budget = budgets[0].model_copy(update={
        "steps": sum(b.steps for b in budgets),
        "max_new_tokens": max(b.max_new_tokens for b in budgets)})
    task = TaskSpec(source="joint", params={"stages": [s.name for s in stages]},
                    train_size=sum(s.task.train_size for s in stages))
    return StageSpec(name="joint", task=task, budget=budget)
