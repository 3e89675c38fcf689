"""Reading what earlier versions of clbench wrote: every migration, in one place.

Files outlive the code that wrote them: results files arrive from other people's runs, run
folders are resumed after an upgrade, suites are kept for years. Whatever reads such a file
passes it through a function here first, so that everything else (the method API, the schemas,
the reports) knows only the current format:

- :func:`suite`: a suite (a file, or one stored in a results file or a run's identity);
- :func:`method_config`: a method config a run recorded, with the built-ins' renamed settings
  and, for a field added since, the value that does what the run did (:data:`VALUES_BEFORE`);
- :func:`results`: a results document before it is validated;
- :func:`model`: a model spec a run recorded, each evaluation setting added since at the value
  that does what the run did (:data:`MODEL_VALUES_BEFORE`);
- :func:`identity_suite`: the suite of a run's identity that did not store it;
- :func:`progress_state`: a step checkpoint's training-loop progress.

A migration is added here, with what it reads and since when, whenever a change would make an
earlier file read differently; `tests/results/test_migrations.py` keeps each one.
"""

from __future__ import annotations

import copy
from typing import Any

#: The SDPO family's fields added after runs were recorded without them, whose default does not
#: do what those runs did: the value that does. A stored config without the field reads with
#: it, so resuming such a run under the new default is refused with the difference named, and
#: its results group with runs that set the old value.
_SDPO_BEFORE = {"warmup_steps": 0, "feedback": "rich", "feedback_with_demo": True}
VALUES_BEFORE: dict[str, dict[str, Any]] = {
    "sdpo": {**_SDPO_BEFORE, "supervision": "final_line"},
    "stable-sdpo": {**_SDPO_BEFORE, "supervision": "final_line"},
    "sdpo-cot": dict(_SDPO_BEFORE),  # its `supervision: all` was its default from the start
}


def method_config(name: str, config: Any) -> Any:
    """A method config recorded by a run, in the current form: settings the built-in SDPO family
    renamed (`use_feedback: true/false` is `feedback: rich/none`, `supervision: answer` is
    `final_line`), and each field added since at the value the run had (:data:`VALUES_BEFORE`).
    None (no settings recorded) reads as an empty config; anything but a mapping is returned as
    it is (validating it then says what is wrong)."""
    if config is None:
        config = {}
    if not isinstance(config, dict):
        return config
    out = dict(config)
    if name in VALUES_BEFORE:
        if "use_feedback" in out:
            used = out.pop("use_feedback")
            out["feedback"] = ("rich" if used else "none") if isinstance(used, bool) else used
        if out.get("supervision") == "answer":
            out["supervision"] = "final_line"
    for field, value in VALUES_BEFORE.get(name, {}).items():
        out.setdefault(field, value)
    return out


#: Model settings added after runs were recorded without them, whose default does not do what
#: those runs did: greedy evaluation in the fp32 master weights under autocast, in batches of
#: `protocol.decoding.batch_size` (docs/performance.md). A stored spec without them reads with
#: these, so resuming such a run is refused with the `--set`s that continue it as it began.
MODEL_VALUES_BEFORE: dict[str, Any] = {"eval_weights": "master", "eval_batching": "suite"}


def model(spec: Any) -> Any:
    """A model spec recorded by a run (its identity or results), each field of
    :data:`MODEL_VALUES_BEFORE` it lacks at the value the run had; anything but a mapping as it
    is."""
    if not isinstance(spec, dict):
        return spec
    return {**MODEL_VALUES_BEFORE, **spec}


def fields_before(name: str, config: Any) -> list[str]:
    """The fields :func:`method_config` fills in for a recorded `config` (settings the run
    predates and did not record)."""
    if config is not None and not isinstance(config, dict):
        return []
    return [f for f in VALUES_BEFORE.get(name, {}) if f not in (config or {})]


def suite(data: Any) -> Any:
    """A suite's fields in the current form: `protocol.diagnostics` was a list that had to be
    empty before diagnostics existed (read as the defaults)."""
    if not isinstance(data, dict):
        return data
    protocol = data.get("protocol")
    if isinstance(protocol, dict) and protocol.get("diagnostics") == []:
        data = copy.copy(data)
        data["protocol"] = {k: v for k, v in protocol.items() if k != "diagnostics"}
    return data


def identity_suite(identity: dict[str, Any], recorded: Any) -> Any:
    """The suite of a run's identity (`run.json`): identities written before the suite itself was
    stored hold only its hash; the suite is then the one its results file `recorded` (None when
    there is none)."""
    return identity.get("suite_spec", recorded)


def results(data: dict[str, Any]) -> dict[str, Any]:
    """A results document in the current form, before it is validated: its suite (:func:`suite`)
    and model spec (:func:`model`),
    without the `drift` field results had until 1.4 (always empty: parameter drift is in each
    stage's diagnostics). (A column without a task source version, as runs recorded before
    versions were, is read as version "1" where versions are compared:
    `clbench.report.comparison`.)"""
    data = {k: v for k, v in data.items() if k != "drift"}
    data["suite"] = suite(data.get("suite"))
    recorded = data.get("model")
    if isinstance(recorded, dict) and isinstance(recorded.get("spec"), dict):
        data["model"] = {**recorded, "spec": model(recorded["spec"])}
    if _minor(data.get("schema_version")) < 5:
        data = recorded_defaults(data)
    return data


def _minor(version: Any) -> int:
    """The minor part of a `MAJOR.MINOR` schema version (0 when unreadable)."""
    parts = version.split(".") if isinstance(version, str) else []
    return int(parts[1]) if len(parts) == 2 and parts[1].isdigit() else 0


_OPTIMIZER = {"weight_decay": 0.01, "max_grad_norm": 1.0, "warmup_steps": 0,
              "lr_schedule": "constant", "adam_betas": [0.9, 0.999], "adam_eps": 1e-08,
              "gradient_checkpointing": True}
_ON_POLICY = {**_OPTIMIZER, "inner_updates": 1, "micro_batch_size": None, "stop": [],
              "generation_batch_size": None, "sampler_correction": "sequence_mask",
              "sampler_clip_max": 3.0, "sampler_clip_min": None}
_SDPO = {**_ON_POLICY, "lr": 1e-05, "warmup_steps": 10, "divergence": "topk", "topk": 100,
         "alpha": 0.5, "is_clip": 2.0, "teacher": "frozen", "ema_rate": 0.05,
         "refresh_fraction": 0.4, "demo_threshold": 0.5, "feedback": "none",
         "feedback_with_demo": False, "use_reference_solution": False,
         "strip_demo_reasoning": True, "supervision": "response", "supervise_eos": True,
         "mask_ratio": 0.0, "max_reprompt_tokens": 10240}
#: The built-in plugins' configs at their defaults as of results 1.4, the last version that did
#: not record them: what a report compares an earlier run's settings with (a run records every
#: setting it had; a field added later is read at its default, or at :data:`VALUES_BEFORE`).
DEFAULTS_BEFORE_1_5: dict[str, dict[str, Any]] = {
    "sft": {**_OPTIMIZER, "lr": 1e-05, "micro_batch_size": None, "append_eos": True},
    "grpo": {**_ON_POLICY, "lr": 1e-06, "scale_rewards": False, "eps_low": 0.2,
             "eps_high": 0.28, "dual_clip": None, "beta": 0.0},
    "sdpo": _SDPO,
    "sdpo-cot": {**_SDPO, "strip_demo_reasoning": False, "supervision": "all"},
    "stable-sdpo": {**_SDPO, "teacher": "refresh"},
}
ADDON_DEFAULTS_BEFORE_1_5: dict[str, dict[str, Any]] = {
    "replay": {"fraction": 0.25, "buffer_per_stage": 32},
    "ewc": {"strength": 100.0, "fisher_items": 16, "decay": 1.0},
    "lwf": {"weight": 1.0, "temperature": 2.0, "topk": None},
    "merge": {"alpha": 0.5},
}


def recorded_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A results document of a version before 1.5 with its built-in method's and add-ons'
    defaults (:data:`DEFAULTS_BEFORE_1_5`), which later results record themselves."""
    method = data.get("method")
    if isinstance(method, dict) and method.get("defaults") is None \
            and method.get("name") in DEFAULTS_BEFORE_1_5:
        data = {**data, "method": {**method,
                                   "defaults": dict(DEFAULTS_BEFORE_1_5[method["name"]])}}
    addons = data.get("addons")
    if isinstance(addons, list):
        data = {**data, "addons": [
            {**a, "defaults": dict(ADDON_DEFAULTS_BEFORE_1_5[a["name"]])}
            if isinstance(a, dict) and a.get("defaults") is None
            and a.get("name") in ADDON_DEFAULTS_BEFORE_1_5 else a for a in addons]}
    return data


def progress_state(progress: dict[str, Any]) -> dict[str, Any]:
    """A step checkpoint's training-loop progress in the current form: the hooks' states under
    `hooks` (`method`, `addons`). Before add-ons existed the method's hooks' state was kept
    under `objective`."""
    if "hooks" not in progress and "objective" in progress:
        progress = dict(progress)
        progress["hooks"] = {"method": progress.pop("objective"), "addons": []}
    return progress
