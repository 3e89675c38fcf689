"""`--set KEY=VALUE` overrides: parsing, routing (method / model / suite) and validation."""

from __future__ import annotations

import re

import pytest
from fakes import run_spec

from clbench.spec.reading import SpecError, apply_override, parse_override, parse_path
from clbench.spec.suites import load_suite, split_overrides


@pytest.mark.parametrize(("text", "path", "value"), [
    ("method.lr=1e-5", ["method", "lr"], 1e-5),
    ("stages[0].budget.steps=4", ["stages", 0, "budget", "steps"], 4),
    ("stages[12].name=x", ["stages", 12, "name"], "x"),
    ("protocol.metrics=[acc, bwt]", ["protocol", "metrics"], ["acc", "bwt"]),
    ("model.revision=", ["model", "revision"], ""),
    ("flag=true", ["flag"], True),
    ("ratio=-2.5E+3", ["ratio"], -2500.0),
    ("text=a=b", ["text"], "a=b"),
    ("operators=*", ["operators"], "*"),  # YAML reads `*` as an alias: taken as written
    ("operators=+*", ["operators"], "+*"),
    ("operators=%", ["operators"], "%"),
])
def test_parse_override(text: str, path: list, value: object) -> None:
    assert parse_override(text) == (path, value)
    assert type(parse_override(text)[1]) is type(value)


@pytest.mark.parametrize(("text", "message"), [
    ("stages[0].budget.steps", "expected KEY=VALUE"),
    ("=4", "override key is empty"),
    ("a..b=1", "expected a field name after the dot"),
    ("a.=1", "expected a field name after the dot"),
    ("stages[x].name=1", "cannot parse near '[x].name'"),
    ("stages[-1].name=1", "cannot parse near '[-1].name'"),
    ("[0].name=1", "must start with a field name"),
    ("stages[0]name=1", "cannot parse near 'name'"),
    ("name=!!python/object/apply:os.system [ls]", "value is not valid YAML"),
    ("protocol.metrics=[acc, bwt", "value is not valid YAML (a string may be quoted: "
                                   "--set 'protocol.metrics=\"...\"')"),
])
def test_bad_override_syntax(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_override(text)


def test_parse_path_reads_indices() -> None:
    assert parse_path("a[1][2].b") == ["a", 1, 2, "b"]


def test_apply_override_reports_bad_indices_and_shapes() -> None:
    data = {"name": "t", "stages": [{"budget": {"steps": 3}}], "probes": [{"lm_eval": None}]}
    with pytest.raises(SpecError) as info:
        apply_override(data, ["stages", 2, "budget", "steps"], 4)
    assert str(info.value) == ("override stages[2].budget.steps: stages[2] does not exist "
                               "(stages has 1 items, indices start at 0)")
    with pytest.raises(SpecError, match=r"name is not a mapping, it has no field 'x'"):
        apply_override(data, ["name", "x"], 1)
    with pytest.raises(SpecError, match=r"stages is not a mapping, it has no field 'budget'"):
        apply_override(data, ["stages", "budget"], 1)
    apply_override(data, ["probes", 0, "lm_eval", "task"], "mmlu")  # null section is created
    assert data["probes"][0]["lm_eval"] == {"task": "mmlu"}
    apply_override(data, ["stages", 0, "budget", "steps"], 9)
    assert data["stages"][0]["budget"] == {"steps": 9}


def test_suite_overrides_are_validated_like_the_file(write_suite) -> None:
    path = write_suite()
    suite = load_suite(path, ["stages[0].budget.steps=4", "stages[1].task.params.level=3"])
    assert suite.stages[0].budget.steps == 4
    assert suite.stages[1].task.params == {"level": 3}
    assert load_suite(path).stages[0].budget.steps == 2  # the file itself is untouched
    with pytest.raises(SpecError) as info:
        load_suite(path, ["stages[0].budget.steps=0"])
    assert str(info.value) == (f"{path} (with --set stages[0].budget.steps=0): "
                               "stages[0].budget.steps: Input should be greater than or equal "
                               "to 1")
    with pytest.raises(SpecError, match=r"stages\[0\]\.budget\.stpes: unknown field"):
        load_suite(path, ["stages[0].budget.stpes=4"])
    with pytest.raises(SpecError, match=r"stages\[5\] does not exist \(stages has 2 items"):
        load_suite(path, ["stages[5].budget.steps=4"])


def test_split_overrides_routes_by_prefix() -> None:
    assert split_overrides(["method.lr=1e-5", "model.dtype=float32", "stages[0].budget.steps=4",
                            "methods_note=x", "addon.ewc.strength=5", "addon.ewc.decay=0.5",
                            "addon.replay.fraction=0.5"]) == (
        ["lr=1e-5"], ["dtype=float32"],
        {"ewc": ["strength=5", "decay=0.5"], "replay": ["fraction=0.5"]},
        ["stages[0].budget.steps=4", "methods_note=x"])
    with pytest.raises(SpecError, match=re.escape("override 'addon.ewc=1': name the add-on and "
                                                  "the field, e.g. addon.replay.fraction=0.5")):
        split_overrides(["addon.ewc=1"])
    with pytest.raises(SpecError, match=re.escape("override 'method.lr': expected KEY=VALUE, "
                                                  "e.g. method.lr=1e-5")):
        split_overrides(["method.lr"])  # named as typed, with its prefix
    with pytest.raises(SpecError, match=re.escape("override 'model.dtype': expected KEY=VALUE")):
        split_overrides(["model.dtype"])
    with pytest.raises(SpecError, match="set one field at a time"):
        split_overrides(["method={lr: 1}"])


def test_build_run_spec_routes_and_validates(write_suite, fake_plugins) -> None:
    path = write_suite()
    run = run_spec(path, "fake-method", seed=3, out_dir=None,
                         overrides=["method.lr=2e-5", "model.dtype=float32",
                                    "stages[0].budget.steps=4"], model="tiny-llama")
    assert run.method.name == "fake-method"
    assert run.method.params == {"lr": 2e-5, "beta": 0.0}  # its config in force, whole
    assert run.model.name == "tiny-llama" and run.model.dtype == "float32"
    assert run.suite.model.name == "smollm2-135m"  # the suite's default is not rewritten
    assert run.suite.stages[0].budget.steps == 4
    assert run.seed == 3
    assert run.out_dir == "runs/tiny/fake-method/s3"
    assert run.suite_file == str(path)


@pytest.mark.parametrize(("override", "message"), [
    ("method.lr=-1", "method.lr: Input should be greater than 0"),
    ("method.lr=fast", "method.lr: Input should be a valid number"),
    ("method.gamma=1", "method.gamma: unknown field"),
    ("model.dtype=int8", "model.dtype: Input should be 'auto', 'bfloat16' or 'float32'"),
    ("model.dtype=float16", "model.dtype: float16 cannot be trained by clbench (fp16 needs "
                            "loss scaling)"),
    ("stages[0].task.params.level=7", "stages[0].task.params.level: Input should be less than "
                                      "or equal to 3"),
])
def test_build_run_spec_errors_carry_the_path(write_suite, fake_plugins, override: str,
                                              message: str) -> None:
    with pytest.raises(SpecError) as info:
        run_spec(write_suite(), "fake-method", overrides=[override])
    assert message in str(info.value)


def test_build_run_spec_unknown_method(write_suite, fake_plugins) -> None:
    from clbench.plugins.registry import PluginError

    with pytest.raises(PluginError, match="unknown method 'fake-metod'. Did you mean "
                                          "'fake-method'?"):
        run_spec(write_suite(), "fake-metod")


def test_build_run_spec_checks_the_device(write_suite, fake_plugins) -> None:
    assert run_spec(write_suite(), "fake-method", device="cuda:1").device == "cuda:1"
    with pytest.raises(SpecError, match=r"run: device: 'gpu' is not allowed here: expected "
                                         r"auto, cpu, mps, cuda or cuda:N"):
        run_spec(write_suite(), "fake-method", device="gpu")


def test_build_run_spec_refuses_a_model_name_that_names_no_model(write_suite,
                                                                 fake_plugins) -> None:
    """Found with the rest of the spec (so `run --plan` and a sweep see it), not when the run,
    its folder claimed, loads the model; a hub id passes (it is loaded, not checked, offline)."""
    with pytest.raises(SpecError, match=r"^--model: unknown tiny model 'tiny-foo'; known: "):
        run_spec(write_suite(), "fake-method", model="tiny-foo")
    with pytest.raises(SpecError, match=r"^model.name: model 'nohub' is neither 'smollm2-135m'"):
        run_spec(write_suite(), "fake-method", overrides=["model.name=nohub"])
    assert run_spec(write_suite(), "fake-method",
                          model="Qwen/Qwen3-4B").model.name == "Qwen/Qwen3-4B"
