"""Plugin registry with fake entry points: listing, clashes, unknown names, broken imports."""

from __future__ import annotations

import importlib.metadata

import pytest
from conftest import FakeAddition, FakeMethod

from clbench.errors import UserError
from clbench.plugins import registry
from clbench.plugins.registry import PluginError, StaticEntryPoint
from clbench.spec.reading import SpecError
from clbench.spec.schema import MethodSpec, TaskSpec

M, T = registry.METHODS_GROUP, registry.TASKS_GROUP


def entries(*eps: StaticEntryPoint):
    return lambda group: [ep for ep in eps if ep.group == group]


def test_list_reads_descriptions_and_distributions(fake_plugins) -> None:
    (method,) = registry.list_plugins(M)
    assert (method.name, method.distribution, method.description) == (
        "fake-method", "fake-dist", "A method that trains nothing (test plugin).")
    assert method.value == "fakes:FakeMethod"
    (task,) = registry.list_plugins(T)
    assert task.details == {"domain": "math", "origin": "offline", "license": "Apache-2.0"}
    assert task.load_error is None


def test_load_and_build(fake_plugins) -> None:
    assert registry.load_method_class("fake-method") is FakeMethod
    method = registry.build_method(MethodSpec(name="fake-method", params={"lr": 3e-4}))
    assert isinstance(method, FakeMethod) and method.config.lr == 3e-4
    task = registry.build_task(TaskSpec(source="fake.addition", params={"level": 2}))
    assert isinstance(task, FakeAddition)
    assert task.examples("eval", 0, 1)[0].answer == 10 + 10010


def test_param_errors_carry_the_full_path(fake_plugins) -> None:
    with pytest.raises(SpecError) as info:
        registry.build_method(MethodSpec(name="fake-method", params={"lr": 0}))
    assert str(info.value) == "method.params.lr: Input should be greater than 0"
    with pytest.raises(SpecError) as info:
        registry.build_task(TaskSpec(source="fake.addition", params={"level": 0, "x": 1}),
                            where="stages[2].task.params")
    assert str(info.value).splitlines() == [
        "stages[2].task.params.level: Input should be greater than or equal to 1",
        "stages[2].task.params.x: unknown field (check the spelling; `clbench tasks show "
        "fake.addition` lists them)"]


def test_unknown_name_lists_known_and_suggests() -> None:
    eps = [StaticEntryPoint(n, M, FakeMethod) for n in ("grpo", "sdpo", "sdpo-cot", "sft")]
    with registry.using_entry_points(entries(*eps)):
        with pytest.raises(PluginError) as info:
            registry.load_method_class("spdo")
    assert str(info.value) == ("unknown method 'spdo'. Did you mean 'sdpo'? Known "
                               "methods: grpo, sdpo, sdpo-cot, sft (see `clbench list methods`).")
    assert isinstance(info.value, UserError)
    with registry.using_entry_points(entries()):
        with pytest.raises(PluginError, match="Known task sources: none are installed"):
            registry.load_task_class("math.arithmetic")


def test_same_name_from_two_distributions_names_both() -> None:
    eps = entries(StaticEntryPoint("sdpo", M, FakeMethod, "clbench"),
                  StaticEntryPoint("sdpo", M, FakeAddition, "sdpo-fork"))
    with registry.using_entry_points(eps):
        with pytest.raises(PluginError) as info:
            registry.load_method_class("sdpo")
        listed = registry.list_plugins(M)
    assert str(info.value) == (
        "method 'sdpo' is registered by more than one distribution: clbench (fakes:FakeMethod)"
        " and sdpo-fork (fakes:FakeAddition). Uninstall one of them.")
    assert [(p.name, p.distribution) for p in listed] == [("sdpo", "clbench"),
                                                           ("sdpo", "sdpo-fork")]
    assert all(p.description.startswith("(conflict: ") for p in listed)


def test_one_distribution_seen_twice_is_not_a_clash() -> None:
    ep = StaticEntryPoint("sdpo", M, FakeMethod, "clbench")
    with registry.using_entry_points(entries(ep, ep)):
        assert registry.load_method_class("sdpo") is FakeMethod


def test_broken_import_fails_only_when_used() -> None:
    broken = StaticEntryPoint("broken", M, None, "broken-plugin",
                              error=ModuleNotFoundError("No module named 'torchx'"),
                              target_path="broken_plugin.method:Broken")
    good = StaticEntryPoint("good", M, FakeMethod, "good-plugin")
    with registry.using_entry_points(entries(broken, good)):
        assert registry.load_method_class("good") is FakeMethod  # unaffected by its neighbour
        listed = {p.name: p for p in registry.list_plugins(M)}
        with pytest.raises(PluginError) as info:
            registry.load_method_class("broken")
    assert listed["broken"].description == ("(import failed: ModuleNotFoundError: No module "
                                            "named 'torchx')")
    assert listed["good"].load_error is None
    assert str(info.value) == ("method 'broken' from distribution broken-plugin failed to import "
                               "(broken_plugin.method:Broken): ModuleNotFoundError: No module "
                               "named 'torchx'")


def test_entry_point_of_a_moved_module_suggests_reinstalling() -> None:
    moved = ModuleNotFoundError("No module named 'old_pkg.tasks'", name="old_pkg.tasks")
    stale = StaticEntryPoint("stale", M, None, "old-pkg", error=moved,
                             target_path="old_pkg.tasks:Thing")
    with registry.using_entry_points(entries(stale)):
        with pytest.raises(PluginError, match=r"if old-pkg is installed in editable mode, "
                                              r"reinstall it \(pip install -e \.\.\.\)"):
            registry.load_method_class("stale")


def test_entry_point_must_name_the_right_kind_of_class() -> None:
    wrong = StaticEntryPoint("adder", M, FakeAddition, "confused-plugin")
    with registry.using_entry_points(entries(wrong)):
        with pytest.raises(PluginError, match=r"method 'adder' from distribution confused-plugin:"
                                              r" fakes:FakeAddition is not a subclass of "
                                              r"clbench\.train\.api\.Method"):
            registry.load_method_class("adder")


def test_loaded_classes_are_cached_until_cleared() -> None:
    calls: list[str] = []

    def source(group: str):
        calls.append(group)
        return [StaticEntryPoint("m", M, FakeMethod)] if group == M else []

    with registry.using_entry_points(source):
        registry.load_method_class("m")
        registry.load_method_class("m")
        registry.list_plugins(M)
        assert calls == [M]
        registry.clear_cache()
        registry.load_method_class("m")
        assert calls == [M, M]


def test_extra_plugins_sit_on_top_of_the_installed_ones() -> None:
    installed = {ep.name for ep in importlib.metadata.entry_points(group=M)}
    with registry.extra_plugins(methods={"extra-method": FakeMethod}):
        names = set(registry.plugin_names(M))
        assert registry.load_method_class("extra-method") is FakeMethod
    assert names == installed | {"extra-method"}
    assert "extra-method" not in registry.plugin_names(M)  # gone after the block


def test_real_entry_points_of_the_installed_distribution() -> None:
    # Our own built-ins are declared through the same group a third party would use.
    mine = {ep.name: ep for ep in importlib.metadata.entry_points(group=M)
            if ep.dist is not None and ep.dist.name == "clbench"}
    assert {"sft", "grpo", "sdpo", "sdpo-cot", "stable-sdpo"} <= set(mine)
    assert all(ep.value.startswith("clbench_methods.") for ep in mine.values())
