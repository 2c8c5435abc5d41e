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


def check_nothing_else(
    layer: nn.Module, children: tuple[str, ...], buffers: tuple[str, ...] = ()
) -> None:
    """Raise unless `layer` holds only what a swap carries over: the child modules named
    `children` and dropouts, the buffers named `buffers` (a causal mask), and no parameter
    of its own. Anything else (a norm, a rotary module or its tables, a learned sink) the
    attnlab layer would silently not compute.

    Raises:
        ValueError: naming what else the layer holds.
    """
    extra = [
        f"submodule {name} ({type(child).__name__})"
        for name, child in layer.named_children()
        if name not in children and not isinstance(child, nn.Dropout)
    ]
    extra += [f"parameter {name}" for name, _ in layer.named_parameters(recurse=False)]
    extra += [
        f"buffer {name}" for name, _ in layer.named_buffers(recurse=False) if name not in buffers
    ]
    if extra:
        raise ValueError(
            f"the layer holds {', '.join(extra)} besides {', '.join(children)}, which "
            f"attnlab's MultiHeadAttention does not compute: it is not swapped"
        )
