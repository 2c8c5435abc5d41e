"""Conversions between attnlab.MultiHeadAttention and the book's MultiHeadAttention
(attnlab.book, section 3.6.2), both ways. Weights are copied, never shared, and each
conversion gives the same outputs as its source."""

from __future__ import annotations

import torch
from torch import nn

from attnlab import book
from attnlab.attention import MultiHeadAttention
from attnlab.interop import swap


def from_book(m: nn.Module) -> MultiHeadAttention:
    """attnlab's MultiHeadAttention with the configuration and weights of the book's
    MultiHeadAttention `m`, giving the same outputs; the inverse of to_book.

    Args:
        m: attnlab.book.MultiHeadAttention, or a class with its layout (d_out,
            num_heads, dropout, W_query, W_key, W_value, out_proj, and a `mask` buffer of
            context_length rows, as the chapter writes it; d_in and context_length are read
            from attributes of those names where the class keeps them).

    Returns:
        A causal MultiHeadAttention on m's device and dtype.

    Raises:
        TypeError: m lacks one of those attributes (named), or has neither a
            context_length nor a mask buffer.
    """
    for name in ("d_out", "num_heads", "W_query", "dropout"):
        if not hasattr(m, name):
            raise TypeError(f"m has no {name!r}: it is not a book MultiHeadAttention")
    weight = m.W_query.weight
    module = MultiHeadAttention(
        getattr(m, "d_in", m.W_query.in_features),  # the book's own class keeps neither
        m.d_out,
        getattr(m, "context_length", None) or _mask_length(m),
        m.dropout.p,
        m.num_heads,
        qkv_bias=m.W_query.bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    module.load_state_dict(m.state_dict())
    return module


def to_book(m: MultiHeadAttention) -> book.MultiHeadAttention:
    """The book's MultiHeadAttention with the configuration and weights of `m`, giving the
    same outputs (in eval mode; dropout draws differ).

    Grouped-query key/value heads are repeated for each query head they serve (the book
    has one per query head), which changes nothing in the outputs.

    Args:
        m: an attnlab.MultiHeadAttention of causal self-attention without rope or a window
            (the book's class has neither) and with d_in == context_dim.

    Returns:
        attnlab.book.MultiHeadAttention on m's device and dtype.

    Raises:
        TypeError: m is not an attnlab.MultiHeadAttention.
        ValueError: m's configuration has no equivalent in the book's class (the message
            names the setting).
    """
    if not isinstance(m, MultiHeadAttention):
        raise TypeError(f"m must be an attnlab.MultiHeadAttention, got {type(m).__name__}")
    unsupported = {
        "causal=False": not m.causal,
        "rope=True": m.rope is not None,
        f"window={m.window}": m.window is not None,
        f"context_dim={m.context_dim} != d_in={m.d_in}": not m.fused,
    }
    refused = [name for name, present in unsupported.items() if present]
    if refused:
        raise ValueError(
            f"the book's MultiHeadAttention is causal self-attention without rope or a "
            f"window; m has {', '.join(refused)}"
        )
    weight = m.out_proj.weight
    result = book.MultiHeadAttention(
        m.d_in, m.d_out, m.context_length, m.dropout, m.num_heads, qkv_bias=m.qkv_bias
    ).to(device=weight.device, dtype=weight.dtype)
    w = m.qkv_weights()
    groups = m.num_heads // m.num_kv_heads
    with torch.no_grad():
        for layer, weight_rows, bias_rows in zip(
            (result.W_query, result.W_key, result.W_value), w.weights, w.biases, strict=True
        ):
            layer.weight.copy_(_per_query_head(weight_rows, m, groups))
            if bias_rows is not None:
                layer.bias.copy_(_per_query_head(bias_rows, m, groups))
        result.out_proj.load_state_dict(m.out_proj.state_dict())
    return result


def _per_query_head(rows: torch.Tensor, m: MultiHeadAttention, groups: int) -> torch.Tensor:
    """Query rows as they are; key/value rows (hkv * hd, ...) repeated per query head."""
    if rows.shape[0] == m.d_out or groups == 1:
        return rows
    heads = rows.reshape(m.num_kv_heads, m.head_dim, *rows.shape[1:])  # (hkv, hd, ...)
    return heads.repeat_interleave(groups, dim=0).reshape(m.d_out, *rows.shape[1:])


_BOOK_LAYOUT = ("d_out", "num_heads", "dropout", "W_query", "W_key", "W_value", "out_proj")


def _mask_length(m: nn.Module) -> int:
    """The context length of a book class that keeps only its mask buffer (the chapter's
    own code stores neither d_in nor context_length)."""
    mask = getattr(m, "mask", None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise TypeError(
            "m has neither a context_length nor a (context_length, context_length) mask"
        )
    return mask.shape[-1]


def has_book_layout(m: nn.Module) -> bool:
    """Whether `m` is the book's MultiHeadAttention or a copy of it (a reader's own class
    from the chapter): the attributes from_book reads, and not attnlab's own module."""
    if isinstance(m, MultiHeadAttention):
        return False
    return all(hasattr(m, name) for name in _BOOK_LAYOUT)


def swap_book_attention(model: nn.Module) -> int:
    """Replace, in place, every book MultiHeadAttention in `model` (has_book_layout: the
    chapter 4 GPTModel's `trf_blocks[i].att`) by attnlab's, with the same weights and
    dropout (from_book). The book model's own state_dict still loads strictly into the
    swapped model: each attnlab layer converts the book's names (W_query, W_key, W_value,
    out_proj, mask) as it loads.

    Args:
        model: any module holding book MultiHeadAttention layers.

    Returns:
        How many layers were replaced.

    Raises:
        ValueError: the model holds none.
    """
    swapped = swap.replace_modules(model, has_book_layout, from_book)
    if not swapped:
        raise ValueError(f"{type(model).__name__} holds no book MultiHeadAttention to swap")
    return swapped


def restore_book_attention(model: nn.Module) -> int:
    """The way back from swap_book_attention: every attnlab MultiHeadAttention in `model`
    replaced, in place, by the book's class with the same weights (to_book), so that the
    model's state_dict is the book model's again.

    Args:
        model: a model swapped by swap_book_attention.

    Returns:
        How many layers were replaced.

    Raises:
        ValueError: the model holds no attnlab MultiHeadAttention; or one has no book
            equivalent (to_book names the setting).
    """
    restored = swap.replace_modules(model, lambda m: isinstance(m, MultiHeadAttention), to_book)
    if not restored:
        raise ValueError(f"{type(model).__name__} holds no attnlab MultiHeadAttention")
    return restored
