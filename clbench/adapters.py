"""Parameter-efficient adapters: LoRA (through peft) trained instead of the whole model.

`model.adapter: {kind: lora, r, alpha, dropout, target_modules, scope}` injects LoRA layers into
the loaded model in place (peft's `inject_adapter_in_model`): the model keeps its class, so
generation, scoring, checkpoints and every method work on it unchanged, and only the adapters'
parameters train (the rest is frozen; an optimizer takes the trainable parameters only). A
LoRA layer's effective weight is `W + (alpha / r) * B @ A`; B starts at 0, so the adapted model
at the start of training is the base model exactly.

- `scope: run`: one adapter trained across the stages. `scope: stage`: at each stage's end the
  adapter is merged into the base weights and a fresh one (B = 0) trains the next stage.
- What reads weights as the model computes with them (weight drift, the base-model copy of
  response drift, `export-model`) reads the merged weights under the plain model's names
  (:func:`effective_parameters`, :func:`merged_copy`, :func:`stored_weight`).
- `export-model` writes the merged model (loadable with `from_pretrained` alone), or with
  `--adapter-only` the adapter in peft's format (:func:`adapter_files`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clbench.errors import UserError

if TYPE_CHECKING:
    import torch

    from clbench.spec.schema import AdapterSpec

#: peft's name of the one adapter clbench injects.
ADAPTER_NAME = "default"


def attach(model: Any, spec: AdapterSpec) -> None:
    """Inject `spec`'s adapter into `model` in place and freeze everything else (nothing for
    `kind: none`)."""
    if spec.kind == "none":
        return
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ModuleNotFoundError:
        raise UserError("model.adapter.kind=lora needs the `peft` package, which is not "
                        "installed: pip install 'clbench[peft]'") from None
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=spec.target_modules, bias="none")
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as exc:  # e.g. target modules the model does not have
        raise UserError(f"model.adapter: {exc}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_parameter(name))
    model.clbench_adapter = config


def is_adapter_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_adapted(model: Any) -> bool:
    return getattr(model, "clbench_adapter", None) is not None


def _lora_layers(model: Any) -> list[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def effective_parameters(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter as the model computes with it, under the plain model's names: a LoRA
    layer's merged weight as `<layer>.weight`, the adapters' own parameters left out (tied
    weights once). The model's own parameters when it has no adapter."""
    params = dict(model.named_parameters())
    if not is_adapted(model):
        return params
    import torch

    out = {n: p for n, p in params.items()
           if not is_adapter_parameter(n) and ".base_layer." not in n}
    with torch.no_grad():
        for name, layer in _lora_layers(model):
            base = layer.get_base_layer()
            out[f"{name}.weight"] = base.weight + layer.get_delta_weight(ADAPTER_NAME)
            if getattr(base, "bias", None) is not None:
                out[f"{name}.bias"] = base.bias
    return out


def stored_weight(get: Callable[[str], torch.Tensor], keys: set[str], name: str,
                  scaling: float | None) -> torch.Tensor | None:
    """Parameter `name` (a plain model's name) from a stored state of an adapted model (`get`
    reads a tensor, `keys` are the stored names): a LoRA layer's merged weight, or the tensor
    itself; None when it is not there."""
    if name in keys:
        return get(name)
    if scaling is None or not name.endswith(".weight"):
        return None
    layer = name[: -len(".weight")]
    base, a, b = (f"{layer}.base_layer.weight", f"{layer}.lora_A.{ADAPTER_NAME}.weight",
                  f"{layer}.lora_B.{ADAPTER_NAME}.weight")
    if not {base, a, b} <= keys:
        return None
    return get(base) + scaling * (get(b).float() @ get(a).float()).to(get(base).dtype)


def scaling_of(model: Any) -> float | None:
    """The LoRA scaling (alpha / r) of an adapted model, None for a plain one."""
    if not is_adapted(model):
        return None
    config = model.clbench_adapter
    return float(config.lora_alpha) / float(config.r)


def merge_into_base(model: Any) -> None:
    """Fold each adapter into its base weight and start a fresh one (B = 0): the model computes
    the same, and the next stage trains a new adapter (`scope: stage`)."""
    import torch

    with torch.no_grad():
        for _, layer in _lora_layers(model):
            _fold(layer)
            layer.reset_lora_parameters(ADAPTER_NAME, True)


def _fold(layer: Any) -> Any:
    """Add a LoRA layer's update into its base layer's weight (no grad); the base layer."""
    base = layer.get_base_layer()
    base.weight += layer.get_delta_weight(ADAPTER_NAME).to(base.weight.dtype)
    return base


def merged_copy(model: Any) -> Any:
    """A plain copy of an adapted model: each LoRA layer replaced by its base layer with the
    adapter merged in (what `from_pretrained` loads); a deep copy of a plain model."""
    import torch

    plain = copy.deepcopy(model)
    if not is_adapted(plain):
        return plain
    with torch.no_grad():
        for name, layer in _lora_layers(plain):
            base = _fold(layer)
            parent_name, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent_name) if parent_name else plain, child, base)
    plain.clbench_adapter = None
    for p in plain.parameters():
        p.requires_grad_(True)
    return plain


def adapter_files(model: Any, folder: Path) -> None:
    """The adapter alone in peft's format (`adapter_model.safetensors` and
    `adapter_config.json`): `PeftModel.from_pretrained(base_model, folder)` loads it."""
    from safetensors.torch import save_file

    if not is_adapted(model):
        raise UserError("--adapter-only: the run trained no adapter (model.adapter.kind is "
                        "none); export the whole model instead")
    tensors = {f"base_model.model.{n.replace(f'.{ADAPTER_NAME}.', '.')}":
               p.detach().to("cpu").contiguous()
               for n, p in model.named_parameters() if is_adapter_parameter(n)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {k: sorted(v) if isinstance(v, (set, frozenset)) else v
              for k, v in model.clbench_adapter.to_dict().items()}
    config["base_model_name_or_path"] = getattr(model.config, "_name_or_path", None)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True,
                                                           default=str) + "\n")
