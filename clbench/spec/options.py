"""What a user asks of one run on the command line, as one validated model.

`clbench run` turns its options into :class:`RunOptions`; `clbench sweep` turns the ones its runs
share into :class:`RunSettings` and makes one :class:`RunOptions` per method and seed; the
sweep's child processes get them back as a command line (:meth:`RunOptions.command_line`). A
run's whole spec is then built from them, with every plugin's parameters checked, by
:func:`clbench.plugins.runspec.build_run_spec`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from clbench.spec.schema import Spec


class RunSettings(Spec):
    """The options every run of a sweep shares."""

    sets: list[str] = Field(default_factory=list, description="`--set KEY=VALUE` overrides: "
                            "`method.X`, `addon.NAME.X`, `model.X` or any suite field.")
    addons: list[str] = Field(default_factory=list, description="`--addon NAME`: add-ons "
                              "appended to the suite's `addons:` list, in this order.")
    model: str | None = Field(default=None, min_length=1, description="`--model`: the model "
                              "to train instead of the suite's.")
    device: str = Field(default="auto", description="`--device` (checked with the run's spec).")
    reuse_base_row: bool = Field(default=True, description="False with `--no-base-cache`.")
    checkpoint_minutes: float = Field(default=15.0, description="`--checkpoint-minutes` "
                                      "(checked with the run's spec).")
    joint: bool = Field(default=False, description="`--joint`: the joint reference run.")
    trust_remote_code: bool = Field(default=False, description="`--trust-remote-code`.")
    allow_task_code: bool = Field(default=False, description="`--allow-task-code`: lm-eval "
                                  "task folders of the suite's probes may run their Python.")
    report_to: list[str] = Field(default_factory=list, description="`--report-to`: experiment "
                                 "trackers (tensorboard, wandb, mlflow).")


class RunOptions(RunSettings):
    """One run: a suite, a method, a seed, where it goes, and the shared settings."""

    suite: str = Field(min_length=1, description="`--suite`: a suite name or file.")
    method: str = Field(min_length=1, description="`--method`: a method plugin.")
    seed: int = Field(default=0, description="`--seed` (checked with the run's spec).")
    out_dir: str | None = Field(default=None, min_length=1, description="`--out`; the "
                                "default folder under runs/ when unset.")

    @classmethod
    def of(cls, settings: RunSettings, **fields: Any) -> RunOptions:
        """The options of one run that shares `settings`."""
        return cls(**settings.model_dump(), **fields)

    def command_line(self) -> list[str]:
        """The `clbench run` arguments that ask for this very run."""
        args = ["--suite", self.suite, "--method", self.method, "--seed", str(self.seed),
                "--device", self.device, "--checkpoint-minutes", repr(self.checkpoint_minutes)]
        if self.out_dir is not None:
            args += ["--out", self.out_dir]
        for name in self.addons:
            args += ["--addon", name]
        for text in self.sets:
            args += ["--set", text]
        for tracker in self.report_to:
            args += ["--report-to", tracker]
        if self.model is not None:
            args += ["--model", self.model]
        for flag, on in (("--no-base-cache", not self.reuse_base_row), ("--joint", self.joint),
                         ("--trust-remote-code", self.trust_remote_code),
                         ("--allow-task-code", self.allow_task_code)):
            if on:
                args.append(flag)
        return args
