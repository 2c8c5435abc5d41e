"""Every public class and function refuses bad arguments with a ValueError or TypeError that
names the argument and the values, never a torch internal error or an assert."""

import subprocess
import sys

import pytest
import torch

from attnlab import book

BATCH_CLASSES = [
    lambda **kw: book.CausalAttention(
        **{"d_in": 3, "d_out": 4, "context_length": 6, "dropout": 0.0, **kw}
    ),
    lambda **kw: book.MultiHeadAttention(
        **{"d_in": 3, "d_out": 4, "context_length": 6, "dropout": 0.0, "num_heads": 2, **kw}
    ),
    lambda **kw: book.MultiHeadAttentionWrapper(
        **{"d_in": 3, "d_out": 4, "context_length": 6, "dropout": 0.0, "num_heads": 2, **kw}
    ),
]
ids = ["CausalAttention", "MultiHeadAttention", "MultiHeadAttentionWrapper"]


def test_num_heads_must_divide_d_out():
    with pytest.raises(ValueError, match=r"num_heads \(3\) must divide d_out \(8\)"):
        book.MultiHeadAttention(3, 8, 6, 0.0, num_heads=3)


@pytest.mark.parametrize("make", BATCH_CLASSES, ids=ids)
@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_outside_unit_interval(make, dropout):
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got"):
        make(dropout=dropout)


@pytest.mark.parametrize("make", BATCH_CLASSES, ids=ids)
@pytest.mark.parametrize(
    ("arg", "value", "error"),
    [
        ("d_in", 0, ValueError),
        ("d_out", -2, ValueError),
        ("context_length", 0, ValueError),
        ("d_in", 2.5, TypeError),
        ("d_out", True, TypeError),
        ("dropout", "0.1", TypeError),
    ],
)
def test_sizes_and_types(make, arg, value, error):
    with pytest.raises(error, match=arg):
        make(**{arg: value})


@pytest.mark.parametrize("make", BATCH_CLASSES, ids=ids)
def test_input_last_dimension_must_be_d_in(make):
    with pytest.raises(ValueError, match=r"x has last dimension 5 but d_in is 3"):
        make()(torch.randn(2, 6, 5))


@pytest.mark.parametrize("make", BATCH_CLASSES, ids=ids)
def test_more_tokens_than_context_length(make):
    with pytest.raises(ValueError, match=r"x has 7 tokens, more than context_length \(6\)"):
        make()(torch.randn(2, 7, 3))


@pytest.mark.parametrize("make", BATCH_CLASSES, ids=ids)
@pytest.mark.parametrize("shape", [(6, 3), (3,), (1, 2, 6, 3)])
def test_input_of_the_wrong_rank(make, shape):
    with pytest.raises(ValueError, match=r"x must have shape \(batch, tokens, d_in\) \(3-D\)"):
        make()(torch.randn(*shape))


@pytest.mark.parametrize("make", BATCH_CLASSES, ids=ids)
def test_input_that_is_not_a_float_tensor(make):
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        make()([[0.1, 0.2, 0.3]])
    with pytest.raises(TypeError, match=r"floating-point.*torch\.int64"):
        make()(torch.ones(1, 6, 3, dtype=torch.long))


@pytest.mark.parametrize("cls", [book.SelfAttention_v1, book.SelfAttention_v2])
def test_self_attention_classes(cls):
    with pytest.raises(ValueError, match="d_in must be >= 1, got 0"):
        cls(0, 2)
    module = cls(3, 2)
    with pytest.raises(ValueError, match=r"x has last dimension 4 but d_in is 3"):
        module(torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"\(tokens, d_in\) or \(batch, tokens, d_in\)"):
        module(torch.randn(3))


def test_per_head_layer():
    with pytest.raises(ValueError, match=r"heads \(5\) must be <= D \(4\)"):
        book.MultiHeadSelfAttention(4, heads=5)
    with pytest.raises(ValueError, match="kdim must be >= 1"):
        book.MultiHeadSelfAttention(4, kdim=0)
    with pytest.raises(ValueError, match=r"X has last dimension 3 but D is 4"):
        book.MultiHeadSelfAttention(4, heads=2)(torch.randn(2, 3))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: book.attention_scores(torch.randn(6)), r"inputs must have shape \(tokens, d\)"),
        (
            lambda: book.attention_scores_for_query(book.INPUTS, torch.randn(4)),
            r"query has last dimension 4 but d is 3",
        ),
        (
            lambda: book.context_vector_loop(book.INPUTS, torch.ones(5)),
            r"attn_weights has last dimension 5 but tokens is 6",
        ),
        (lambda: book.causal_weights_neg_inf(torch.randn(3, 4), 2), r"square.*\(3, 4\)"),
        (lambda: book.causal_weights_renormalised(torch.randn(3, 3), 0), "d_k must be >= 1"),
        (lambda: book.causal_keep_mask(0), "num_tokens must be >= 1"),
        (lambda: book.softmax_naive([1.0, 2.0]), "x must be a torch.Tensor"),
        (lambda: book.count_parameters("model"), "module must be a torch.nn.Module"),
    ],
)
def test_functions(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_validation_survives_python_dash_o():
    """`python -O` strips asserts; the checks must still raise."""
    code = (
        "import attnlab.book as b\n"
        "try:\n    b.MultiHeadAttention(3, 8, 6, 0.0, num_heads=3)\n"
        "except ValueError as e:\n    print('raised:', e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True
    )
    assert "raised: num_heads (3) must divide d_out (8)" in result.stdout


@pytest.mark.parametrize(
    "module",
    [
        book.SelfAttention_v1(3, 2),
        book.SelfAttention_v2(3, 2),
        book.CausalAttention(3, 2, 6, 0.0),
        book.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2),
        book.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2),
    ],
    ids=lambda m: type(m).__name__,
)
def test_input_dtype_must_match_the_module(module):
    with pytest.raises(TypeError, match=r"x has dtype torch\.float64 but the module's parameters"):
        module(torch.randn(2, 6, 3, dtype=torch.float64))
    assert module.double()(torch.randn(2, 6, 3, dtype=torch.float64)).dtype == torch.float64


def test_per_head_input_dtype_must_match():
    with pytest.raises(TypeError, match=r"X has dtype torch\.float64"):
        book.MultiHeadSelfAttention(4, heads=2)(torch.randn(2, 4, dtype=torch.float64))


@pytest.mark.parametrize(
    ("mask", "error", "message"),
    [
        (torch.ones(5, 5, dtype=torch.bool), TypeError, "additive float mask"),
        ([[0.0]], TypeError, "additive float mask"),
        (
            torch.zeros(3, 3),
            ValueError,
            r"does not broadcast to the scores' shape \(\.\.\., L, S\) = \(2, 5, 5\)",
        ),
    ],
)
def test_per_head_attn_mask(mask, error, message):
    with pytest.raises(error, match=message):
        book.MultiHeadSelfAttention(4, heads=2)(torch.randn(2, 5, 4), attn_mask=mask)


def test_per_head_attn_mask_follows_the_input_dtype():
    layer = book.MultiHeadSelfAttention(4, heads=2).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    out = layer(x, attn_mask=book.additive_causal_mask(5))  # a float32 mask
    torch.testing.assert_close(out, layer(x, attn_mask=book.additive_causal_mask(5).double()))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(key=torch.randn(2, 5, 7)), ValueError, r"key has last dimension 7 but mha\.kdim"),
        (dict(key=torch.randn(2, 5, 8), value=torch.randn(2, 4, 8)), ValueError, "key has 5"),
        (dict(attn_mask=[[0.0]]), TypeError, "additive float mask"),
        (dict(attn_mask=torch.zeros(4, 3, 5)), ValueError, "does not broadcast"),
        (dict(key=torch.randn(2, 5, 8, dtype=torch.float64)), TypeError, "key has dtype"),
    ],
)
def test_torch_attention_by_heads_checks_its_inputs(kwargs, error, message):
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    with pytest.raises(error, match=message):
        book.torch_attention_by_heads(mha, torch.randn(2, 3, 8), **kwargs)


def test_qkv_bias_must_be_a_bool():
    for make in (
        lambda: book.SelfAttention_v2(3, 2, qkv_bias="no"),
        lambda: book.CausalAttention(3, 2, 6, 0.0, qkv_bias="no"),
        lambda: book.MultiHeadAttention(3, 2, 6, 0.0, 2, qkv_bias="no"),
    ):
        with pytest.raises(TypeError, match=r"qkv_bias must be a bool, got str \('no'\)"):
            make()


def test_softmax_naive_is_one_dimensional_and_helpers_check_dtypes():
    with pytest.raises(ValueError, match=r"x must have shape \(tokens,\)"):
        book.softmax_naive(torch.randn(2, 3))
    with pytest.raises(TypeError, match=r"query has dtype torch\.float64"):
        book.attention_scores_for_query(book.INPUTS, book.INPUTS[1].double())
    with pytest.raises(ValueError, match="d_k must be >= 1, got 0"):
        book.scaled_softmax(torch.randn(3, 3), 0)
    w = torch.rand(3, 2)
    with pytest.raises(ValueError, match="must project to the same width"):
        book.attention_for_query(book.INPUTS, w, torch.rand(3, 4), w)
