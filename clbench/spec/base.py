"""The base of every declarative model (suites, runs, task files) and the names they share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

#: Suite, stage, probe and task names: they name folders and files of a run, so no path
#: separator and no leading dot.
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.\-]*$"


class Spec(BaseModel):
    """Base of every declarative model: unknown keys are errors, values are validated on set."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
