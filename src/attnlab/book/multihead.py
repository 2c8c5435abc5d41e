"""Section 3.6: multi-head attention, first as stacked CausalAttention heads, then with
weight splits; exercises 3.2 and 3.3.

Shapes: x is (b, t, d_in) with b batch, t tokens; inside MultiHeadAttention the projections
are split into (b, h, t, hd) with h heads of hd = d_out / h features; weights are
(b, h, t, t); the output is (b, t, d_out).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab._validate import (
    check_bool,
    check_divides,
    check_dropout,
    check_like_module,
    check_product,
    check_size,
    check_tensor,
    check_tokens,
)
from attnlab.book.causal import CausalAttention
from attnlab.book.trainable import scaled_softmax


class MultiHeadAttentionWrapper(nn.Module):
    """Listing 3.4: num_heads CausalAttention modules run one after another, concatenated.

    The output has d_out * num_heads features: d_out is each head's width here.

    Args:
        d_in: input width, an int >= 1.
        d_out: each head's output width, an int >= 1.
        context_length: the longest sequence, an int >= 1.
        dropout: dropout probability on the attention weights, in [0, 1); training mode only.
        num_heads: the number of heads, an int >= 1.
        qkv_bias: whether the query, key and value projections have biases.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a size < 1, num_heads past MAX_SIZE (2**40), or dropout outside [0, 1).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        check_size("num_heads", num_heads)  # bounded before the loop that builds the heads
        self.heads = nn.ModuleList(
            [
                CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
                for _ in range(num_heads)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every head's causal attention, side by side.

        Args:
            x: (batch, tokens, d_in) in the module's dtype and device, tokens <= context_length.

        Returns:
            (batch, tokens, d_out * num_heads), head 0's features first.

        Raises:
            TypeError: x is not a floating-point tensor, or not of the module's dtype.
            ValueError: x is not (batch, tokens, d_in), is on another device, or has more than
                context_length tokens.
        """
        return torch.cat([head(x) for head in self.heads], dim=-1)  # (b, t, d_out * h)


class MultiHeadAttention(nn.Module):
    """Listing 3.5: one projection per Q/K/V split into heads, then an output projection.

    Parameters are created in the book's order (W_query, W_key, W_value, out_proj) so that
    the chapter's random seed reproduces its printed outputs. The `mask` buffer is 1 above
    the diagonal (the future), as the book has it. attnlab.MultiHeadAttention loads this
    module's state_dict unchanged.

    Args:
        d_in: input width, an int >= 1.
        d_out: the total output width over all heads, an int >= 1.
        context_length: the longest sequence, an int >= 1.
        dropout: dropout probability on the attention weights, in [0, 1); training mode only.
        num_heads: the number of heads, an int >= 1 dividing d_out.
        qkv_bias: whether the query, key and value projections have biases.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a size < 1, num_heads not dividing d_out, or dropout outside [0, 1).

    Examples:
        >>> _ = torch.manual_seed(123)
        >>> from attnlab.book import example_batch
        >>> mha = MultiHeadAttention(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2)
        >>> mha(example_batch())[0, 0]  # as printed in section 3.6.2
        tensor([0.3190, 0.4858], grad_fn=<SelectBackward0>)
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        self.d_in = check_size("d_in", d_in)
        self.d_out = check_size("d_out", d_out)
        check_product("d_in x d_out", self.d_in, self.d_out)
        self.context_length = check_size("context_length", context_length)
        check_product("context_length x context_length", *(self.context_length,) * 2)
        self.num_heads = check_size("num_heads", num_heads)
        check_divides("num_heads", num_heads, "d_out", d_out)
        check_dropout("dropout", dropout)
        self.head_dim = self.d_out // self.num_heads
        check_bool("qkv_bias", qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # combines the heads' outputs
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def _check_x(self, x: object) -> torch.Tensor:
        x = check_tensor("x", x, ndims=(3,), layout="(batch, tokens, d_in)", last_dim=self.d_in)
        check_like_module("x", x, self)
        check_tokens("x", x.shape[1], self.context_length)
        return x

    def _split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        b, num_tokens, _ = projected.shape
        # (b, t, d_out) -> (b, t, h, hd) -> (b, h, t, hd)
        return projected.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Each head's causal attention weights, before dropout.

        Args:
            x: (batch, tokens, d_in) in the module's dtype and device, tokens <= context_length.

        Returns:
            (batch, num_heads, tokens, tokens) weights: 0 above the diagonal, rows summing to 1.

        Raises:
            TypeError: x is not a floating-point tensor, or not of the module's dtype.
            ValueError: x is not (batch, tokens, d_in), is on another device, or has more than
                context_length tokens.
        """
        return self._causal_weights(self._check_x(x))

    def _causal_weights(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[1]
        keys = self._split_heads(self.W_key(x))  # (b, h, t, hd)
        queries = self._split_heads(self.W_query(x))
        attn_scores = queries @ keys.transpose(2, 3)  # (b, h, t, t), one product per head
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]  # truncated to the tokens
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        return scaled_softmax(attn_scores, keys.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal attention per head, the heads merged by out_proj.

        Args:
            x: (batch, tokens, d_in) in the module's dtype and device, tokens <= context_length.

        Returns:
            (batch, tokens, d_out) context vectors.

        Raises:
            TypeError: x is not a floating-point tensor, or not of the module's dtype.
            ValueError: x is not (batch, tokens, d_in), is on another device, or has more than
                context_length tokens.
        """
        x = self._check_x(x)
        b, num_tokens, _ = x.shape
        attn_weights = self.dropout(self._causal_weights(x))  # (b, h, t, t)
        values = self._split_heads(self.W_value(x))  # (b, h, t, hd)
        context_vec = (attn_weights @ values).transpose(1, 2)  # (b, t, h, hd)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)  # (b, t, d_out)
        return self.out_proj(context_vec)


def wrapper_with_2d_output(
    d_in: int = 3, context_length: int = 6, dropout: float = 0.0
) -> MultiHeadAttentionWrapper:
    """Exercise 3.2: keep num_heads=2 but get 2-d outputs, by giving each head d_out=1.

    Args:
        d_in: input width.
        context_length: the longest sequence.
        dropout: dropout probability on the attention weights, in [0, 1).

    Returns:
        A MultiHeadAttentionWrapper of two heads of width 1.
    """
    return MultiHeadAttentionWrapper(d_in, 1, context_length, dropout, num_heads=2)


def gpt2_small_attention(dropout: float = 0.0, qkv_bias: bool = False) -> MultiHeadAttention:
    """Exercise 3.3: attention sized like GPT-2 small: 768 in and out, 12 heads, 1024 tokens.

    Args:
        dropout: dropout probability on the attention weights, in [0, 1).
        qkv_bias: whether the query, key and value projections have biases.

    Returns:
        A MultiHeadAttention of 2,360,064 parameters (without qkv_bias).
    """
    return MultiHeadAttention(768, 768, 1024, dropout, num_heads=12, qkv_bias=qkv_bias)


def count_parameters(module: nn.Module) -> int:
    """The number of trainable parameters (buffers such as the causal mask do not count).

    Args:
        module: any torch.nn.Module.

    Returns:
        The sum of numel() over the parameters that require grad.

    Raises:
        TypeError: module is not an nn.Module.

    Examples:
        >>> count_parameters(gpt2_small_attention())
        2360064
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
