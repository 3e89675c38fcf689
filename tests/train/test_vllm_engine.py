"""Training rollouts from a colocated vLLM engine (clbench/train/vllm_engine.py), on the CPU
with a fake engine that follows vLLM's interface: the student's weights reach the engine before
every generation, the engine sleeps while the step trains, and the sampler's log-probs turn
into the sampler correction."""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from toy import tiny, toy_context

from clbench.errors import UserError
from clbench.train.logprobs import completion_logprobs
from clbench.train.loop import TrainingLoop
from clbench.train.rollout import HFGenerator, SamplingParams
from clbench.train.vllm_engine import VLLMGenerator, colocated_generator
from methods.grpo import GRPOConfig, GRPOObjective


@dataclass
class FakeSamplingParams:
    """The fields of vLLM's `SamplingParams` clbench sets."""

    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: list[str] | None
    seed: int
    logprobs: int | None


class FakeLLM:
    """vLLM's `LLM` as a colocated trainer uses it, on a bf16 copy of the model (the weights a
    vLLM engine holds); every call is recorded, and generating asleep or with weights other than
    the student's is an error."""

    def __init__(self, student: Any, tokenizer: Any) -> None:
        self.student, self.tokenizer = student, tokenizer
        self.model = copy.deepcopy(student).to(torch.bfloat16)
        self.events: list[str] = []
        self.asleep = {"weights": False, "kv_cache": False}
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load_weights))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=runner)))
        self.loaded: set[str] = set()

    def _load_weights(self, weights: Any) -> None:
        assert not self.asleep["weights"], "weights loaded into a sleeping engine"
        params = dict(self.model.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor.to(torch.bfloat16))
            self.loaded.add(name)

    def sleep(self, level: int = 1) -> None:
        self.events.append(f"sleep {level}")
        self.asleep = {"weights": level == 2, "kv_cache": True}

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.events.append(f"wake {','.join(tags or ['all'])}")
        for tag in tags or list(self.asleep):
            self.asleep[tag] = False

    def reset_prefix_cache(self) -> None:
        self.events.append("reset")

    def generate(self, requests: list[dict], sampling_params: list[FakeSamplingParams],
                 use_tqdm: bool = True) -> list[Any]:
        assert not any(self.asleep.values()), f"generate while asleep: {self.asleep}"
        # the engine holds the student's current weights (as bf16)
        for (name, mine), theirs in zip(self.model.named_parameters(),
                                        self.student.parameters()):
            assert torch.equal(mine, theirs.detach().to(torch.bfloat16)), name
        self.events.append(f"generate {len(self.loaded)}")
        self.loaded.clear()
        gen = HFGenerator(self.model, self.tokenizer, batch_size=64)
        outputs = []
        for request, sp in zip(requests, sampling_params):
            ids = request["prompt_token_ids"]
            rollouts = gen.generate_from_ids([ids], SamplingParams(
                n=sp.n, temperature=sp.temperature, top_p=sp.top_p, max_new_tokens=sp.max_tokens,
                stop=tuple(sp.stop or ()), seed=sp.seed))
            # "processed" log-probs: the sampler's distribution, temperature applied
            scored = completion_logprobs(self.model, [ids] * len(rollouts),
                                         [r.completion_ids for r in rollouts],
                                         temperature=sp.temperature or 1.0)
            outputs.append(SimpleNamespace(prompt_token_ids=ids, outputs=[
                SimpleNamespace(token_ids=r.completion_ids, text=r.text,
                                finish_reason="stop" if r.finished else "length",
                                logprobs=[{t: SimpleNamespace(logprob=float(v))}
                                          for t, v in zip(r.completion_ids, scored.logprobs[i])])
                for i, r in enumerate(rollouts)]))
        return outputs


def test_a_grpo_stage_on_the_fake_engine_pushes_weights_sleeps_and_corrects(
        tmp_path: Path) -> None:
    model, tok = tiny(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    llm = FakeLLM(model, tok)
    log: list[dict] = []
    ctx = toy_context(model, tok, tmp_path, steps=3, lr=3e-2, log=log)
    settings = GRPOConfig(lr=3e-2, sampler_correction="token_truncate")
    objective = GRPOObjective(ctx, settings,
                              generator=VLLMGenerator(llm, tok, model, FakeSamplingParams))
    report = TrainingLoop(ctx, settings, objective).run()
    # the student trained, and before each of the 3 steps the engine took all its weights
    # (checked against the student inside `generate`), woke, generated and slept again
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    names = len(dict(model.named_parameters()))
    step = ["wake weights", "reset", "wake kv_cache", f"generate {names}", "sleep 2"]
    assert llm.events == step * 3
    # bf16 sampling against the fp32 trainer: ratios near 1, not exactly 1
    weights = [r["sampler_weight_mean"] for r in report.steps]
    assert all(0.8 < w < 1.25 for w in weights) and any(w != 1.0 for w in weights)
    assert [r["step"] for r in log] == [1, 2, 3]


def test_rollouts_keep_the_engines_tokens_text_end_and_sampler_logprobs() -> None:
    model, tok = tiny(seed=0)
    llm = FakeLLM(model, tok)
    gen = VLLMGenerator(llm, tok, model, FakeSamplingParams, sleep=False)
    prompts = [tok("abc")["input_ids"], tok("de")["input_ids"]]
    rollouts = gen.generate_from_ids(prompts, SamplingParams(n=2, temperature=1.0,
                                                             max_new_tokens=3, seed=5))
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [(0, 0), (0, 1), (1, 0),
                                                                    (1, 1)]
    assert llm.events == ["reset", f"generate {len(dict(model.named_parameters()))}"]
    for r in rollouts:
        assert r.prompt_ids == prompts[r.prompt_index]
        assert len(r.sampler_logprobs) == r.num_tokens <= 3
        assert all(v <= 0.0 for v in r.sampler_logprobs)
        assert r.finished == (r.num_tokens < 3)  # the tiny model rarely ends in 3 tokens


def test_without_vllm_the_engine_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = tiny(seed=0)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails
    with pytest.raises(UserError, match=r"pip install 'clbench\[vllm\]' \(vLLM 0\.32\.0"):
        colocated_generator(model, tok, seed=0, max_model_len=128)


def test_a_model_without_a_folder_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = tiny(seed=0)  # built from a config: vLLM has nothing to load
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kwargs: pytest.fail("no engine should be built")  # type: ignore[attr-defined]
    fake.SamplingParams = FakeSamplingParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    model.name_or_path = ""
    model.config._name_or_path = ""
    with pytest.raises(UserError, match="needs a model stored as a folder or on the hub"):
        colocated_generator(model, tok, seed=0, max_model_len=128)
