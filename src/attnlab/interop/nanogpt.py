"""nanoGPT's GPT (karpathy/nanoGPT, model.py) with attnlab's attention, and back.

nanoGPT's `CausalSelfAttention` is one fused projection `c_attn` (query, key, value rows,
each head-major), the causal attention with dropout on its weights, an output projection
`c_proj` and a dropout after it (`resid_dropout`). `swap(model)` replaces each by
`CausalSelfAttention` here: attnlab's MultiHeadAttention (`c_attn` -> `qkv_proj`, `c_proj`
-> `out_proj`, the same biases or none, the same dropout on the weights) followed by the same
residual dropout. The weights are copied from the model as it is, so nanoGPT's scaled
initialisation of `c_proj` (0.02 / sqrt(2 * n_layer)) is kept.

State dicts: `from_nanogpt_state(state)` renames nanoGPT's keys to the swapped model's, so a
nanoGPT checkpoint loads strictly; `to_nanogpt_state(state)` is the way back, for nanoGPT's
own class. nanoGPT's causal-mask buffer (`attn.bias`, kept only on PyTorch without SDPA) is
not a weight: it is dropped on the way in and not made on the way out.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from attnlab.attention import MultiHeadAttention
from attnlab.interop import swap as _swap
from attnlab.kv_cache import KVCache

# nanoGPT key (within a block's attention) -> the swapped model's
_NAMES = {"c_attn": "attention.qkv_proj", "c_proj": "attention.out_proj"}
_ATTENTION = re.compile(r"^(?P<block>.*\battn\.)(?P<layer>c_attn|c_proj)\.(?P<what>weight|bias)$")
_SWAPPED = re.compile(
    r"^(?P<block>.*\battn\.)attention\.(?P<layer>qkv_proj|out_proj)\.(?P<what>weight|bias)$"
)
_MASK = re.compile(r"^.*\battn\.bias$")


class CausalSelfAttention(nn.Module):
    """nanoGPT's causal self-attention on attnlab: `attention` (MultiHeadAttention) then
    `resid_dropout`, as nanoGPT's layer does after `c_proj`.

    Args:
        attention: the attention, its output projection included.
        resid_dropout: the dropout after it.
    """

    def __init__(self, attention: MultiHeadAttention, resid_dropout: nn.Dropout) -> None:
        super().__init__()
        self.attention = attention
        self.resid_dropout = resid_dropout

    def forward(
        self,
        x: torch.Tensor,
        *,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(b, t, n_embd) -> (b, t, n_embd); `cache` and `mask` as MultiHeadAttention's."""
        return self.resid_dropout(self.attention(x, cache=cache, mask=mask))


def from_nanogpt_attention(layer: nn.Module, block_size: int) -> CausalSelfAttention:
    """attnlab's CausalSelfAttention with the weights, biases and dropouts of nanoGPT's.

    Args:
        layer: a nanoGPT CausalSelfAttention (c_attn, c_proj, n_head, n_embd, dropout,
            resid_dropout).
        block_size: the model's context length (config.block_size).

    Returns:
        The same layer on attnlab, on its device and dtype.

    Raises:
        TypeError: layer lacks one of those attributes (named).
        ValueError: the layer holds anything else (a norm, rotary positions, a parameter
            of its own), which the swap would drop.
    """
    for name in ("c_attn", "c_proj", "n_head", "n_embd", "dropout", "resid_dropout"):
        if not hasattr(layer, name):
            raise TypeError(f"layer has no {name!r}: it is not nanoGPT's CausalSelfAttention")
    _swap.check_nothing_else(layer, ("c_attn", "c_proj"), buffers=("bias",))  # its mask
    c_attn, c_proj = layer.c_attn, layer.c_proj
    attention = MultiHeadAttention(
        layer.n_embd,
        layer.n_embd,
        block_size,
        float(layer.dropout),  # nanoGPT's dropout on the attention weights (attn_dropout)
        layer.n_head,
        qkv_bias=c_attn.bias is not None,
        device=c_attn.weight.device,
        dtype=c_attn.weight.dtype,
    )
    if c_proj.bias is None:  # nanoGPT's bias=False: no bias on any projection
        attention.out_proj = nn.Linear(layer.n_embd, layer.n_embd, bias=False).to(c_proj.weight)
    with torch.no_grad():
        attention.qkv_proj.load_state_dict(c_attn.state_dict())
        attention.out_proj.load_state_dict(c_proj.state_dict())
    return CausalSelfAttention(attention, nn.Dropout(layer.resid_dropout.p))


def swap(model: nn.Module, block_size: int | None = None) -> int:
    """Replace, in place, every nanoGPT CausalSelfAttention in `model` (a GPT's
    `transformer.h[i].attn`) by attnlab's (from_nanogpt_attention).

    Args:
        model: nanoGPT's GPT, or any module holding its attention layers.
        block_size: the context length (default model.config.block_size).

    Returns:
        How many layers were replaced.

    Raises:
        ValueError: the model holds none, or has no config.block_size and none is given.
    """
    if not any(_is_nanogpt_attention(m) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} holds no nanoGPT CausalSelfAttention")
    if block_size is None:
        block_size = getattr(getattr(model, "config", None), "block_size", None)
    if block_size is None:
        raise ValueError(
            f"{type(model).__name__} has no config.block_size: pass block_size, the context length"
        )
    swapped = _swap.replace_modules(
        model, _is_nanogpt_attention, lambda layer: from_nanogpt_attention(layer, block_size)
    )
    if not swapped:
        raise ValueError(f"{type(model).__name__} holds no nanoGPT CausalSelfAttention")
    return swapped


def _is_nanogpt_attention(m: nn.Module) -> bool:
    return hasattr(m, "c_attn") and hasattr(m, "c_proj") and hasattr(m, "n_head")


def from_nanogpt_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A nanoGPT GPT's state_dict with its attention keys renamed for the swapped model
    (`attn.c_attn.*` -> `attn.attention.qkv_proj.*`, `attn.c_proj.*` ->
    `attn.attention.out_proj.*`) and the causal-mask buffers (`attn.bias`) dropped; every
    other key as it is. Tensors are shared, not copied."""
    renamed = {}
    for key, tensor in state.items():
        if _MASK.match(key):
            continue
        found = _ATTENTION.match(key)
        if found:
            key = f"{found['block']}{_NAMES[found['layer']]}.{found['what']}"
        renamed[key] = tensor
    return renamed


def to_nanogpt_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of from_nanogpt_state: a swapped model's state_dict with nanoGPT's names,
    for nanoGPT's own GPT (built with SDPA, which keeps no mask buffer)."""
    back = {value: key for key, value in _NAMES.items()}
    renamed = {}
    for key, tensor in state.items():
        found = _SWAPPED.match(key)
        if found:
            key = f"{found['block']}{back['attention.' + found['layer']]}.{found['what']}"
        renamed[key] = tensor
    return renamed
