"""Training rollouts from a vLLM engine colocated in each training process (`model.generation:
vllm`), as TRL's `vllm_mode="colocate"` runs it.

Each process holds its own engine (tensor parallel 1, vLLM's `external_launcher` executor, so
it lives inside the launched process), built once per run from the model's folder. Before every
generation call the engine takes the student's current weights (vLLM's `load_weights`, one
parameter at a time, from the plain student `ctx.model`, which under sharding is the whole copy
the loop refreshes after each optimizer step); with sleep mode the engine then wakes its KV
cache, generates, and goes back to sleep (level 2: weights and cache released), so that its
memory is free while the step trains. Its sampler reports the log-prob of every sampled token
after temperature and nucleus (`logprobs_mode="processed_logprobs"`), which the on-policy
trainer turns into the sampler correction (:mod:`clbench.train.sampler_correction`).

Evaluation keeps the decode loop: greedy rows stay comparable across engines.

:class:`VLLMGenerator` only needs an object with vLLM's `LLM` interface (`generate`, `sleep`,
`wake_up`, `reset_prefix_cache`, the model runner's `load_weights`) and its `SamplingParams`
class: the tests give it a fake engine on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clbench.errors import UserError
from clbench.train.rollout import Generator, Rollout, SamplingParams

#: The vLLM release `pip install clbench[vllm]` installs: the one built for the pinned torch.
VLLM_VERSION = "0.32.0"


class VLLMGenerator(Generator):
    """Rollouts from `llm` (vLLM's `LLM`, or an object with its interface) after pushing the
    weights of `model` (the plain student) into it; `sampling_params` is vLLM's
    `SamplingParams` class (or the fake's)."""

    def __init__(self, llm: Any, tokenizer: Any, model: Any, sampling_params: Any,
                 sleep: bool = True) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.model = model
        self.sampling_params = sampling_params
        self.sleep = sleep

    def sync_weights(self) -> None:
        """The student's current weights into the engine (woken first when asleep: a level-2
        sleep discards them), and its prefix cache emptied (it holds the old weights' keys)."""
        import torch

        from clbench.train.distributed import unwrap

        if self.sleep:
            self.llm.wake_up(tags=["weights"])
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        with torch.no_grad():
            for name, param in unwrap(self.model).named_parameters():
                runner.load_weights([(name, param.detach())])
        self.llm.reset_prefix_cache()

    def generate_from_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams
                          ) -> list[Rollout]:
        self.sync_weights()
        requests = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        sampling = [self.sampling_params(
            n=params.n, temperature=params.temperature, top_p=params.top_p,
            max_tokens=params.cap_of(i), stop=list(params.stop) or None,
            seed=params.seed * 1_000_003 + i, logprobs=0) for i in range(len(prompt_ids))]
        if self.sleep:
            self.llm.wake_up(tags=["kv_cache"])
        try:
            outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        finally:
            if self.sleep:  # weights and cache released while the step trains
                self.llm.sleep(level=2)
        rollouts = []
        for p, output in enumerate(outputs):
            for s, sample in enumerate(output.outputs):
                ids = [int(t) for t in sample.token_ids]
                logprobs = None if sample.logprobs is None else \
                    [float(step[t].logprob) for t, step in zip(ids, sample.logprobs)]
                rollouts.append(Rollout(p, s, list(prompt_ids[p]), ids, sample.text,
                                        sample.finish_reason != "length",
                                        sampler_logprobs=logprobs))
        return rollouts


_ENGINES: dict[tuple[Any, ...], Any] = {}


def colocated_generator(model: Any, tokenizer: Any, *, seed: int, max_model_len: int,
                        gpu_memory_utilization: float = 0.3) -> VLLMGenerator:
    """A :class:`VLLMGenerator` on this process's engine for `model` (built on first use and
    kept for the run: building one takes a minute and most of its memory)."""
    try:
        from vllm import LLM
        from vllm import SamplingParams as VLLMSamplingParams
    except ImportError:
        raise UserError(f"model.generation: vllm needs vLLM: pip install 'clbench[vllm]' "
                        f"(vLLM {VLLM_VERSION}, built for the pinned torch; a CUDA GPU)") from None
    path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if not path:
        raise UserError("model.generation: vllm needs a model stored as a folder or on the hub "
                        "(vLLM loads it by name); a model built from a config has neither")
    key = (path, seed, max_model_len, gpu_memory_utilization)
    if key not in _ENGINES:
        _ENGINES[key] = LLM(model=path, tensor_parallel_size=1, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len, enable_sleep_mode=True,
                            distributed_executor_backend="external_launcher",
                            logprobs_mode="processed_logprobs", dtype="bfloat16")
        _ENGINES[key].sleep(level=2)
    return VLLMGenerator(_ENGINES[key], tokenizer, model, VLLMSamplingParams)
