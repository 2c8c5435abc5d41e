"""MultiHeadAttention: the production layer. The book's constructor and outputs, one fused
query/key/value projection, attention through attnlab.functional (SDPA's fused kernels by
default), masks in attnlab's polarity, grouped-query heads and cross-attention.

Shapes: x is (b, tq, d_in); context is (b, tk, context_dim); inside, queries are
(b, h, tq, hd) and keys/values (b, hkv, tk, hd) with h = num_heads, hkv = num_kv_heads and
hd = d_out / num_heads; the output is (b, tq, d_out).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import functional
from attnlab._validate import (
    check_bool,
    check_divides,
    check_dropout,
    check_int,
    check_like_module,
    check_tensor,
    check_tokens,
)

_BOOK_PROJECTIONS = ("W_query", "W_key", "W_value")


class MultiHeadAttention(nn.Module):
    """Multi-head attention a GPT-like model can use as is; equal to the book's
    MultiHeadAttention given the same weights, and able to load its state_dict unchanged.

    num_kv_heads (default num_heads) key/value heads are shared by groups of query heads
    (grouped-query; 1 is multi-query). causal masks each query's future in self-attention.
    context_dim (default d_in) is the width of the `context` that cross-attention reads its
    keys and values from; a module whose context_dim differs from d_in is cross-attention
    only. backend picks attnlab.functional's kernel ("auto", "math" or "sdpa"). device and
    dtype place the parameters, as for torch's own modules.

    Parameters: when the keys and values are computed from inputs of width d_in, one fused
    `qkv_proj` (d_in -> d_out + 2 * kv_dim, rows in query, key, value order); otherwise
    `q_proj` (d_in -> d_out) and `kv_proj` (context_dim -> 2 * kv_dim). Then `out_proj`.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        num_kv_heads: int | None = None,
        causal: bool = True,
        context_dim: int | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_in = check_int("d_in", d_in)
        self.d_out = check_int("d_out", d_out)
        self.context_length = check_int("context_length", context_length)
        self.dropout = check_dropout("dropout", dropout)
        self.num_heads = check_int("num_heads", num_heads)
        check_divides("num_heads", num_heads, "d_out", d_out)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_int("num_kv_heads", self.num_kv_heads)
        check_divides("num_kv_heads", self.num_kv_heads, "num_heads", num_heads)
        self.qkv_bias = check_bool("qkv_bias", qkv_bias)
        self.causal = check_bool("causal", causal)
        self.context_dim = d_in if context_dim is None else check_int("context_dim", context_dim)
        self.backend = functional.check_backend(backend)
        if self.fused:
            self.qkv_proj = nn.Linear(d_in, d_out + 2 * self.kv_dim, bias=qkv_bias, **factory)
        else:
            self.q_proj = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
            self.kv_proj = nn.Linear(self.context_dim, 2 * self.kv_dim, bias=qkv_bias, **factory)
        self.out_proj = nn.Linear(
            d_out, d_out, **factory
        )  # combines the heads' outputs, as in the book
        self.register_load_state_dict_pre_hook(_book_state_dict_hook)

    @property
    def head_dim(self) -> int:
        return self.d_out // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of all key (or all value) heads together: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def fused(self) -> bool:
        """True when queries, keys and values come from one fused projection of width d_in."""
        return self.context_dim == self.d_in

    def extra_repr(self) -> str:
        return (
            f"d_in={self.d_in}, d_out={self.d_out}, context_length={self.context_length}, "
            f"dropout={self.dropout}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, causal={self.causal}, "
            f"context_dim={self.context_dim}, backend={self.backend!r}"
        )

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(b, tq, d_in) -> (b, tq, d_out); with need_weights, also each head's attention
        weights (b, h, tq, tk), computed only then.

        context (b, tk, context_dim): cross-attention, keys and values from it, never causal
        (its tokens have no order relative to x's). mask: bool, True where a query may attend
        (attnlab.masks), or additive float, broadcastable to (b, h, tq, tk); combined with
        the causal mask. A query with no key left gets zeros.
        """
        x = self._check_input("x", x, self.d_in, batch=None)
        check_tokens("x", x.shape[1], self.context_length)
        check_bool("need_weights", need_weights)
        q, k, v = self._project(x, context)
        result = functional.attention(
            q,
            k,
            v,
            mask=mask,
            causal=self.causal and context is None,
            dropout_p=self.dropout,
            training=self.training,
            need_weights=need_weights,
            backend=self.backend,
        )
        out, weights = result if need_weights else (result, None)
        b, tq = x.shape[:2]
        out = out.transpose(1, 2).reshape(b, tq, self.d_out)  # (b, h, tq, hd) -> (b, tq, d_out)
        out = self.out_proj(out)
        return (out, weights) if need_weights else out

    def _project(
        self, x: torch.Tensor, context: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (b, h, tq, hd), keys and values (b, hkv, tk, hd)."""
        if context is None and not self.fused:
            raise ValueError(
                f"this module reads keys and values from a context of width context_dim "
                f"({self.context_dim}) != d_in ({self.d_in}): pass context"
            )
        if context is None:
            q, k, v = self.qkv_proj(x).split([self.d_out, self.kv_dim, self.kv_dim], dim=-1)
        else:
            context = self._check_input("context", context, self.context_dim, batch=x.shape[0])
            q_weight, kv_weight, q_bias, kv_bias = self._split_projection()
            q = nn.functional.linear(x, q_weight, q_bias)
            k, v = nn.functional.linear(context, kv_weight, kv_bias).chunk(2, dim=-1)
        return (
            self._split_heads(q, self.num_heads),
            self._split_heads(k, self.num_kv_heads),
            self._split_heads(v, self.num_kv_heads),
        )

    def _split_projection(self):
        """(query weight, key/value weight, query bias, key/value bias) for cross-attention."""
        if not self.fused:
            return self.q_proj.weight, self.kv_proj.weight, self.q_proj.bias, self.kv_proj.bias
        bias = self.qkv_proj.bias
        return (
            self.qkv_proj.weight[: self.d_out],
            self.qkv_proj.weight[self.d_out :],
            None if bias is None else bias[: self.d_out],
            None if bias is None else bias[self.d_out :],
        )

    def _split_heads(self, projected: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = projected.shape
        # (b, t, heads * hd) -> (b, t, heads, hd) -> (b, heads, t, hd)
        return projected.view(b, t, heads, self.head_dim).transpose(1, 2)

    def _check_input(self, name: str, x: object, width: int, *, batch: int | None) -> torch.Tensor:
        width_name = "d_in" if name == "x" else "context_dim"
        layout = f"(batch, tokens, {width_name})"
        x = check_tensor(
            name, x, ndims=(3,), layout=layout, last_dim=width, last_dim_name=width_name
        )
        check_like_module(name, x, self)
        if batch is not None and x.shape[0] != batch:
            raise ValueError(f"{name} has batch size {x.shape[0]} but x has {batch}")
        return x


def _book_state_dict_hook(module, state_dict, prefix, *_args) -> None:
    """Convert a state_dict saved from attnlab.book.MultiHeadAttention (W_query, W_key,
    W_value, out_proj, mask) to this module's fused layout, in place, before loading."""
    if prefix + "W_query.weight" not in state_dict:
        return
    if module.num_kv_heads != module.num_heads:
        raise ValueError(
            f"a book MultiHeadAttention state_dict has one key/value head per query head; "
            f"this module has num_kv_heads ({module.num_kv_heads}) != num_heads "
            f"({module.num_heads})"
        )
    state_dict.pop(prefix + "mask", None)  # the book's causal mask buffer: rebuilt as needed
    for kind in ("weight", "bias"):
        names = [f"{prefix}{p}.{kind}" for p in _BOOK_PROJECTIONS]
        if not any(n in state_dict for n in names):
            continue
        if not all(n in state_dict for n in names):
            continue  # partial: leave the keys for load_state_dict to report
        q, k, v = (state_dict.pop(n) for n in names)
        if module.fused:
            state_dict[f"{prefix}qkv_proj.{kind}"] = torch.cat([q, k, v])
        else:
            state_dict[f"{prefix}q_proj.{kind}"] = q
            state_dict[f"{prefix}kv_proj.{kind}"] = torch.cat([k, v])
