"""Section 3.4: the classes against F.scaled_dot_product_attention, and exercise 3.1."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from attnlab import book


def sdpa_reference(x, w_query, w_key, w_value):
    """Independent reference: PyTorch's fused attention on the same projections (x @ W)."""
    return F.scaled_dot_product_attention(x @ w_query, x @ w_key, x @ w_value)


@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 3),
    st.integers(1, 8),
    st.integers(1, 6),
    st.integers(1, 6),
)
def test_v1_and_v2_equal_sdpa(seed, batch, tokens, d_in, d_out):
    torch.manual_seed(seed)
    x = torch.randn(batch, tokens, d_in)
    v1 = book.SelfAttention_v1(d_in, d_out)
    expected = sdpa_reference(x, v1.W_query, v1.W_key, v1.W_value)
    torch.testing.assert_close(v1(x), expected, rtol=1e-5, atol=1e-6)
    v2 = book.SelfAttention_v2(d_in, d_out)
    expected = sdpa_reference(x, v2.W_query.weight.T, v2.W_key.weight.T, v2.W_value.weight.T)
    torch.testing.assert_close(v2(x), expected, rtol=1e-5, atol=1e-6)


def test_two_dimensional_input_is_the_books_unbatched_case():
    torch.manual_seed(0)
    v2 = book.SelfAttention_v2(3, 4)
    x = torch.randn(2, 5, 3)
    torch.testing.assert_close(v2(x), torch.stack([v2(x[0]), v2(x[1])]), rtol=1e-6, atol=1e-7)


@given(st.integers(0, 2**31 - 1), st.integers(1, 8), st.integers(1, 6), st.integers(1, 6))
def test_exercise_3_1_copy_v2_into_v1(seed, tokens, d_in, d_out):
    torch.manual_seed(seed)
    sa_v2 = book.SelfAttention_v2(d_in, d_out)
    sa_v1 = book.SelfAttention_v1(d_in, d_out)
    x = torch.randn(tokens, d_in)
    assert not torch.allclose(sa_v1(x), sa_v2(x), atol=1e-4)  # different inits differ
    book.copy_v2_weights_into_v1(sa_v2, sa_v1)
    torch.testing.assert_close(sa_v1(x), sa_v2(x), rtol=1e-5, atol=1e-6)


def test_exercise_3_1_refuses_what_v1_cannot_hold():
    with pytest.raises(ValueError, match="qkv_bias"):
        book.copy_v2_weights_into_v1(
            book.SelfAttention_v2(3, 2, qkv_bias=True), book.SelfAttention_v1(3, 2)
        )
    with pytest.raises(ValueError, match="d_out=3"):
        book.copy_v2_weights_into_v1(book.SelfAttention_v2(3, 2), book.SelfAttention_v1(3, 3))
    with pytest.raises(TypeError, match="sa_v1 must be a SelfAttention_v1"):
        book.copy_v2_weights_into_v1(book.SelfAttention_v2(3, 2), book.SelfAttention_v2(3, 2))


def test_step_by_step_equals_the_class_for_every_token():
    torch.manual_seed(123)
    v1 = book.SelfAttention_v1(3, 2)
    out = v1(book.INPUTS)
    for i in range(6):
        step = book.attention_for_query(book.INPUTS, v1.W_query, v1.W_key, v1.W_value, i)
        torch.testing.assert_close(step.context_vec, out[i], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(step.own_score, step.attn_scores[i])
    with pytest.raises(ValueError, match=r"query_index \(6\) must be < the number of tokens"):
        book.attention_for_query(book.INPUTS, v1.W_query, v1.W_key, v1.W_value, 6)
