"""A decoding forward for Llama-family models with their projections fused.

The decode loop (:mod:`clbench.train.decoding`) runs one forward per new token. On a CPU a
small model's decoding step is bound by the number of operations as much as by their
arithmetic: transformers' forward builds a 4-D attention mask at every step and runs three
query/key/value and two gate/up matrix multiplies per layer, each reading the same
activations. :class:`FusedDecoder` computes the same layers over the same weights with the
query, key and value projections as one matrix multiply and the gate and up projections as
another (their weights concatenated once per generation call, and on a CPU with bf16 weights
packed once for oneDNN's decoding-sized products, :data:`PACKED_ROWS`), and hands attention
the 2-D padding mask as a boolean mask at a decoding step and an additive one, made once per
forward, at a prefill (none at all for a prefill with no past, where the causal kernel
runs). A decoding step (one new token a row) attends over the preallocated cache's whole
buffers, the unfilled columns masked, with two batched matrix multiplies: on a CPU as fast as
transformers' SDPA attention over the filled slice for long caches and 1.4-1.5x faster for
short ones (docs/performance.md, "A decoding forward with fused projections" and "Weights
packed for decoding steps, and a leaner prefill").

Every other operation is the model's, in the same order and dtype, so under an enclosing
autocast it computes what transformers computes under it (the fused weights are cast to the
compute dtype when built, as autocast casts each weight): in fp32 the logits agree to float
rounding (tests/train/test_fused_forward.py), in bf16 a near-tie may round the other way, as
in any batch of another shape.

It takes models whose layers are plain Llama decoder layers (:func:`fused_decoder` says which:
Llama, Qwen2 and Mistral without a sliding window, SmolLM2 among them); others, models whose
projections are wrapped (LoRA adapters, quantized layers), sharded weights (FSDP2's) and models
with forward hooks on modules whose forward it does not call keep transformers' forward.
It looks like a model to the decode loop: `config`, a KV cache of transformers' kind, and a
forward that takes `input_ids`, `attention_mask`, `position_ids`, `cache` and
`logits_to_keep` and returns an object with `.logits`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from clbench.train import decoding

#: `config.model_type` of the families whose decoder layers this forward computes.
FUSED_MODEL_TYPES = ("llama", "qwen2", "mistral")

#: A projection over at most this many rows (a decoding step's batch) multiplies by its weight
#: packed once per generation call in oneDNN's blocked layout, where the weights are bf16 on a
#: CPU with bf16 support: the same products bit for bit, 1.2-1.9x faster at 1-100 rows on the
#: embedded model's shapes (a decoding step reads every weight once and is bound by how it
#: streams them); longer inputs (prefills) keep the plain layout, where packing gained nothing
#: (`benchmarks/generation.py --compare packed`). 0 turns packing off.
PACKED_ROWS = 256

#: Under autocast, cast queries and keys to the compute dtype once, after the rotary embedding
#: (the residual's dtype, fp32), so that the cache holds the keys as attention reads them:
#: autocast would cast them at every attention call, a decoding step re-casting every layer's
#: whole cache. The same values (tests/train/test_fused_forward.py); a speed constant
#: (`benchmarks/generation.py --compare keys`).
CAST_KEYS_ONCE = True


class _Projection:
    """A linear map `x W^T + b`, its weight also packed for oneDNN where :data:`PACKED_ROWS`
    says so (:func:`_packed`), the packed form taken for inputs of at most that many rows."""

    def __init__(self, weight: Any, bias: Any = None) -> None:
        import torch
        import torch.nn.functional as F

        self.weight, self.bias = weight, bias
        self.packed = _packed(weight)
        # the operators looked up once: a call runs for every projection of every step
        self.plain = F.linear
        self.packed_linear = None if self.packed is None else \
            torch.ops.mkldnn._linear_pointwise

    @property
    def dtype(self) -> Any:
        return self.weight.dtype

    def __call__(self, x: Any) -> Any:
        if self.packed_linear is not None and x.numel() <= PACKED_ROWS * x.shape[-1]:
            # autocast has no rule for this operator: the input is cast as autocast casts it
            return self.packed_linear(x.to(self.weight.dtype), self.packed, self.bias,
                                      "none", [], "")
        return self.plain(x, self.weight, self.bias)


def _packed(weight: Any) -> Any:
    """`weight` in oneDNN's blocked layout for matrix multiplies of few rows, or None where
    that does not apply: packing off, not a CPU bf16 weight, no oneDNN bf16 support, or a torch
    without the operators."""
    import torch

    if not PACKED_ROWS or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 \
            or not _onednn_bf16():
        return None
    try:
        # the batch size oneDNN is told to expect: at 16 and 64 the products are F.linear's
        # bit for bit at 1-200 rows; at 1 they were not for 50 rows and more
        return torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def _onednn_bf16() -> bool:
    """Whether this torch has oneDNN with bf16 support on this CPU (asked once per process,
    not for each of a model's weights at every generation call)."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass
class _Layer:
    """One decoder layer's fused projections and its norms."""

    qkv: _Projection
    o: _Projection
    gate_up: _Projection
    down: _Projection
    input_norm: Any
    post_norm: Any


def fused_decoder(model: Any, dtype: Any = None) -> FusedDecoder | None:
    """A :class:`FusedDecoder` over `model`'s weights (cast to `dtype` when given: an
    autocast's compute dtype), or None where this forward does not compute the model's layers
    exactly: another architecture, a sliding window, a non-SiLU MLP, projections that are not
    plain linear layers, forward hooks on its modules (which this forward would not call), or
    weights that are not plain tensors (sharded)."""
    import torch

    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or getattr(config, "model_type", None) not in FUSED_MODEL_TYPES \
            or inner is None or not hasattr(inner, "layers") \
            or getattr(config, "hidden_act", None) != "silu" \
            or (getattr(config, "sliding_window", None) and getattr(
                config, "use_sliding_window", config.model_type == "mistral")) \
            or any(kind != "full_attention" for kind in getattr(config, "layer_types", None)
                   or ()) \
            or getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    linear = torch.nn.Linear
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or any(
                type(getattr(attn, name, None)) is not linear
                for name in ("q_proj", "k_proj", "v_proj", "o_proj")) or any(
                type(getattr(mlp, name, None)) is not linear
                for name in ("gate_proj", "up_proj", "down_proj")) \
                or any(getattr(mlp, name).bias is not None for name in
                       ("gate_proj", "up_proj", "down_proj")) \
                or len({getattr(attn, name).bias is None
                        for name in ("q_proj", "k_proj", "v_proj")}) > 1 \
                or set(dict(layer.named_children())) != {
                    "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"} \
                or set(dict(attn.named_children())) != {"q_proj", "k_proj", "v_proj", "o_proj"}:
            return None
    if type(getattr(model, "lm_head", None)) is not linear or model.lm_head.bias is not None:
        return None
    if _hooked(model) or any(type(p) is not torch.nn.Parameter or type(p.data) is not torch.Tensor
                             for p in model.parameters()):  # hooks, or sharded weights
        return None
    return FusedDecoder(model, dtype)


def decoding_forward(model: Any, device_type: str) -> Any:
    """What the decode loop calls for its forwards now: the fused forward over `model`'s
    weights as they are (cast to an enclosing autocast's dtype, as autocast would cast them),
    or `model` itself where :func:`fused_decoder` does not apply."""
    import torch

    dtype = torch.get_autocast_dtype(device_type) \
        if torch.is_autocast_enabled(device_type) else None
    return fused_decoder(model, dtype) or model


def _hooked(model: Any) -> bool:
    """Whether a forward hook is registered on a module whose forward this forward does not
    call (the model, its layers, attention and MLP blocks, projections, head), or on every
    module: whoever registered it expects that forward to run. The modules this forward calls
    as modules (embeddings, norms, rotary embedding) run their hooks, such as the one
    transformers puts on the embeddings for activation checkpointing
    (`enable_input_require_grads`)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    inner = model.model
    called = {id(inner.embed_tokens), id(inner.norm), id(inner.rotary_emb)} | {
        id(norm) for layer in inner.layers
        for norm in (layer.input_layernorm, layer.post_attention_layernorm)}
    return any((m._forward_hooks or m._forward_pre_hooks) and id(m) not in called
               for m in model.modules())


class FusedDecoder:
    """The forward of a Llama-family causal LM with fused projections (module docstring)."""

    def __init__(self, model: Any, dtype: Any = None) -> None:
        import torch

        self.model, self.config = model, model.config
        self.attention_dtype = dtype if CAST_KEYS_ONCE else None
        inner = model.model
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = self.config.num_attention_heads
        self.kv_heads = self.config.num_key_value_heads
        self.scaling = first.scaling

        def cast(t: Any) -> Any:
            return t if t is None or dtype is None else t.to(dtype)

        def joined(*parts: Any) -> Any:
            return None if parts[0] is None else cast(torch.cat(parts))

        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append(_Layer(
                    qkv=_Projection(joined(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                                    joined(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)),
                    o=_Projection(cast(a.o_proj.weight), cast(a.o_proj.bias)),
                    gate_up=_Projection(joined(m.gate_proj.weight, m.up_proj.weight)),
                    down=_Projection(cast(m.down_proj.weight)),
                    input_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm))
            self.lm_head = _Projection(cast(model.lm_head.weight))
        self.intermediate = inner.layers[0].mlp.gate_proj.out_features
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return True

    @property
    def device(self) -> Any:
        return self.model.device

    def __call__(self, **kwargs: Any) -> Any:
        return self.forward(**kwargs)

    def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, cache: Any,
                use_cache: bool = True, logits_to_keep: Any = None) -> Any:
        """Logits of `input_ids` (rows x new tokens) after what `cache` holds; the cache gets
        their keys and values. `attention_mask` covers the cache's columns and the new ones
        (0: padding); `logits_to_keep`, positions of the new tokens whose logits are wanted."""
        import torch
        import torch.nn.functional as F

        rows, new = input_ids.shape
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        past = cache.get_seq_length() if cache is not None else 0
        mask = None
        if past or not bool(attention_mask.all()):
            # new token j of a row sees the cache's columns up to its own (past + j) that are
            # not padding, and its own column always: a padding token that saw nothing would
            # make NaNs, which reach real tokens through the zero weights of masked columns
            columns = torch.arange(past + new, device=input_ids.device)[None, :]
            own = past + torch.arange(new, device=input_ids.device)[:, None]
            mask = (attention_mask[:, None, None, :].bool() & (columns <= own)) | (columns == own)
        groups = self.heads // self.kv_heads
        rotated = self.heads + self.kv_heads  # query and key heads, before the value heads
        step_masks: dict[int, Any] = {}  # a decoding step's mask over whole cache buffers
        additive = None  # a prefill's mask as the attention kernel would make it at each call
        for i, layer in enumerate(self.layers):
            residual = hidden
            x = layer.input_norm(hidden)
            qkv = layer.qkv(x).view(rows, new, self.heads + 2 * self.kv_heads, self.head_dim)
            # queries and keys rotated (and cast) together: the same element-wise operations
            # as on each apart, half the kernel calls of a decoding step's rotation
            qk = _rotated(qkv[:, :, :rotated].transpose(1, 2), cos, sin)
            if self.attention_dtype is not None:  # CAST_KEYS_ONCE
                qk = qk.to(self.attention_dtype)
            q, k = qk[:, :self.heads], qk[:, self.heads:]
            v = qkv[:, :, rotated:].transpose(1, 2)
            layer_mask = mask
            if cache is not None:
                k, v = cache.update(k, v, i)
                if new == 1:
                    k, v, layer_mask = _over_whole_buffers(cache.layers[i], k, v, mask,
                                                           step_masks)
            if new > 1 and mask is not None:  # made additive once, for every layer
                if additive is None or additive.dtype != q.dtype:
                    additive = torch.zeros(mask.shape, dtype=q.dtype, device=mask.device
                                           ).masked_fill_(~mask, float("-inf"))
                layer_mask = additive
            attended = _attention(q, k, v, layer_mask, self.scaling, groups)
            hidden = residual + layer.o(attended)
            residual = hidden
            gate, up = layer.gate_up(layer.post_norm(hidden)).split(self.intermediate, dim=-1)
            hidden = residual + layer.down(F.silu(gate) * up)
        hidden = self.norm(hidden)
        if isinstance(logits_to_keep, int):  # transformers' meaning: the last n (0: all)
            logits_to_keep = slice(-logits_to_keep, None) if logits_to_keep else None
        if logits_to_keep is not None:
            hidden = hidden[:, logits_to_keep]
        return SimpleNamespace(logits=self.lm_head(hidden))


def _over_whole_buffers(layer: Any, k: Any, v: Any, mask: Any, masks: dict[int, Any]
                        ) -> tuple[Any, Any, Any]:
    """A decoding step's keys, values and mask over the layer's whole preallocated buffers
    (:func:`clbench.train.decoding.whole_buffers`: read in place, the columns past the filled
    part masked), or as they are for any other cache layer. `masks` keeps each buffer width's
    mask for the step's other layers."""
    import torch

    whole = decoding.whole_buffers(layer)
    if whole is None:
        return k, v, mask
    keys, values = whole
    width, filled = keys.shape[-2], k.shape[-2]
    if width not in masks:
        padded = keys.new_zeros((k.shape[0], 1, 1, width), dtype=torch.bool)
        padded[..., :filled] = True if mask is None else mask
        masks[width] = padded
    return keys, values, masks[width]


def _rotated(x: Any, cos: Any, sin: Any) -> Any:
    """Rotary embedding as transformers applies it (`x * cos + rotate_half(x) * sin`)."""
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attention(q: Any, k: Any, v: Any, mask: Any, scaling: float, groups: int) -> Any:
    """Scaled dot-product attention of (rows, heads, new, dim) queries over (rows, kv heads,
    columns, dim) keys and values, the output (rows, new, heads x dim).

    One new token (a decoding step): two batched matrix multiplies with the softmax in fp32
    between them, the queries of a key/value head packed as its rows so that keys and values are
    not repeated, over the cache's whole buffers (:func:`_over_whole_buffers`, no slice to
    copy); on a CPU up to 1.5x faster than the fused attention kernel over repeated keys, which
    is made for long queries. Several (a prefill): that kernel, with grouped query heads on a
    CPU (keys and values repeated per query head elsewhere), and its causal form where there is
    no mask."""
    import torch
    import torch.nn.functional as F

    rows, heads, new, dim = q.shape
    if new == 1:
        kv_heads, columns = k.shape[1], k.shape[-2]
        # (rows x kv heads) matrices: the buffers' rows and heads merge without a copy
        scores = torch.bmm(q.reshape(rows * kv_heads, groups, dim),
                           k.flatten(0, 1).transpose(1, 2)).float() * scaling
        scores = scores.view(rows, kv_heads, groups, columns)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype).flatten(0, 1)
        out = torch.bmm(probs, v.flatten(0, 1))
    else:
        # on a CPU the kernel reads each key/value head for its query heads (the outputs bit
        # for bit those over repeated heads); elsewhere the kernels that take a mask may not
        # take grouped heads, so they are repeated
        grouped = groups > 1 and q.device.type == "cpu"
        if groups > 1 and not grouped:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                             is_causal=mask is None and new > 1,
                                             enable_gqa=grouped)
    return out.reshape(rows, heads, new, dim).transpose(1, 2).reshape(rows, new, heads * dim)
