"""A Llama-style model written from scratch (the book's bonus chapters: grouped-query
attention with rotary positions) with attnlab's attention, and back.

The from-scratch layer is `GroupedQueryAttention(d_in, d_out, num_heads, num_kv_groups)`:
projections `W_query`, `W_key`, `W_value` and `out_proj`, none with a bias; its forward
takes `(x, mask, cos, sin)`, the causal mask (True where a key is hidden) and the model's
rotary tables (halves rotated, as GPT-NeoX and HF Llama do). `swap(model, rope_base=...)`
replaces each by `GroupedQueryAttention` here: attnlab's MultiHeadAttention with rope on the
same base and the same key/value heads, its three projections fused into `qkv_proj`. It
takes the same call: a mask is passed on to attnlab (inverted to attnlab's polarity) unless
it is the plain causal one, and the rotary tables are checked against attnlab's, never
ignored.

State dicts: `from_llama_state(state)` fuses `W_query`, `W_key`, `W_value` into the swapped
model's `attention.qkv_proj` (rows in query, key, value order) and renames `out_proj`, so
the original checkpoint loads strictly; `to_llama_state(state)` splits them back.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from attnlab import masks
from attnlab.attention import MultiHeadAttention
from attnlab.interop import swap as _swap
from attnlab.kv_cache import KVCache

_PROJECTIONS = ("W_query", "W_key", "W_value", "out_proj")
_ORIGINAL = re.compile(r"^(?P<prefix>.*)W_query\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.*)attention\.qkv_proj\.weight$")
# rotary tables computed in float32 (as from-scratch code does) differ from attnlab's
# float64-exact ones by rounding that grows with the position; a different base or a
# frequency scaling differs by far more at the first positions already
_TABLE_ROWS, _TABLE_TOLERANCE = 1024, 1e-4


class GroupedQueryAttention(nn.Module):
    """The from-scratch layer's call on attnlab: `attention` (MultiHeadAttention with rope).

    Args:
        attention: the attention, rope and output projection included.
    """

    def __init__(self, attention: MultiHeadAttention) -> None:
        super().__init__()
        self.attention = attention
        self._checked_tables: tuple | None = None

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """(b, t, d_in) -> (b, t, d_out).

        Args:
            x: the tokens.
            mask: the from-scratch mask, True where a key is hidden ((t, t), a square buffer
                of the context length sliced to (t, t) as the from-scratch layer slices it,
                or broadcastable to the scores); the plain causal one is attnlab's own and
                is not passed on.
            cos: the model's rotary cosines (positions, head_dim), checked against attnlab's.
            sin: its sines.
            cache: a KVCache, as MultiHeadAttention's.

        Raises:
            ValueError: rotary tables that are not attnlab's (another base or a scaling).
        """
        if cos is not None or sin is not None:
            self._check_tables(cos, sin)
        return self.attention(x, cache=cache, mask=self._allowed(mask, x.shape[1]))

    def _allowed(self, mask: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
        """attnlab's mask (True where a query may attend) for a from-scratch one, None for
        the plain causal mask attnlab applies anyway."""
        if mask is None:
            return None
        if mask.dim() == 2 and mask.shape[0] == mask.shape[1] >= tokens:
            mask = mask[:tokens, :tokens]  # a (context, context) buffer, sliced as the layer does
        if mask.shape == (tokens, tokens) and torch.equal(
            mask, ~masks.causal_mask(tokens, device=mask.device)
        ):
            return None
        return ~mask.bool()

    def _check_tables(self, cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
        if cos is None or sin is None:
            raise ValueError("cos and sin come together: pass both rotary tables or neither")
        key = (cos.data_ptr(), tuple(cos.shape), sin.data_ptr(), cos._version, sin._version)
        if key == self._checked_tables:
            return
        check_tables(self.attention, cos, sin)
        self._checked_tables = key


def check_tables(attention: MultiHeadAttention, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise unless the from-scratch rotary tables (positions, head_dim) are attnlab's rope
    of `attention`, on their first positions (up to 1024), within 1e-4.

    Raises:
        ValueError: another shape, base, or a frequency scaling (the message says how far).
    """
    rope = attention.rope
    rows = min(_TABLE_ROWS, cos.shape[0], rope.cos.shape[0])
    if cos.shape[-1] != rope.cos.shape[-1] or sin.shape != cos.shape:
        raise ValueError(
            f"rotary tables of shape cos {tuple(cos.shape)}, sin {tuple(sin.shape)}; attnlab's "
            f"rope has head_dim {rope.cos.shape[-1]}"
        )
    # tables stored in a narrow dtype (a bfloat16 model's buffers) are rounded to it
    tolerance = max(_TABLE_TOLERANCE, 2 * torch.finfo(cos.dtype).eps)
    for name, theirs, ours in (("cos", cos, rope.cos), ("sin", sin, rope.sin)):
        error = (theirs[:rows].to(ours) - ours[:rows]).abs().max().item()
        if not error <= tolerance:
            raise ValueError(
                f"the model's rotary {name} table differs from attnlab's rope (base "
                f"{attention.rope_base}) by {error:.2e} on its first {rows} positions "
                f"(tolerance {tolerance:.1e} for {cos.dtype}): another base, a frequency "
                f"scaling, or tables that start at another position, none of which "
                f"attnlab's rope applies"
            )


def from_llama_attention(
    layer: nn.Module, context_length: int, rope_base: float
) -> GroupedQueryAttention:
    """attnlab's GroupedQueryAttention with the weights and head layout of the from-scratch
    layer.

    Args:
        layer: W_query, W_key, W_value, out_proj (no biases), num_heads, and num_kv_groups.
        context_length: the model's context length.
        rope_base: the rotary base (theta) the model's tables were made with.

    Returns:
        The same layer on attnlab, on its device and dtype.

    Raises:
        TypeError: layer lacks one of those attributes (named).
    """
    for name in ("W_query", "W_key", "W_value", "out_proj", "num_heads", "num_kv_groups"):
        if not hasattr(layer, name):
            raise TypeError(f"layer has no {name!r}: it is not a from-scratch Llama attention")
    _swap.check_nothing_else(layer, _PROJECTIONS)  # Qwen3's q_norm, own tables, sinks
    if layer.out_proj.bias is not None:
        raise ValueError("out_proj has a bias; the from-scratch Llama layout has none")
    weight = layer.W_query.weight
    d_out, d_in = weight.shape
    biased = [name for name in _PROJECTIONS[:3] if getattr(layer, name).bias is not None]
    if biased and len(biased) < 3:
        raise ValueError(
            f"{', '.join(biased)} have a bias and the other query/key/value projections none: "
            f"attnlab's fused projection has biases on all three (Qwen2) or none (Llama)"
        )
    qkv_bias = bool(biased)  # Qwen2-style biases on the three
    attention = MultiHeadAttention(
        d_in,
        d_out,
        context_length,
        0.0,
        layer.num_heads,
        qkv_bias=qkv_bias,
        num_kv_heads=layer.num_kv_groups,
        rope=True,
        rope_base=rope_base,
        device=weight.device,
        dtype=weight.dtype,
    )
    attention.out_proj = nn.Linear(d_out, d_out, bias=False).to(weight)  # Llama: no bias
    wrapper = GroupedQueryAttention(attention)
    wrapper.load_state_dict(from_llama_state(layer.state_dict()))  # keys as the wrapper's
    return wrapper


def swap(model: nn.Module, *, rope_base: float, context_length: int | None = None) -> int:
    """Replace, in place, every from-scratch GroupedQueryAttention in `model` by attnlab's
    (from_llama_attention); where the model keeps its rotary tables as buffers `cos` and
    `sin`, they are checked against attnlab's first (check_tables).

    Args:
        model: the from-scratch Llama model, or any module holding its attention layers.
        rope_base: the rotary base (theta) of the model's configuration.
        context_length: the context length (default the rows of the model's `cos`).

    Returns:
        How many layers were replaced.

    Raises:
        ValueError: the model holds none; tables that are not attnlab's; no context length.
    """
    if not any(_is_llama_attention(m) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} holds no from-scratch GroupedQueryAttention")
    tables = getattr(model, "cos", None), getattr(model, "sin", None)
    if context_length is None:
        if not isinstance(tables[0], torch.Tensor):
            raise ValueError(f"{type(model).__name__} has no `cos` table: pass context_length")
        context_length = tables[0].shape[0]
    converted = []

    def convert(layer: nn.Module) -> GroupedQueryAttention:
        wrapper = from_llama_attention(layer, context_length, rope_base)
        converted.append(wrapper)
        return wrapper

    swapped = _swap.replace_modules(model, _is_llama_attention, convert)
    if not swapped:
        raise ValueError(f"{type(model).__name__} holds no from-scratch GroupedQueryAttention")
    if all(isinstance(table, torch.Tensor) for table in tables):
        check_tables(converted[0].attention, *tables)
    return swapped


def _is_llama_attention(m: nn.Module) -> bool:
    return all(hasattr(m, name) for name in ("W_query", "W_key", "W_value", "num_kv_groups"))


def from_llama_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The from-scratch model's state_dict with each attention's W_query, W_key, W_value
    fused (concatenated rows, biases too where they have them) into
    `attention.qkv_proj` and `out_proj` renamed `attention.out_proj`; every other key as it
    is."""
    result = dict(state)
    for key in [k for k in state if _ORIGINAL.match(k)]:
        prefix = _ORIGINAL.match(key)["prefix"]
        for what in ("weight", "bias"):
            names = [f"{prefix}{name}.{what}" for name in _PROJECTIONS[:3]]
            if all(name in result for name in names):  # biases: Qwen2-style, or none
                parts = [result.pop(name) for name in names]
                result[f"{prefix}attention.qkv_proj.{what}"] = torch.cat(parts)  # rows q, k, v
        result[f"{prefix}attention.out_proj.weight"] = result.pop(f"{prefix}out_proj.weight")
    return result


def to_llama_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of from_llama_state, for the from-scratch class."""
    result = dict(state)
    for key in [k for k in state if _FUSED.match(k)]:
        prefix = _FUSED.match(key)["prefix"]
        out = result.pop(f"{prefix}attention.out_proj.weight")
        result[f"{prefix}out_proj.weight"] = out
        for what in ("weight", "bias"):
            fused = result.pop(f"{prefix}attention.qkv_proj.{what}", None)
            if fused is None:
                continue
            kv = (fused.shape[0] - out.shape[0]) // 2
            parts = fused.split([out.shape[0], kv, kv])  # rows q, k, v
            result.update(
                {
                    f"{prefix}{name}.{what}": part
                    for name, part in zip(_PROJECTIONS[:3], parts, strict=True)
                }
            )
    return result
