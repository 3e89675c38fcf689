"""A method plugin that breaks its contract is named, with its distribution, in one message (exit
2), and a method can be named by its location (`package.module:Class`) during development."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
from click.testing import CliRunner
from pydantic import Field

from clbench.cli import cli
from clbench.plugins import registry
from clbench.run.stages import check_stage_report
from clbench.train.api import Method, MethodConfig, StageReport


class Undocumented(MethodConfig):
    lr: float = 1e-5  # no description: no help text for it


class UndocumentedMethod(Method):
    name: ClassVar[str] = "undocumented"
    description: ClassVar[str] = "a config field without a description"
    Config = Undocumented

    def train_stage(self, ctx: Any) -> StageReport:
        raise AssertionError("never trained")


class Quiet(MethodConfig):
    note: str = Field(default="", description="Ignored.")


class ReturnsNothing(Method):
    name: ClassVar[str] = "returns-nothing"
    description: ClassVar[str] = "forgets to return its report"
    Config = Quiet

    def train_stage(self, ctx: Any) -> Any:
        return None


def test_a_config_field_without_a_description_is_refused_by_name() -> None:
    with registry.extra_plugins(methods={"undocumented": UndocumentedMethod}), \
            pytest.raises(registry.PluginError) as info:
        registry.load_method_class("undocumented")
    message = str(info.value)
    assert "'undocumented' from distribution test-plugins" in message
    assert "field lr of its Config has no description" in message


class Idle(Method):
    name: ClassVar[str] = "idle"
    description: ClassVar[str] = "says nothing of how it trains"
    Config = Quiet


class LoopWithoutOptimizer(Method):
    name: ClassVar[str] = "loop-without-optimizer"
    description: ClassVar[str] = "step hooks, but a config without the optimizer's fields"
    Config = Quiet

    def hooks(self, ctx: Any) -> Any:
        raise AssertionError("never trained")


@pytest.mark.parametrize("cls, problem", [
    (Idle, "implements neither hooks(ctx) nor train_stage(ctx)"),
    (LoopWithoutOptimizer, "gives hooks(ctx) to the shared training loop, but its Config does "
                           "not inherit OptimizerSettings"),
])
def test_a_method_that_cannot_train_is_refused_when_it_loads(cls: type, problem: str) -> None:
    with registry.extra_plugins(methods={cls.name: cls}), \
            pytest.raises(registry.PluginError) as info:
        registry.load_method_class(cls.name)
    assert f"method {cls.name!r} from distribution test-plugins" in str(info.value)
    assert problem in str(info.value)


def test_a_stage_report_of_the_wrong_type_or_without_steps_names_the_plugin() -> None:
    with registry.extra_plugins(methods={"returns-nothing": ReturnsNothing}):
        with pytest.raises(registry.PluginError) as info:
            check_stage_report("returns-nothing", 1, 4, None)
        assert "'returns-nothing'" in str(info.value)
        assert "from distribution test-plugins" in str(info.value)
        assert "train_stage returned NoneType, not a clbench.train.api.StageReport" \
            in str(info.value)
        with pytest.raises(registry.PluginError, match="has 4 steps to take, but its "
                           "StageReport records none"):
            check_stage_report("returns-nothing", 1, 4, StageReport())
        check_stage_report("returns-nothing", 1, 0, StageReport())  # nothing to take: fine


@pytest.mark.e2e
def test_a_run_of_a_method_that_breaks_the_contract_stops_with_one_message(tmp_path: Path
                                                                          ) -> None:
    with registry.extra_plugins(methods={"returns-nothing": ReturnsNothing}):
        result = CliRunner().invoke(cli, ["run", "--suite", "smoke", "--method",
                                          "returns-nothing", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "returns-nothing" in result.output and "not a clbench.train.api.StageReport" \
        in result.output
    assert "Traceback" not in result.output


def test_a_method_named_by_its_location_loads_with_its_distribution() -> None:
    for name in ("clbench_methods.sft:SFT", "no_such_package.mod:Method",
                 "clbench.train.api:StageReport"):
        registry.allow_location(name)  # as the command line does for --method
    cls = registry.load_method_class("clbench_methods.sft:SFT")
    assert cls.name == "sft"
    origin = registry.plugin_origin(registry.METHODS_GROUP, "clbench_methods.sft:SFT")
    assert origin.distribution == "clbench" and origin.target == "clbench_methods.sft:SFT"
    with pytest.raises(registry.PluginError, match="failed to import.*No module named "
                       "'no_such_package'"):
        registry.load_method_class("no_such_package.mod:Method")
    with pytest.raises(registry.PluginError, match="is not a subclass of "
                       "clbench.train.api.Method"):
        registry.load_method_class("clbench.train.api:StageReport")


def test_a_method_records_the_commit_of_the_checkout_holding_its_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in's code is in clbench's own checkout; a method in another git checkout records
    that checkout's commit, `+dirty` once its files are edited."""
    import subprocess

    from clbench.results import git_revision

    sft = registry.plugin_origin(registry.METHODS_GROUP, "sft")
    assert sft.source_revision == git_revision()
    repo = tmp_path / "elsewhere"
    (repo / "other_methods").mkdir(parents=True)
    (repo / "other_methods" / "__init__.py").write_text("")
    module = repo / "other_methods" / "mine.py"
    module.write_text("from clbench_methods.sft import SFT\n\n\nclass Mine(SFT):\n    pass\n")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c",
                               "user.email=t@example.org", *args], check=True,
                              capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "a method")
    monkeypatch.syspath_prepend(str(repo))
    registry.allow_location("other_methods.mine:Mine")
    mine = registry.plugin_origin(registry.METHODS_GROUP, "other_methods.mine:Mine")
    assert mine.source_revision == git("rev-parse", "HEAD") != sft.source_revision
    module.write_text(module.read_text() + "# edited\n")
    assert registry.plugin_origin(registry.METHODS_GROUP, "other_methods.mine:Mine"
                                  ).source_revision == git("rev-parse", "HEAD") + "+dirty"


def test_a_built_in_method_from_another_checkout_than_clbench_is_warned_about(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from clbench.run import setup

    monkeypatch.setattr(setup, "git_revision", lambda: "a" * 40)
    with caplog.at_level("WARNING", logger=setup.log.name):
        setup.warn_if_another_checkout("sft", registry.Origin(
            "clbench", "0.1.0", "clbench_methods.sft:SFT", "b" * 40 + "+dirty"))
        (record,) = caplog.records
        assert record.getMessage().startswith(
            f"the method 'sft' ships with clbench but its code is from a checkout at {'b' * 40}"
            f"+dirty, clbench's from one at {'a' * 40}")
        caplog.clear()
        setup.warn_if_another_checkout("sft", registry.Origin(  # one checkout
            "clbench", "0.1.0", "clbench_methods.sft:SFT", "a" * 40))
        setup.warn_if_another_checkout("mine", registry.Origin(  # not a built-in
            "my-methods", "1.0", "my_methods:Mine", "b" * 40))
        assert caplog.records == []


def test_the_public_api_has_every_name_it_lists_and_the_builtins_to_subclass() -> None:
    """What `docs/plugins.md` builds on resolves from `clbench.api` alone, the built-in methods
    and their configs included (they are imported on first use)."""
    import clbench.api as api

    for name in api.__all__:
        assert getattr(api, name) is not None, name
    from clbench.api import GRPOConfig, SDPOConfig, SFTConfig, TrainingHooks

    assert issubclass(SFTConfig, api.OptimizerSettings)
    assert issubclass(GRPOConfig, api.OnPolicySettings) and issubclass(SDPOConfig,
                                                                       api.OnPolicySettings)
    assert issubclass(api.StepHooks, TrainingHooks) and issubclass(api.AddOn, TrainingHooks)
    assert issubclass(api.Objective, api.StepHooks)  # one hook protocol for all three
    with pytest.raises(AttributeError, match="has no attribute 'SFTConfg'"):
        api.SFTConfg  # noqa: B018
