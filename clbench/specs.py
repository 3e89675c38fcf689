"""Declarative specifications: the pydantic models of suites, stages, probes, protocols and runs.

Everything a user writes in a suite YAML (or passes with `--set`) is validated here. Models are
strict (`extra="forbid"`) and every field carries a description, which is what `clbench schema`
and the CLI help show. Plugin parameters (a task source's or a method's) are validated against
the plugin's own config model by :mod:`clbench.registry`, not here, so that this module never
imports a plugin.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from clbench.errors import UserError

SUITE_SCHEMA_VERSION = 1
_NAME = r"^[a-z0-9][a-z0-9_.\-]*$"


class Spec(BaseModel):
    """Base of every declarative model: unknown keys are errors, values are validated on set."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TaskSpec(Spec):
    """A task: a registered task source, its parameters, and how many items each split holds."""

    source: str = Field(description="Name of a task source registered in the `clbench.tasks` "
                        "entry-point group (see `clbench list tasks`), e.g. `math.arithmetic`.")
    params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the task "
                                   "source, validated against that source's own config model.")
    train_size: int = Field(default=512, ge=0, description="Number of training items drawn from "
                            "the source's train split.")
    eval_size: int | None = Field(default=None, ge=1, description="Number of evaluation items; "
                                  "defaults to the protocol's `eval_size`.")
    seed: int = Field(default=1234, description="Data seed: which items are drawn. Fixed per "
                      "suite so that every method and run seed sees the same items.")


class Budget(Spec):
    """What one stage may spend: optimizer steps, prompts per step, samples per prompt, tokens."""

    steps: int = Field(ge=1, description="Optimizer steps in the stage.")
    prompts_per_step: int = Field(default=4, ge=1, description="Distinct prompts per optimizer "
                                  "step (SFT uses this many reference solutions per step).")
    samples_per_prompt: int = Field(default=4, ge=1, description="Rollouts per prompt for "
                                    "on-policy methods (the GRPO group size).")
    max_new_tokens: int = Field(default=64, ge=1, description="Maximum tokens generated per "
                                "rollout.")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature of the "
                               "training rollouts.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold "
                         "of the training rollouts.")
    lr: float | None = Field(default=None, gt=0.0, description="Learning-rate override for this "
                             "stage; the method's own default applies when unset.")


class StageSpec(Spec):
    """One stage of the stream: a task to learn under a budget."""

    name: str = Field(pattern=_NAME, description="Column name of the stage's task in the "
                      "accuracy matrix, e.g. `math`.")
    task: TaskSpec = Field(description="The task learned in this stage.")
    budget: Budget = Field(description="Training budget of the stage.")


#: lm-eval metrics that cannot be a column of R (lower is better, not bounded by 1).
LOWER_IS_BETTER_LM_EVAL_METRICS = frozenset({
    "perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "ter"})


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
    num_fewshot: int | None = Field(default=None, ge=0, description="Few-shot examples.")
    limit: int | None = Field(default=None, ge=1, description="Evaluate at most this many items.")

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

    name: str = Field(pattern=_NAME, description="Column name of the probe.")
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
    max_new_tokens: int = Field(default=96, ge=1, description="Maximum tokens per answer.")
    batch_size: int = Field(default=16, ge=1, description="Prompts per generation batch.")


MetricName = Literal["acc", "op", "aia", "la", "bwt", "fwt", "forgetting", "ood_delta",
                     "general_delta", "intransigence"]
DiagnosticName = Literal["weight_drift", "response_drift", "artifacts"]


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
    eval_size: int = Field(default=200, ge=1, description="Evaluation items per column unless "
                           "a task sets `eval_size`.")
    decoding: DecodingSpec = Field(default_factory=DecodingSpec, description="Evaluation "
                                   "decoding.")
    diagnostics: list[DiagnosticName] = Field(default_factory=list, description="Diagnostics "
                                              "run after each stage.")
    bootstrap_samples: int = Field(default=1000, ge=0, description="Bootstrap resamples of "
                                   "items for each cell's interval (0 disables).")


class ModelSpec(Spec):
    """The model a run starts from."""

    name: str = Field(default="smollm2-135m", description="`smollm2-135m` (the embedded "
                      "default), a `tiny-*` test model, a hub id or a local path.")
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        default="auto", description="`auto`: bf16 where the device supports it, else fp32.")
    mixed_precision: bool = Field(
        default=True, description="Keep fp32 master weights and autocast forwards to `dtype` "
        "(when it is 16-bit); false stores the weights in `dtype` itself (half the memory, but "
        "updates below its resolution are lost).")
    revision: str | None = Field(default=None, description="Hub revision (branch, tag, commit).")
    trust_remote_code: bool = Field(default=False, description="Allow code from the model "
                                    "repository to run; only set for repositories you trust.")


#: Suite fields that do not change what a run measures (left out of its hash and identity).
MEASURED_EXCLUDES = {"description"}


class SuiteSpec(Spec):
    """A continual-learning suite: an ordered stream of stages, held-out probes and a protocol."""

    schema_version: int = Field(default=SUITE_SCHEMA_VERSION, description="Version of this "
                                "suite format.")
    name: str = Field(pattern=_NAME, description="Suite name.")
    version: str = Field(default="1", description="Version of the suite's content; bump it when "
                         "items or budgets change.")
    description: str = Field(default="", description="What the suite measures.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="Default model.")
    stages: list[StageSpec] = Field(min_length=1, description="The stream, in training order.")
    probes: list[ProbeSpec] = Field(default_factory=list, description="Held-out columns.")
    protocol: ProtocolSpec = Field(default_factory=ProtocolSpec, description="Measurement "
                                   "protocol.")

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != SUITE_SCHEMA_VERSION:
            raise ValueError(f"this clbench reads suite schema_version {SUITE_SCHEMA_VERSION}")
        return v

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
        does not make another suite (nor turn a run folder into another run's)."""
        canonical = json.dumps(self.model_dump(mode="json", exclude=MEASURED_EXCLUDES),
                               sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


class MethodSpec(Spec):
    """A training method: a plugin from the `clbench.methods` group and its parameters."""

    name: str = Field(description="Method name (see `clbench list methods`).")
    params: dict[str, Any] = Field(default_factory=dict, description="Method parameters, "
                                   "validated against the method's config model.")


class RunSpec(Spec):
    """One run: a suite, a method, a model, a seed and where the results go."""

    suite: SuiteSpec
    method: MethodSpec
    model: ModelSpec = Field(description="The model trained (the suite's default unless "
                             "overridden).")
    seed: int = Field(default=0, description="Run seed: rollout sampling, data order, init.")
    out_dir: str = Field(description="Run directory: results, checkpoints, logs.")
    device: str = Field(default="auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$",
                        description="`auto`, `cpu`, `mps`, `cuda`, `cuda:N`.")
    reuse_base_row: bool = Field(default=True, description="Take row 0 (the base model's "
                                 "scores) from the cache when an earlier run computed the same "
                                 "row (same items, model, decoding, versions); see "
                                 "`clbench.baserow`.")
    suite_file: str | None = Field(default=None, description="The suite file the run was "
                                   "built from; relative paths in the suite (e.g. an lm-eval "
                                   "`include_path`) resolve against its folder.")


# ---------------------------------------------------------------------------------------------
# Loading and overrides
# ---------------------------------------------------------------------------------------------

class SpecError(UserError, ValueError):
    """A user mistake in a spec file or override: one readable message, no traceback needed."""


def format_loc(loc: tuple[Any, ...]) -> str:
    """`('stages', 1, 'budget', 'steps')` -> `stages[1].budget.steps`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


_UNKNOWN_FIELD_HINT = "check the spelling; `clbench schema` lists the fields"


def describe_validation_error(err: Any, source: str, prefix: str = "",
                              unknown_field_hint: str = _UNKNOWN_FIELD_HINT) -> str:
    """Render a pydantic ValidationError as lines `source: prefix.field.path: what was expected`.

    `prefix` is where the validated object sits in a larger document (e.g. `method.params`);
    an empty `source` drops the leading `source: `.
    """
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown field ({unknown_field_hint})"
        elif e["type"] == "missing":
            msg = "required field is missing"
        path = format_loc(loc) if loc else ""
        if prefix:
            path = prefix + (path if path.startswith("[") or not path else "." + path)
        where = path or "<root>"
        lines.append(f"{source}: {where}: {msg}" if source else f"{where}: {msg}")
    return "\n".join(lines)


class _SafeLoader(__import__("yaml").SafeLoader):
    """YAML safe loader that also rejects duplicate keys (a silent overwrite hides typos)."""


def _construct_mapping(loader: Any, node: Any, deep: bool = False) -> dict:
    import yaml

    mapping: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_SafeLoader.add_constructor(
    __import__("yaml").resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str | Path) -> Any:
    """Read YAML with a safe loader; errors become :class:`SpecError` naming the file."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    try:
        return yaml.load(text, Loader=_SafeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None


def validate_model(model: type[BaseModel], data: Any, source: str) -> Any:
    """Validate `data` against `model`, turning errors into one :class:`SpecError`."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise SpecError(describe_validation_error(err, source)) from None


_PATH_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def parse_path(path: str) -> list[str | int]:
    """`stages[0].budget.steps` -> `['stages', 0, 'budget', 'steps']`.

    Names are separated by dots, indices written `[N]`; anything else (`a..b`, `a.`, `[x]`,
    `a[0]b`) is an error that points at the offending part.
    """
    parts: list[str | int] = []
    pos = 0
    path = path.strip()
    if not path:
        raise SpecError("override key is empty; expected e.g. stages[0].budget.steps=4")
    while pos < len(path):
        if parts and path[pos] == ".":
            pos += 1
            if pos == len(path) or path[pos] in ".[":
                raise SpecError(f"override key {path!r}: expected a field name after the dot")
        elif parts and path[pos] != "[":
            raise SpecError(f"override key {path!r}: cannot parse near {path[pos:]!r}")
        m = _PATH_TOKEN.match(path, pos)
        if not m:
            raise SpecError(f"override key {path!r}: cannot parse near {path[pos:]!r} "
                            "(indices are written [N] with N >= 0)")
        parts.append(m.group(1).strip() if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    if isinstance(parts[0], int):
        raise SpecError(f"override key {path!r}: must start with a field name")
    return parts


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """`key.path=value` -> (path parts, YAML-typed value). `=1e-5` becomes a float."""
    import yaml

    if "=" not in text:
        raise SpecError(f"override {text!r}: expected KEY=VALUE, e.g. stages[0].budget.steps=4")
    key, raw = text.split("=", 1)
    try:
        value = yaml.load(raw, Loader=_SafeLoader) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise SpecError(f"override {text!r}: value is not valid YAML: {exc}") from None
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value.strip()):
        value = float(value)  # YAML 1.1 reads `1e-5` as a string; users mean a number
    return parse_path(key), value


def apply_override(data: dict, path: list[str | int], value: Any) -> None:
    """Set `value` at `path` inside nested dicts/lists, creating mappings as needed.

    Indices must point at existing list items; a missing (or null) mapping on the way is
    created, so `model.revision=main` works whether or not the file has a `model:` section.
    """
    full = format_loc(tuple(path))
    node: Any = data
    for i, part in enumerate(path):
        parent = format_loc(tuple(path[:i])) if i else "the document"
        last = i == len(path) - 1
        if isinstance(part, int):
            if not isinstance(node, list):
                raise SpecError(f"override {full}: {parent} is not a list, it cannot be indexed "
                                f"with [{part}]")
            if part >= len(node):
                raise SpecError(f"override {full}: {format_loc(tuple(path[:i + 1]))} does not "
                                f"exist ({parent} has {len(node)} items, indices start at 0)")
            if last:
                node[part] = value
            else:
                node = node[part]
        else:
            if not isinstance(node, dict):
                raise SpecError(f"override {full}: {parent} is not a mapping, it has no field "
                                f"{part!r}")
            if last:
                node[part] = value
            else:
                if node.get(part) is None:  # an absent or null section (e.g. `lm_eval: null`)
                    node[part] = {}
                node = node[part]
