"""SDPO and its variants: on-policy self-distillation on the shared on-policy loop.

For each prompt, n rollouts are sampled and graded exactly as for GRPO
(the API's :class:`~clbench.api.Objective`). Then, per rollout:

1. teacher context (:mod:`clbench_methods.sdpo.teacher`): the first OTHER rollout of the prompt with
   reward >= `demo_threshold` as a demonstration and/or the verifier's feedback on this rollout
   (`feedback`: none by default, as the reference's paper runs), written into the last user
   turn with the reference templates; a rollout with neither gets no loss;
2. supervised tokens (:mod:`clbench_methods.sdpo.supervision`): the response after the reasoning
   block (`supervision: response`, SDPO), every token (`all`, SDPO-CoT) or the task's final line
   (`final_line`, an ablation), optionally thinned by `mask_ratio`;
3. the teacher network (:class:`clbench_methods.sdpo.teacher.TeacherWeights`, `frozen` / `ema` /
   `live` / `refresh`) scores the student's OWN completion under the teacher context (no grad);
4. loss = :func:`clbench.api.sdpo_loss`: the token mean over supervised tokens of
   divergence(student, teacher) times the detached importance weight min(p_new / p_old,
   is_clip).

The SDPO loss replaces the policy-gradient loss, as in the reference; the lr warms up over the
reference's 10 steps. Variants: ``sdpo`` (response supervision, frozen teacher: the paper's
SDPO_0), ``sdpo-cot`` (every token, demonstration reasoning kept) and ``stable-sdpo``
(refresh-and-freeze teacher, period 40% of the stage's steps).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from clbench.api import (
    DistillationScores,
    Method,
    Objective,
    OnPolicySettings,
    RolloutBatch,
    StageContext,
    StageReport,
    StepBatch,
    TrainingLoop,
    completion_distributions,
    completion_logprobs,
    opens_reasoning,
    response_prefix,
    sdpo_loss,
    seeded_rng,
)
from clbench_methods.sdpo.attribution import (
    KINDS,
    divergence_parts,
    kind_masks,
    restricted,
    token_kinds,
)
from clbench_methods.sdpo.supervision import Supervision, completion_supervision, random_token_mask
from clbench_methods.sdpo.teacher import (
    FeedbackMode,
    TeacherWeights,
    fit_teacher_context,
    plan_teacher_contexts,
    verifier_feedback,
)


class SDPOConfig(OnPolicySettings):
    """SDPO settings. Defaults follow the reference (lasgroup/SDPO) and the paper's SDPO_0."""

    lr: float = Field(default=1e-5, gt=0.0, description="Peak learning rate (reference: 1e-5). "
                      "A stage budget's `lr` overrides it.")
    warmup_steps: int = Field(
        default=10, ge=0,
        description="Linear warm-up of every stage from 0 to `lr` over this many optimizer "
        "steps (the reference: 10; step s takes lr * s / 10, so the first step only "
        "initialises AdamW's moments); at most the stage's steps - 1.")
    divergence: Literal["sampled_token", "topk", "full"] = Field(
        default="topk", description="Per-token divergence: `topk` (student's top-k tokens plus a "
        "tail bucket, generalised JSD; the reference), `full` (whole vocabulary) or "
        "`sampled_token` (reverse KL on the sampled token only; TRL's default).")
    topk: int = Field(default=100, ge=1, description="Support size of the `topk` divergence.")
    alpha: float = Field(default=0.5, ge=0.0, le=1.0, description="Generalised JSD weight: 0 = "
                         "forward KL(teacher||student), 1 = reverse KL(student||teacher), 0.5 = "
                         "symmetric JSD. Ignored by `sampled_token` (always reverse KL).")
    is_clip: float | None = Field(default=2.0, gt=0.0, description="Cap of the detached "
                                  "importance weight p_new/p_old multiplying each token's loss; "
                                  "null disables the weight.")
    teacher: Literal["frozen", "ema", "live", "refresh"] = Field(
        default="frozen", description="Teacher weights: `frozen` copy of the student at stage "
        "start (SDPO_0), `ema` moving average (SDPO_tau), `live` current student, `refresh` "
        "copy refreshed every `refresh_fraction` of the stage and frozen in between "
        "(StableSDPO).")
    ema_rate: float = Field(default=0.05, ge=0.0, le=1.0, description="EMA rate tau of the `ema` "
                            "teacher: theta_T <- (1 - tau) theta_T + tau theta_S after each step.")
    refresh_fraction: float = Field(default=0.4, gt=0.0, le=1.0, description="Refresh period of "
                                    "the `refresh` teacher as a fraction of the stage's steps: "
                                    "refreshes before steps 0, K, 2K, ... with K = "
                                    "ceil(fraction * steps).")
    demo_threshold: float = Field(default=0.5, ge=0.0, le=1.0, description="A sibling rollout "
                                  "with reward >= this is a demonstration.")
    feedback: FeedbackMode = Field(
        default="none",
        description="Verifier feedback in a failed rollout's teacher context: `none` (the "
        "reference's paper runs), `format` (only a cut-off response or one without a readable "
        "answer is told so, as the reference's math verifier) or `rich` (every message, wrong "
        "values included: \"Your answer 41 is wrong.\").")
    feedback_with_demo: bool = Field(
        default=False,
        description="Also give feedback to a failed rollout that has a demonstration. Off, as "
        "in the reference's config (`environment_feedback_only_without_solution`): feedback "
        "only where there is no demonstration.")
    use_reference_solution: bool = Field(default=False, description="Use the task's reference "
                                         "solution as the demonstration when no sibling "
                                         "succeeded (privileged context).")
    strip_demo_reasoning: bool = Field(default=True, description="Remove <think>...</think> from "
                                       "demonstrations before inserting them.")
    supervision: Supervision = Field(
        default="response",
        description="Which completion tokens get a target: `response` "
        "(everything after the reasoning block `</think>`, the whole completion without one: "
        "the paper's SDPO), `all` (reasoning included: the paper's SDPO^CoT, and the span the "
        "reference code supervises, its whole response mask) or `final_line` (the task's "
        "answer line only, e.g. the `\\boxed{}` line: an ablation).")
    supervise_eos: bool = Field(default=True, description="Give the end-of-sequence token that "
                                "closes a completion a target (the references do); off, the "
                                "decision to stop is left to the student.")
    mask_ratio: float = Field(default=0.0, ge=0.0, le=1.0, description="Drop each supervised "
                              "token at random with this probability (supervision density).")
    max_reprompt_tokens: int | None = Field(
        default=10240, ge=1, description="Longest teacher prompt, in tokens (the reference's "
        "max_reprompt_len): a longer one has its demonstration, then its feedback, cut from the "
        "end until it fits; a rollout whose prompt alone is longer gets no teacher. null: no "
        "limit.")


class SDPOCoTConfig(SDPOConfig):
    """SDPO-CoT: every completion token is supervised and demonstrations keep their reasoning."""

    supervision: Supervision = Field(
        default="all", description="Which completion tokens get a target (SDPO-CoT: `all`, the "
        "reasoning included; see sdpo's `supervision`).")
    strip_demo_reasoning: bool = Field(default=False, description="Remove <think>...</think> "
                                       "from demonstrations (SDPO-CoT keeps it).")


class StableSDPOConfig(SDPOConfig):
    """StableSDPO: refresh-and-freeze teacher."""

    teacher: Literal["frozen", "ema", "live", "refresh"] = Field(
        default="refresh", description="Teacher weights (StableSDPO: `refresh`).")


class SDPOObjective(Objective):
    """Self-distillation loss from the teacher's scores of the student's own completions."""

    config: SDPOConfig
    resumable = True

    def __init__(self, ctx: StageContext, config: SDPOConfig, **kwargs: Any) -> None:
        super().__init__(ctx, config, **kwargs)
        self.teacher = TeacherWeights(config.teacher, ema_rate=config.ema_rate,
                                      refresh_fraction=config.refresh_fraction)
        self.teacher_seconds = 0.0
        self.refresh_steps: list[int] = []

    # -- stage life cycle ------------------------------------------------------------------------

    def on_stage_start(self, loop: TrainingLoop) -> None:
        self.teacher.start_stage(loop.model, self.ctx.budget.steps)
        if self.teacher.before_step(0):
            self.refresh_steps.append(0)

    def after_step(self, loop: TrainingLoop, step: int) -> dict[str, float]:
        self.teacher.after_optimizer_step()
        refreshed = False
        if step + 1 < self.ctx.budget.steps:
            # The refresh for step s+1 copies the student as it is after step s.
            refreshed = self.teacher.before_step(step + 1)
            if refreshed:
                self.refresh_steps.append(step + 1)
        return {"teacher_refreshed": float(refreshed)}

    def on_stage_end(self, loop: TrainingLoop, report: StageReport) -> None:
        # Teacher forwards run inside the loss, so this time is also part of `backward`.
        report.wall_time["teacher_forward"] = self.teacher_seconds
        report.extra["teacher"] = {"mode": self.config.teacher, "refresh_steps":
                                   list(self.refresh_steps), "refresh_period": self.teacher.period}

    def state_dict(self) -> dict[str, Any]:
        return {"teacher": self.teacher.state_dict(), "refresh_steps": list(self.refresh_steps),
                "teacher_seconds": self.teacher_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.teacher.load_state_dict(state["teacher"])
        self.refresh_steps = list(state["refresh_steps"])
        self.teacher_seconds = float(state["teacher_seconds"])

    # -- a fresh batch ---------------------------------------------------------------------------

    def prepare(self, loop: TrainingLoop, batch: RolloutBatch) -> dict[str, float]:
        cfg, ctx = self.config, self.ctx
        n = batch.group_size
        feedbacks = [verifier_feedback(cfg.feedback, g.feedback, g.format_error, r.finished)
                     for g, r in zip(batch.grades, batch.rollouts)]
        contexts = []
        for g, example in enumerate(batch.examples):
            rows = range(g * n, (g + 1) * n)
            # a demonstration is the whole response, with the start the prompt wrote for it
            prefix = response_prefix(example.messages)
            contexts += plan_teacher_contexts(
                example.messages, [float(batch.rewards[i]) for i in rows],
                [prefix + batch.rollouts[i].text for i in rows], [feedbacks[i] for i in rows],
                threshold=cfg.demo_threshold, feedback_with_demo=cfg.feedback_with_demo,
                reference=example.reference if cfg.use_reference_solution else None,
                strip_reasoning=cfg.strip_demo_reasoning)
        fitted = [fit_teacher_context(tc, batch.examples[i // n].messages, ctx.tokenizer,
                                      cfg.max_reprompt_tokens) for i, tc in enumerate(contexts)]
        contexts = [tc for tc, _, _ in fitted]
        supervised = torch.zeros_like(batch.completion_mask)
        for i, (rollout, tc) in enumerate(zip(batch.rollouts, contexts)):
            if not tc.active:
                continue
            example = batch.examples[i // n]
            row = completion_supervision(
                ctx.tokenizer, rollout.text, rollout.completion_ids, cfg.supervision,
                ctx.task_for(example).answer_start_for(example),
                supervise_closing=cfg.supervise_eos,
                opened=opens_reasoning(response_prefix(example.messages)))
            supervised[i, :len(row)] = torch.tensor(row, dtype=torch.bool)
        generator = torch.Generator().manual_seed(
            seeded_rng("sdpo.mask", ctx.seed, batch.step).getrandbits(63))
        supervised = random_token_mask(supervised, cfg.mask_ratio, generator)
        supervised &= batch.completion_mask
        special = set(getattr(ctx.tokenizer, "all_special_ids", None) or [])
        # responses that ended with EOS and whose EOS is supervised: where P(EOS) is logged
        stops = [i for i, r in enumerate(batch.rollouts) if r.completion_ids
                 and r.completion_ids[-1] in special and bool(supervised[i, r.num_tokens - 1])]
        batch.extra["contexts"] = contexts
        batch.extra["teacher_prompt_ids"] = [ids for _, ids, _ in fitted]
        batch.extra["supervised"] = supervised
        batch.extra["normalizer"] = int(supervised.sum())
        batch.extra["stops"] = set(stops)
        batch.extra["token_kinds"] = token_kinds(ctx, batch)  # where the divergence falls
        # every rank's: the P(EOS) statistics are a mean over the step's such responses
        batch.extra["stops_total"] = loop.dist.sum_int(len(stops))
        total = max(int(batch.completion_mask.sum()), 1)
        size = max(batch.size, 1)
        return {
            "supervised_token_fraction": float(supervised.sum()) / total,
            "demo_fraction": sum(tc.demonstration is not None for tc in contexts) / size,
            "feedback_only_fraction": sum(tc.demonstration is None and tc.feedback is not None
                                          for tc in contexts) / size,
            "no_teacher_fraction": sum(not tc.active for tc in contexts) / size,
            "teacher_active_fraction": sum(tc.active for tc in contexts) / size,
            "reference_demo_fraction": sum(tc.source == "reference" for tc in contexts) / size,
            "feedback_fraction": sum(tc.feedback is not None for tc in contexts) / size,
            "teacher_prompt_cut_fraction": sum(cut for _, _, cut in fitted) / size,
        }

    # -- the loss ----------------------------------------------------------------------------------

    def loss(self, loop: TrainingLoop, batch: StepBatch, rows: Any
             ) -> tuple[torch.Tensor, dict[str, float]]:
        assert isinstance(batch, RolloutBatch)
        cfg = self.config
        supervised: torch.Tensor = batch.extra["supervised"]
        active = [i for i in rows if bool(supervised[i].any())]
        if not active:
            # Nothing to learn from in these rows: a loss without a graph and no forward (the
            # loop keeps the ranks' forwards in step, see `Objective.loss`), and this rank's
            # share of the statistics, 0, so the mean over the ranks counts every rank.
            return torch.zeros(()), self._zero_stats(batch)
        completions = [batch.rollouts[i].completion_ids for i in active]
        student, teacher = self._scores(loop, batch, active)
        length = student.token_logprobs.shape[1]  # the longest of these rows' completions
        mask = supervised[active][:, :length]
        kinds = kind_masks(batch, active, mask, student, teacher)
        mask = restricted(batch, kinds, mask)
        old = None if batch.old_logprobs is None else \
            batch.old_logprobs[active][:, :length].to(student.token_logprobs.device)
        sampled = batch.sampler_weights_of(active, length, mask.device)
        terms = sdpo_loss(student, teacher, mask, old_logprobs=old, divergence=cfg.divergence,
                          alpha=cfg.alpha, is_clip=cfg.is_clip, normalizer=batch.total_tokens,
                          sampler_weights=sampled)
        teacher_prompts = batch.extra["teacher_prompt_ids"]
        loop.counters.add("teacher_tokens", sum(len(teacher_prompts[i]) + len(c)
                                                for i, c in zip(active, completions)))
        # KL(student || teacher) estimated on the sampled tokens (they are drawn from the student)
        log_ratio = (student.token_logprobs.detach() - teacher.token_logprobs).clamp(-20, 20)
        stats = {"teacher_kl": float(batch.token_mean(log_ratio, mask)),
                 "divergence_mean": float(batch.token_mean(terms.divergence.detach(), mask)),
                 "importance_weight_mean": float(batch.token_mean(terms.weight, mask))}
        stats.update(self._stop_probabilities(batch, active, student, teacher))
        stats.update(divergence_parts(batch, kinds, mask, terms.divergence))
        return batch.rank_term(terms.loss), stats

    def _scores(self, loop: TrainingLoop, batch: RolloutBatch, active: list[int]
                ) -> tuple[DistillationScores, DistillationScores]:
        """The student's scores of `active` rows' completions (with grad, through the prepared
        student) and the teacher's under the teacher prompts (no grad), as the divergence needs:
        sampled tokens only, the student's top-k support, or the whole vocabulary."""
        cfg = self.config
        completions = [batch.rollouts[i].completion_ids for i in active]
        student_prompts = [batch.rollouts[i].prompt_ids for i in active]
        teacher_prompts = [batch.extra["teacher_prompt_ids"][i] for i in active]
        common = {"temperature": batch.temperature, "chunk_size": self.chunk_size}
        if cfg.divergence == "sampled_token":
            scored = completion_logprobs(loop.train_model, student_prompts, completions,
                                         grad=True, **common)
            started = time.perf_counter()
            with torch.no_grad():
                by_teacher = completion_logprobs(self.teacher.model, teacher_prompts,
                                                 completions, **common)
            self.teacher_seconds += time.perf_counter() - started
            return DistillationScores(scored.logprobs), DistillationScores(by_teacher.logprobs)
        topk = cfg.topk if cfg.divergence == "topk" else None
        student = completion_distributions(loop.train_model, student_prompts, completions,
                                           topk=topk, grad=True, **common)
        started = time.perf_counter()
        with torch.no_grad():
            teacher = completion_distributions(self.teacher.model, teacher_prompts, completions,
                                               indices=student.indices, **common)
        self.teacher_seconds += time.perf_counter() - started
        return (DistillationScores(student.token_logprobs, student.logprobs),
                DistillationScores(teacher.token_logprobs, teacher.logprobs))

    @staticmethod
    def _zero_stats(batch: RolloutBatch) -> dict[str, float]:
        """The statistics of rows without a loss: a zero share of each (the EOS ones only when
        some rank has a supervised response that ended)."""
        keys = ["teacher_kl", "divergence_mean", "importance_weight_mean",
                *(f"divergence_{k}" for k in KINDS)]
        if batch.extra["stops_total"]:
            keys += ["student_eos_prob", "teacher_eos_prob"]
        return dict.fromkeys(keys, 0.0)

    @staticmethod
    def _stop_probabilities(batch: RolloutBatch, active: list[int], student: DistillationScores,
                            teacher: DistillationScores) -> dict[str, float]:
        """Student's and teacher's P(EOS) where supervised responses ended, as this rank's term
        of the mean over the step's such responses on every rank (summed over micro-batches,
        averaged over the ranks like the loss; none when no rank has one)."""
        total = batch.extra["stops_total"]
        if not total:
            return {}
        stops: set[int] = batch.extra["stops"]
        ended = [(j, batch.rollouts[i].num_tokens - 1) for j, i in enumerate(active) if i in stops]
        rows = torch.tensor([j for j, _ in ended], dtype=torch.long)
        cols = torch.tensor([t for _, t in ended], dtype=torch.long)

        def mean_p(scores: DistillationScores) -> float:
            summed = scores.token_logprobs.detach()[rows, cols].exp().sum()
            return float(batch.rank_term(summed / total))

        return {"student_eos_prob": mean_p(student), "teacher_eos_prob": mean_p(teacher)}

    def supervised_tokens(self, batch: StepBatch) -> int:
        assert isinstance(batch, RolloutBatch)
        return int(batch.extra["normalizer"])


class SDPO(Method):
    """Self-distillation policy optimisation (the paper's SDPO_0 by default)."""

    name: ClassVar[str] = "sdpo"
    supports_sharding: ClassVar[bool] = True
    description: ClassVar[str] = ("SDPO: self-distillation from the model re-prompted with a "
                                  "successful sibling; response tokens, frozen teacher")
    Config: ClassVar[type[SDPOConfig]] = SDPOConfig
    config: SDPOConfig

    def hooks(self, ctx: StageContext) -> SDPOObjective:
        return SDPOObjective(ctx, self.config)


class SDPOCoT(SDPO):
    """SDPO with chain-of-thought supervision: every completion token is a target."""

    name: ClassVar[str] = "sdpo-cot"
    supports_sharding: ClassVar[bool] = True
    description: ClassVar[str] = ("SDPO-CoT: SDPO supervising every completion token, "
                                  "demonstrations keep their reasoning")
    Config: ClassVar[type[SDPOConfig]] = SDPOCoTConfig


class StableSDPO(SDPO):
    """SDPO with a refresh-and-freeze teacher."""

    name: ClassVar[str] = "stable-sdpo"
    supports_sharding: ClassVar[bool] = True
    description: ClassVar[str] = ("StableSDPO: SDPO whose teacher is reset to the student every "
                                  "40% of the stage and frozen in between")
    Config: ClassVar[type[SDPOConfig]] = StableSDPOConfig
