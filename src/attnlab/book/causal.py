"""Section 3.5: hiding future words with causal attention, and dropout on the weights.

Three ways to mask, all equal (the tests show it): softmax then zero the future and
renormalise; fill future scores with -inf before softmax; add seed 003's mask M (0 on and
below the diagonal, -inf above). Shapes: scores and weights are (..., tokens, tokens);
CausalAttention maps (batch, tokens, d_in) to (batch, tokens, d_out).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab._validate import (
    check_bool,
    check_dropout,
    check_int,
    check_like_module,
    check_tensor,
    check_tokens,
)
from attnlab.book.trainable import scaled_softmax


def _check_scores(attn_scores: object) -> torch.Tensor:
    attn_scores = check_tensor(
        "attn_scores", attn_scores, ndims=(2, 3, 4), layout="(..., tokens, tokens)"
    )
    if attn_scores.shape[-1] != attn_scores.shape[-2]:
        raise ValueError(
            f"attn_scores must be square in its last two dimensions (self-attention), "
            f"got shape {tuple(attn_scores.shape)}"
        )
    return attn_scores


def causal_keep_mask(num_tokens: int) -> torch.Tensor:
    """The chapter's `mask_simple`: 1 on and below the diagonal, 0 above (float)."""
    n = check_int("num_tokens", num_tokens)
    return torch.tril(torch.ones(n, n))


def causal_future_mask(num_tokens: int) -> torch.Tensor:
    """The chapter's `mask`: 1 strictly above the diagonal (the future), 0 elsewhere (float)."""
    n = check_int("num_tokens", num_tokens)
    return torch.triu(torch.ones(n, n), diagonal=1)


def additive_causal_mask(num_tokens: int) -> torch.Tensor:
    """Seed 003's additive mask M: 0 on and below the diagonal, -inf above, built its way."""
    n = check_int("num_tokens", num_tokens)
    mask = torch.tril(torch.ones(n, n) * (-1) * float("inf"), diagonal=-1)  # -inf below
    return mask.t()  # -inf above the diagonal


def causal_weights_renormalised(attn_scores: torch.Tensor, d_k: int) -> torch.Tensor:
    """Way 1 (figure 3.20): softmax, zero the weights above the diagonal, renormalise rows.

    Numerically the weakest way: if the softmax underflows every kept weight of a row to 0
    (a future score far above the rest), the row is 0 / 0 = NaN where ways 2 and 3 are fine.
    """
    attn_scores = _check_scores(attn_scores)
    attn_weights = scaled_softmax(attn_scores, check_int("d_k", d_k))
    masked_simple = attn_weights * causal_keep_mask(attn_scores.shape[-1]).to(attn_weights)
    row_sums = masked_simple.sum(dim=-1, keepdim=True)
    return masked_simple / row_sums


def mask_future_scores(attn_scores: torch.Tensor) -> torch.Tensor:
    """Fill the scores above the diagonal with -inf (the chapter's `masked`), out of place."""
    attn_scores = _check_scores(attn_scores)
    future = causal_future_mask(attn_scores.shape[-1]).to(attn_scores.device).bool()
    return attn_scores.masked_fill(future, -torch.inf)


def causal_weights_neg_inf(attn_scores: torch.Tensor, d_k: int) -> torch.Tensor:
    """Way 2 (figure 3.21): -inf above the diagonal, then one softmax; no renormalising."""
    return scaled_softmax(mask_future_scores(attn_scores), check_int("d_k", d_k))


def causal_weights_additive(attn_scores: torch.Tensor, d_k: int) -> torch.Tensor:
    """Way 3 (seed 003): softmax((scores + M) / sqrt(d_k)) with the additive mask M."""
    attn_scores = _check_scores(attn_scores)
    masked = attn_scores + additive_causal_mask(attn_scores.shape[-1]).to(attn_scores)
    return scaled_softmax(masked, check_int("d_k", d_k))


class CausalAttention(nn.Module):
    """Listing 3.3: self-attention with a causal mask (a registered buffer) and dropout."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        self.d_in = check_int("d_in", d_in)
        self.d_out = check_int("d_out", d_out)
        self.context_length = check_int("context_length", context_length)
        check_dropout("dropout", dropout)
        check_bool("qkv_bias", qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, tokens, d_in) -> (batch, tokens, d_out); a token sees itself and earlier ones."""
        x = check_tensor("x", x, ndims=(3,), layout="(batch, tokens, d_in)", last_dim=self.d_in)
        check_like_module("x", x, self)
        num_tokens = x.shape[1]
        check_tokens("x", num_tokens, self.context_length)
        keys = self.W_key(x)  # (b, tokens, d_out)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)  # (b, tokens, tokens)
        attn_scores.masked_fill_(  # in place: the trailing underscore matters (seed 001)
            self.mask.bool()[:num_tokens, :num_tokens], -torch.inf
        )
        attn_weights = scaled_softmax(attn_scores, keys.shape[-1])
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values  # (b, tokens, d_out)
