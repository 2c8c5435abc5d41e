"""Conversions between attnlab.MultiHeadAttention and PyTorch's nn.MultiheadAttention
(both ways, with its mask polarity). Weights are copied, never shared, and each conversion
gives the same outputs as its source."""

from __future__ import annotations

import torch
from torch import nn

from attnlab import masks, qkv
from attnlab._validate import check_size
from attnlab.attention import MultiHeadAttention

DEFAULT_CONTEXT_LENGTH = 8192


def from_torch(
    m: nn.MultiheadAttention, *, context_length: int = DEFAULT_CONTEXT_LENGTH
) -> MultiHeadAttention:
    """attnlab's MultiHeadAttention with the weights of `m`, giving the same outputs.

    Not causal: torch's module takes its causal mask per call; masks for it come from
    torch's through `from_torch_masks`.

    Args:
        m: a torch.nn.MultiheadAttention (either batch layout; attnlab's is batch first).
        context_length: the longest query sequence the result will accept.

    Returns:
        A non-causal MultiHeadAttention on m's device and dtype (cross-attention when
        kdim differs from embed_dim).

    Raises:
        TypeError: m is not an nn.MultiheadAttention.
        ValueError: kdim != vdim, add_bias_kv or add_zero_attn (no equivalent here).
    """
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"m must be a torch.nn.MultiheadAttention, got {type(m).__name__}")
    if m.kdim != m.vdim:
        raise ValueError(
            f"m has key width kdim ({m.kdim}) != value width vdim ({m.vdim}); attnlab's "
            f"cross-attention reads keys and values from one context of one width"
        )
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError("m uses add_bias_kv or add_zero_attn, which attnlab does not support")
    has_bias = m.in_proj_bias is not None
    module = MultiHeadAttention(
        m.embed_dim,
        m.embed_dim,
        check_size("context_length", context_length),
        m.dropout,
        m.num_heads,
        qkv_bias=has_bias,
        causal=False,
        context_dim=m.kdim,
        device=m.out_proj.weight.device,
        dtype=m.out_proj.weight.dtype,
    )
    biases = m.in_proj_bias.chunk(3) if has_bias else (None, None, None)
    module.load_qkv_weights(qkv.QKVWeights(*_torch_in_proj_weights(m), *biases))
    with torch.no_grad():
        module.out_proj.weight.copy_(m.out_proj.weight)
        if m.out_proj.bias is not None:
            module.out_proj.bias.copy_(m.out_proj.bias)
        else:  # torch's bias=False drops both biases; ours always has the output one
            module.out_proj.bias.zero_()
    return module


def to_torch(m: MultiHeadAttention) -> nn.MultiheadAttention:
    """nn.MultiheadAttention (batch_first=True) with the weights of `m`, giving the same
    outputs; grouped-query key/value heads are repeated for each query head they serve.

    torch's module is never causal by itself and has no window: pass its attn_mask
    (`masks.to_torch_mask` of `masks.causal_mask`, or of `masks.sliding_window_mask` for a
    module with a window) or is_causal with a causal mask, as it requires.

    Args:
        m: an attnlab.MultiHeadAttention with d_out == d_in (torch has one width).

    Returns:
        nn.MultiheadAttention on m's device and dtype.

    Raises:
        TypeError: m is not an attnlab.MultiHeadAttention.
        ValueError: d_out != d_in, or rope (torch's module has no rotary positions).
    """
    if not isinstance(m, MultiHeadAttention):
        raise TypeError(f"m must be an attnlab.MultiHeadAttention, got {type(m).__name__}")
    if m.rope is not None:
        raise ValueError(
            "m has rope=True: nn.MultiheadAttention has no rotary positions, so it could not "
            "give m's outputs"
        )
    if m.d_out != m.d_in:
        raise ValueError(
            f"nn.MultiheadAttention has one embed_dim for input and output; m has d_in "
            f"({m.d_in}) != d_out ({m.d_out})"
        )
    weight = m.out_proj.weight
    torch_module = nn.MultiheadAttention(
        m.d_in,
        m.num_heads,
        dropout=m.dropout,
        bias=True,
        kdim=m.context_dim,
        vdim=m.context_dim,
        batch_first=True,
        device=weight.device,
        dtype=weight.dtype,
    )
    w = m.qkv_weights()
    k_weight, v_weight = (_repeat_kv(t, m) for t in (w.k_weight, w.v_weight))
    with torch.no_grad():
        if torch_module._qkv_same_embed_dim:
            torch_module.in_proj_weight.copy_(qkv.fuse_rows(w.q_weight, k_weight, v_weight))
        else:
            torch_module.q_proj_weight.copy_(w.q_weight)
            torch_module.k_proj_weight.copy_(k_weight)
            torch_module.v_proj_weight.copy_(v_weight)
        if w.q_bias is None:
            torch_module.in_proj_bias.zero_()
        else:
            k_bias, v_bias = (_repeat_kv(t, m) for t in (w.k_bias, w.v_bias))
            torch_module.in_proj_bias.copy_(qkv.fuse_rows(w.q_bias, k_bias, v_bias))
        torch_module.out_proj.weight.copy_(m.out_proj.weight)
        torch_module.out_proj.bias.copy_(m.out_proj.bias)
    return torch_module


def from_torch_masks(
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    *,
    num_heads: int | None = None,
) -> torch.Tensor | None:
    """The mask for attnlab from nn.MultiheadAttention's two.

    Args:
        attn_mask: (queries, keys) or (batch * num_heads, queries, keys), bool (True =
            blocked, torch's polarity) or additive float; or None.
        key_padding_mask: (batch, keys), bool (True = padding) or additive float; or None.
        num_heads: needed only for a 3-D attn_mask.

    Returns:
        None, a bool mask (True = may attend) or an additive float one, broadcastable to
        (batch, heads, queries, keys).

    Raises:
        TypeError: a mask that is neither bool nor floating point (named).
        ValueError: shapes that do not fit, or a 3-D attn_mask without num_heads.
    """
    if attn_mask is not None:
        attn_mask = _per_head(attn_mask, num_heads)
    padding = None
    if key_padding_mask is not None:
        kpm = _batch_keys("key_padding_mask", key_padding_mask)
        kpm = masks.from_torch_mask(kpm, name="key_padding_mask")
        padding = kpm[:, None, None, :]  # (b, 1, 1, tk)
    if attn_mask is None:
        return padding
    attn = masks.from_torch_mask(attn_mask, name="attn_mask")
    if padding is None:
        return attn
    if attn.dtype == torch.bool and padding.dtype == torch.bool:
        return masks.combine_masks(attn, padding)
    return _additive(attn) + _additive(padding)


def _torch_in_proj_weights(m: nn.MultiheadAttention) -> tuple[torch.Tensor, ...]:
    if m._qkv_same_embed_dim:
        return m.in_proj_weight.chunk(3)
    return m.q_proj_weight, m.k_proj_weight, m.v_proj_weight


def _repeat_kv(t: torch.Tensor, m: MultiHeadAttention) -> torch.Tensor:
    """Key or value rows (hkv * hd, ...) repeated per query head: (h * hd, ...)."""
    groups = m.num_heads // m.num_kv_heads
    heads = t.reshape(m.num_kv_heads, m.head_dim, *t.shape[1:])  # (hkv, hd, ...)
    return heads.repeat_interleave(groups, dim=0).reshape(m.d_out, *t.shape[1:])  # (h*hd, ...)


def _per_head(attn_mask: object, num_heads: int | None) -> object:
    """torch's 3-D attn_mask (b * h, tq, tk) as (b, h, tq, tk); other shapes unchanged."""
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dim() != 3:
        return attn_mask
    if num_heads is None:
        raise ValueError(
            f"a 3-D attn_mask {tuple(attn_mask.shape)} is (batch * num_heads, queries, keys): "
            f"pass num_heads"
        )
    check_size("num_heads", num_heads)
    if attn_mask.shape[0] % num_heads != 0:
        raise ValueError(
            f"attn_mask's first dimension ({attn_mask.shape[0]}) is not batch * num_heads "
            f"for num_heads ({num_heads})"
        )
    return attn_mask.view(-1, num_heads, *attn_mask.shape[1:])  # (b, h, tq, tk)


def _batch_keys(name: str, mask: object) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a (batch, keys) tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"{name} must be a (batch, keys) tensor, got {tuple(mask.shape)}")
    return mask


def _additive(mask: torch.Tensor) -> torch.Tensor:
    return masks.to_additive(mask) if mask.dtype == torch.bool else mask
