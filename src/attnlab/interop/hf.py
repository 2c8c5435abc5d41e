"""Hugging Face transformers: attnlab as an attention implementation, and weight conversion
for GPT-2's and Llama's attention layers. transformers is an optional extra
(`pip install 'attnlab[hf]'`), imported only here.

register() adds "attnlab" to transformers' AttentionInterface, so
`AutoModelForCausalLM.from_config(config, attn_implementation="attnlab")` (or
`model.set_attn_implementation("attnlab")`) runs every model that uses that interface on
attnlab.functional.attention, with masks in SDPA's boolean form (True = may attend, the
polarity attnlab uses) and output_attentions supported.

Shapes from transformers: query (b, h, tq, d), key and value (b, hkv, tk, d) (grouped-query
heads are passed unrepeated); the output goes back as (b, tq, h, d).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import functional
from attnlab.attention import MultiHeadAttention

NAME = "attnlab"


def register(name: str = NAME) -> str:
    """Register attnlab's attention (and SDPA's boolean masks) under `name`; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention signature on attnlab.functional.attention. A mask from
    transformers already holds the causal pattern; without one, a causal layer is causal
    over its keys (bottom-right, as the queries are the newest tokens)."""
    if kwargs.get("softcap") is not None:  # a sliding_window kwarg is already in the mask
        raise ValueError("attnlab's attention does not support softcap (Gemma-2 style)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and attention_mask is None and query.shape[2] > 1
    need_weights = bool(kwargs.get("output_attentions", False)) or _attentions_requested()
    result = functional.attention(
        query,
        key,
        value,
        mask=attention_mask,
        causal=causal,
        scale=scaling,
        dropout_p=dropout,
        training=module.training,
        need_weights=need_weights,
    )
    out, weights = result if need_weights else (result, None)
    return out.transpose(1, 2).contiguous(), weights  # (b, h, tq, d) -> (b, tq, h, d)


def _attentions_requested() -> bool:
    """True while a transformers model records attention weights (output_attentions=True):
    transformers 5 collects them with hooks instead of passing the flag down."""
    try:
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except (ImportError, AttributeError, LookupError):
        return False
    return isinstance(collected, dict) and "attentions" in collected


def from_gpt2_attention(
    layer: nn.Module, *, context_length: int | None = None
) -> MultiHeadAttention:
    """attnlab's MultiHeadAttention with the weights of a GPT2Attention (self-attention):
    c_attn and c_proj are Conv1D layers, weights stored (in, out)."""
    _check_gpt2(layer)
    d, heads = layer.embed_dim, layer.num_heads
    length = context_length or layer.config.max_position_embeddings
    module = MultiHeadAttention(d, d, length, 0.0, heads, qkv_bias=True).to(layer.c_attn.weight)
    with torch.no_grad():
        module.qkv_proj.weight.copy_(layer.c_attn.weight.T)  # (in, 3d) -> (3d, in)
        module.qkv_proj.bias.copy_(layer.c_attn.bias)
        module.out_proj.weight.copy_(layer.c_proj.weight.T)
        module.out_proj.bias.copy_(layer.c_proj.bias)
    return module


def to_gpt2_attention(module: MultiHeadAttention, layer: nn.Module) -> nn.Module:
    """Copy `module`'s weights into a GPT2Attention `layer` (same width and heads); returns
    the layer."""
    _check_gpt2(layer)
    fits = (
        module.fused
        and module.qkv_bias
        and module.d_in == module.d_out == layer.embed_dim
        and module.num_heads == module.num_kv_heads == layer.num_heads
        and module.rope is None
        and module.window is None
    )
    if not fits:
        raise ValueError(
            f"GPT2Attention has {layer.num_heads} heads of width {layer.embed_dim} with q/k/v "
            f"biases and no rope or window; the module has {module.extra_repr()}"
        )
    with torch.no_grad():
        layer.c_attn.weight.copy_(module.qkv_proj.weight.T)
        layer.c_attn.bias.copy_(module.qkv_proj.bias)
        layer.c_proj.weight.copy_(module.out_proj.weight.T)
        layer.c_proj.bias.copy_(module.out_proj.bias)
    return layer


def from_llama_attention(
    layer: nn.Module, *, context_length: int | None = None
) -> MultiHeadAttention:
    """attnlab's MultiHeadAttention (rope, grouped-query heads) with the weights of a
    Llama-style attention layer: q_proj, k_proj, v_proj, o_proj. Its rotary embedding must
    be the default one (rope_theta, no scaling), which attnlab's rope equals."""
    config = layer.config
    _check_llama_rope(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d_in, d_out = layer.q_proj.in_features, layer.q_proj.out_features
    bias = layer.q_proj.bias is not None
    module = MultiHeadAttention(
        d_in,
        d_out,
        context_length or config.max_position_embeddings,
        0.0,
        heads,
        qkv_bias=bias,
        num_kv_heads=kv_heads,
        rope=True,
        rope_base=float(_rope_theta(config)),
    ).to(layer.q_proj.weight)
    if module.head_dim != layer.head_dim or layer.o_proj.in_features != d_out:
        raise ValueError(f"head_dim {layer.head_dim} != hidden width / heads: not supported")
    with torch.no_grad():
        module.qkv_proj.weight.copy_(
            torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])
        )
        if bias:
            module.qkv_proj.bias.copy_(
                torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias])
            )
        module.out_proj.weight.copy_(layer.o_proj.weight)
        o_bias = layer.o_proj.bias
        module.out_proj.bias.copy_(o_bias if o_bias is not None else torch.zeros(d_out))
    return module


def to_llama_attention(module: MultiHeadAttention, layer: nn.Module) -> nn.Module:
    """Copy `module`'s weights into a Llama-style attention `layer`; returns the layer. The
    module needs rope, the layer's head counts, and a zero out_proj bias when o_proj has
    none."""
    _check_llama_rope(layer.config)
    q, k, v = module.qkv_proj.weight.split([module.d_out, module.kv_dim, module.kv_dim])
    fits = (
        module.fused
        and module.rope is not None
        and module.num_heads == layer.config.num_attention_heads
        and module.num_kv_heads == layer.config.num_key_value_heads
        and q.shape == layer.q_proj.weight.shape
        and k.shape == layer.k_proj.weight.shape
        and (layer.o_proj.bias is not None or not module.out_proj.bias.any())
    )
    if not fits:
        raise ValueError(
            f"the module ({module.extra_repr()}) does not fit this Llama attention layer "
            f"({layer.config.num_attention_heads} heads, {layer.config.num_key_value_heads} "
            f"key/value heads, rope, o_proj bias {layer.o_proj.bias is not None})"
        )
    with torch.no_grad():
        for target, weight in zip(
            (layer.q_proj, layer.k_proj, layer.v_proj), (q, k, v), strict=True
        ):
            target.weight.copy_(weight)
        if module.qkv_bias:
            biases = module.qkv_proj.bias.split([module.d_out, module.kv_dim, module.kv_dim])
            for target, bias in zip(
                (layer.q_proj, layer.k_proj, layer.v_proj), biases, strict=True
            ):
                target.bias.copy_(bias)
        layer.o_proj.weight.copy_(module.out_proj.weight)
        if layer.o_proj.bias is not None:
            layer.o_proj.bias.copy_(module.out_proj.bias)
    return layer


def _check_gpt2(layer: nn.Module) -> None:
    if not hasattr(layer, "c_attn") or getattr(layer, "is_cross_attention", False):
        raise TypeError(f"expected a GPT2Attention (self-attention), got {type(layer).__name__}")


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))


def _check_llama_rope(config) -> None:
    parameters = getattr(config, "rope_parameters", None) or {}
    kind = parameters.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"only the default rotary embedding converts, got rope_type {kind!r}")
