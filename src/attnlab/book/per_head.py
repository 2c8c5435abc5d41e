"""The self-attention blog post (the chapter's fifth source): multi-head self-attention
with a separate Q/K/V matrix per head, and the recovery of those per-head matrices from
PyTorch's nn.MultiheadAttention.

Shapes: X is (L, D) as in the blog, or (B, L, D); each head projects D to kdim (queries,
keys) and vdim (values); the heads' outputs are concatenated to (..., L, heads * vdim) and
mapped back to D by the output matrix. Note that the blog's kdim and vdim are per-head widths,
whereas nn.MultiheadAttention's kdim and vdim are the key and value *input* widths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from attnlab._validate import (
    check_broadcasts_to,
    check_like_module,
    check_size,
    check_tensor,
)


class MultiHeadSelfAttention(nn.Module):
    """The blog's layer, batch-capable: per-head parameters `_wq_h{h}`, `_wk_h{h}`, `_wv_h{h}`
    of shape (D, kdim) / (D, vdim) and an output matrix `_wo` of shape (heads * vdim, D),
    drawn with torch.randn (unscaled, as in the blog) in that order.

    Args:
        D: the model width, an int >= 1.
        kdim: each head's query and key width (default D // heads), an int >= 1. Per head,
            unlike nn.MultiheadAttention's kdim, the width of its key input.
        vdim: each head's value width (default D // heads), an int >= 1.
        heads: the number of heads, an int >= 1 (<= D when kdim or vdim defaults).

    Raises:
        TypeError: a size that is not an int.
        ValueError: a size < 1, or heads > D with a defaulted kdim or vdim.

    Examples:
        >>> layer = MultiHeadSelfAttention(D=8, kdim=3, vdim=5, heads=2)
        >>> layer(torch.randn(4, 8)).shape  # unbatched (L, D), as in the blog
        torch.Size([4, 8])
    """

    def __init__(
        self, D: int, kdim: int | None = None, vdim: int | None = None, heads: int = 1
    ) -> None:
        super().__init__()
        self._D = check_size("D", D)
        self._heads = check_size("heads", heads)
        if heads > D and (kdim is None or vdim is None):
            raise ValueError(
                f"heads ({heads}) must be <= D ({D}) when kdim or vdim defaults to D // heads"
            )
        self._kdim = check_size("kdim", kdim) if kdim is not None else self._D // self._heads
        self._vdim = check_size("vdim", vdim) if vdim is not None else self._D // self._heads
        for h in range(self._heads):
            setattr(self, f"_wq_h{h}", nn.Parameter(torch.randn(self._D, self._kdim)))
            setattr(self, f"_wk_h{h}", nn.Parameter(torch.randn(self._D, self._kdim)))
            setattr(self, f"_wv_h{h}", nn.Parameter(torch.randn(self._D, self._vdim)))
        self._wo = nn.Parameter(torch.randn(self._heads * self._vdim, self._D))

    def head_weights(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head h's (W_q, W_k, W_v), applied as X @ W.

        Args:
            h: the head's index, an int in [0, heads).

        Returns:
            The three parameters: (D, kdim), (D, kdim) and (D, vdim).

        Raises:
            TypeError: h is not an int.
            ValueError: h outside [0, heads).
        """
        check_size("h", h, minimum=0)
        if h >= self._heads:
            raise ValueError(f"h ({h}) must be < heads ({self._heads})")
        return getattr(self, f"_wq_h{h}"), getattr(self, f"_wk_h{h}"), getattr(self, f"_wv_h{h}")

    def forward(self, X: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention per head, heads concatenated, then @ W_o.

        As in the blog and in PyTorch, a row masked entirely with -inf gives NaN.

        Args:
            X: (L, D) as in the blog, or (B, L, D), in the module's dtype and device.
            attn_mask: an optional additive float mask broadcastable to (..., L, L), such as the
                blog's causal M (`attnlab.book.additive_causal_mask(L)`); it is added after the
                1/sqrt(kdim) scaling, as PyTorch does.

        Returns:
            (L, D) or (B, L, D).

        Raises:
            TypeError: X is not a floating-point tensor of the module's dtype, or attn_mask is
                not a float tensor (a bool mask must be made additive first).
            ValueError: X's shape does not fit, it is on another device, or attn_mask does not
                broadcast to the scores.
        """
        X = check_tensor(
            "X", X, ndims=(2, 3), layout="(L, D) or (B, L, D)", last_dim=self._D, last_dim_name="D"
        )
        check_like_module("X", X, self)
        attn_mask = _check_additive_mask(attn_mask, X, X.shape[-2])
        heads = []
        for h in range(self._heads):
            wq, wk, wv = self.head_weights(h)
            heads.append(_head_attention(X @ wq, X @ wk, X @ wv, attn_mask))  # (..., L, vdim)
        return torch.cat(heads, dim=-1) @ self._wo  # (..., L, heads * vdim) -> (..., L, D)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> MultiHeadSelfAttention:
        """A layer computing exactly what `mha` computes, built from its recovered weights.

        The blog's layer has no biases, so `mha` must be built with bias=False.

        Args:
            mha: an nn.MultiheadAttention with bias=False and kdim == vdim == embed_dim.

        Returns:
            A MultiHeadSelfAttention in mha's dtype (the global random state is left as it was).

        Raises:
            TypeError: mha is not an nn.MultiheadAttention.
            ValueError: mha has biases, add_bias_kv or add_zero_attn, or key/value widths other
                than embed_dim.
        """
        weights = heads_from_torch(mha)
        if weights.bo is not None or weights.bq is not None:
            raise ValueError(
                "mha has biases (bias=True); MultiHeadSelfAttention has none. "
                "Use torch_attention_by_heads to recompute it with its biases"
            )
        if mha.kdim != mha.embed_dim or mha.vdim != mha.embed_dim:
            raise ValueError(
                f"mha takes keys of width {mha.kdim} and values of width "
                f"{mha.vdim}; self-attention needs both = embed_dim ({mha.embed_dim})"
            )
        with torch.random.fork_rng(devices=[]):  # the random init is overwritten below
            layer = cls(mha.embed_dim, heads=mha.num_heads)
        with torch.no_grad():
            for h in range(mha.num_heads):
                for param, value in zip(
                    layer.head_weights(h),
                    (weights.wq[h], weights.wk[h], weights.wv[h]),
                    strict=True,
                ):
                    param.copy_(value)
            layer._wo.copy_(weights.wo)
        return layer.to(mha.out_proj.weight.dtype)


def _check_additive_mask(
    attn_mask: object, like: torch.Tensor, num_keys: int
) -> torch.Tensor | None:
    """An additive float mask broadcastable to (..., L, S), in `like`'s dtype, or None."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor) or not attn_mask.is_floating_point():
        got = attn_mask.dtype if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
        raise TypeError(
            f"attn_mask must be an additive float mask (0 = attend, -inf = blocked), "
            f"got {got}; turn a bool mask into one with masked_fill first"
        )
    scores_shape = (*like.shape[:-1], num_keys)  # (..., L, S)
    check_broadcasts_to("attn_mask", attn_mask, scores_shape, "shape (..., L, S)")
    return attn_mask.to(like)


def _head_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_k) + mask) v for one head; q, k, v are (..., L, d)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(float(q.shape[-1]))  # (..., L, L)
    if attn_mask is not None:
        scores = scores + attn_mask
    return torch.softmax(scores, dim=-1) @ v


@dataclass(frozen=True)
class TorchHeads:
    """Per-head weights recovered from an nn.MultiheadAttention, in X @ W layout.

    Attributes:
        wq: one (embed_dim, head_dim) query matrix per head.
        wk: one (kdim, head_dim) key matrix per head.
        wv: one (vdim, head_dim) value matrix per head.
        bq: one (head_dim,) query bias per head, or None.
        bk: one (head_dim,) key bias per head, or None.
        bv: one (head_dim,) value bias per head, or None.
        wo: (heads * head_dim, embed_dim), rows following the concatenated heads.
        bo: (embed_dim,) or None.
    """

    wq: list[torch.Tensor]
    wk: list[torch.Tensor]
    wv: list[torch.Tensor]
    bq: list[torch.Tensor] | None
    bk: list[torch.Tensor] | None
    bv: list[torch.Tensor] | None
    wo: torch.Tensor
    bo: torch.Tensor | None


def heads_from_torch(mha: nn.MultiheadAttention) -> TorchHeads:
    """Split `mha`'s packed projections into the blog's per-head matrices.

    PyTorch computes q = x @ W_q.T + b_q with W_q of shape (E, E) and gives head h the
    features h*hd:(h+1)*hd, so head h's matrix is rows h*hd:(h+1)*hd of W_q, transposed.

    Args:
        mha: an nn.MultiheadAttention (packed or separate projections, with or without
            biases).

    Returns:
        The per-head weights, detached views of mha's parameters.

    Raises:
        TypeError: mha is not an nn.MultiheadAttention.
        ValueError: mha uses add_bias_kv or add_zero_attn.
    """
    if not isinstance(mha, nn.MultiheadAttention):
        raise TypeError(f"mha must be a torch.nn.MultiheadAttention, got {type(mha).__name__}")
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError(
            "mha uses add_bias_kv or add_zero_attn, which have no per-head "
            "equivalent in the blog's layer"
        )
    hd = mha.head_dim
    if mha.in_proj_weight is not None:
        w_q, w_k, w_v = mha.in_proj_weight.detach().chunk(3)  # each (E, E)
    else:
        w_q, w_k, w_v = (
            mha.q_proj_weight.detach(),
            mha.k_proj_weight.detach(),
            mha.v_proj_weight.detach(),
        )
    b_q = b_k = b_v = None
    if mha.in_proj_bias is not None:
        b_q, b_k, b_v = mha.in_proj_bias.detach().chunk(3)  # each (E,)

    def per_head(w: torch.Tensor) -> list[torch.Tensor]:
        return [w[h * hd : (h + 1) * hd].T for h in range(mha.num_heads)]  # (in_width, hd)

    def per_head_bias(b: torch.Tensor | None) -> list[torch.Tensor] | None:
        return None if b is None else [b[h * hd : (h + 1) * hd] for h in range(mha.num_heads)]

    out_bias = mha.out_proj.bias
    return TorchHeads(
        wq=per_head(w_q),
        wk=per_head(w_k),
        wv=per_head(w_v),
        bq=per_head_bias(b_q),
        bk=per_head_bias(b_k),
        bv=per_head_bias(b_v),
        wo=mha.out_proj.weight.detach().T,  # (E, E): rows follow the concatenated heads
        bo=None if out_bias is None else out_bias.detach(),
    )


def torch_attention_by_heads(
    mha: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Recompute `mha(query, key, value, attn_mask=...)[0]` one head at a time.

    Eval-mode semantics (no dropout).

    Args:
        mha: an nn.MultiheadAttention without add_bias_kv or add_zero_attn.
        query: (batch, tokens, embed_dim), whatever mha.batch_first says.
        key: (batch, source tokens, kdim); default query (self-attention).
        value: (batch, source tokens, vdim); default key.
        attn_mask: PyTorch's polarity: a float mask is added to the scores, a boolean one is
            True where attending is *not* allowed; broadcastable to (batch, tokens, source
            tokens).

    Returns:
        (batch, tokens, embed_dim), equal to mha's output.

    Raises:
        TypeError: mha is not an nn.MultiheadAttention, or an input is not a floating-point
            tensor of mha's dtype.
        ValueError: widths, batch sizes or token counts that do not fit, or a mask that does
            not broadcast.
    """
    w = heads_from_torch(mha)
    key = query if key is None else key
    value = key if value is None else value
    widths = (
        ("query", query, mha.embed_dim, "embed_dim"),
        ("key", key, mha.kdim, "kdim"),
        ("value", value, mha.vdim, "vdim"),
    )
    for name, t, width, width_name in widths:
        check_tensor(
            name,
            t,
            ndims=(3,),
            layout=f"(batch, tokens, {width_name})",
            last_dim=width,
            last_dim_name=f"mha.{width_name}",
        )
        check_like_module(name, t, mha)
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        raise ValueError(
            f"query, key, value batch sizes differ: {query.shape[0]}, "
            f"{key.shape[0]}, {value.shape[0]}"
        )
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"key has {key.shape[1]} tokens but value has {value.shape[1]}")
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(
            attn_mask, -torch.inf
        )
    attn_mask = _check_additive_mask(attn_mask, query, key.shape[1])
    heads = []
    for h in range(mha.num_heads):
        q = query @ w.wq[h] + (w.bq[h] if w.bq is not None else 0)  # (b, t, hd)
        k = key @ w.wk[h] + (w.bk[h] if w.bk is not None else 0)
        v = value @ w.wv[h] + (w.bv[h] if w.bv is not None else 0)
        heads.append(_head_attention(q, k, v, attn_mask))
    out = torch.cat(heads, dim=-1) @ w.wo  # (b, t, E)
    return out if w.bo is None else out + w.bo
