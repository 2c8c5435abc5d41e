"""Section 3.3: self-attention without trainable weights.

Each function is one step of the chapter, written the way the chapter writes it (loops where
it loops), so a reader can run the step and compare the printed tensor. Shapes: `inputs` is
(tokens, d), a query is (d,), attention scores and weights are (tokens,) for one query and
(tokens, tokens) for all.
"""

from __future__ import annotations

import torch

from attnlab._validate import check_tensor


def _check_inputs(inputs: object) -> torch.Tensor:
    return check_tensor("inputs", inputs, ndims=(2,), layout="(tokens, d)")


def _check_vector(
    name: str, x: object, length: int, length_name: str, like: torch.Tensor
) -> torch.Tensor:
    x = check_tensor(
        name, x, ndims=(1,), layout=f"({length_name},)", last_dim=length, last_dim_name=length_name
    )
    if x.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the other operand has {like.dtype}")
    return x


def dot_product_loop(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The dot product as the chapter spells it out: multiply element-wise, then sum.

    Args:
        x: (d,) floating-point vector.
        y: (d,) vector of x's dtype.

    Returns:
        The 0-d tensor sum_i x[i] * y[i], equal to torch.dot(x, y).

    Raises:
        TypeError: a non-tensor, a non-floating tensor, or two dtypes.
        ValueError: a tensor that is not 1-D, or lengths that differ.

    Examples:
        >>> from attnlab.book import INPUTS
        >>> dot_product_loop(INPUTS[0], INPUTS[1])
        tensor(0.9544)
    """
    x = check_tensor("x", x, ndims=(1,), layout="(d,)")
    y = _check_vector("y", y, x.shape[0], "len(x)", x)
    res = torch.zeros((), dtype=x.dtype)
    for idx in range(x.shape[0]):
        res += x[idx] * y[idx]
    return res


def attention_scores_for_query(inputs: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Scores omega_i = x_i . query for one query, by a loop over the tokens (attn_scores_2).

    Args:
        inputs: (tokens, d) floating-point embeddings, e.g. `INPUTS`.
        query: (d,) vector of inputs' dtype, e.g. `INPUTS[1]`.

    Returns:
        (tokens,) scores of the query against every token.

    Raises:
        TypeError: a non-tensor, a non-floating tensor, or two dtypes.
        ValueError: inputs not 2-D, or query not (d,).

    Examples:
        >>> from attnlab.book import INPUTS
        >>> attention_scores_for_query(INPUTS, INPUTS[1])
        tensor([0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])
    """
    inputs = _check_inputs(inputs)
    query = _check_vector("query", query, inputs.shape[1], "d", inputs)
    attn_scores = torch.empty(inputs.shape[0], dtype=inputs.dtype)
    for i, x_i in enumerate(inputs):
        attn_scores[i] = torch.dot(x_i, query)
    return attn_scores


def attention_scores_loop(inputs: torch.Tensor) -> torch.Tensor:
    """All pairwise scores x_i . x_j by two nested loops: the slow way.

    Args:
        inputs: (tokens, d) floating-point embeddings.

    Returns:
        (tokens, tokens) scores, row i the scores of query i.

    Raises:
        TypeError: inputs is not a floating-point tensor.
        ValueError: inputs is not 2-D (tokens, d).
    """
    inputs = _check_inputs(inputs)
    n = inputs.shape[0]
    attn_scores = torch.empty(n, n, dtype=inputs.dtype)
    for i, x_i in enumerate(inputs):
        for j, x_j in enumerate(inputs):
            attn_scores[i, j] = torch.dot(x_i, x_j)
    return attn_scores


def attention_scores(inputs: torch.Tensor) -> torch.Tensor:
    """All pairwise scores in one matrix multiplication: inputs @ inputs.T.

    Args:
        inputs: (tokens, d) floating-point embeddings.

    Returns:
        (tokens, tokens) scores, equal to attention_scores_loop's.

    Raises:
        TypeError: inputs is not a floating-point tensor.
        ValueError: inputs is not 2-D (tokens, d).
    """
    inputs = _check_inputs(inputs)
    return inputs @ inputs.T


def normalize_by_sum(attn_scores: torch.Tensor) -> torch.Tensor:
    """Divide scores by their sum: weights that sum to 1, but not always positive.

    Args:
        attn_scores: (tokens,) floating-point scores of one query.

    Returns:
        (tokens,) weights summing to 1.

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: not 1-D.
    """
    attn_scores = check_tensor("attn_scores", attn_scores, ndims=(1,), layout="(tokens,)")
    return attn_scores / attn_scores.sum()


def softmax_naive(x: torch.Tensor) -> torch.Tensor:
    """exp(x) / sum(exp(x)) over dim 0, the chapter's naive softmax.

    It overflows: exp(x) is inf in float32 once x > 88.7, and inf / inf is NaN, where
    torch.softmax subtracts the maximum first and stays finite.

    Args:
        x: (tokens,) floating-point scores.

    Returns:
        (tokens,) positive weights summing to 1 (NaN where exp overflows).

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: not 1-D.
    """
    x = check_tensor("x", x, ndims=(1,), layout="(tokens,)")
    return torch.exp(x) / torch.exp(x).sum(dim=0)


def context_vector_loop(inputs: torch.Tensor, attn_weights: torch.Tensor) -> torch.Tensor:
    """The context vector z = sum_i alpha_i x_i for one query, by a loop over the tokens.

    Args:
        inputs: (tokens, d) floating-point embeddings.
        attn_weights: (tokens,) weights of one query, of inputs' dtype.

    Returns:
        (d,) context vector.

    Raises:
        TypeError: a non-tensor, a non-floating tensor, or two dtypes.
        ValueError: inputs not 2-D, or attn_weights not (tokens,).
    """
    inputs = _check_inputs(inputs)
    attn_weights = _check_vector("attn_weights", attn_weights, inputs.shape[0], "tokens", inputs)
    context_vec = torch.zeros(inputs.shape[1], dtype=inputs.dtype)
    for i, x_i in enumerate(inputs):
        context_vec += attn_weights[i] * x_i
    return context_vec


def all_context_vectors(inputs: torch.Tensor) -> torch.Tensor:
    """Every context vector at once: softmax(inputs @ inputs.T) @ inputs.

    Args:
        inputs: (tokens, d) floating-point embeddings.

    Returns:
        (tokens, d) context vectors, row i the one of query i.

    Raises:
        TypeError: inputs is not a floating-point tensor.
        ValueError: inputs is not 2-D (tokens, d).
    """
    attn_weights = torch.softmax(attention_scores(inputs), dim=-1)  # (tokens, tokens)
    return attn_weights @ inputs
