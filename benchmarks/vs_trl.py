"""Seconds per training step of clbench's grpo and sdpo against TRL 1.16 with matched settings.

Each method trains the same stage both ways from freshly loaded weights, alternating in one
process (clbench, TRL, clbench, TRL, ...): the starter suite's math task (2-digit addition), 4
prompts x 4 samples x 48 new tokens per step, on the embedded model (SmolLM2-135M-Instruct) on
the CPU. clbench runs through `measure` of benchmarks/step_time.py; TRL through
`trl.GRPOTrainer` and `trl.experimental.sdpo.SDPOTrainer`. The first step of every run is a
warm-up (allocations, lazy imports) and is left out of the step times and losses.

    .venv/bin/python benchmarks/vs_trl.py                              # grpo and sdpo, 4 steps x 2
    .venv/bin/python benchmarks/vs_trl.py --methods sdpo --steps 6 --repeats 3 --threads 4
    .venv/bin/python benchmarks/vs_trl.py --threads 1 --steps 2 --repeats 1 --max-new-tokens 8

Prints, per method and implementation: seconds per step (median [min-max] over the timed steps
of all repeats), the phase split (mean per step over all steps, warm-up included, as clbench
reports phase totals per stage), the peak resident memory of a run, the mean loss of the timed
steps, the tokens generated per step, and TRL's seconds per step over clbench's.

Matched settings
- Weights: the embedded model loaded the same way for both, `Distributed.create("cpu", dtype,
  True).load_model("smollm2-135m")`: fp32 weights under bf16 autocast (clbench's mixed
  precision; TRL `bf16=True, use_cpu=True`, whose accelerator wraps the model's forward in the
  same autocast, generation included). `--dtype float32` gives fp32 on both.
- Prompts: the chat prompts (`ex.messages`) of the task's training items, and the SAME prompts
  at every step: TRL's dataset holds, in order, the items clbench's `step_examples` draws for
  steps 1..N, with `shuffle_dataset=False` (the script checks the order the reward saw).
  Rewards: the clbench task's grader on the decoded completion (`task.grade(...).reward`).
- Batch: 4 prompts x 4 generations, all 16 rollouts generated in one batch and trained in one
  forward/backward (per_device_train_batch_size=16, num_generations=4, steps_per_generation=1,
  gradient_accumulation_steps=1), one optimizer step per generated batch (num_iterations=1 /
  inner_updates=1), so neither computes old log-probs.
- Sampling: temperature 1.0, top_p 1.0, no top-k (TRL top_k=0 disables it), no repetition
  penalty, no min_p, max 48 new tokens, EOS ends a completion, no stop strings.
- Optimizer: AdamW (torch's fused kernel on both), betas (0.9, 0.999), eps 1e-8, weight decay
  0.01 not applied to biases and norm weights, gradient norm clipped at 1.0, lr 1e-6 (grpo) /
  1e-5 (sdpo), constant, NO warm-up on either: clbench sdpo's default of 10 warm-up steps is
  set to 0 (`warmup_steps: 0`), because clbench caps it at the stage's steps - 1 while TRL
  would warm up over all 10, and a short run would then take different learning rates.
  Activation (gradient) checkpointing on both (non-reentrant). Seed equal.
- GRPO: beta 0 (no reference model), clip 0.2 / 0.28 (epsilon / epsilon_high), advantages
  r - mean(group) without std scaling (scale_rewards "none"), loss a token mean over the step's
  completion tokens (loss_type "dapo").
- SDPO (clbench's defaults, SDPO_0): top-k divergence over the student's top 100 tokens plus a
  tail bucket (distillation_mode "topk_logits", distillation_topk 100, distillation_add_tail),
  generalised JSD alpha 0.5, importance weight capped at 2.0 (distillation_is_clip; 1 on both
  with one update per batch), frozen teacher = the student at the start (teacher_model_kind
  "base"), demonstration = the first OTHER sibling with reward >= 0.5
  (use_successful_as_teacher, success_reward_threshold 0.5, dont_reprompt_on_self_success), no
  verifier feedback (include_environment_feedback False), <think> stripped from demonstrations,
  pure distillation (distillation_weight 1.0), the same reprompt templates, every completion
  token supervised (EOS included).
- Logging every step, no checkpoints, no evaluation, report_to none.

Not matched (and why)
- The samples: both samplers draw pure samples at temperature 1, but with different random
  streams and code (clbench's decode loop: one prefill per distinct prompt, ended rows leave the
  batch, each row its own uniforms; TRL: `model.generate` over the padded batch until every row
  ends). Completions, their lengths, rewards and how many SDPO rollouts get a teacher differ per
  step, so the step times carry that noise (see gen tok/step) and the losses are compared as
  magnitudes only. The loss functions themselves are tested equal in tests/train/test_losses.py.
- SDPO's loss aggregation: TRL 1.16 hard-codes the mean over rollouts of each rollout's token
  mean (rollouts without a teacher count as 0); clbench takes the token mean over the step's
  supervised tokens. No TRL setting changes it (loss_type acts on the policy loss only). The
  loss column therefore shows TRL's logged `self_distillation/distillation_loss`, a token mean
  like clbench's; the gradients differ in weighting, not in cost.
- An SDPO step without a learning signal (no rollout has a successful sibling, so none gets a
  teacher): clbench skips the forward, backward and optimizer step (the schedule advances);
  TRL 1.16 still runs the student and teacher forwards, a zero backward and an AdamW step
  (weight decay included). Such steps are common with a small `--max-new-tokens`, where
  completions are cut before their answer.
- SDPO's teacher: TRL's `base` teacher is a second model loaded from the student's folder when
  the trainer is built; clbench copies the student in memory at the start of the stage. Same
  weights; both outside the timed steps, inside the memory peak.
- Work each implementation does by design: TRL's GRPO loss forward also computes per-token
  entropies (for its logs); under TRL, autocast casts each weight on every forward (each decoded
  token), clbench casts once per generation call; clbench projects to the vocabulary 128
  positions at a time. These are what the comparison measures.

Timing and memory
- Step seconds: clbench's per-step records (`report.steps[i]["seconds"]`: sample, grade, score,
  update); TRL's from `on_step_begin` to `on_step_end` (the same work; each one's logging after
  the step is outside). TRL's phases: `generate` = inside `model.generate`, `prep` = the rest of
  `_prepare_inputs` (rewards, advantages, teacher prompts), `optim` = between the
  pre/post-optimizer-step callbacks, `loss+bwd` = the rest of the step, `teacher` = inside the
  teacher model's forward (part of loss+bwd, as clbench's `teacher_forward` is part of backward).
  clbench's: generate, grade + score, backward, step, teacher_forward of `report.wall_time`.
- Peak RSS: the kernel's high-water mark of this process (VmHWM), reset at the start of each
  run by writing 5 to /proc/self/clear_refs, after a garbage collection and `malloc_trim`; where
  that reset is refused, RSS sampled every 10 ms by a background thread (psutil). It covers the
  whole run (model load, trainer setup, steps); `+` is the growth over the RSS at the run's
  start. Memory the allocator kept from an earlier run can lower a later run's growth.
"""

from __future__ import annotations

import os

# Before any Hugging Face import: never reach the network (the model comes from the local
# package), and no banner about TRL's experimental module.
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
              "TRL_EXPERIMENTAL_SILENCE"):
    os.environ.setdefault(_name, "1")

import argparse
import contextlib
import ctypes
import gc
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any, Self

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
from step_time import TASK, measure

from clbench.plugins.registry import build_task
from clbench.train.cpu import run_threads
from clbench.train.distributed import Distributed
from clbench.train.optim import step_examples

PROMPTS, SAMPLES = 4, 4
MODEL = "smollm2-135m"
# clbench's method settings for this comparison: its defaults, warm-up off (module docstring).
CLBENCH_PARAMS: dict[str, dict[str, Any]] = {"grpo": {}, "sdpo": {"warmup_steps": 0}}
LR = {"grpo": 1e-6, "sdpo": 1e-5}  # clbench's defaults (`clbench methods show grpo|sdpo`)
PHASES = ("generate", "prep", "loss+bwd", "optim", "teacher")
GIB = 1024 ** 3


# -- memory ------------------------------------------------------------------------------------

def _status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes (None where there is no such file)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def _rss_bytes() -> int | None:
    try:
        import psutil
    except ImportError:
        return _status_bytes("VmRSS")
    return int(psutil.Process().memory_info().rss)


def _release_freed_memory() -> None:
    """Give freed heap back to the OS so that a run does not start on the last run's leftovers."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRss:
    """Peak resident memory of the code in its `with` block (see the module docstring)."""

    def __enter__(self) -> Self:
        _release_freed_memory()
        self.start = _rss_bytes()
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
            Path("/proc/self/clear_refs").write_text("5")
            self.exact = _status_bytes("VmHWM") is not None
        except OSError:
            self.exact = False
        if not self.exact:
            self.peak = self.start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            rss = _rss_bytes()
            if rss is not None and (self.peak is None or rss > self.peak):
                self.peak = rss

    def __exit__(self, *exc: object) -> None:
        if self.exact:
            self.peak = _status_bytes("VmHWM")
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()


# -- clbench -----------------------------------------------------------------------------------

def clbench_run(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One clbench run through step_time's `measure`, its phases renamed to this table's."""
    row = measure(method, args.steps, args.dtype, args.seed, "cpu", True,
                  params=CLBENCH_PARAMS[method], max_new_tokens=args.max_new_tokens)
    wall = row["wall_time"]
    phases = {"generate": wall.get("generate", 0.0),
              "prep": wall.get("grade", 0.0) + wall.get("score", 0.0),
              "loss+bwd": wall.get("backward", 0.0), "optim": wall.get("step", 0.0),
              "teacher": wall.get("teacher_forward", 0.0)}
    return {"per_step": row["per_step"], "losses": row["losses"], "phases": phases,
            "gen_tokens_per_step": row["generated_tokens_per_step"], "precision": row["dtype"],
            "note": ""}


# -- TRL ---------------------------------------------------------------------------------------

def reset_accelerate_state() -> None:
    """accelerate keeps one state per process and refuses an Accelerator whose mixed precision
    differs from the last one's: clbench's use "no" (clbench autocasts itself), TRL's "bf16"."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def trl_config(method: str, out_dir: str, args: argparse.Namespace, bf16: bool) -> Any:
    """TRL's config with the settings of the module docstring."""
    from trl import GRPOConfig
    from trl.experimental.sdpo import SDPOConfig

    cls = GRPOConfig if method == "grpo" else SDPOConfig
    # transformers 5 renamed gradient_checkpointing (now a deprecated alias)
    names = {f.name for f in fields(cls)}
    checkpointing = ("activation_checkpointing" if "activation_checkpointing" in names
                     else "gradient_checkpointing")
    common: dict[str, Any] = dict(
        output_dir=out_dir, max_steps=args.steps, seed=args.seed, use_cpu=True, bf16=bf16,
        per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=SAMPLES, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        min_p=None, repetition_penalty=1.0, shuffle_dataset=False,
        learning_rate=LR[method], lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        weight_decay=0.01, max_grad_norm=1.0, disable_dropout=True,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, scale_rewards="none", loss_type="dapo",
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        disable_tqdm=True, **{checkpointing: True})
    if method == "grpo":
        return cls(**common)
    return cls(**common, distillation_weight=1.0, distillation_mode="topk_logits",
               distillation_topk=100, distillation_add_tail=True, distillation_alpha=0.5,
               distillation_is_clip=2.0, teacher_model_kind="base",
               use_successful_as_teacher=True, success_reward_threshold=0.5,
               dont_reprompt_on_self_success=True, include_environment_feedback=False,
               remove_thinking_from_demonstration=True, diagnostics_warning_interval=0)


class TrlClock(TrainerCallback):
    """Per-step seconds and phase totals of a TRL trainer: step and optimizer boundaries from
    callbacks, generation and batch preparation from wrapped calls, the teacher from hooks."""

    def __init__(self, trainer: Any, model: torch.nn.Module) -> None:
        self.per_step: list[float] = []
        self.totals = dict.fromkeys(("generate", "prepare", "optim", "teacher"), 0.0)
        self._marks: dict[str, float] = {}
        # instance attributes shadow the methods: TRL calls both through these objects
        self._wrap(model, "generate", "generate")
        self._wrap(trainer, "_prepare_inputs", "prepare")
        teacher = getattr(trainer, "teacher_model", None)
        if isinstance(teacher, torch.nn.Module) and teacher is not model:
            teacher.register_forward_pre_hook(lambda *_: self._mark("teacher"))
            teacher.register_forward_hook(lambda *_: self._add("teacher"))

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - started

        setattr(owner, name, timed)

    def _mark(self, key: str) -> None:
        self._marks[key] = time.perf_counter()

    def _add(self, key: str) -> None:
        self.totals[key] += time.perf_counter() - self._marks.pop(key)

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self._mark("step")

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.per_step.append(time.perf_counter() - self._marks.pop("step"))

    def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self._mark("optim")

    def on_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self._add("optim")

    def phases(self) -> dict[str, float]:
        t = self.totals
        return {"generate": t["generate"], "prep": t["prepare"] - t["generate"],
                "loss+bwd": sum(self.per_step) - t["prepare"] - t["optim"],
                "optim": t["optim"], "teacher": t["teacher"]}


def trl_run(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One TRL run: fresh weights, the steps' prompts in clbench's order, `args.steps` steps."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOTrainer
    from trl.experimental.sdpo import SDPOTrainer

    dist = Distributed.create("cpu", args.dtype, True)
    model, tokenizer = dist.load_model(MODEL)
    task = build_task(TASK)
    items = task.examples("train", TASK.seed, TASK.train_size)
    chosen = [ex for s in range(args.steps) for ex in step_examples(items, PROMPTS, s, args.seed)]
    dataset = Dataset.from_dict({"prompt": [ex.messages for ex in chosen],
                                 "item": list(range(len(chosen)))})
    graded: list[int] = []

    def clbench_grade(completions: list, item: list[int], **_: Any) -> list[float]:
        graded.extend(item[::SAMPLES])  # a prompt's generations are consecutive
        return [task.grade(chosen[i], c[0]["content"]).reward for i, c in zip(item, completions)]

    precision = dist.precision
    bf16 = precision.mixed and precision.compute == torch.bfloat16
    reset_accelerate_state()
    trainer_cls = GRPOTrainer if method == "grpo" else SDPOTrainer
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_cls(model=model, reward_funcs=clbench_grade,
                              args=trl_config(method, out, args, bf16),
                              train_dataset=dataset, processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)  # it prints every log dict
        clock = TrlClock(trainer, model)
        trainer.add_callback(clock)
        trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r and "step" in r]
    # SDPO: TRL's token-mean distillation loss, comparable to clbench's (module docstring)
    key = "loss" if method == "grpo" else "self_distillation/distillation_loss"
    lengths = [r.get("completions/mean_length", 0.0) for r in logs]  # mean over the rollouts
    order_ok = graded == list(range(len(chosen)))
    return {"per_step": clock.per_step, "losses": [r.get(key) for r in logs],
            "phases": clock.phases(),
            "gen_tokens_per_step": statistics.mean(lengths or [0.0]) * PROMPTS * SAMPLES,
            "precision": precision.label,
            "note": "" if order_ok else "prompts differ from clbench's (TRL drew another order)"}


# -- the table ---------------------------------------------------------------------------------

def timed_run(impl: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of `impl` with its memory peak; an exception becomes the row's error."""
    runner = clbench_run if impl == "clbench" else trl_run
    try:
        with PeakRss() as rss:
            result = runner(method, args)
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}
    result.update(peak_rss=rss.peak, rss_growth=None if rss.peak is None or rss.start is None
                  else rss.peak - rss.start, threads=torch.get_num_threads())
    return result


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Step seconds and losses of the timed steps (warm-up left out) of all repeats; phases per
    step over all steps; the largest memory peak."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[0]["error"]}
    timed = [s for r in good for s in (r["per_step"][1:] or r["per_step"])]
    losses = [v for r in good for v in (r["losses"][1:] or r["losses"]) if v is not None]
    steps = sum(len(r["per_step"]) for r in good)
    peaks = [r["peak_rss"] for r in good if r["peak_rss"] is not None]
    growths = [r["rss_growth"] for r in good if r["rss_growth"] is not None]
    return {"median": statistics.median(timed), "min": min(timed), "max": max(timed),
            "phases": {p: sum(r["phases"][p] for r in good) / steps for p in PHASES},
            "loss": statistics.mean(losses) if losses else float("nan"),
            "gen_tokens": statistics.mean(r["gen_tokens_per_step"] for r in good),
            "peak_rss": max(peaks) if peaks else None,
            "rss_growth": max(growths) if growths else None,
            "precision": good[0]["precision"], "threads": {r["threads"] for r in good},
            "notes": sorted({r["note"] for r in good if r["note"]}),
            "errors": [r["error"] for r in runs if "error" in r]}


def table_row(method: str, impl: str, s: dict[str, Any], ratio: str) -> str:
    if "error" in s:
        return f"| {method} | {impl} | error: {s['error']} |"
    phases = " | ".join(f"{s['phases'][p]:.2f}" for p in PHASES)
    memory = "-" if s["peak_rss"] is None else f"{s['peak_rss'] / GIB:.2f}" + (
        "" if s["rss_growth"] is None else f" (+{s['rss_growth'] / GIB:.2f})")
    return (f"| {method} | {impl} | {s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}] | "
            f"{phases} | {memory} | {s['loss']:.4g} | {s['gen_tokens']:.0f} | {ratio} |")


def print_table(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    import transformers
    import trl

    precision = next((s["precision"] for m in results.values() for s in m.values()
                      if "precision" in s), "?")
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, trl {trl.__version__}, "
          f"torch threads {torch.get_num_threads()}, {precision}")
    print(f"# {PROMPTS} prompts x {SAMPLES} samples x {args.max_new_tokens} tokens; {args.steps} "
          f"steps per run (the first left out) x {args.repeats} repeats, clbench and TRL "
          "alternating")
    print()
    print("| method | impl | s/step median [min-max] | " + " | ".join(PHASES)
          + " | peak RSS GiB (+growth) | loss | gen tok/step | TRL/clbench |")
    print("|---|---|---|" + "---|" * len(PHASES) + "---|---|---|---|")
    for method, by_impl in results.items():
        ours, theirs = by_impl["clbench"], by_impl["trl"]
        ratio = "-" if "error" in ours or "error" in theirs else \
            f"{theirs['median'] / ours['median']:.2f}"
        print(table_row(method, "clbench", ours, ""))
        print(table_row(method, "TRL", theirs, ratio))
    print()
    print("Phases: seconds per step over all steps (warm-up included); teacher is part of "
          "loss+bwd. clbench prep = grade + score; TRL prep = _prepare_inputs minus generation.")
    print("Losses are on different samples (the two samplers draw differently): compare their "
          "magnitudes, not their values; the loss functions are tested equal in "
          "tests/train/test_losses.py. SDPO's TRL loss is its token-mean distillation loss.")
    print("Peak RSS: VmHWM of this process reset at each run's start (else sampled RSS); the "
          "whole run, model load included.")
    if "sdpo" in results:
        print("SDPO: a step where no rollout gets a teacher costs clbench no update, while TRL "
              "still runs its forwards, a zero backward and an optimizer step (frequent when "
              "completions are cut short).")
    for method, by_impl in results.items():
        for impl, s in by_impl.items():
            for note in s.get("notes", []) + s.get("errors", []):
                print(f"Note ({method}, {impl}): {note}")
            if s.get("threads", {args.threads}) != {args.threads}:
                print(f"Note ({method}, {impl}): torch threads were {sorted(s['threads'])}")


# -- main --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="grpo,sdpo", help="comma-separated: grpo, sdpo")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is a warm-up)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each implementation")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: clbench's share of this machine's cores)")
    ap.add_argument("--max-new-tokens", type=int, default=48,
                    help="token cap of a rollout (48 for the benchmark; less for a quick check)")
    ap.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32 (fp32 weights "
                    "under autocast to it, or plain fp32)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    unknown = [m for m in args.methods.split(",") if m.strip() not in CLBENCH_PARAMS]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; choose from {sorted(CLBENCH_PARAMS)}")
    if args.steps < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("--steps, --repeats and --max-new-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # One thread count for every run: clbench sets torch's from its share of the cores unless
    # OMP_NUM_THREADS is set, and TRL runs in the same process with whatever is in force.
    args.threads = args.threads or run_threads() or torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=r".*deprecated and will be removed in v6")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for method in (m.strip() for m in args.methods.split(",")):
        runs: dict[str, list[dict[str, Any]]] = {"clbench": [], "trl": []}
        for repeat in range(args.repeats):
            for impl, done_runs in runs.items():
                run = timed_run(impl, method, args)
                done_runs.append(run)
                done = run.get("error") or " ".join(f"{s:.2f}" for s in run["per_step"]) + " s"
                print(f"[{method} {impl} {repeat + 1}/{args.repeats}] {done}", file=sys.stderr,
                      flush=True)
        results[method] = {impl: summarise(r) for impl, r in runs.items()}
    print_table(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
