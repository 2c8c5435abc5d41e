"""Putting attnlab's attention into a model someone else wrote, and decoding through it.

`replace_modules` swaps every submodule a predicate picks for what a conversion makes of it
(attnlab.interop.book, .nanogpt and .llama each pass their own); `make_caches` gives one
KVCache per attnlab MultiHeadAttention of a model, in the order the model holds them, for a
cached forward that passes cache i to layer i.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from attnlab.attention import MultiHeadAttention
from attnlab.kv_cache import KVCache


def replace_modules(
    model: nn.Module, picks: Callable[[nn.Module], bool], convert: Callable[[nn.Module], nn.Module]
) -> int:
    """Replace, in place, every submodule of `model` that `picks` chooses by `convert(it)`
    (children of a chosen module are not visited).

    Args:
        model: any module; itself is never replaced.
        picks: whether a submodule is to be replaced.
        convert: what replaces it (called once per chosen submodule).

    Returns:
        How many submodules were replaced.
    """
    replaced = 0
    for name, child in list(model.named_children()):
        if picks(child):
            setattr(model, name, convert(child))
            replaced += 1
        else:
            replaced += replace_modules(child, picks, convert)
    return replaced


def make_caches(
    model: nn.Module,
    batch_size: int,
    max_tokens: int | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> list[KVCache]:
    """One empty KVCache per attnlab MultiHeadAttention in `model`, in `model.modules()`
    order (a model's layers in order): MultiHeadAttention.make_cache of each.

    Args:
        model: a model holding attnlab MultiHeadAttention layers (after a swap).
        batch_size: sequences decoded together.
        max_tokens: positions each cache holds (default each layer's context_length).
        dtype: how keys and values are stored (make_cache: bfloat16, float16, int8).

    Returns:
        The caches.

    Raises:
        ValueError: the model holds no attnlab MultiHeadAttention.
    """
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} holds no attnlab MultiHeadAttention: swap its attention "
            f"in first (attnlab.interop.swap_book_attention, nanogpt.swap, llama.swap)"
        )
    return [layer.make_cache(batch_size, max_tokens, dtype=dtype) for layer in layers]
