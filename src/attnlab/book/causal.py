"""Section 3.5: hiding future words with causal attention, and dropout on the weights.

Three ways to mask, all equal (the tests show it): softmax then zero the future and
renormalise; fill future scores with -inf before softmax; add the self-attention blog
post's mask M (0 on and below the diagonal, -inf above). Shapes: scores and weights are
(..., tokens, tokens); CausalAttention maps (batch, tokens, d_in) to (batch, tokens, d_out).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab._validate import (
    check_bool,
    check_dropout,
    check_like_module,
    check_product,
    check_size,
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
    """The chapter's `mask_simple`: 1 on and below the diagonal, 0 above.

    Args:
        num_tokens: the number of tokens, an int >= 1.

    Returns:
        (num_tokens, num_tokens) float32 mask of ones and zeros.

    Raises:
        TypeError: num_tokens is not an int.
        ValueError: num_tokens < 1.

    Examples:
        >>> causal_keep_mask(3)
        tensor([[1., 0., 0.],
                [1., 1., 0.],
                [1., 1., 1.]])
    """
    n = check_size("num_tokens", num_tokens)
    check_product("num_tokens x num_tokens", n, n)
    return torch.tril(torch.ones(n, n))


def causal_future_mask(num_tokens: int) -> torch.Tensor:
    """The chapter's `mask`: 1 strictly above the diagonal (the future), 0 elsewhere.

    This is the book's polarity (1 = hidden); attnlab.masks uses the opposite (True = may
    attend).

    Args:
        num_tokens: the number of tokens, an int >= 1.

    Returns:
        (num_tokens, num_tokens) float32 mask of ones and zeros.

    Raises:
        TypeError: num_tokens is not an int.
        ValueError: num_tokens < 1.
    """
    n = check_size("num_tokens", num_tokens)
    check_product("num_tokens x num_tokens", n, n)
    return torch.triu(torch.ones(n, n), diagonal=1)


def additive_causal_mask(num_tokens: int) -> torch.Tensor:
    """The additive mask M of the self-attention blog post: 0 on and below the diagonal, -inf
    above, built its way.

    Args:
        num_tokens: the number of tokens, an int >= 1.

    Returns:
        (num_tokens, num_tokens) float32 mask to add to the scores.

    Raises:
        TypeError: num_tokens is not an int.
        ValueError: num_tokens < 1.
    """
    n = check_size("num_tokens", num_tokens)
    check_product("num_tokens x num_tokens", n, n)
    mask = torch.tril(torch.ones(n, n) * (-1) * float("inf"), diagonal=-1)  # -inf below
    return mask.t()  # -inf above the diagonal


def causal_weights_renormalised(attn_scores: torch.Tensor, d_k: int) -> torch.Tensor:
    """Way 1 (figure 3.20): softmax, zero the weights above the diagonal, renormalise rows.

    Numerically the weakest way: if the softmax underflows every kept weight of a row to 0
    (a future score far above the rest), the row is 0 / 0 = NaN where ways 2 and 3 are fine.

    Args:
        attn_scores: (..., tokens, tokens) floating-point scores, 2-D to 4-D, unscaled.
        d_k: the keys' width, an int >= 1; the scores are divided by sqrt(d_k).

    Returns:
        (..., tokens, tokens) causal weights: 0 above the diagonal, rows summing to 1.

    Raises:
        TypeError: attn_scores is not a floating-point tensor, or d_k not an int.
        ValueError: attn_scores not 2-D to 4-D or not square, or d_k < 1.
    """
    attn_scores = _check_scores(attn_scores)
    attn_weights = scaled_softmax(attn_scores, check_size("d_k", d_k))
    masked_simple = attn_weights * causal_keep_mask(attn_scores.shape[-1]).to(attn_weights)
    row_sums = masked_simple.sum(dim=-1, keepdim=True)
    return masked_simple / row_sums


def mask_future_scores(attn_scores: torch.Tensor) -> torch.Tensor:
    """Fill the scores above the diagonal with -inf (the chapter's `masked`), out of place.

    Args:
        attn_scores: (..., tokens, tokens) floating-point scores, 2-D to 4-D.

    Returns:
        A new tensor: the scores, -inf above the diagonal.

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: not 2-D to 4-D, or not square.
    """
    attn_scores = _check_scores(attn_scores)
    future = causal_future_mask(attn_scores.shape[-1]).to(attn_scores.device).bool()
    return attn_scores.masked_fill(future, -torch.inf)


def causal_weights_neg_inf(attn_scores: torch.Tensor, d_k: int) -> torch.Tensor:
    """Way 2 (figure 3.21): -inf above the diagonal, then one softmax; no renormalising.

    Args:
        attn_scores: (..., tokens, tokens) floating-point scores, 2-D to 4-D, unscaled.
        d_k: the keys' width, an int >= 1; the scores are divided by sqrt(d_k).

    Returns:
        (..., tokens, tokens) causal weights: 0 above the diagonal, rows summing to 1.

    Raises:
        TypeError: attn_scores is not a floating-point tensor, or d_k not an int.
        ValueError: attn_scores not 2-D to 4-D or not square, or d_k < 1.
    """
    return scaled_softmax(mask_future_scores(attn_scores), check_size("d_k", d_k))


def causal_weights_additive(attn_scores: torch.Tensor, d_k: int) -> torch.Tensor:
    """Way 3 (the blog post's): softmax((scores + M) / sqrt(d_k)) with the additive mask M.

    Args:
        attn_scores: (..., tokens, tokens) floating-point scores, 2-D to 4-D, unscaled.
        d_k: the keys' width, an int >= 1; the scores are divided by sqrt(d_k).

    Returns:
        (..., tokens, tokens) causal weights: 0 above the diagonal, rows summing to 1.

    Raises:
        TypeError: attn_scores is not a floating-point tensor, or d_k not an int.
        ValueError: attn_scores not 2-D to 4-D or not square, or d_k < 1.
    """
    attn_scores = _check_scores(attn_scores)
    masked = attn_scores + additive_causal_mask(attn_scores.shape[-1]).to(attn_scores)
    return scaled_softmax(masked, check_size("d_k", d_k))


class CausalAttention(nn.Module):
    """Listing 3.3: self-attention with a causal mask (a registered buffer) and dropout.

    The book's class; beyond it, the arguments and the input are validated (a ValueError
    or TypeError naming the argument) and a sequence longer than context_length is a
    ValueError.

    Args:
        d_in: input width, an int >= 1.
        d_out: output width, an int >= 1.
        context_length: the longest sequence, an int >= 1 (the size of the `mask` buffer).
        dropout: dropout probability on the attention weights, in [0, 1); training mode only.
        qkv_bias: whether W_query, W_key and W_value have biases.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a size < 1, or dropout outside [0, 1).

    Examples:
        >>> _ = torch.manual_seed(123)
        >>> from attnlab.book import example_batch
        >>> ca = CausalAttention(d_in=3, d_out=2, context_length=6, dropout=0.0)
        >>> ca(example_batch()).shape
        torch.Size([2, 6, 2])
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        self.d_in = check_size("d_in", d_in)
        self.d_out = check_size("d_out", d_out)
        check_product("d_in x d_out", self.d_in, self.d_out)
        self.context_length = check_size("context_length", context_length)
        check_product("context_length x context_length", *(self.context_length,) * 2)
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
        """Causal self-attention: each token sees itself and the earlier ones.

        Args:
            x: (batch, tokens, d_in) in the module's dtype and device, tokens <= context_length.

        Returns:
            (batch, tokens, d_out) context vectors.

        Raises:
            TypeError: x is not a floating-point tensor, or not of the module's dtype.
            ValueError: x's shape does not fit, it is on another device, or it has more than
                context_length tokens.
        """
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
