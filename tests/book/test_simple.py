"""Section 3.3 against independent computations: loops vs matmul vs torch.softmax."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import book


def random_inputs(seed: int, tokens: int, d: int) -> torch.Tensor:
    return torch.randn(tokens, d, generator=torch.Generator().manual_seed(seed))


@given(st.integers(0, 2**31 - 1), st.integers(1, 9), st.integers(1, 7))
def test_loops_equal_matrix_product(seed, tokens, d):
    inputs = random_inputs(seed, tokens, d)
    expected = inputs @ inputs.T
    torch.testing.assert_close(book.attention_scores_loop(inputs), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(book.attention_scores(inputs), expected, rtol=0, atol=0)
    for i in range(tokens):
        torch.testing.assert_close(
            book.attention_scores_for_query(inputs, inputs[i]), expected[i], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            book.dot_product_loop(inputs[i], inputs[0]),
            torch.dot(inputs[i], inputs[0]),
            rtol=1e-5,
            atol=1e-6,
        )


@given(st.integers(0, 2**31 - 1), st.integers(1, 9), st.integers(1, 7))
def test_each_context_vector_is_the_weighted_sum(seed, tokens, d):
    inputs = random_inputs(seed, tokens, d)
    all_vecs = book.all_context_vectors(inputs)
    for i in range(tokens):
        weights = torch.softmax(inputs @ inputs[i], dim=0)
        torch.testing.assert_close(
            book.context_vector_loop(inputs, weights), all_vecs[i], rtol=1e-5, atol=1e-6
        )


def test_naive_softmax_overflows_where_torch_softmax_does_not():
    scores = torch.tensor([100.0, 10.0])  # exp(100) > float32 max (3.4e38)
    assert torch.isnan(book.softmax_naive(scores)).any()
    torch.testing.assert_close(
        torch.softmax(scores, dim=0), torch.tensor([1.0, 0.0]), rtol=0, atol=1e-30
    )


@given(st.integers(0, 2**31 - 1), st.integers(1, 9))
def test_naive_softmax_equals_torch_on_moderate_scores(seed, n):
    scores = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 5
    torch.testing.assert_close(
        book.softmax_naive(scores), torch.softmax(scores, dim=0), rtol=1e-5, atol=1e-7
    )


def test_normalize_by_sum_is_not_always_a_distribution():
    """Why the chapter prefers softmax: dividing by the sum can give negative weights."""
    weights = book.normalize_by_sum(torch.tensor([2.0, -1.0]))
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
    assert (weights < 0).any()
    assert (torch.softmax(torch.tensor([2.0, -1.0]), dim=0) > 0).all()
