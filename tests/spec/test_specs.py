"""Suite validation: valid files load, every kind of mistake names the file and the field path."""

from __future__ import annotations

from pathlib import Path

import pytest

from clbench.errors import UserError
from clbench.plugins.runspec import validate_suite_plugins
from clbench.spec.reading import SpecError
from clbench.spec.schema import SuiteSpec
from clbench.spec.suites import SuiteNotFoundError, list_suites, load_suite, resolve_suite


def error_of(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(SpecError) as info:
        load_suite(path, overrides)
    return str(info.value)


def test_valid_suite_loads_with_defaults(write_suite, fake_plugins) -> None:
    path = write_suite()
    suite = load_suite(path)
    assert [s.name for s in suite.stages] == ["add1", "add2"]
    assert suite.stages[0].task.params == {"level": 1}
    assert suite.stages[0].task.train_size == 8
    assert suite.stages[1].task.train_size == 512  # default
    assert suite.stages[1].budget.samples_per_prompt == 4  # default
    assert suite.probes[0].kind == "ood"
    assert suite.protocol.eval_size == 16
    assert suite.protocol.variants.bwt == "t_minus_1"
    validate_suite_plugins(suite, path)  # every fake source exists and its params validate


def test_spec_error_is_a_user_error() -> None:
    assert issubclass(SpecError, UserError)
    assert issubclass(SpecError, ValueError)  # kept for callers that catch ValueError


def test_wrong_type_names_file_and_path(write_suite) -> None:
    path = write_suite("""\
        name: tiny
        stages:
          - name: a
            task: {source: fake.addition}
            budget: {steps: many}
        """)
    msg = error_of(path)
    assert msg == f"{path}: stages[0].budget.steps (line 5, column 21): Input should be a " \
                  "valid integer, unable to parse string as an integer"


def test_unknown_key_is_refused(write_suite) -> None:
    path = write_suite("""\
        name: tiny
        stages:
          - name: a
            task: {source: fake.addition}
            budget: {steps: 1, step_size: 3}
        """)
    assert error_of(path) == (f"{path}: stages[0].budget.step_size (line 5, column 35): unknown "
                              "field (check the spelling; `clbench schema` lists the fields)")


def test_missing_field_is_named(write_suite) -> None:
    path = write_suite("""\
        name: tiny
        stages:
          - name: a
            task: {source: fake.addition}
          - name: b
            task: {source: fake.addition}
            budget: {steps: 1}
        """)
    # a missing field is placed at the mapping that lacks it
    assert error_of(path) == (f"{path}: stages[0].budget (line 3, column 5): required field is "
                              "missing")


def test_several_mistakes_are_reported_together(write_suite) -> None:
    path = write_suite("""\
        name: Tiny Suite
        stages:
          - name: a
            task: {source: fake.addition, train_size: -1}
            budget: {steps: 1, top_p: 1.5}
        """)
    lines = error_of(path).splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "name (line 1, column 7)", "stages[0].task.train_size (line 4, column 47)",
        "stages[0].budget.top_p (line 5, column 31)"]


def test_a_stage_without_training_items_is_refused_but_a_probe_needs_none(write_suite) -> None:
    """Found when the suite is read, not after row 0 when the stage would start training."""
    path = write_suite("""\
        name: tiny
        stages:
          - name: a
            task: {source: fake.addition, train_size: 0}
            budget: {steps: 1}
        probes:
          - name: b
            task: {source: fake.addition, train_size: 0}
        """)
    assert error_of(path) == (f"{path}: stages[0].task (line 4, column 11): train_size must be "
                              "at least 1: a stage trains on its task's training items")


def test_duplicate_column_is_refused(write_suite) -> None:
    path = write_suite("""\
        name: tiny
        stages:
          - name: math
            task: {source: fake.addition}
            budget: {steps: 1}
        probes:
          - name: math
            task: {source: fake.addition}
        """)
    msg = error_of(path)
    assert msg.startswith(f"{path}: the top level: column name 'math' is used twice")


def test_probe_needs_exactly_one_source(write_suite) -> None:
    both = write_suite("""\
        name: tiny
        stages:
          - {name: a, task: {source: fake.addition}, budget: {steps: 1}}
        probes:
          - name: p
            task: {source: fake.addition}
            lm_eval: {task: mmlu}
        """)
    assert error_of(both) == (f"{both}: probes[0] (line 5, column 5): give exactly one of "
                              "`task` or `lm_eval`")
    bad_kind = write_suite("""\
        name: tiny
        stages:
          - {name: a, task: {source: fake.addition}, budget: {steps: 1}}
        probes:
          - {name: p, kind: trivia, task: {source: fake.addition}}
        """, name="kind.yaml")
    assert error_of(bad_kind) == (f"{bad_kind}: probes[0].kind (line 5, column 21): Input "
                                  "should be 'ood' or 'general'")


def test_python_tag_is_refused_and_never_runs(write_suite, tmp_path) -> None:
    marker = tmp_path / "pwned"
    path = write_suite(f"""\
        name: !!python/object/apply:os.system ["touch {marker}"]
        stages: []
        """)
    msg = error_of(path)
    assert msg.startswith(f"{path}: not valid YAML")
    assert "python/object/apply:os.system" in msg
    assert f'in "{path}", line 1' in msg  # where, by the file's name, not "<unicode string>"
    assert not marker.exists()


def test_duplicate_yaml_key_is_refused(write_suite) -> None:
    path = write_suite("""\
        name: tiny
        name: other
        stages: []
        """)
    assert "duplicate key 'name'" in error_of(path)


@pytest.mark.parametrize("text", ["[]:\n", "name: tiny\n{a: 1}: 2\n", "? [a, b]\n: 1\n"])
def test_a_list_or_mapping_as_a_key_is_refused_with_where_it_is(write_suite, text) -> None:
    path = write_suite(text)
    msg = error_of(path)
    assert msg.startswith(f"{path}: not valid YAML: a key must be a name or a number, not a ")
    assert f'in "{path}", line' in msg


def test_top_level_must_be_a_mapping(write_suite) -> None:
    path = write_suite("- just\n- a list\n")
    assert error_of(path) == (f"{path}: expected a mapping of suite fields at the top level, "
                              "got list")


def test_newer_suite_schema_version_is_refused(write_suite) -> None:
    path = write_suite("""\
        schema_version: 2
        name: tiny
        stages:
          - {name: a, task: {source: fake.addition}, budget: {steps: 1}}
        """)
    assert error_of(path) == (f"{path}: schema_version (line 1, column 17): this clbench reads "
                              "suite schema_version 1")


def test_plugin_params_are_validated_with_their_path(write_suite, fake_plugins) -> None:
    path = write_suite("""\
        name: tiny
        stages:
          - {name: a, task: {source: fake.addition}, budget: {steps: 1}}
          - {name: b, task: {source: fake.addition, params: {level: 9}}, budget: {steps: 1}}
        probes:
          - {name: p, task: {source: fake.addition, params: {colour: red}}}
          - {name: q, task: {source: fake.additon}}
        """)
    suite = load_suite(path)  # the fields are fine; only the plugins can tell what is wrong
    with pytest.raises(SpecError) as info:
        validate_suite_plugins(suite, path)
    lines = str(info.value).splitlines()
    assert lines[0] == (f"{path}: stages[1].task.params.level (line 4, column 61): Input "
                        "should be less than or equal to 3")
    assert lines[1].startswith(f"{path}: probes[0].task.params.colour (line 6, column 62): "
                               "unknown field")
    assert lines[2].startswith(f"{path}: probes[1].task.source (line 7, column 30): unknown task "
                               "source "
                               "'fake.additon'. Did you mean 'fake.addition'?")
    assert len(lines) == 3


def test_a_suite_model_that_names_no_model_is_reported_with_the_file(write_suite,
                                                                    fake_plugins) -> None:
    path = write_suite("""\
        name: tiny
        model: {name: tiny-foo}
        stages:
          - {name: a, task: {source: fake.addition}, budget: {steps: 1}}
        """)
    with pytest.raises(SpecError, match=f"^{path}: model.name \\(line 2, column 15\\): unknown "
                                         "tiny model 'tiny-foo'"):
        validate_suite_plugins(load_suite(path), path)


def test_model_names_checked_without_loading(tmp_path: Path) -> None:
    from clbench.models import check_model_name

    for fine in ("smollm2-135m", "tiny-llama", "Qwen/Qwen3-4B", str(tmp_path),
                 str(tmp_path / "removed-since"),  # absolute: a folder a run recorded
                 "~nosuchuser/model"):  # hub-id shaped; an unknown ~user is no crash
        check_model_name(fine)
    for wrong, message in (("tiny-foo", "unknown tiny model"), ("nohub", "neither"),
                           ("models/removed/since", "neither")):
        with pytest.raises(SpecError, match=message):
            check_model_name(wrong)


def test_missing_lm_eval_include_path_is_reported(write_suite, fake_plugins) -> None:
    path = write_suite("""\
        name: tiny
        stages:
          - {name: a, task: {source: fake.addition}, budget: {steps: 1}}
        probes:
          - {name: g, kind: general, lm_eval: {task: mini, include_path: lmeval_tasks}}
        """)
    suite = load_suite(path)
    with pytest.raises(SpecError, match=r"probes\[0\]\.lm_eval\.include_path \(line 5, column "
                                        r"66\): folder .*lmeval_tasks does not exist"):
        validate_suite_plugins(suite, path)
    (path.parent / "lmeval_tasks").mkdir()
    validate_suite_plugins(suite, path)  # resolved against the suite's folder


def test_content_hash_ignores_key_order_and_sees_content(write_suite) -> None:
    a = load_suite(write_suite("name: t\nstages: [{name: a, budget: {steps: 1, lr: 0.1}, "
                               "task: {source: s}}]\n", name="a.yaml"))
    b = load_suite(write_suite("stages: [{task: {source: s}, name: a, budget: {lr: 0.1, "
                               "steps: 1}}]\nname: t\n", name="b.yaml"))
    c = load_suite(write_suite("name: t\nstages: [{name: a, budget: {steps: 2, lr: 0.1}, "
                               "task: {source: s}}]\n", name="c.yaml"))
    assert a.content_hash() == b.content_hash()
    assert a.content_hash() != c.content_hash()
    assert a.content_hash().startswith("sha256:") and len(a.content_hash()) == 7 + 64


def test_the_generation_engine_is_not_part_of_what_a_suite_measures(write_suite) -> None:
    text = "name: t\nstages: [{name: a, budget: {steps: 1, lr: 0.1}, task: {source: s}}]\n"
    plain = load_suite(write_suite(text, name="a.yaml"))
    static = load_suite(write_suite(text + "model: {generation: static}\n", name="b.yaml"))
    half = load_suite(write_suite(text + "model: {dtype: float32}\n", name="c.yaml"))
    assert static.model.generation == "static"
    assert static.content_hash() == plain.content_hash() != half.content_hash()
    with pytest.raises(SpecError, match="generation"):
        load_suite(write_suite(text + "model: {generation: compiled}\n", name="d.yaml"))


def test_how_evaluation_holds_weights_batches_and_drafts_is_not_hashed(write_suite) -> None:
    # like the engine: how a machine computes the suite's greedy rows, not what they measure
    text = "name: t\nstages: [{name: a, budget: {steps: 1, lr: 0.1}, task: {source: s}}]\n"
    plain = load_suite(write_suite(text, name="a.yaml"))
    assert (plain.model.eval_weights, plain.model.eval_batching) == ("compute", "auto")
    other = load_suite(write_suite(text + "model: {eval_weights: master, eval_batching: suite, "
                                   "eval_drafts: 4}\n", name="b.yaml"))
    assert other.content_hash() == plain.content_hash()
    with pytest.raises(SpecError, match="eval_weights"):
        load_suite(write_suite(text + "model: {eval_weights: fp16}\n", name="c.yaml"))
    with pytest.raises(SpecError, match="eval_drafts"):
        load_suite(write_suite(text + "model: {eval_drafts: -1}\n", name="d.yaml"))


def test_suite_found_by_name_through_the_search_path(write_suite, monkeypatch) -> None:
    path = write_suite(name="mine.yaml")
    monkeypatch.setenv("CLBENCH_SUITE_PATH", str(path.parent))
    assert resolve_suite("mine") == path
    assert resolve_suite("mine.yaml") == path  # a bare file name not in the cwd: the named one
    assert load_suite("mine").name == "tiny"
    infos = {s.name: s for s in list_suites()}
    assert infos["mine"].description == "Two fake stages and one probe."
    assert infos["mine"].path == path


def test_unknown_suite_name_suggests_close_names(write_suite, monkeypatch) -> None:
    path = write_suite(name="zebra-walk.yaml")
    monkeypatch.setenv("CLBENCH_SUITE_PATH", str(path.parent))
    with pytest.raises(SuiteNotFoundError) as info:
        resolve_suite("zebra-wlak")
    assert "unknown suite 'zebra-wlak'. Did you mean 'zebra-walk'?" in str(info.value)
    with pytest.raises(SuiteNotFoundError, match="no such suite file"):
        resolve_suite(str(path.parent / "absent.yaml"))
    with pytest.raises(SuiteNotFoundError, match="is a folder; name a suite file in it"):
        resolve_suite(str(path.parent))
    with pytest.raises(SuiteNotFoundError, match="/dev/null: not a regular file"):
        resolve_suite("/dev/null")


def test_schema_describes_every_field() -> None:
    schema = SuiteSpec.model_json_schema()
    budget = schema["$defs"]["Budget"]["properties"]
    assert budget["steps"]["description"] == "Optimizer steps in the stage."
    undocumented = [f"{name}.{field}" for name, d in schema["$defs"].items()
                    for field, prop in d.get("properties", {}).items()
                    if "description" not in prop and name not in ("RunSpec",)]
    assert undocumented == []


def test_a_lower_is_better_lm_eval_metric_is_refused_in_the_suite(write_suite) -> None:
    path = write_suite("""\
        name: tiny
        stages:
          - {name: a, task: {source: fake.addition}, budget: {steps: 1}}
        probes:
          - {name: g, kind: general, lm_eval: {task: wikitext, metric: "word_perplexity,none"}}
        """)
    assert error_of(path) == (
        f"{path}: probes[0].lm_eval.metric (line 5, column 64): 'word_perplexity' is "
        "lower-is-better "
        "and not a fraction; a probe column is scored like an accuracy (e.g. acc, acc_norm, "
        "exact_match)")


def test_every_lower_is_better_metric_lm_eval_registers_is_refused_as_a_probe_score() -> None:
    """The list is lm-eval's own: every metric it registers as lower-is-better (brier_score
    included, which a multiple-choice task may list) cannot be a column of R."""
    import importlib

    importlib.import_module("lm_eval.api.metrics")  # registers the metrics
    from lm_eval.api.registry import HIGHER_IS_BETTER_REGISTRY

    from clbench.spec.schema import LOWER_IS_BETTER_LM_EVAL_METRICS

    lower = {name for name, higher in HIGHER_IS_BETTER_REGISTRY.items() if higher is False}
    assert lower and lower <= LOWER_IS_BETTER_LM_EVAL_METRICS


def test_validate_checks_that_offline_sources_can_give_the_items_asked(write_suite) -> None:
    """A train or eval size beyond what a generated source can draw, or a training stage on an
    evaluation-only source, is a validation error (not a failure after row 0)."""
    from clbench.errors import UserError
    from clbench.plugins.runspec import validate_suite_plugins
    from clbench.spec.suites import load_suite

    text = resolve_suite("smoke").read_text()
    path = write_suite(text.replace("train_size: 32\n      eval_size: 8\n    budget: {steps: 2",
                                    "train_size: 100000\n      eval_size: 8\n    budget: {steps: 2",
                                    1).replace("max_value: 9}\n      eval_size: 8",
                                               "max_value: 9}\n      eval_size: 5000"))
    with pytest.raises(UserError) as err:
        validate_suite_plugins(load_suite(path), path)
    lines = str(err.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{path}: stages[0].task.train_size=100000: only 64 distinct "
                               "train math.arithmetic problems found, 100000 requested")
    assert lines[1].startswith(f"{path}: probes[0].task.eval_size=5000: only ")
    validate_suite_plugins(load_suite(resolve_suite("smoke")))  # the shipped one is fine
