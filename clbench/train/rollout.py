"""Rollouts: sampling completions of chat prompts, the interface and its transformers backend.

A :class:`Generator` turns chat prompts into :class:`Rollout` records (n samples per prompt).
:class:`HFGenerator` decodes batches of left-padded prompts with a KV cache through the loop of
:mod:`clbench.train.decoding` (`model.generate` for models whose cache that loop cannot run);
another backend (vLLM, :mod:`clbench.train.vllm_engine`) only has to implement
:meth:`Generator.generate_from_ids`, and report its sampler's log-probs when it samples from
weights other than the trained ones (`Rollout.sampler_logprobs`).

Conventions every backend keeps:
- prompts are chats, encoded with `apply_chat_template(add_generation_prompt=True)` (and the start
  of the response, when a chat holds one: :func:`encode_chat`);
- rollouts come out prompt-major: all samples of prompt 0, then prompt 1, ...;
- EOS: the completion ids end with the EOS token (the model did emit it, and training on it teaches
  stopping); the text never contains it;
- stop strings: the text is cut right before the earliest stop string; the ids keep every token up
  to and including the one that completed the stop string; `finished` is then True;
- `finished` is False only when the token cap ran out first: `max_new_tokens`, or a prompt's
  own cap in `prompt_max_new_tokens` (a row holds what the same batch and seed would give it
  under a uniform cap of that size: the cap cuts a row, it never changes what the row draws);
- temperature 0 means greedy; otherwise pure sampling at that temperature with nucleus `top_p`
  (no top-k, no repetition penalty: the log-probs the methods compute must describe the sampler);
- the same `seed`, inputs, batch size and device give the same samples;
- the samples of a prompt share one prefill of it, and a row's draws depend on its own logits
  alone (:mod:`clbench.train.decoding`): the same distribution as separate prefills, though in
  bf16 some samples differ (a batch of another shape rounds differently, and a sampled token
  near a tie flips);
- under mixed precision (an enclosing autocast) each weight is cast to the compute dtype once per
  generation call, not once per decoded token (:func:`weights_cast_once`): the same values, so
  the same samples (benchmarks/generation.py measures the gain, docs/performance.md); greedy
  decoding may instead hold the weights in the compute dtype and run without autocast
  (`greedy_weights="compute"`, evaluation's default: :func:`weights_in_compute_dtype`), which
  sampled decoding never does;
- batches: `batch_size` rows, or with a `token_budget` as many rows as fit it
  (:func:`row_batches`: evaluation on a CPU).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clbench.errors import UserError
from clbench.tasks.base import Example, Messages, continuation, split_response_start
from clbench.train import decoding, prompt_lookup
from clbench.train.decoding import row_batches

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from clbench.spec.schema import Budget, DecodingSpec


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: samples per prompt, temperature (0 = greedy), nucleus, length, stops, seed.

    `prompt_max_new_tokens`, when given, holds one cap per prompt (each at most
    `max_new_tokens`): the joint reference trains items of several stages at once, each under
    its own stage's cap.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int = 0
    prompt_max_new_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.prompt_max_new_tokens is not None and any(
                not 1 <= c <= self.max_new_tokens for c in self.prompt_max_new_tokens):
            raise ValueError(f"each prompt's max_new_tokens must lie in [1, "
                             f"{self.max_new_tokens}], got {list(self.prompt_max_new_tokens)}")

    def cap_of(self, prompt_index: int) -> int:
        """The token cap of one prompt's rollouts."""
        if self.prompt_max_new_tokens is None:
            return self.max_new_tokens
        return self.prompt_max_new_tokens[prompt_index]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_budget(cls, budget: Budget, seed: int = 0, stop: Sequence[str] = ()
                    ) -> SamplingParams:
        """Training rollouts of a stage: `samples_per_prompt` samples at the budget's
        temperature."""
        return cls(n=budget.samples_per_prompt, temperature=budget.temperature,
                   top_p=budget.top_p, max_new_tokens=budget.max_new_tokens, stop=tuple(stop),
                   seed=seed)

    @classmethod
    def from_decoding(cls, decoding: DecodingSpec, seed: int = 0, stop: Sequence[str] = ()
                      ) -> SamplingParams:
        """Evaluation decoding of a protocol: one sample per prompt (greedy by default)."""
        return cls(n=1, temperature=decoding.temperature, top_p=decoding.top_p,
                   max_new_tokens=decoding.max_new_tokens, stop=tuple(stop), seed=seed)


@dataclass
class Rollout:
    """One sampled completion of one prompt."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finished: bool
    metadata: dict = field(default_factory=dict)
    #: log-prob of each completion token under the engine's own sampler, when the engine is not
    #: the trained model (vLLM); None from the decode loop, which samples from the trained
    #: weights (:mod:`clbench.train.sampler_correction`)
    sampler_logprobs: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.completion_ids)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> list[int]:
    """Token ids of a chat prompt ending with the assistant generation header, then the start
    of the response when the chat ends with one (:func:`clbench.tasks.base.split_response_start`:
    a final assistant turn the model continues, written after the header as it is, the way
    reasoning models' templates open their `<think>` block; independent of how a template or a
    transformers version would close or strip such a turn)."""
    # The template already writes any BOS it wants; adding special tokens again would double it.
    return list(tokenizer(chat_prompt_text(tokenizer, messages),
                          add_special_tokens=False)["input_ids"])


def encode_reference(tokenizer: PreTrainedTokenizerBase, example: Example,
                     append_eos: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of `example` answered by its reference solution: the response
    is the reference after the start its prompt already holds, then the EOS token when
    `append_eos` (what SFT trains on and what EWC's Fisher scores)."""
    prompt = encode_chat(tokenizer, example.messages)
    response = list(tokenizer(continuation(example), add_special_tokens=False)["input_ids"])
    if append_eos and tokenizer.eos_token_id is not None:
        response.append(int(tokenizer.eos_token_id))
    return prompt, response


def chat_prompt_text(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> str:
    """The text :func:`encode_chat` encodes: the chat template with the generation header,
    then the start of the response when the chat holds one."""
    head, start = split_response_start(messages)
    return tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=False) + start


class Generator(ABC):
    """Samples completions. Backends implement :meth:`generate_from_ids`."""

    tokenizer: PreTrainedTokenizerBase

    def generate(self, prompts: Sequence[Messages], params: SamplingParams) -> list[Rollout]:
        """`params.n` rollouts per chat prompt, prompt-major."""
        return self.generate_from_ids([encode_chat(self.tokenizer, m) for m in prompts], params)

    @abstractmethod
    def generate_from_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams
                          ) -> list[Rollout]:
        """`params.n` rollouts per already-encoded prompt, prompt-major; a backend honours
        each prompt's cap (:meth:`SamplingParams.cap_of`)."""


#: How :class:`HFGenerator` holds the weights for greedy decoding under mixed precision
#: (`ModelSpec.eval_weights`).
GREEDY_WEIGHTS = ("master", "compute")


#: How :class:`HFGenerator` decodes (`ModelSpec.generation`): `loop`, clbench's decode loop
#: (:mod:`clbench.train.decoding`); `static`, transformers' `generate` over a static KV cache,
#: whose decoding step transformers compiles (`torch.compile`, CUDA graphs) on a GPU.
GENERATION_ENGINES = ("loop", "static")


def evaluation_engine(generation: str) -> str:
    """The :class:`HFGenerator` engine evaluation uses under `ModelSpec.generation`: its own, or
    the decode loop for an engine that only draws training rollouts (`vllm`)."""
    return generation if generation in GENERATION_ENGINES else "loop"


class HFGenerator(Generator):
    """`transformers` models: batches of `batch_size` sequences, left padded, KV cache.

    `engine` (:data:`GENERATION_ENGINES`): the decode loop drops ended rows and shares a
    prompt's prefill among its samples, which is what a CPU needs; a small model on a GPU is
    bound by kernel launches instead, which a static cache lets transformers capture once
    (fixed shapes: every row decodes until the batch ends). Greedy tokens are the same on the
    same weights and dtype uncompiled; sampled draws differ between the engines, and `static`
    measures no rollout entropy."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 batch_size: int = 16, engine: str = "loop", token_budget: int | None = None,
                 greedy_weights: str = "master", drafts: int = 0, fused: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if engine not in GENERATION_ENGINES:
            raise ValueError(f"engine must be one of {', '.join(GENERATION_ENGINES)}, "
                             f"got {engine!r}")
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if drafts < 0:
            raise ValueError(f"drafts must be >= 0, got {drafts}")
        if greedy_weights not in GREEDY_WEIGHTS:
            raise ValueError(f"greedy_weights must be one of {', '.join(GREEDY_WEIGHTS)}, "
                             f"got {greedy_weights!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.engine = engine
        #: when set, a batch holds at most `batch_size` rows and at most this many tokens of
        #: prompt (padded to the batch's longest) and token cap per row (:func:`row_batches`)
        self.token_budget = token_budget
        #: greedy decoding under mixed precision: `master`, the fp32 weights under autocast;
        #: `compute`, the weights held in the compute dtype (:func:`weights_in_compute_dtype`)
        self.greedy_weights = greedy_weights
        #: prompt-lookup drafts scored with each new token in greedy decoding by the decode
        #: loop (:mod:`clbench.train.prompt_lookup`); 0: one token per forward
        self.drafts = drafts
        #: the decode loop computes Llama-family models through their fused projections
        #: (:mod:`clbench.train.fused_forward`; others keep transformers' forward)
        self.fused = fused

    def eos_token_ids(self) -> set[int]:
        """Every id that ends a completion: the tokenizer's EOS and the model's configured ones."""
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif configured:
            ids.update(int(i) for i in configured)
        return ids

    def generate_from_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams
                          ) -> list[Rollout]:
        caps = params.prompt_max_new_tokens
        if caps is not None and len(caps) != len(prompt_ids):
            raise ValueError(f"{len(caps)} prompt caps for {len(prompt_ids)} prompts")
        rows = [(p, s) for p in range(len(prompt_ids)) for s in range(params.n)]
        eos_ids = self.eos_token_ids()
        was_training = self.model.training
        self.model.eval()
        out: list[Rollout] = []
        device_type = self.model.device.type
        weights = weights_in_compute_dtype(self.model, device_type) \
            if params.greedy and self.greedy_weights == "compute" \
            else weights_cast_once(device_type)
        batches = row_batches([len(prompt_ids[p]) + params.cap_of(p) for p, _ in rows],
                              self.batch_size, self.token_budget)
        try:
            with weights:
                forward = self._forward_model(device_type)
                for batch_no, (start, stop) in enumerate(batches):
                    out += self._generate_rows(prompt_ids, rows[start:stop], params, eos_ids,
                                               batch_no, forward)
            return out
        finally:
            self.model.train(was_training)

    def _forward_model(self, device_type: str) -> Any:
        """What the decode loop calls for the call's forwards: the fused forward over the
        weights as they are now (cast to an enclosing autocast's dtype, as autocast would
        cast them), or the model itself."""
        from clbench.train.fused_forward import decoding_forward

        if not self.fused or self.engine != "loop":
            return self.model
        return decoding_forward(self.model, device_type)

    def _generate_rows(self, prompt_ids: Sequence[list[int]], chunk: list[tuple[int, int]],
                       params: SamplingParams, eos_ids: set[int], batch_no: int,
                       forward: Any) -> list[Rollout]:
        """One batch of (prompt, sample) rows; `forward`: the model the decode loop calls."""
        import torch

        sequences = [list(prompt_ids[p]) for p, _ in chunk]
        row_caps = [params.cap_of(p) for p, _ in chunk]
        with torch.random.fork_rng(devices=self._rng_devices()):
            # One seed per batch, so a batch's samples do not depend on earlier batches.
            torch.manual_seed(_batch_seed(params.seed, batch_no))
            entropy = [0.0] * len(chunk)
            generated = self._generate_batch(sequences, params, eos_ids, row_caps,
                                             [p for p, _ in chunk], entropy, forward)
        out: list[Rollout] = []
        for (p, s), ids, cap, h in zip(chunk, generated, row_caps, entropy):
            completion, text, finished = finish_completion(ids[:cap], self.tokenizer, eos_ids,
                                                           params.stop)
            rollout = Rollout(p, s, list(prompt_ids[p]), completion, text, finished)
            if ids and h == h:  # NaN: not measured
                rollout.metadata["entropy"] = h / len(ids)
            out.append(rollout)
        return out

    def _rng_devices(self) -> list:
        device = self.model.device
        return [device] if device.type == "cuda" else []

    def _generate_batch(self, sequences: list[list[int]], params: SamplingParams,
                        eos_ids: set[int], row_caps: list[int], row_prompts: list[int],
                        entropy: list[float], forward: Any) -> list[list[int]]:
        """Generated ids per row, ending at the token that ended it (the caller trims at EOS
        and stop strings); `row_prompts`: each row's prompt index (a prompt's samples share
        it). The decode loop of :mod:`clbench.train.decoding` (which adds each row's summed
        token entropies to `entropy`), or `generate` for the `static` engine and for a model
        whose cache the loop cannot run (which measures none: `entropy` becomes NaN)."""
        import torch

        pad_id = self.tokenizer.pad_token_id
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, seq in enumerate(sequences):
            input_ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            attention[i, width - len(seq):] = 1
        device = self.model.device
        input_ids, attention = input_ids.to(device), attention.to(device)
        stops = decoding.StopScanner(self.tokenizer, params.stop) if params.stop else None
        cache = None if self.engine == "static" else decoding.attention_cache(
            self.model, capacity=width + max(row_caps))
        with torch.no_grad():
            if cache is not None:
                plan = decoding.RowPlan(row_prompts, row_caps, frozenset(eos_ids), stops)
                if params.greedy and self.drafts:
                    return prompt_lookup.decode_with_drafts(self.model, input_ids, attention, plan,
                                                            cache, self.drafts, pad_id)
                return decoding.decode(forward, input_ids, attention, plan,
                                       decoding.Sampling(params.temperature, params.top_p), cache,
                                       entropy=entropy)
            entropy[:] = [float("nan")] * len(entropy)
            return self._generate_with_transformers(input_ids, attention, params, eos_ids,
                                                    row_caps, stops)

    def _generate_with_transformers(self, input_ids: torch.Tensor, attention: torch.Tensor,
                                    params: SamplingParams, eos_ids: set[int],
                                    row_caps: list[int], stops: Any) -> list[list[int]]:
        """`model.generate` (the `static` engine, and models with recurrent layers or their
        own cache): every row decodes until the batch ends, each sample prefills its prompt."""
        from transformers import GenerationConfig, StoppingCriteriaList

        width = input_ids.shape[1]
        # A fresh config, not the model's, and the model's hidden while generating
        # (:func:`checkpoint_defaults_hidden`): checkpoints ship sampling defaults (top_k=50,
        # repetition penalties) that would make the sampler differ from the scored policy.
        config = GenerationConfig(
            max_new_tokens=max(row_caps), do_sample=not params.greedy,
            temperature=params.temperature if not params.greedy else None,
            top_p=params.top_p if not params.greedy else None, top_k=0 if not params.greedy
            else None, eos_token_id=sorted(eos_ids) or None,
            pad_token_id=self.tokenizer.pad_token_id, bos_token_id=None, use_cache=True,
            cache_implementation="static" if self.engine == "static" else None)
        criteria = StoppingCriteriaList()
        if stops is not None:
            criteria.append(StopStringCriteria(stops, width))
        if min(row_caps) < max(row_caps):
            criteria.append(RowCapCriteria(row_caps, width))
        if self.engine == "static":
            check_static_cache_support(self.model.device.type)
        with checkpoint_defaults_hidden(self.model, config):
            result = self.model.generate(input_ids=input_ids, attention_mask=attention,
                                         generation_config=config, stopping_criteria=criteria)
        return result[:, width:].tolist()


#: The first transformers whose static KV cache takes the keys of a mixed-precision forward
#: (before it, a prefill's float32 keys and a decoding step's bf16 ones collide in the cache).
STATIC_CACHE_MIXED_PRECISION = (5, 24)


def check_static_cache_support(device_type: str) -> None:
    """Refuse the `static` engine under autocast with a transformers that cannot run it."""
    import torch
    import transformers

    if not torch.is_autocast_enabled(device_type):
        return
    found = tuple(int(part) for part in transformers.__version__.split(".")[:2]
                  if part.isdigit())
    if found < STATIC_CACHE_MIXED_PRECISION:
        need = ".".join(map(str, STATIC_CACHE_MIXED_PRECISION))
        raise UserError(f"model.generation: static under mixed precision needs transformers >= "
                        f"{need} (this environment has {transformers.__version__}); upgrade "
                        "it, or use model.generation: loop or model.mixed_precision: false")


@contextmanager
def checkpoint_defaults_hidden(model: Any, config: Any) -> Iterator[None]:
    """While generating, the model's own generation config is `config`.

    transformers (5.x) fills every setting a passed config leaves unset from the checkpoint's
    generation config, so a checkpoint's `repetition_penalty`, `min_p` or `num_beams` would reach
    the sampler and the samples would no longer come from the policy the methods score."""
    saved = getattr(model, "generation_config", None)
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = saved


@contextmanager
def weights_cast_once(device_type: str) -> Iterator[None]:
    """Inside an enclosing autocast (mixed precision), keep each weight's cast to the compute
    dtype for the whole block instead of casting it again at every forward.

    A run's autocast has its cast cache off, because it spans optimizer steps and a cached cast
    would outlive the weights it came from. A generation call changes no weight, and it runs one
    forward per new token, so there it casts once and the cache is dropped on the way out (the
    next call sees the weights as they are then). Outside an autocast it does nothing."""
    import torch

    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                        cache_enabled=True):
        try:
            yield
        finally:
            torch.clear_autocast_cache()


@contextmanager
def weights_in_compute_dtype(model: Any, device_type: str) -> Iterator[None]:
    """Inside an enclosing autocast (mixed precision), hold the model's floating-point
    parameters in the autocast dtype for the block and compute without autocast.

    The matrix multiplies see the same bf16 weights as under autocast, but no activation is cast
    at each forward (13% of a CPU decoding step) and the element-wise work (norms, residual
    additions, the KV cache) runs in bf16 instead of fp32: completions differ where a near-tie
    rounds the other way (docs/performance.md measures what it does to scores). The fp32
    master weights are put back on the way out, the same tensors, untouched. Outside an
    autocast, or with weights that are not plain tensors (sharded), it does nothing but keep
    the casts for the block (:func:`weights_cast_once`)."""
    import torch

    compute = torch.get_autocast_dtype(device_type)
    params = [p for p in model.parameters() if p.dtype == torch.float32]
    if not torch.is_autocast_enabled(device_type) or compute == torch.float32 or \
            any(type(p.data) is not torch.Tensor for p in params):
        with weights_cast_once(device_type):
            yield
        return
    masters = [p.data for p in params]
    try:
        for p in params:
            p.data = p.data.to(compute)
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        for p, master in zip(params, masters):
            p.data = master


class StopStringCriteria:
    """`generate`'s stopping criterion for stop strings: a row is done once its newest tokens
    hold one (:class:`clbench.train.decoding.StopScanner`; exact for any tokenizer, where
    transformers' own matcher reasons about token spellings and misfires on character-level
    vocabularies)."""

    def __init__(self, scanner: Any, prompt_width: int) -> None:
        self.scanner = scanner
        self.prompt_width = prompt_width

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        done = [self.scanner.hit(row[self.prompt_width:]) for row in input_ids.tolist()]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class RowCapCriteria:
    """Marks each row done at its own token cap, so the batch ends as soon as every row is
    done (it runs to the largest cap otherwise); the ids past a row's cap are cut by the
    caller either way."""

    def __init__(self, caps: Sequence[int], prompt_width: int) -> None:
        self.caps = list(caps)
        self.prompt_width = prompt_width

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        made = input_ids.shape[1] - self.prompt_width
        return torch.tensor([made >= c for c in self.caps], dtype=torch.bool,
                            device=input_ids.device)


def _batch_seed(seed: int, batch_no: int) -> int:
    return (seed * 1_000_003 + batch_no) % (2**63 - 1)


def finish_completion(generated: list[int], tokenizer: PreTrainedTokenizerBase,
                      eos_ids: set[int], stop: Sequence[str] = ()
                      ) -> tuple[list[int], str, bool]:
    """Trim raw generated ids at EOS or the earliest stop string: `(ids, text, finished)`.

    See the module docstring for what is kept on each side of the cut.
    """
    ids = list(generated)
    finished = False
    for i, tok in enumerate(ids):
        if tok in eos_ids:
            ids, finished = ids[:i + 1], True
            break
    body = ids[:-1] if finished else ids
    text = tokenizer.decode(body, skip_special_tokens=True)
    cut = _earliest_stop(text, stop)
    if cut is None:
        return ids, text, finished
    # Fewest tokens whose decoded text already contains a stop string (containment grows with
    # the prefix, so bisect).
    lo, hi = 1, len(body)
    while lo < hi:
        mid = (lo + hi) // 2
        if _earliest_stop(tokenizer.decode(body[:mid], skip_special_tokens=True), stop) is None:
            lo = mid + 1
        else:
            hi = mid
    return body[:lo], text[:cut], True


def _earliest_stop(text: str, stop: Sequence[str]) -> int | None:
    positions = [p for p in (text.find(s) for s in stop) if p >= 0]
    return min(positions) if positions else None
