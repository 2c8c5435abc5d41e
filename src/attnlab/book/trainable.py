"""Section 3.4: self-attention with trainable weights (scaled dot-product attention).

Shapes: x is (tokens, d_in) as in the chapter, or (batch, tokens, d_in); W_* map d_in to
d_out; scores and weights are (..., tokens, tokens); outputs are (..., tokens, d_out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnlab._validate import check_bool, check_like_module, check_product, check_size, check_tensor


def _check_x(x: object, module: nn.Module) -> torch.Tensor:
    x = check_tensor(
        "x",
        x,
        ndims=(2, 3),
        layout="(tokens, d_in) or (batch, tokens, d_in)",
        last_dim=module.d_in,
    )
    return check_like_module("x", x, module)


def scaled_softmax(attn_scores: torch.Tensor, d_k: int) -> torch.Tensor:
    """softmax(scores / sqrt(d_k)) over the keys: the chapter's attention weights.

    Args:
        attn_scores: (..., keys) floating-point scores (-inf where masked).
        d_k: the keys' width, an int >= 1.

    Returns:
        Weights of attn_scores' shape, each row summing to 1 over the keys.

    Raises:
        TypeError: d_k is not an int.
        ValueError: d_k < 1.
    """
    d_k = check_size("d_k", d_k)
    return torch.softmax(attn_scores / d_k**0.5, dim=-1)


class SelfAttention_v1(nn.Module):  # noqa: N801 - the book's name
    """Listing 3.1: weights as nn.Parameter(torch.rand(d_in, d_out)), applied as x @ W.

    Args:
        d_in: input width, an int >= 1.
        d_out: output width, an int >= 1.

    Raises:
        TypeError: a width that is not an int.
        ValueError: a width < 1.

    Examples:
        >>> _ = torch.manual_seed(123)
        >>> from attnlab.book import INPUTS
        >>> SelfAttention_v1(d_in=3, d_out=2)(INPUTS)[1]  # as printed in section 3.4.2
        tensor([0.3061, 0.8210], grad_fn=<SelectBackward0>)
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_in = check_size("d_in", d_in)
        self.d_out = check_size("d_out", d_out)
        check_product("d_in x d_out", self.d_in, self.d_out)
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """softmax(Q K^T / sqrt(d_out)) V over the tokens, with Q = x @ W_query and so on.

        Args:
            x: (tokens, d_in), the book's input, or (batch, tokens, d_in), in the module's
                dtype and device.

        Returns:
            (tokens, d_out) or (batch, tokens, d_out) context vectors.

        Raises:
            TypeError: x is not a floating-point tensor, or not of the module's dtype.
            ValueError: x is not 2-D or 3-D, its last dimension is not d_in, or it is on another
                device.
        """
        x = _check_x(x, self)
        keys = x @ self.W_key  # (..., tokens, d_out)
        queries = x @ self.W_query
        values = x @ self.W_value
        attn_scores = queries @ keys.transpose(-2, -1)  # omega, (..., tokens, tokens)
        attn_weights = scaled_softmax(attn_scores, keys.shape[-1])
        return attn_weights @ values


class SelfAttention_v2(nn.Module):  # noqa: N801 - the book's name
    """Listing 3.2: the same mechanism with nn.Linear layers (better initialisation, bias).

    Args:
        d_in: input width, an int >= 1.
        d_out: output width, an int >= 1.
        qkv_bias: whether the three projections have biases.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a width < 1.
    """

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.d_in = check_size("d_in", d_in)
        self.d_out = check_size("d_out", d_out)
        check_product("d_in x d_out", self.d_in, self.d_out)
        check_bool("qkv_bias", qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The weights the forward pass uses (start of section 3.5).

        Args:
            x: (tokens, d_in), the book's input, or (batch, tokens, d_in), in the module's
                dtype and device.

        Returns:
            (tokens, tokens) or (batch, tokens, tokens) weights, each row summing to 1.

        Raises:
            TypeError: x is not a floating-point tensor, or not of the module's dtype.
            ValueError: x is not 2-D or 3-D, its last dimension is not d_in, or it is on another
                device.
        """
        return self._weights(_check_x(x, self))

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        keys = self.W_key(x)
        queries = self.W_query(x)
        attn_scores = queries @ keys.transpose(-2, -1)  # (..., tokens, tokens)
        return scaled_softmax(attn_scores, keys.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """As SelfAttention_v1, with Linear layers.

        Args:
            x: (tokens, d_in), the book's input, or (batch, tokens, d_in), in the module's
                dtype and device.

        Returns:
            (tokens, d_out) or (batch, tokens, d_out) context vectors.

        Raises:
            TypeError: x is not a floating-point tensor, or not of the module's dtype.
            ValueError: x is not 2-D or 3-D, its last dimension is not d_in, or it is on another
                device.
        """
        x = _check_x(x, self)
        return self._weights(x) @ self.W_value(x)  # (..., tokens, d_out)


@dataclass(frozen=True)
class QueryStep:
    """Section 3.4.1's intermediate tensors for one query token x(i).

    Attributes:
        query: (d_out,) q(i) = x(i) @ W_query.
        keys: (tokens, d_out) every token's key.
        values: (tokens, d_out_v) every token's value.
        own_score: () omega_ii = q(i) . k(i).
        attn_scores: (tokens,) q(i) . k(j) for every token j.
        attn_weights: (tokens,) softmax(scores / sqrt(d_k)).
        context_vec: (d_out_v,) z(i), the weighted sum of the values.
    """

    query: torch.Tensor  # (d_out,)    q(i) = x(i) @ W_query
    keys: torch.Tensor  # (tokens, d_out)
    values: torch.Tensor  # (tokens, d_out)
    own_score: torch.Tensor  # ()     omega_ii = q(i) . k(i)
    attn_scores: torch.Tensor  # (tokens,)
    attn_weights: torch.Tensor  # (tokens,)  softmax(scores / sqrt(d_k))
    context_vec: torch.Tensor  # (d_out,)   z(i)


def attention_for_query(
    inputs: torch.Tensor,
    W_query: torch.Tensor,  # noqa: N803 - the book's names
    W_key: torch.Tensor,  # noqa: N803
    W_value: torch.Tensor,  # noqa: N803
    query_index: int = 1,
) -> QueryStep:
    """Section 3.4.1 step by step: the context vector of one token (x(2) by default).

    Args:
        inputs: (tokens, d_in) floating-point embeddings, e.g. `INPUTS`.
        W_query: (d_in, d_out) of inputs' dtype.
        W_key: (d_in, d_out) of inputs' dtype.
        W_value: (d_in, d_out_v) of inputs' dtype.
        query_index: the query token's index (0-based; 1 is the book's x(2)).

    Returns:
        Every intermediate tensor of the step, as a QueryStep.

    Raises:
        TypeError: a non-floating tensor, or weights of another dtype than inputs.
        ValueError: a tensor not 2-D, weights whose rows are not d_in, W_query and W_key
            of different widths, or query_index outside the tokens.
    """
    inputs = check_tensor("inputs", inputs, ndims=(2,), layout="(tokens, d_in)")
    d_in, tokens = inputs.shape[1], inputs.shape[0]
    for name, w in (("W_query", W_query), ("W_key", W_key), ("W_value", W_value)):
        w = check_tensor(name, w, ndims=(2,), layout="(d_in, d_out)")
        if w.shape[0] != d_in:
            raise ValueError(f"{name} has {w.shape[0]} rows but inputs has d_in = {d_in}")
        if w.dtype != inputs.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but inputs has {inputs.dtype}")
    if W_query.shape[1] != W_key.shape[1]:
        raise ValueError(
            f"W_query ({W_query.shape[1]} columns) and W_key ({W_key.shape[1]}) "
            f"must project to the same width"
        )
    check_size("query_index", query_index, minimum=0)
    if query_index >= tokens:
        raise ValueError(f"query_index ({query_index}) must be < the number of tokens ({tokens})")
    x_i = inputs[query_index]
    query = x_i @ W_query  # (d_out,)
    keys = inputs @ W_key  # (tokens, d_out)
    values = inputs @ W_value  # (tokens, d_out_v)
    attn_scores = query @ keys.T  # (tokens,)
    attn_weights = scaled_softmax(attn_scores, keys.shape[-1])  # (tokens,)
    return QueryStep(
        query=query,
        keys=keys,
        values=values,
        own_score=query.dot(keys[query_index]),
        attn_scores=attn_scores,
        attn_weights=attn_weights,
        context_vec=attn_weights @ values,
    )


def copy_v2_weights_into_v1(sa_v2: SelfAttention_v2, sa_v1: SelfAttention_v1) -> None:
    """Exercise 3.1: give `sa_v1` the weights of `sa_v2` so both compute the same outputs.

    nn.Linear stores its weight as (d_out, d_in) and computes x @ W.T, so v1's W is v2's W.T.
    A v2 with qkv_bias has no v1 equivalent (v1 has no bias), which is refused.

    Args:
        sa_v2: the source, without qkv_bias.
        sa_v1: the destination, of the same d_in and d_out; changed in place.

    Raises:
        TypeError: sa_v2 or sa_v1 of another class.
        ValueError: sa_v2 has biases, or the two differ in d_in or d_out.
    """
    if not isinstance(sa_v2, SelfAttention_v2):
        raise TypeError(f"sa_v2 must be a SelfAttention_v2, got {type(sa_v2).__name__}")
    if not isinstance(sa_v1, SelfAttention_v1):
        raise TypeError(f"sa_v1 must be a SelfAttention_v1, got {type(sa_v1).__name__}")
    if sa_v2.W_query.bias is not None:
        raise ValueError("sa_v2 has qkv_bias=True; SelfAttention_v1 has no bias to receive it")
    if (sa_v2.d_in, sa_v2.d_out) != (sa_v1.d_in, sa_v1.d_out):
        raise ValueError(
            f"sa_v2 is (d_in={sa_v2.d_in}, d_out={sa_v2.d_out}) but sa_v1 is "
            f"(d_in={sa_v1.d_in}, d_out={sa_v1.d_out})"
        )
    with torch.no_grad():
        sa_v1.W_query.copy_(sa_v2.W_query.weight.T)
        sa_v1.W_key.copy_(sa_v2.W_key.weight.T)
        sa_v1.W_value.copy_(sa_v2.W_value.weight.T)
