"""Reading what earlier versions of clbench wrote: every migration, in one place.

Files outlive the code that wrote them: results files arrive from other people's runs, run
folders are resumed after an upgrade, suites are kept for years. Whatever reads such a file
passes it through a function here first, so that everything else (the method API, the schemas,
the reports) knows only the current format:

- :func:`suite`: a suite (a file, or one stored in a results file or a run's identity);
- :func:`method_config`: a method config a run recorded, with the built-ins' renamed settings
  and, for a field added since, the value that does what the run did (:data:`VALUES_BEFORE`);
- :func:`results`: a results document before it is validated;
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
    """A results document in the current form, before it is validated: its suite (:func:`suite`),
    without the `drift` field results had until 1.4 (always empty: parameter drift is in each
    stage's diagnostics). (A column without a task source version, as runs recorded before
    versions were, is read as version "1" where versions are compared:
    `clbench.report.comparison`.)"""
    data = {k: v for k, v in data.items() if k != "drift"}
    data["suite"] = suite(data.get("suite"))
    return data


def progress_state(progress: dict[str, Any]) -> dict[str, Any]:
    """A step checkpoint's training-loop progress in the current form: the hooks' states under
    `hooks` (`method`, `addons`). Before add-ons existed the method's hooks' state was kept
    under `objective`."""
    if "hooks" not in progress and "objective" in progress:
        progress = dict(progress)
        progress["hooks"] = {"method": progress.pop("objective"), "addons": []}
    return progress
