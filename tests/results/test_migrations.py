"""Files written by earlier versions read as what they did, through clbench/migrations.py alone:
renamed and added method settings, a suite's old diagnostics list, results without task source
versions, a step checkpoint's progress from before add-ons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import result_of, run_spec
from where import SMOKE

from clbench import migrations
from clbench.plugins import registry
from clbench.results import read_results, write_results
from clbench.spec.suites import load_suite


def test_settings_the_sdpo_family_renamed_read_as_what_they_did() -> None:
    read = migrations.method_config
    assert read("sdpo", {"use_feedback": True})["feedback"] == "rich"
    assert read("sdpo", {"use_feedback": False})["feedback"] == "none"
    assert read("stable-sdpo", {"supervision": "answer"})["supervision"] == "final_line"
    assert "use_feedback" not in read("sdpo-cot", {"use_feedback": True})
    # another method's settings of those names are its own
    assert read("grpo", {"supervision": "answer"}) == {"supervision": "answer"}


def test_fields_added_since_a_run_read_with_the_value_it_ran_with() -> None:
    config = registry.validate_method_params("sdpo", migrations.method_config("sdpo", {}))
    assert (config.feedback, config.warmup_steps, config.feedback_with_demo,
            config.supervision) == ("rich", 0, True, "final_line")
    cot = registry.validate_method_params("sdpo-cot", migrations.method_config("sdpo-cot", None))
    assert (cot.supervision, cot.warmup_steps) == ("all", 0)  # `all` was its default throughout
    assert migrations.method_config("sdpo", {"warmup_steps": 10})["warmup_steps"] == 10
    assert migrations.fields_before("sdpo", {"feedback": "none"}) == [
        "warmup_steps", "feedback_with_demo", "supervision"]
    assert migrations.fields_before("sft", {}) == []
    assert migrations.method_config("sdpo", "damaged") == "damaged"  # validation says what


def test_a_suite_with_the_old_empty_diagnostics_list_reads_as_the_defaults(tmp_path: Path
                                                                           ) -> None:
    smoke = SMOKE.read_text()
    path = tmp_path / "old.yaml"
    path.write_text(smoke.replace("protocol:\n", "protocol:\n  diagnostics: []\n", 1))
    assert load_suite(path).content_hash() == load_suite("smoke").content_hash()
    path.write_text(smoke.replace("protocol:\n", "protocol:\n  diagnostics: [x]\n", 1))
    with pytest.raises(Exception, match="diagnostics"):
        load_suite(path)


def test_results_with_the_old_diagnostics_list_read_as_the_defaults(tmp_path: Path) -> None:
    result = result_of(run_spec("smoke", "sft", out_dir=tmp_path / "unused"))
    path = write_results(tmp_path / "results.json", result)
    data = json.loads(path.read_text())
    data["suite"]["protocol"]["diagnostics"] = []
    path.write_text(json.dumps(data))
    assert read_results(path).suite_spec() == result.suite_spec()


def test_a_step_checkpoint_from_before_addons_continues() -> None:
    old = {"step": 3, "objective": {"teacher": 1}, "optimizer": {}}
    assert migrations.progress_state(old) == {
        "step": 3, "optimizer": {}, "hooks": {"method": {"teacher": 1}, "addons": []}}
    new = {"step": 3, "hooks": {"method": {}, "addons": [{}]}}
    assert migrations.progress_state(new) is new


def test_results_from_before_1_5_read_with_the_defaults_the_built_ins_had(tmp_path: Path
                                                                         ) -> None:
    """Results before 1.5 did not record the method's and add-ons' defaults: the report reads
    them from migrations' table, which holds the built-ins' defaults as of results 1.4 (should a
    default change later, this test pins the old value, the table stays)."""
    for name, table in migrations.DEFAULTS_BEFORE_1_5.items():
        assert registry.validate_method_params(name, None).model_dump(mode="json") == table
    for name, table in migrations.ADDON_DEFAULTS_BEFORE_1_5.items():
        assert registry.validate_addon_params(name, None).model_dump(mode="json") == table

    from clbench.report.comparison import addon_settings_in_force, settings_line

    run = run_spec("smoke", "sdpo", out_dir=tmp_path / "unused", addons=["replay"])
    config = {**migrations.DEFAULTS_BEFORE_1_5["sdpo"], "lr": 3e-6}
    path = write_results(tmp_path / "results.json", result_of(run, config))
    data = json.loads(path.read_text())
    assert data["method"]["defaults"] == migrations.DEFAULTS_BEFORE_1_5["sdpo"]
    data["schema_version"] = "1.4"
    del data["method"]["defaults"], data["addons"][0]["defaults"]
    data["addons"][0]["config"]["fraction"] = 0.5
    path.write_text(json.dumps(data))
    assert settings_line(read_results(path)) == "lr=3e-06; replay: fraction=0.5"
    assert addon_settings_in_force(read_results(path)) == {"replay": {"fraction": 0.5}}
    data["method"]["name"] = "someone-elses"  # a third party's: its defaults are unknown here
    path.write_text(json.dumps(data))
    assert settings_line(read_results(path)).startswith(
        "someone-elses's settings as recorded in results.json (its defaults are not recorded")


def test_a_model_spec_from_before_the_evaluation_settings_reads_as_it_evaluated(
        tmp_path: Path) -> None:
    # greedy evaluation then ran in the fp32 master weights, in the protocol's batches
    assert migrations.model({"name": "m"}) == {"name": "m", "eval_weights": "master",
                                               "eval_batching": "suite"}
    assert migrations.model({"eval_weights": "compute"})["eval_weights"] == "compute"
    assert migrations.model("damaged") == "damaged"
    result = result_of(run_spec("smoke", "sft", out_dir=tmp_path / "unused"))
    path = write_results(tmp_path / "results.json", result)
    data = json.loads(path.read_text())
    assert data["model"]["spec"]["eval_weights"] == "compute"  # a run records what it does
    for field in ("eval_weights", "eval_batching"):
        del data["model"]["spec"][field]
    path.write_text(json.dumps(data))
    spec = read_results(path).model.spec
    assert (spec["eval_weights"], spec["eval_batching"]) == ("master", "suite")
