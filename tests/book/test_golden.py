"""Every tensor the seeds print, reproduced to its printed four decimals under its seed."""

import pytest
import torch

from attnlab import book
from tests.book import printed
from tests.book.leaky import LeakyCausalAttention


def assert_printed(actual: torch.Tensor | float, expected: torch.Tensor | float) -> None:
    """Equal to a value printed with four decimals: within half a unit of the last digit."""
    actual = torch.as_tensor(actual).detach()
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=0, atol=5.01e-5)


# --- 3.3.1 -------------------------------------------------------------------------------


def test_scores_for_query_journey():
    query = book.INPUTS[1]
    assert_printed(book.attention_scores_for_query(book.INPUTS, query), printed.ATTN_SCORES_2)


def test_dot_product_loop_equals_torch_dot():
    query = book.INPUTS[1]
    assert_printed(book.dot_product_loop(book.INPUTS[0], query), printed.DOT_X1_QUERY)
    assert_printed(torch.dot(book.INPUTS[0], query), printed.DOT_X1_QUERY)


def test_normalize_by_sum():
    scores = book.attention_scores_for_query(book.INPUTS, book.INPUTS[1])
    weights = book.normalize_by_sum(scores)
    assert_printed(weights, printed.ATTN_WEIGHTS_2_TMP)
    assert_printed(weights.sum(), 1.0)


def test_naive_and_torch_softmax_agree_on_the_example():
    scores = book.attention_scores_for_query(book.INPUTS, book.INPUTS[1])
    assert_printed(book.softmax_naive(scores), printed.ATTN_WEIGHTS_2_SOFTMAX)
    assert_printed(torch.softmax(scores, dim=0), printed.ATTN_WEIGHTS_2_SOFTMAX)


def test_context_vector_of_journey():
    scores = book.attention_scores_for_query(book.INPUTS, book.INPUTS[1])
    weights = torch.softmax(scores, dim=0)
    assert_printed(book.context_vector_loop(book.INPUTS, weights), printed.CONTEXT_VEC_2)


# --- 3.3.2 -------------------------------------------------------------------------------


@pytest.mark.parametrize("scores_fn", [book.attention_scores_loop, book.attention_scores])
def test_all_scores(scores_fn):
    assert_printed(scores_fn(book.INPUTS), printed.ATTN_SCORES)


def test_all_weights_and_row_sums():
    weights = torch.softmax(book.attention_scores(book.INPUTS), dim=-1)
    assert_printed(weights, printed.ATTN_WEIGHTS)
    assert_printed(weights.sum(dim=-1), torch.ones(6))


def test_all_context_vectors():
    context = book.all_context_vectors(book.INPUTS)
    assert_printed(context, printed.ALL_CONTEXT_VECS)
    assert_printed(context[1], printed.CONTEXT_VEC_2)  # "matches the second row exactly"


# --- 3.4 ---------------------------------------------------------------------------------


def test_trainable_step_by_step_for_journey():
    torch.manual_seed(123)
    d_in, d_out = 3, 2
    w_query = torch.nn.Parameter(torch.rand(d_in, d_out), requires_grad=False)
    w_key = torch.nn.Parameter(torch.rand(d_in, d_out), requires_grad=False)
    w_value = torch.nn.Parameter(torch.rand(d_in, d_out), requires_grad=False)
    step = book.attention_for_query(book.INPUTS, w_query, w_key, w_value, query_index=1)
    assert_printed(step.query, printed.QUERY_2)
    assert step.keys.shape == (6, 2) and step.values.shape == (6, 2)
    assert_printed(step.own_score, printed.ATTN_SCORE_22)
    assert_printed(step.attn_scores, printed.TRAINABLE_ATTN_SCORES_2)
    assert_printed(step.attn_weights, printed.TRAINABLE_ATTN_WEIGHTS_2)
    assert_printed(step.context_vec, printed.TRAINABLE_CONTEXT_VEC_2)


def test_self_attention_v1_seed_123():
    torch.manual_seed(123)
    sa_v1 = book.SelfAttention_v1(3, 2)
    out = sa_v1(book.INPUTS)
    assert_printed(out, printed.SA_V1_OUT)
    assert_printed(out[1], printed.TRAINABLE_CONTEXT_VEC_2)  # "matches context_vec_2"


def test_self_attention_v2_seed_789():
    torch.manual_seed(789)
    assert_printed(book.SelfAttention_v2(3, 2)(book.INPUTS), printed.SA_V2_OUT)


# --- 3.5 ---------------------------------------------------------------------------------


@pytest.fixture
def sa_v2_scores():
    """Section 3.5's starting point: sa_v2 (seed 789) queries @ keys.T, and d_k."""
    torch.manual_seed(789)
    sa_v2 = book.SelfAttention_v2(3, 2)
    queries = sa_v2.W_query(book.INPUTS)
    keys = sa_v2.W_key(book.INPUTS)
    return (queries @ keys.T).detach(), keys.shape[-1]


def test_sa_v2_attention_weights(sa_v2_scores):
    scores, d_k = sa_v2_scores
    assert_printed(book.scaled_softmax(scores, d_k), printed.SA_V2_ATTN_WEIGHTS)
    torch.manual_seed(789)
    assert_printed(
        book.SelfAttention_v2(3, 2).attention_weights(book.INPUTS), printed.SA_V2_ATTN_WEIGHTS
    )


def test_masking_by_renormalising(sa_v2_scores):
    scores, d_k = sa_v2_scores
    mask_simple = book.causal_keep_mask(6)
    assert_printed(mask_simple, printed.MASK_SIMPLE)
    assert_printed(book.scaled_softmax(scores, d_k) * mask_simple, printed.MASKED_SIMPLE)
    assert_printed(book.causal_weights_renormalised(scores, d_k), printed.CAUSAL_WEIGHTS)


def test_masking_with_minus_infinity(sa_v2_scores):
    scores, d_k = sa_v2_scores
    masked = book.mask_future_scores(scores)
    assert torch.equal(torch.isinf(masked), torch.isinf(printed.MASKED_SCORES))
    finite = torch.isfinite(printed.MASKED_SCORES)
    assert_printed(masked[finite], printed.MASKED_SCORES[finite])
    assert_printed(book.causal_weights_neg_inf(scores, d_k), printed.CAUSAL_WEIGHTS)


def test_masking_with_seed_003_additive_mask(sa_v2_scores):
    scores, d_k = sa_v2_scores
    assert_printed(book.causal_weights_additive(scores, d_k), printed.CAUSAL_WEIGHTS)


def test_dropout_on_ones_and_on_causal_weights_linux(sa_v2_scores):
    """004's printout; the book notes that other platforms draw other masks."""
    scores, d_k = sa_v2_scores
    torch.manual_seed(123)
    dropout = torch.nn.Dropout(0.5)
    assert_printed(dropout(torch.ones(6, 6)), printed.DROPOUT_ONES_LINUX)
    torch.manual_seed(123)
    weights = book.causal_weights_neg_inf(scores, d_k)
    assert_printed(dropout(weights), printed.DROPOUT_WEIGHTS_LINUX)


def test_batch_shape():
    assert book.example_batch().shape == (2, 6, 3)


def test_causal_attention_shape():
    torch.manual_seed(123)
    ca = book.CausalAttention(3, 2, 6, 0.0)
    assert ca(book.example_batch()).shape == (2, 6, 2)


# --- 3.6 ---------------------------------------------------------------------------------


def test_wrapper_seed_123():
    torch.manual_seed(123)
    mha = book.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    context_vecs = mha(book.example_batch())
    assert context_vecs.shape == (2, 6, 4)
    for row in context_vecs:
        assert_printed(row, printed.WRAPPER_OUT_ROWS)


def test_seed_001_printout_is_the_leaky_variant():
    """001's wrapper printout is reproduced by its masked_fill bug, not by CausalAttention."""
    torch.manual_seed(123)
    heads = torch.nn.ModuleList([LeakyCausalAttention(3, 2, 6, 0.0) for _ in range(2)])
    out = torch.cat([head(book.example_batch()) for head in heads], dim=-1)
    for row in out:
        assert_printed(row, printed.WRAPPER_OUT_ROWS_001_LEAKY)
    torch.manual_seed(123)
    correct = book.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)(book.example_batch())
    assert not torch.allclose(correct[0], printed.WRAPPER_OUT_ROWS_001_LEAKY, atol=1e-3)


def test_batched_matmul_over_heads():
    a = printed.BATCHED_MATMUL_A
    assert_printed(a @ a.transpose(2, 3), printed.BATCHED_MATMUL_OUT)
    first_head, second_head = a[0, 0], a[0, 1]
    assert_printed(first_head @ first_head.T, printed.BATCHED_MATMUL_OUT[0, 0])
    assert_printed(second_head @ second_head.T, printed.BATCHED_MATMUL_OUT[0, 1])


def test_multi_head_attention_seed_123():
    torch.manual_seed(123)
    mha = book.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    context_vecs = mha(book.example_batch())
    assert context_vecs.shape == (2, 6, 2)
    for row in context_vecs:
        assert_printed(row, printed.MHA_OUT_ROWS)
