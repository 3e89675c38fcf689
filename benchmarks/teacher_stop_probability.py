"""How likely the SDPO teacher is to stop right after a correct answer, against the student.

Scores the reference solutions of a suite's first task (the starter's math) under four contexts
of the embedded model: the student's own prompt, the SDPO teacher prompt with that solution as
the demonstration, the teacher prompt with verifier feedback only, and with both (which the
teacher sees only under `feedback_with_demo: true`). SDPO supervises the end-of-sequence token
of every response, so a teacher that stops less often than the student trains the student to
keep talking after its answer (docs/results-starter.md).

    .venv/bin/python benchmarks/teacher_stop_probability.py [--items 12] [--set ...]
"""

from __future__ import annotations

import argparse

import torch

from clbench.models import load_model
from clbench.plugins.registry import build_task
from clbench.spec.suites import load_suite
from clbench.tasks.base import continuation
from clbench.train.rollout import encode_chat
from clbench_methods.sdpo.teacher import build_teacher_messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=12)
    parser.add_argument("--suite", default="starter", help="suite whose first stage is used")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="suite override KEY=VALUE, e.g. stages[0].task.params.think=false")
    args = parser.parse_args()
    stage = load_suite(args.suite, args.sets).stages[0]
    model, tok = load_model("smollm2-135m", device="cpu", dtype="float32")
    examples = build_task(stage.task).examples("train", stage.task.seed, args.items)
    contexts = {
        "student prompt": lambda ex: ex.messages,
        "teacher, demonstration": lambda ex: build_teacher_messages(ex.messages, ex.reference,
                                                                    None),
        "teacher, feedback only": lambda ex: build_teacher_messages(
            ex.messages, None, "Your answer 1 is wrong."),
        "teacher, both": lambda ex: build_teacher_messages(  # feedback_with_demo: true
            ex.messages, ex.reference, "Your answer 1 is wrong."),
    }
    for name, make in contexts.items():
        probs = []
        for ex in examples:
            # the response as the model writes it: after any start its prompt holds
            ids = encode_chat(tok, make(ex)) + tok(continuation(ex), add_special_tokens=False)[
                "input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            probs.append(float(torch.softmax(logits, -1)[tok.eos_token_id]))
        print(f"{name:24s} P(stop after the answer): mean {sum(probs) / len(probs):.3f}, "
              f"min {min(probs):.3f} over {len(probs)} items")


if __name__ == "__main__":
    main()
