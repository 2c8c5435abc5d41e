"""Section 3.6: the weight-split module equals the wrapper with the same weights, equals
PyTorch's fused causal attention, and exercises 3.2 and 3.3."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from attnlab import book
from attnlab.book import multihead
from tests.invariants import assert_batch_independent, assert_causal

seeds = st.integers(0, 2**31 - 1)


def mha_sdpa_reference(mha: book.MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Independent reference: the same projections through F.scaled_dot_product_attention."""
    b, t, _ = x.shape

    def heads(p):
        return p.view(b, t, mha.num_heads, mha.head_dim).transpose(1, 2)  # (b, h, t, hd)

    out = F.scaled_dot_product_attention(
        heads(mha.W_query(x)), heads(mha.W_key(x)), heads(mha.W_value(x)), is_causal=True
    )
    return mha.out_proj(out.transpose(1, 2).reshape(b, t, mha.d_out))  # (b, t, d_out)


@given(
    seeds,
    st.integers(1, 3),
    st.integers(2, 9),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(1, 3),
    st.booleans(),
)
def test_mha_equals_sdpa_and_is_causal(seed, b, tokens, d_in, num_heads, head_dim, bias):
    torch.manual_seed(seed)
    mha = book.MultiHeadAttention(d_in, num_heads * head_dim, 9, 0.0, num_heads, qkv_bias=bias)
    x = torch.randn(b, tokens, d_in)
    with torch.no_grad():
        torch.testing.assert_close(mha(x), mha_sdpa_reference(mha, x), rtol=1e-5, atol=1e-6)
    assert_causal(mha, x, tokens // 2 - 1)
    assert_batch_independent(mha, x)


@given(seeds, st.integers(1, 4), st.integers(1, 3), st.booleans())
def test_mha_equals_wrapper_with_the_same_weights(seed, num_heads, head_dim, bias):
    torch.manual_seed(seed)
    wrapper = book.MultiHeadAttentionWrapper(3, head_dim, 6, 0.0, num_heads, qkv_bias=bias)
    mha = book.MultiHeadAttention(3, num_heads * head_dim, 6, 0.0, num_heads, qkv_bias=bias)
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            layers = [getattr(head, name) for head in wrapper.heads]
            getattr(mha, name).weight.copy_(torch.cat([lin.weight for lin in layers]))
            if bias:
                getattr(mha, name).bias.copy_(torch.cat([lin.bias for lin in layers]))
        mha.out_proj.weight.copy_(torch.eye(num_heads * head_dim))
        mha.out_proj.bias.zero_()
        x = book.example_batch()
        torch.testing.assert_close(mha(x), wrapper(x), rtol=1e-5, atol=1e-6)


def test_attention_weights_reproduce_the_forward():
    torch.manual_seed(123)
    mha = book.MultiHeadAttention(3, 4, 6, 0.0, num_heads=2)
    x = book.example_batch()
    weights = mha.attention_weights(x)
    assert weights.shape == (2, 2, 6, 6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 6), rtol=1e-6, atol=1e-6)
    assert torch.all(weights.triu(diagonal=1) == 0)
    values = mha.W_value(x).view(2, 6, 2, 2).transpose(1, 2)  # (b, h, t, hd)
    out = mha.out_proj((weights @ values).transpose(1, 2).reshape(2, 6, 4))
    torch.testing.assert_close(out, mha(x), rtol=1e-6, atol=1e-7)


def test_dropout_only_in_training_mode():
    torch.manual_seed(0)
    mha = book.MultiHeadAttention(3, 4, 6, 0.5, num_heads=2)
    x = book.example_batch()
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x), rtol=0, atol=0)
    mha.train()
    assert not torch.equal(mha(x), mha(x))


def test_exercise_3_2_two_dimensional_output_with_two_heads():
    torch.manual_seed(123)
    mha = book.wrapper_with_2d_output(d_in=3, context_length=6)
    assert len(mha.heads) == 2
    x = book.example_batch()
    out = mha(x)
    assert out.shape == (2, 6, 2)
    torch.testing.assert_close(
        out, torch.cat([mha.heads[0](x), mha.heads[1](x)], dim=-1), rtol=0, atol=0
    )


def test_exercise_3_3_gpt2_small_parameter_count():
    mha = book.gpt2_small_attention()
    assert (mha.d_in, mha.d_out, mha.num_heads, mha.head_dim) == (768, 768, 12, 64)
    assert mha.mask.shape == (1024, 1024)
    # Independent reference: PyTorch's own 768-wide, 12-head layer without biases has the
    # same Q, K, V and output matrices; the book's out_proj adds a 768-long bias.
    torch_mha = torch.nn.MultiheadAttention(768, 12, bias=False)
    torch_count = sum(p.numel() for p in torch_mha.parameters())
    assert book.count_parameters(mha) == torch_count + 768 == 4 * 768 * 768 + 768
    torch.manual_seed(0)
    assert mha(torch.randn(1, 5, 768)).shape == (1, 5, 768)


@pytest.mark.parametrize("num_heads", [2**63, 2**40 + 1])
def test_the_wrapper_refuses_a_head_count_past_the_bound_before_building_a_head(
    num_heads, monkeypatch
):
    """MultiHeadAttentionWrapper(8, 4, 16, 0.0, 2**63) once started building 2**63 heads (a
    hang): the count is refused by name before the first head is built."""

    def no_head(*args, **kwargs):
        raise AssertionError("a head was built before num_heads was checked")

    monkeypatch.setattr(multihead, "CausalAttention", no_head)
    with pytest.raises(ValueError, match=rf"num_heads must be at most .*, got {num_heads:,}"):
        book.MultiHeadAttentionWrapper(8, 4, 16, 0.0, num_heads)
    with pytest.raises(ValueError, match=rf"num_heads must be at most .*, got {num_heads:,}"):
        book.MultiHeadAttention(8, 8, 16, 0.0, num_heads)
