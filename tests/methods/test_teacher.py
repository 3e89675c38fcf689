"""SDPO teacher: template strings, demonstration selection, EMA arithmetic, refresh schedule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clbench_methods.sdpo import teacher as tm

PROMPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 1 + 1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "What is 14 + 23?"},
]


# ---------------------------------------------------------------------------------------------
# Templates
# ---------------------------------------------------------------------------------------------

def test_solution_only_template_exactly():
    msgs = tm.build_teacher_messages(PROMPT, "14 + 23 = 37.\nAnswer: 37", None)
    assert msgs[:-1] == PROMPT[:-1]
    assert msgs[-1] == {"role": "user", "content": (
        "What is 14 + 23?"
        "\nCorrect solution:\n\n14 + 23 = 37.\nAnswer: 37\n\n"
        "\n\nCorrectly solve the original question.\n")}


def test_feedback_only_template_exactly():
    msgs = tm.build_teacher_messages(PROMPT, None, "The answer 36 is wrong.")
    assert msgs[-1]["content"] == (
        "What is 14 + 23?"
        "\nThe following is feedback from your unsuccessful earlier attempt:\n\n"
        "The answer 36 is wrong.\n\n"
        "\n\nCorrectly solve the original question.\n")


def test_solution_and_feedback_template_exactly():
    msgs = tm.build_teacher_messages(PROMPT, "Answer: 37", "No final answer found.")
    assert msgs[-1]["content"] == (
        "What is 14 + 23?"
        "\nCorrect solution:\n\nAnswer: 37\n\n"
        "\nThe following is feedback from your unsuccessful earlier attempt:\n\n"
        "No final answer found.\n\n"
        "\n\nCorrectly solve the original question.\n")


def test_templates_agree_with_trl_sdpo_config_defaults():
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.sdpo import SDPOConfig

    fields = SDPOConfig.__dataclass_fields__
    expected = fields["reprompt_template"].default.format(
        prompt="Q?", solution=fields["solution_template"].default.format(
            successful_previous_attempt="D"),
        feedback=fields["feedback_template"].default.format(feedback_raw="F"))
    assert tm.reprompt_text("Q?", "D", "F") == expected


def test_neither_demonstration_nor_feedback_leaves_the_prompt_unchanged():
    msgs = tm.build_teacher_messages(PROMPT, None, None)
    assert msgs == PROMPT and msgs is not PROMPT
    msgs[-1]["content"] = "changed"
    assert PROMPT[-1]["content"] == "What is 14 + 23?"  # the caller's chat is never mutated


def test_reasoning_is_stripped_unless_asked():
    demo = "<think>14+23: 4+3=7, 1+2=3</think>\nAnswer: 37"
    stripped = tm.build_teacher_messages(PROMPT, demo, None)[-1]["content"]
    kept = tm.build_teacher_messages(PROMPT, demo, None, strip_reasoning=False)[-1]["content"]
    assert "\nCorrect solution:\n\nAnswer: 37\n\n" in stripped and "<think>" not in stripped
    assert f"\nCorrect solution:\n\n{demo}\n\n" in kept


def test_remove_reasoning_handles_missing_opening_tag_and_several_blocks():
    assert tm.remove_reasoning("reasoning first</think>\n\nAnswer: 3") == "Answer: 3"
    assert tm.remove_reasoning("<think>a</think> x <think>b</think>y") == "x y"
    assert tm.remove_reasoning("no reasoning here") == "no reasoning here"
    # a block never closed is reasoning to the end (a response cut inside it)
    assert tm.remove_reasoning("<think>\n56 + 71 = 127.\n\\boxed{127}") == ""
    assert tm.remove_reasoning("<think>a</think>b<think>c") == "b"


def test_prompt_must_end_with_a_user_turn_or_the_start_of_the_response():
    with pytest.raises(tm.TeacherContextError, match="found role 'system' where it should be"):
        tm.build_teacher_messages([PROMPT[0], {"role": "assistant", "content": "<think>\n"}],
                                  "x", None)
    with pytest.raises(tm.TeacherContextError, match="found role 'assistant'"):
        tm.build_teacher_messages(PROMPT[:3] + [{"role": "assistant", "content": "x"}], "x",
                                  None)  # two assistant turns after the user's
    with pytest.raises(tm.TeacherContextError, match="found role None"):
        tm.build_teacher_messages([], "x", None)


def test_the_start_of_the_response_stays_after_the_rewritten_user_turn():
    opened = PROMPT + [{"role": "assistant", "content": "<think>\n"}]
    teacher = tm.build_teacher_messages(opened, "<think>\n14 + 23 = 37.\n</think>\n37", None)
    assert teacher[:-2] == PROMPT[:-1] and teacher[-1] == opened[-1]
    assert teacher[-2]["content"] == tm.reprompt_text(PROMPT[-1]["content"], "37", None)


# ---------------------------------------------------------------------------------------------
# Demonstration selection
# ---------------------------------------------------------------------------------------------

def test_first_other_successful_sibling():
    texts = ["a", "b", "c", "d"]
    assert tm.select_demonstrations([0.0, 1.0, 0.0, 1.0], texts) == ["b", "d", "b", "b"]


def test_only_self_succeeded_gives_no_demonstration_to_itself():
    assert tm.select_demonstrations([0.0, 1.0, 0.0], ["a", "b", "c"]) == ["b", None, "b"]
    assert tm.select_demonstrations([0.0, 0.0], ["a", "b"]) == [None, None]


def test_threshold_is_inclusive():
    assert tm.select_demonstrations([0.5, 0.49], ["a", "b"], threshold=0.5) == [None, "a"]
    with pytest.raises(ValueError, match="2 rewards but 1 texts"):
        tm.select_demonstrations([0.0, 1.0], ["a"])


def test_plan_contexts_mask_feedback_and_reference():
    rewards = [1.0, 0.0, 0.0]
    texts = ["<think>r</think>Answer: 37", "Answer: 36", "nothing"]
    feedbacks = [None, "36 is wrong", ""]
    plan = tm.plan_teacher_contexts(PROMPT, rewards, texts, feedbacks)
    assert [c.source for c in plan] == ["none", "sibling", "sibling"]
    assert [c.active for c in plan] == [False, True, True]
    assert plan[0].messages == PROMPT  # only self succeeded, no feedback -> no loss
    # the reference config gives feedback only to a rollout without a demonstration
    assert plan[1].demonstration == "Answer: 37" and plan[1].feedback is None
    both = tm.plan_teacher_contexts(PROMPT, rewards, texts, feedbacks,
                                    feedback_with_demo=True)
    assert both[1].demonstration == "Answer: 37" and both[1].feedback == "36 is wrong"
    assert both[2].feedback is None  # empty feedback is no feedback
    alone = tm.plan_teacher_contexts(PROMPT, [0.0, 0.0], ["Answer: 36", "x"],
                                     ["36 is wrong", None])
    assert alone[0].demonstration is None and alone[0].feedback == "36 is wrong"
    assert alone[0].active and not alone[1].active
    off = tm.plan_teacher_contexts(PROMPT, [0.0, 0.0], ["Answer: 36", "x"], [None, None])
    assert off[0].feedback is None and not off[0].active
    with_ref = tm.plan_teacher_contexts(PROMPT, rewards, texts, feedbacks,
                                        reference="14 + 23 = 37.\nAnswer: 37")
    assert with_ref[0].source == "reference" and with_ref[0].active
    assert with_ref[1].source == "sibling"  # a sibling's success is preferred to the reference


@pytest.fixture(scope="module")
def char_tokenizer():
    from clbench.models import build_char_tokenizer, prepare_tokenizer

    return prepare_tokenizer(build_char_tokenizer())


def _context(demo: str | None, feedback: str | None) -> tm.TeacherContext:
    return tm.TeacherContext(tm.build_teacher_messages(PROMPT, demo, feedback, False), demo,
                             feedback, "sibling" if demo is not None else "none")


def test_a_teacher_prompt_within_the_limit_is_left_as_it_is(char_tokenizer):
    from clbench.train.rollout import encode_chat

    context = _context("Answer: 37", "36 is wrong")
    full = encode_chat(char_tokenizer, context.messages)
    for limit in (None, len(full)):
        fitted, ids, cut = tm.fit_teacher_context(context, PROMPT, char_tokenizer, limit)
        assert fitted == context and ids == full and not cut
    inactive = _context(None, None)
    assert tm.fit_teacher_context(inactive, PROMPT, char_tokenizer, 1) == (inactive, None, False)


def test_a_long_demonstration_is_cut_from_its_end_and_the_rest_kept(char_tokenizer):
    from clbench.train.rollout import encode_chat

    demo = "14 + 23: add the tens, then the units. " * 20 + "Answer: 37"
    context = _context(demo, "36 is wrong")
    full = encode_chat(char_tokenizer, context.messages)
    limit = len(full) - 300
    fitted, ids, cut = tm.fit_teacher_context(context, PROMPT, char_tokenizer, limit)
    assert cut and ids is not None and len(ids) <= limit
    assert ids == encode_chat(char_tokenizer, fitted.messages)
    assert demo.startswith(fitted.demonstration) and len(fitted.demonstration) < len(demo)
    assert fitted.feedback == "36 is wrong" and fitted.source == "sibling" and fitted.active
    # what follows the demonstration (feedback, closing instruction, assistant header) is intact
    after_demo = char_tokenizer.decode(full).split(demo, 1)[1]
    assert "Correctly solve the original question" in after_demo
    assert char_tokenizer.decode(ids).endswith(fitted.demonstration + after_demo)
    assert fitted.messages[:-1] == PROMPT[:-1]  # earlier turns untouched


def test_when_no_demonstration_fits_the_feedback_is_kept_and_then_cut(char_tokenizer):
    from clbench.train.rollout import encode_chat

    feedback = "36 is wrong: the units add to 7, not 6. " * 10
    only_feedback = encode_chat(char_tokenizer, _context(None, feedback).messages)
    context = _context("Answer: 37 " * 50, feedback)
    fitted, ids, cut = tm.fit_teacher_context(context, PROMPT, char_tokenizer,
                                              len(only_feedback))
    assert cut and fitted.demonstration is None and fitted.source == "none"
    assert fitted.feedback == feedback and ids == only_feedback
    fitted, ids, cut = tm.fit_teacher_context(context, PROMPT, char_tokenizer,
                                              len(only_feedback) - 100)
    assert fitted.demonstration is None and feedback.startswith(fitted.feedback)
    assert len(ids) <= len(only_feedback) - 100 and fitted.active


def test_a_prompt_too_long_without_privileged_text_gets_no_teacher(char_tokenizer):
    from clbench.train.rollout import encode_chat

    bare = encode_chat(char_tokenizer, PROMPT)
    fitted, ids, cut = tm.fit_teacher_context(_context("Answer: 37", "36 is wrong"), PROMPT,
                                              char_tokenizer, len(bare) - 1)
    assert cut and ids is None and not fitted.active and fitted.messages == PROMPT


@pytest.mark.parametrize("mode, wrong_value, no_answer, cut_off", [
    # (mode, a wrong value, no readable answer, a response cut at the token cap)
    ("none", None, None, None),
    ("format", None, "No final answer in \\boxed{} found.", tm.TRUNCATED_FEEDBACK),
    ("rich", "Your answer 41 is wrong.", "No final answer in \\boxed{} found.", None),
])
def test_the_three_feedback_modes(mode, wrong_value, no_answer, cut_off):
    assert tm.verifier_feedback(mode, "Your answer 41 is wrong.", False, True) == wrong_value
    assert tm.verifier_feedback(mode, "No final answer in \\boxed{} found.", True,
                                True) == no_answer
    # a cut-off response: `format` says it was cut (whatever the grader said), `rich` passes
    # the grader's message on (here none: a cut-off right answer still fails on the value)
    assert tm.verifier_feedback(mode, None, False, False) == cut_off
    with pytest.raises(ValueError, match="unknown feedback mode 'on'"):
        tm.verifier_feedback("on", "x", False, True)  # type: ignore[arg-type]


def test_format_errors_are_what_the_graders_say_they_are():
    from clbench.tasks.math.generated import grade_boxed
    from clbench.tasks.science.generated import Facts
    from clbench.tasks.tool_use.generated import GeneratedTools

    assert grade_boxed("37", "the sum is 37").format_error
    assert not grade_boxed("37", "\\boxed{36}").format_error
    facts = Facts({"families": ["symbol"]})
    item = facts.examples("eval", 0, 1)[0]
    assert facts.grade(item, "I do not know").format_error
    assert not facts.grade(item, "Answer: Zz").format_error
    tools = GeneratedTools()
    call = tools.examples("eval", 0, 1)[0]
    assert tools.grade(call, "Sure, I can help with that.").format_error
    assert not tools.grade(call, '{"name": "nope", "arguments": {}}').format_error


def test_feedback_on_a_successful_rollout_is_not_used():
    plan = tm.plan_teacher_contexts(PROMPT, [1.0, 1.0], ["a", "b"], ["nice", "good"])
    assert all(c.feedback is None for c in plan)
    assert [c.demonstration for c in plan] == ["b", "a"]


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

def _tiny_module(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    return module


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _step(student: nn.Module, delta: float) -> None:
    with torch.no_grad():
        for p in student.parameters():
            p.add_(delta)


def test_frozen_teacher_is_an_independent_copy():
    student = _tiny_module()
    teacher = tm.TeacherWeights("frozen")
    teacher.start_stage(student, stage_steps=5)
    assert teacher.model is not student
    start = _params(student)
    _step(student, 1.0)
    teacher.after_optimizer_step()
    assert all(torch.equal(a, b) for a, b in zip(_params(teacher.model), start))
    assert not any(p.requires_grad for p in teacher.model.parameters())


def test_live_teacher_is_the_student():
    student = _tiny_module()
    teacher = tm.TeacherWeights("live")
    teacher.start_stage(student, stage_steps=5)
    assert teacher.model is student
    assert teacher.state_dict()["weights"] is None


def test_ema_arithmetic_by_hand():
    student = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        student.weight.fill_(1.0)
    teacher = tm.TeacherWeights("ema", ema_rate=0.25)
    teacher.start_stage(student, stage_steps=3)
    with torch.no_grad():
        student.weight.fill_(3.0)
    teacher.after_optimizer_step()
    # 0.75 * 1 + 0.25 * 3 = 1.5
    assert teacher.model.weight.item() == pytest.approx(1.5)
    with torch.no_grad():
        student.weight.fill_(5.0)
    teacher.after_optimizer_step()
    # 0.75 * 1.5 + 0.25 * 5 = 2.375
    assert teacher.model.weight.item() == pytest.approx(2.375)


def test_ema_of_a_bf16_model_accumulates_in_fp32():
    student = nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        student.weight.fill_(1.0)
    teacher = tm.TeacherWeights("ema", ema_rate=0.05)
    teacher.start_stage(student, stage_steps=20)
    with torch.no_grad():
        student.weight.fill_(1.0078125)  # one bf16 ulp above 1
    expected = 1.0
    for _ in range(20):
        teacher.after_optimizer_step()
        expected = 0.95 * expected + 0.05 * 1.0078125
    # a plain bf16 lerp adds 0.05 ulp per step, rounds it away and never leaves 1.0
    assert teacher.shadow is not None
    assert teacher.shadow[0].item() == pytest.approx(expected, abs=1e-6)
    assert teacher.model.weight.item() == torch.tensor(expected).to(torch.bfloat16).item()
    assert teacher.model.weight.item() > 1.0
    restored = tm.TeacherWeights("ema", ema_rate=0.05)
    restored.start_stage(student, 20)
    restored.load_state_dict(teacher.state_dict())
    assert restored.shadow[0].item() == teacher.shadow[0].item()


def test_ema_rate_zero_is_frozen_and_one_follows_the_student():
    for rate, expected in ((0.0, 1.0), (1.0, 4.0)):
        student = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            student.weight.fill_(1.0)
        teacher = tm.TeacherWeights("ema", ema_rate=rate)
        teacher.start_stage(student, 2)
        with torch.no_grad():
            student.weight.fill_(4.0)
        teacher.after_optimizer_step()
        assert teacher.model.weight.item() == expected


def test_refresh_period_and_steps():
    assert tm.refresh_period(10, 0.4) == 4
    assert tm.refresh_steps(10, 0.4) == [0, 4, 8]
    assert tm.refresh_steps(5, 0.4) == [0, 2, 4]
    assert tm.refresh_steps(3, 0.1) == [0, 1, 2]
    assert tm.refresh_steps(4, 1.0) == [0]
    with pytest.raises(ValueError, match="refresh_fraction"):
        tm.refresh_period(10, 0.0)


def test_refresh_teacher_equals_student_at_each_refresh_and_is_frozen_between():
    student = _tiny_module()
    teacher = tm.TeacherWeights("refresh", refresh_fraction=0.4)
    steps = 10
    teacher.start_stage(student, stage_steps=steps)
    last_refresh = _params(student)
    refreshed_at = []
    for step in range(steps):
        if teacher.before_step(step):
            refreshed_at.append(step)
            assert all(torch.equal(a, b) for a, b in zip(_params(teacher.model), _params(student)))
            last_refresh = _params(student)
        else:
            assert all(torch.equal(a, b) for a, b in zip(_params(teacher.model), last_refresh))
            assert not all(torch.equal(a, b)
                           for a, b in zip(_params(teacher.model), _params(student)))
        _step(student, 0.1)  # the optimizer step
        teacher.after_optimizer_step()
    assert refreshed_at == [0, 4, 8] and teacher.refreshes == 3


def test_refresh_copies_buffers_too():
    student = _tiny_module()
    teacher = tm.TeacherWeights("refresh", refresh_fraction=0.5)
    teacher.start_stage(student, stage_steps=2)
    student.train()
    student(torch.randn(8, 3))  # updates BatchNorm running stats
    teacher.before_step(1)
    assert torch.equal(teacher.model[1].running_mean, student[1].running_mean)


def test_teacher_checkpoint_round_trip():
    student = _tiny_module()
    teacher = tm.TeacherWeights("ema", ema_rate=0.5)
    teacher.start_stage(student, 4)
    _step(student, 1.0)
    teacher.after_optimizer_step()
    state = teacher.state_dict()
    expected = _params(teacher.model)

    restored = tm.TeacherWeights("ema", ema_rate=0.5)
    restored.start_stage(student, 4)  # a copy of the (moved) student, not the saved teacher
    restored.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_params(restored.model), expected))
    _step(student, 1.0)
    teacher.after_optimizer_step()
    restored.after_optimizer_step()
    assert all(torch.equal(a, b) for a, b in zip(_params(restored.model), _params(teacher.model)))
    with pytest.raises(ValueError, match="'ema' teacher, this one is 'frozen'"):
        frozen = tm.TeacherWeights("frozen")
        frozen.start_stage(student, 4)
        frozen.load_state_dict(state)


def test_invalid_teacher_settings_are_rejected():
    with pytest.raises(ValueError, match="unknown teacher mode 'stale'"):
        tm.TeacherWeights("stale")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ema_rate"):
        tm.TeacherWeights("ema", ema_rate=1.5)
    with pytest.raises(RuntimeError, match="start_stage"):
        _ = tm.TeacherWeights("frozen").model
