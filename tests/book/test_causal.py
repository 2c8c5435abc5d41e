"""Section 3.5: the three masking ways agree, CausalAttention is causal and equals SDPA, and
where the seeds disagree, the test shows which rendering is right."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from attnlab import book
from tests.book import printed
from tests.book.leaky import LeakyCausalAttention
from tests.invariants import assert_batch_independent, assert_causal, assert_leaks

seeds = st.integers(0, 2**31 - 1)


@given(seeds, st.integers(1, 12), st.sampled_from([(), (2,), (2, 3)]), st.integers(1, 8))
def test_three_ways_of_masking_agree(seed, n, lead, d_k):
    scores = torch.randn(*lead, n, n, generator=torch.Generator().manual_seed(seed)) * 4
    renormalised = book.causal_weights_renormalised(scores, d_k)
    torch.testing.assert_close(
        book.causal_weights_neg_inf(scores, d_k), renormalised, rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        book.causal_weights_additive(scores, d_k), renormalised, rtol=1e-5, atol=1e-6
    )
    assert torch.all(renormalised.triu(diagonal=1) == 0)
    torch.testing.assert_close(renormalised.sum(-1), torch.ones(*lead, n), rtol=1e-6, atol=1e-6)


def test_additive_mask_is_the_blogs_mask_m():
    inf = float("inf")
    expected = torch.tensor(
        [[0, -inf, -inf, -inf], [0, 0, -inf, -inf], [0, 0, 0, -inf], [0, 0, 0, 0]]
    )
    assert torch.equal(book.additive_causal_mask(4), expected)
    for n in (1, 6, 9):
        future = book.causal_future_mask(n).bool()
        m = book.additive_causal_mask(n)
        assert torch.equal(torch.isinf(m), future) and torch.all(m[~future] == 0)
        assert torch.equal(book.causal_keep_mask(n).bool(), ~future)


def test_seed_002_seven_row_mask_is_a_typo():
    """002 prints 7 rows for 6 tokens: a repeated row, not the tril mask of any size."""
    typo = printed.MASK_SIMPLE_002_TYPO
    assert typo.shape == (7, 6) and book.causal_keep_mask(6).shape == (6, 6)
    assert torch.equal(typo[3], typo[4])  # the row "[1, 1, 1, 1, 0, 0]" twice
    assert torch.equal(torch.cat([typo[:4], typo[5:]]), book.causal_keep_mask(6))


def test_seed_002_seven_row_dropout_matrix_is_the_same_typo():
    """002's second dropout(ones) rendering repeats a row of 004's matrix."""
    typo = printed.DROPOUT_ONES_002_TYPO
    assert torch.equal(typo[4], typo[5])
    torch.manual_seed(123)
    drawn = torch.nn.Dropout(0.5)(torch.ones(6, 6))
    assert torch.equal(torch.cat([typo[:5], typo[6:]]), drawn)


def test_dropout_printouts_of_both_platforms_are_self_consistent():
    """Each platform's dropout(weights) is its own ones-mask times the causal weights, so 000
    and 002 show another RNG stream, not another computation; Linux draws 004's."""
    weights = printed.CAUSAL_WEIGHTS
    for ones, dropped in (
        (printed.DROPOUT_ONES_LINUX, printed.DROPOUT_WEIGHTS_LINUX),
        (printed.DROPOUT_ONES_OTHER_PLATFORM, printed.DROPOUT_WEIGHTS_OTHER_PLATFORM),
    ):
        torch.testing.assert_close(ones * weights, dropped, rtol=0, atol=1.01e-4)
    torch.manual_seed(123)
    drawn = torch.nn.Dropout(0.5)(torch.ones(6, 6))
    assert torch.equal(drawn, printed.DROPOUT_ONES_LINUX)
    assert not torch.equal(drawn, printed.DROPOUT_ONES_OTHER_PLATFORM)


def test_seed_001_variant_leaks_and_causal_attention_does_not():
    x = book.example_batch()
    torch.manual_seed(123)
    leaky = LeakyCausalAttention(3, 2, 6, 0.0)
    torch.manual_seed(123)
    correct = book.CausalAttention(3, 2, 6, 0.0)
    for t in range(5):
        assert_leaks(leaky, x, t)
        assert_causal(correct, x, t)


def causal_sdpa_reference(ca: book.CausalAttention, x: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(ca.W_query(x), ca.W_key(x), ca.W_value(x), is_causal=True)


@given(
    seeds,
    st.integers(1, 3),
    st.integers(2, 10),
    st.integers(1, 5),
    st.integers(1, 5),
    st.booleans(),
)
def test_causal_attention_equals_sdpa_and_is_causal(seed, b, tokens, d_in, d_out, bias):
    torch.manual_seed(seed)
    ca = book.CausalAttention(d_in, d_out, 10, 0.0, qkv_bias=bias)
    x = torch.randn(b, tokens, d_in)
    with torch.no_grad():
        torch.testing.assert_close(ca(x), causal_sdpa_reference(ca, x), rtol=1e-5, atol=1e-6)
    assert_causal(ca, x, tokens // 2 - 1)
    assert_batch_independent(ca, x)


def test_dropout_only_in_training_mode():
    torch.manual_seed(0)
    ca = book.CausalAttention(3, 4, 6, 0.5)
    x = book.example_batch()
    ca.eval()
    torch.testing.assert_close(ca(x), ca(x), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ca(x), causal_sdpa_reference(ca, x), rtol=1e-5, atol=1e-6)
    ca.train()
    assert not torch.equal(ca(x), ca(x))


def test_mask_is_a_buffer_that_follows_the_module():
    ca = book.CausalAttention(3, 2, 6, 0.0).to(torch.float64)
    assert "mask" in dict(ca.named_buffers()) and "mask" in ca.state_dict()
    assert ca.mask.dtype == torch.float64
    assert ca(book.example_batch().double()).dtype == torch.float64


@pytest.mark.parametrize("tokens", [1, 3, 6])
def test_fewer_tokens_than_context_length_use_the_truncated_mask(tokens):
    torch.manual_seed(1)
    ca = book.CausalAttention(3, 2, 6, 0.0)
    x = book.example_batch()
    torch.testing.assert_close(ca(x[:, :tokens]), ca(x)[:, :tokens], rtol=1e-6, atol=1e-7)
