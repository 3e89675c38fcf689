"""The SDPO teacher: its context (who re-prompts the model, with what) and its weights.

Context. The teacher is the model re-prompted with privileged information: a successful sibling
rollout of the same prompt (a demonstration) and/or the verifier's feedback on the rollout. It
scores the student's own completion under that prompt. Templates are TRL's ``SDPOConfig``
defaults and lasgroup/SDPO's config-class defaults, character for character (its YAML config
writes them as `|-` blocks, which drop the trailing newlines; docs/methods.md).
A prompt over the length limit has its privileged text cut (:func:`fit_teacher_context`).
Which verifier feedback a rollout may get is the feedback mode's choice (:func:`verifier_feedback`:
`none`, as the reference's paper runs; `format`, as its math verifier; `rich`, every message).

Weights. :class:`TeacherWeights` keeps the network that plays the teacher, always built from the
in-memory student (a deep copy, never reloaded from disk, so it is right after stage 1 of a
continual run) in one of four modes:

- ``frozen``: a copy of the student taken at stage start (the paper's SDPO_0);
- ``ema``: a copy at stage start, then theta_T <- (1 - tau) theta_T + tau theta_S after every
  optimizer step (SDPO_tau; tau = 0 is frozen, tau = 1 follows the student one step behind);
- ``live``: the current student itself, no copy (scored without grad);
- ``refresh``: refresh-and-freeze (StableSDPO): the teacher is set to the current student before
  steps 0, K, 2K, ... of the stage and kept frozen in between, with
  K = max(1, ceil(refresh_fraction * stage_steps)) (fraction 0.4, 10 steps -> refreshes before
  steps 0, 4 and 8).

Every copy-based mode starts each stage from the student at stage start, as the reference does
when each stage is its own training run. The copy holds parameters and buffers; EMA and refresh
update floating-point parameters and copy buffers. When the model is in a 16-bit dtype, the EMA
is accumulated in an fp32 shadow of the teacher's parameters: in bf16 an increment of
tau * (theta_S - theta_T) is usually below half a unit in the last place and would round away,
leaving the "EMA" teacher frozen.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from clbench.api import THINK_CLOSE, THINK_OPEN, frozen_copy, module_state, split_response_start

if TYPE_CHECKING:
    from torch import nn

    from clbench.api import Messages

TeacherMode = Literal["frozen", "ema", "live", "refresh"]
TEACHER_MODES: tuple[str, ...] = ("frozen", "ema", "live", "refresh")
FeedbackMode = Literal["none", "format", "rich"]
FEEDBACK_MODES: tuple[str, ...] = ("none", "format", "rich")

#: `feedback: format`'s text for a rollout cut at the token cap (the reference's math verifier
#: says the same: truncation is a format problem, whatever the value).
TRUNCATED_FEEDBACK = "Your response was cut off: it reached the length limit before it ended."

# The reference templates, with the final newline of TRL's SDPOConfig and lasgroup/SDPO's config
# class (the YAML that lasgroup/SDPO's scripts load drops it, and the sections' trailing "\n\n").
SOLUTION_TEMPLATE = "\nCorrect solution:\n\n{demonstration}\n\n"
FEEDBACK_TEMPLATE = ("\nThe following is feedback from your unsuccessful earlier attempt:\n\n"
                     "{feedback}\n\n")
REPROMPT_TEMPLATE = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"

_THINK_BLOCK = re.compile(rf"{THINK_OPEN}.*?{THINK_CLOSE}\s*", flags=re.DOTALL)
_UNOPENED_THINK = re.compile(rf"^.*?{THINK_CLOSE}\s*", flags=re.DOTALL)
_UNCLOSED_THINK = re.compile(rf"{THINK_OPEN}.*$", flags=re.DOTALL)


class TeacherContextError(ValueError):
    """A prompt the teacher cannot be re-prompted from (e.g. it does not end with a user turn)."""


# ---------------------------------------------------------------------------------------------
# Contexts
# ---------------------------------------------------------------------------------------------

def remove_reasoning(text: str) -> str:
    """Remove ``<think>...</think>`` blocks (and the whitespace after each) from a demonstration.

    Also removes everything up to a ``</think>`` that has no opening tag, which is how thinking
    models whose chat template opens the block in the prompt (Qwen3-Thinking) write completions,
    and a ``<think>`` never closed with everything after it (all of it is reasoning).
    """
    return _UNCLOSED_THINK.sub("", _UNOPENED_THINK.sub("", _THINK_BLOCK.sub("", text)))


def reprompt_text(prompt: str, demonstration: str | None, feedback: str | None) -> str:
    """``{prompt}{solution}{feedback}\\n\\nCorrectly solve the original question.\\n``.

    ``solution`` is ``\\nCorrect solution:\\n\\n{demonstration}\\n\\n`` (empty without one) and
    ``feedback`` is ``\\nThe following is feedback from your unsuccessful earlier attempt:\\n\\n
    {feedback}\\n\\n`` (empty without one).
    """
    solution = SOLUTION_TEMPLATE.format(demonstration=demonstration) if demonstration is not None \
        else ""
    critique = FEEDBACK_TEMPLATE.format(feedback=feedback) if feedback is not None else ""
    return REPROMPT_TEMPLATE.format(prompt=prompt, solution=solution, feedback=critique)


def verifier_feedback(mode: FeedbackMode, feedback: str | None, format_error: bool,
                      finished: bool) -> str | None:
    """The feedback a rollout's teacher may see under `mode` (None: none).

    - ``none`` (the default, as the reference's paper runs): no feedback at all;
    - ``format`` (the reference's math verifier): a rollout cut at the token cap is told so
      (:data:`TRUNCATED_FEEDBACK`), one with no readable answer gets the grader's format message
      (`Grade.format_error`); a wrong value gets nothing;
    - ``rich``: the grader's feedback as it is, wrong values included ("Your answer 41 is wrong.",
      "Argument `city` has a wrong value").

    Whether feedback reaches the teacher prompt is decided afterwards by
    :func:`plan_teacher_contexts` (failed rollouts only, by default only without a demonstration).
    """
    if mode == "none":
        return None
    if mode == "format":
        if not finished:
            return TRUNCATED_FEEDBACK
        return feedback if format_error else None
    if mode == "rich":
        return feedback
    raise ValueError(f"unknown feedback mode {mode!r}; expected one of "
                     f"{', '.join(FEEDBACK_MODES)}")


def build_teacher_messages(prompt_messages: Messages, demonstration: str | None,
                           feedback: str | None, strip_reasoning: bool = True) -> Messages:
    """The teacher's chat: the student's chat with the LAST user turn re-written.

    Earlier turns (system prompt, worked examples) are kept as they are; the last user turn's
    content becomes :func:`reprompt_text` of it, and a start of the response after it (the
    opened reasoning block of the `think` format) stays, so the teacher scores the completion in
    the student's position. With neither a demonstration nor feedback the student's chat is
    returned unchanged (such a rollout gets no distillation loss). Reasoning is stripped from
    the demonstration unless ``strip_reasoning=False`` (SDPO-CoT keeps it).
    """
    last = len(split_response_start(prompt_messages)[0]) - 1
    if last < 0 or prompt_messages[last].get("role") != "user":
        role = prompt_messages[last].get("role") if last >= 0 else None
        raise TeacherContextError(
            f"the teacher re-prompts the last user turn, but found role {role!r} where it should "
            "be (a prompt ends with a user turn, optionally followed by the start of the "
            "response)")
    messages = [dict(m) for m in prompt_messages]
    if demonstration is None and feedback is None:
        return messages
    if demonstration is not None and strip_reasoning:
        demonstration = remove_reasoning(demonstration)
    messages[last]["content"] = reprompt_text(messages[last]["content"], demonstration, feedback)
    return messages


def select_demonstrations(rewards: Sequence[float], texts: Sequence[str],
                          threshold: float = 0.5) -> list[str | None]:
    """For each rollout of one prompt: the FIRST OTHER rollout with reward >= threshold, or None.

    A rollout never demonstrates to itself, so a group where only rollout i succeeded gives i no
    demonstration (its siblings get i's text).
    """
    if len(rewards) != len(texts):
        raise ValueError(f"{len(rewards)} rewards but {len(texts)} texts")
    good = [j for j, r in enumerate(rewards) if r >= threshold]
    return [next((texts[j] for j in good if j != i), None) for i in range(len(rewards))]


@dataclass(frozen=True)
class TeacherContext:
    """The teacher prompt of one rollout and why it is (in)active."""

    messages: Messages
    demonstration: str | None   # as inserted (after reasoning stripping)
    feedback: str | None
    source: Literal["sibling", "reference", "none"]

    @property
    def active(self) -> bool:
        """Whether the rollout gets a distillation loss (it has a demonstration or feedback)."""
        return self.demonstration is not None or self.feedback is not None


def plan_teacher_contexts(prompt_messages: Messages, rewards: Sequence[float],
                          texts: Sequence[str], feedbacks: Sequence[str | None] | None = None, *,
                          threshold: float = 0.5, feedback_with_demo: bool = False,
                          reference: str | None = None,
                          strip_reasoning: bool = True) -> list[TeacherContext]:
    """Teacher contexts of the n rollouts of one prompt.

    - demonstration: the first other rollout with reward >= `threshold`
      (:func:`select_demonstrations`); when there is none and `reference` is given (the task's
      reference solution, opt-in privileged context), the reference;
    - feedback: the feedback on this rollout (`feedbacks`, as the feedback mode chose it:
      :func:`verifier_feedback`), used when it is non-empty, the rollout itself failed (reward
      < `threshold`: the template calls it an "unsuccessful earlier attempt") and, unless
      `feedback_with_demo`, it has no demonstration (the reference config's
      `environment_feedback_only_without_solution`).
    """
    demos = select_demonstrations(rewards, texts, threshold)
    feedbacks = list(feedbacks) if feedbacks is not None else [None] * len(texts)
    if len(feedbacks) != len(texts):
        raise ValueError(f"{len(feedbacks)} feedbacks but {len(texts)} texts")
    out: list[TeacherContext] = []
    for demo, fb, reward in zip(demos, feedbacks, rewards):
        source: Literal["sibling", "reference", "none"] = "sibling" if demo is not None else "none"
        if demo is None and reference is not None:
            demo, source = reference, "reference"
        if demo is not None and strip_reasoning:
            demo = remove_reasoning(demo)
        wanted = demo is None or feedback_with_demo
        used_fb = fb if (wanted and fb and fb.strip() and reward < threshold) else None
        messages = build_teacher_messages(prompt_messages, demo, used_fb, strip_reasoning=False)
        out.append(TeacherContext(messages, demo, used_fb, source))
    return out


def fit_teacher_context(context: TeacherContext, prompt_messages: Messages, tokenizer: Any,
                        max_tokens: int | None) -> tuple[TeacherContext, list[int] | None, bool]:
    """The teacher prompt's token ids within `max_tokens`: `(context, ids, cut)`.

    A longer prompt has its demonstration cut from the end, then its feedback, until it fits;
    a part that cannot fit at all is left out. A context whose prompt is too long even without
    either becomes inactive (`ids` None: that rollout gets no distillation loss). The reference
    caps the re-prompt too (`max_reprompt_len`) but truncates the token sequence itself, which
    can cut the closing instruction and the assistant header; here only the privileged text is
    shortened. `max_tokens` None: no limit. An inactive context is returned as it is.
    """
    from clbench.api import encode_chat

    if not context.active:
        return context, None, False
    ids = encode_chat(tokenizer, context.messages)
    if max_tokens is None or len(ids) <= max_tokens:
        return context, ids, False
    parts = {"demonstration": context.demonstration, "feedback": context.feedback}
    for name in ("demonstration", "feedback"):
        text = parts[name]
        if text is None:
            continue
        pieces = tokenizer(text, add_special_tokens=False)["input_ids"]
        keep = len(pieces) - (len(ids) - max_tokens)
        while keep > 0:
            trial = {**parts, name: tokenizer.decode(pieces[:keep])}
            messages = build_teacher_messages(prompt_messages, trial["demonstration"],
                                              trial["feedback"], strip_reasoning=False)
            ids = encode_chat(tokenizer, messages)
            if len(ids) <= max_tokens:
                return _refitted(context, messages, trial), ids, True
            keep -= max(1, len(ids) - max_tokens)  # a re-tokenised cut can differ by a token
        parts[name] = None
        if parts["demonstration"] is None and parts["feedback"] is None:
            break
        messages = build_teacher_messages(prompt_messages, parts["demonstration"],
                                          parts["feedback"], strip_reasoning=False)
        ids = encode_chat(tokenizer, messages)
        if len(ids) <= max_tokens:
            return _refitted(context, messages, parts), ids, True
    return replace(context, messages=[dict(m) for m in prompt_messages], demonstration=None,
                   feedback=None, source="none"), None, True


def _refitted(context: TeacherContext, messages: Messages, parts: dict[str, str | None]
              ) -> TeacherContext:
    return replace(context, messages=messages, demonstration=parts["demonstration"],
                   feedback=parts["feedback"],
                   source=context.source if parts["demonstration"] is not None else "none")


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

def refresh_period(stage_steps: int, fraction: float) -> int:
    """K = max(1, ceil(fraction * stage_steps)): optimizer steps between teacher refreshes."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"refresh_fraction must lie in (0, 1], got {fraction}")
    if stage_steps < 1:
        raise ValueError(f"stage_steps must be >= 1, got {stage_steps}")
    # round() first so that 0.4 * 10 = 4.000000000000001 does not become 5
    return max(1, math.ceil(round(fraction * stage_steps, 9)))


def refresh_steps(stage_steps: int, fraction: float) -> list[int]:
    """The 0-based steps before which a refresh teacher is reset to the student."""
    return list(range(0, stage_steps, refresh_period(stage_steps, fraction)))


class TeacherWeights:
    """The network that scores completions as the SDPO teacher (see the module docstring).

    Life cycle per stage: :meth:`start_stage` (copies the student), then for each optimizer step
    ``s = 0..S-1``: :meth:`before_step` (refresh), score with :attr:`model`, update the student,
    :meth:`after_optimizer_step` (EMA).
    """

    def __init__(self, mode: TeacherMode = "frozen", *, ema_rate: float = 0.05,
                 refresh_fraction: float = 0.4) -> None:
        if mode not in TEACHER_MODES:
            raise ValueError(f"unknown teacher mode {mode!r}; expected one of "
                             f"{', '.join(TEACHER_MODES)}")
        if not 0.0 <= ema_rate <= 1.0:
            raise ValueError(f"ema_rate must lie in [0, 1], got {ema_rate}")
        if mode == "refresh":
            refresh_period(1, refresh_fraction)  # validates the fraction early
        self.mode = mode
        self.ema_rate = ema_rate
        self.refresh_fraction = refresh_fraction
        self.student: nn.Module | None = None
        self.copy: nn.Module | None = None
        self.shadow: list[torch.Tensor] | None = None  # fp32 EMA accumulators (16-bit models)
        self.period: int | None = None
        self.refreshes = 0

    @property
    def model(self) -> nn.Module:
        """The module to score with (the student itself in ``live`` mode)."""
        if self.student is None:
            raise RuntimeError("call start_stage(student, steps) before using the teacher")
        return self.student if self.mode == "live" else self.copy  # type: ignore[return-value]

    def start_stage(self, student: nn.Module, stage_steps: int) -> None:
        """Attach to the student and, except in ``live`` mode, take a fresh copy of it."""
        self.student = student
        self.period = refresh_period(stage_steps, self.refresh_fraction) \
            if self.mode == "refresh" else None
        self.refreshes = 0
        self.shadow = None
        if self.mode == "live":
            self.copy = None
            return
        self.copy = frozen_copy(student)
        if self.mode == "ema" and any(p.is_floating_point() and p.element_size() < 4
                                      for p in self.copy.parameters()):
            self.shadow = [p.detach().float().clone() for p in self.copy.parameters()]

    def before_step(self, step: int) -> bool:
        """Refresh mode: reset the teacher to the student before steps 0, K, 2K, ...

        Returns whether a refresh happened. Step 0 needs no copy (the stage-start copy is the
        student) but is counted as a refresh.
        """
        if self.mode != "refresh" or self.period is None or step % self.period:
            return False
        if step > 0:
            _copy_into(self.copy, self._require_student())
        self.refreshes += 1
        return True

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """EMA mode: theta_T <- (1 - tau) theta_T + tau theta_S (a no-op in other modes)."""
        if self.mode != "ema" or self.ema_rate == 0.0:
            return
        student = self._require_student()
        params = zip(self.copy.parameters(), student.parameters())  # type: ignore[union-attr]
        for i, (t, s) in enumerate(params):
            if not t.is_floating_point():
                t.copy_(s)
            elif self.shadow is not None:
                self.shadow[i].lerp_(s.detach().float(), self.ema_rate)
                t.copy_(self.shadow[i])
            else:
                t.lerp_(s.detach().to(t.dtype), self.ema_rate)

    def state_dict(self) -> dict[str, Any]:
        """Mode, counters and (except in ``live`` mode) the teacher's weights, for checkpoints
        (copied to the CPU: a checkpoint is written from there, and the device keeps its
        memory)."""
        weights = module_state(self.copy) if self.copy is not None else None
        shadow = [t.detach().to("cpu", copy=True) for t in self.shadow] \
            if self.shadow is not None else None
        return {"mode": self.mode, "ema_rate": self.ema_rate,
                "refresh_fraction": self.refresh_fraction, "period": self.period,
                "refreshes": self.refreshes, "weights": weights, "ema_shadow": shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a teacher already attached with :meth:`start_stage`."""
        if state.get("mode") != self.mode:
            raise ValueError(f"checkpoint holds a {state.get('mode')!r} teacher, this one is "
                             f"{self.mode!r}")
        self.period = state.get("period")
        self.refreshes = int(state.get("refreshes", 0))
        weights = state.get("weights")
        if weights is None:
            return
        if self.copy is None:
            raise RuntimeError("call start_stage(student, steps) before load_state_dict")
        self.copy.load_state_dict(weights)
        shadow = state.get("ema_shadow")
        if shadow is not None:  # saved on the CPU: back beside the teacher's parameters
            self.shadow = [t.detach().to(device=p.device, dtype=torch.float32, copy=True)
                           for t, p in zip(shadow, self.copy.parameters())]
        elif self.shadow is not None:
            self.shadow = [p.detach().float().clone() for p in self.copy.parameters()]

    def _require_student(self) -> nn.Module:
        if self.student is None or self.copy is None:
            raise RuntimeError("call start_stage(student, steps) first")
        return self.student


@torch.no_grad()
def _copy_into(target: nn.Module | None, source: nn.Module) -> None:
    if target is None:
        raise RuntimeError("no teacher copy to refresh")
    for t, s in zip(target.parameters(), source.parameters()):
        t.copy_(s)
    for t, s in zip(target.buffers(), source.buffers()):
        t.copy_(s)
