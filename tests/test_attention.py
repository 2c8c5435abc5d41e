"""attnlab.MultiHeadAttention: equal to the book's MultiHeadAttention and to an independent
float64 reference over random configurations, on every backend; causal, batch independent,
zero (never NaN) on fully masked rows; bad input refused with clear messages."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnlab import MultiHeadAttention, book, flash_cpu, masks
from tests.definitions import module_reference
from tests.invariants import assert_batch_independent, assert_causal

seeds = st.integers(0, 2**31 - 1)
BACKENDS = ("math", "sdpa")


@given(
    seeds,
    st.integers(1, 3),
    st.integers(1, 8),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 4),
    st.booleans(),
)
def test_equals_book_multihead_after_loading_its_state_dict(
    seed, b, tokens, d_in, num_heads, head_dim, bias
):
    torch.manual_seed(seed)
    d_out = num_heads * head_dim
    oracle = book.MultiHeadAttention(d_in, d_out, 8, 0.0, num_heads, qkv_bias=bias)
    x = torch.randn(b, tokens, d_in, requires_grad=True)
    expected = oracle(x)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
    for backend in BACKENDS:
        m = MultiHeadAttention(d_in, d_out, 8, 0.0, num_heads, qkv_bias=bias, backend=backend)
        m.load_state_dict(oracle.state_dict())
        out = m(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)
    m.backend = "math"  # the one backend that can return the weights
    _, weights = m(x, need_weights=True)
    torch.testing.assert_close(weights, oracle.attention_weights(x), rtol=1e-5, atol=1e-6)


@st.composite
def configs(draw):
    num_kv_heads = draw(st.integers(1, 3))
    num_heads = num_kv_heads * draw(st.integers(1, 3))
    cross = draw(st.booleans())
    tokens = draw(st.integers(1, 7))
    return dict(
        seed=draw(seeds),
        b=draw(st.integers(1, 3)),
        tokens=tokens,
        d_in=draw(st.integers(1, 6)),
        d_out=num_heads * draw(st.integers(1, 4)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        bias=draw(st.booleans()),
        causal=draw(st.booleans()),
        pad=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.integers(1, 4))),
        context_dim=draw(st.one_of(st.none(), st.integers(1, 6))) if cross else None,
        context_tokens=draw(st.integers(1, 7)) if cross else None,
    )


def build(c, backend):
    """The module of config `c`, its input, context and user mask."""
    torch.manual_seed(c["seed"])
    m = MultiHeadAttention(
        c["d_in"],
        c["d_out"],
        8,
        0.0,
        c["num_heads"],
        qkv_bias=c["bias"],
        num_kv_heads=c["num_kv_heads"],
        causal=c["causal"],
        context_dim=c["context_dim"],
        backend=backend,
    )
    x = torch.randn(c["b"], c["tokens"], c["d_in"])
    context = None
    if c["context_tokens"] is not None:
        width = c["d_in"] if c["context_dim"] is None else c["context_dim"]
        context = torch.randn(c["b"], c["context_tokens"], width)
    tk = c["tokens"] if context is None else context.shape[1]
    lengths = torch.randint(0, tk + 1, (c["b"],))
    mask = masks.combine_masks(
        masks.padding_mask_from_lengths(lengths, tk) if c["pad"] else None,
        masks.sliding_window_mask(c["tokens"], tk, window=c["window"]) if c["window"] else None,
    )
    return m, x, context, mask


@given(configs())
def test_every_backend_equals_the_reference(c):
    """Grouped-query heads, bias, causal or not, padding, windows, cross-attention of another
    width, d_in != d_out: each backend equals the float64 per-head reference, gradients too."""
    outputs, grads = [], []
    for backend in BACKENDS:
        m, x, context, mask = build(c, backend)
        out = m(x, context, mask=mask)
        causal = c["causal"] and context is None
        allowed = masks.combine_masks(mask, masks.causal_mask(c["tokens"]) if causal else None)
        expected = module_reference(m, x, context, allowed)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        outputs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), list(m.parameters())))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    for math_grad, sdpa_grad in zip(*grads, strict=True):
        assert torch.isfinite(math_grad).all()
        torch.testing.assert_close(math_grad, sdpa_grad, rtol=1e-4, atol=1e-5)


@given(seeds, st.integers(1, 3), st.integers(1, 3), st.booleans())
def test_as_many_kv_heads_as_heads_is_plain_multihead(seed, num_heads, head_dim, bias):
    torch.manual_seed(seed)
    d_out = num_heads * head_dim
    plain = MultiHeadAttention(4, d_out, 8, 0.0, num_heads, qkv_bias=bias)
    explicit = MultiHeadAttention(
        4, d_out, 8, 0.0, num_heads, qkv_bias=bias, num_kv_heads=num_heads
    )
    explicit.load_state_dict(plain.state_dict())
    x = torch.randn(2, 6, 4)
    with torch.no_grad():
        torch.testing.assert_close(explicit(x), plain(x), rtol=0, atol=0)


def test_grouped_query_equals_multihead_with_repeated_key_value_weights():
    torch.manual_seed(5)
    gqa = MultiHeadAttention(6, 8, 8, 0.0, num_heads=4, num_kv_heads=2, qkv_bias=True)
    plain = MultiHeadAttention(6, 8, 8, 0.0, num_heads=4, qkv_bias=True)
    # rows of qkv_proj: 8 query, then 2 kv heads x 2 features of keys, then of values
    w, bias = gqa.qkv_proj.weight, gqa.qkv_proj.bias
    with torch.no_grad():

        def repeat(t):  # (hkv * hd, ...) -> (h * hd, ...), each kv head serving 2 query heads
            return t.view(2, 2, -1).repeat_interleave(2, dim=0).reshape(8, *t.shape[1:])

        plain.qkv_proj.weight.copy_(torch.cat([w[:8], repeat(w[8:12]), repeat(w[12:])]))
        plain.qkv_proj.bias.copy_(
            torch.cat([bias[:8], repeat(bias[8:12, None])[:, 0], repeat(bias[12:, None])[:, 0]])
        )
        plain.out_proj.load_state_dict(gqa.out_proj.state_dict())
        x = torch.randn(3, 7, 6)
        torch.testing.assert_close(gqa(x), plain(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_causal_and_batch_independent(backend, num_kv_heads):
    torch.manual_seed(6)
    m = MultiHeadAttention(5, 8, 9, 0.0, 4, num_kv_heads=num_kv_heads, backend=backend)
    x = torch.randn(3, 9, 5)
    for t in range(8):
        assert_causal(m, x, t)
    assert_batch_independent(m, x)


def test_not_causal_sees_the_future():
    torch.manual_seed(7)
    m = MultiHeadAttention(4, 4, 6, 0.0, 2, causal=False)
    x = torch.randn(1, 6, 4)
    changed = x.clone()
    changed[:, -1] += 1.0
    with torch.no_grad():
        assert not torch.allclose(m(changed)[:, 0], m(x)[:, 0], atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_zero_with_finite_gradients(backend):
    """Left padding with causal masking empties the first rows of the padded sequence, and a
    sequence of length 0 empties all of its rows."""
    torch.manual_seed(8)
    m = MultiHeadAttention(4, 6, 8, 0.0, 3, num_kv_heads=1, qkv_bias=True, backend=backend)
    x = torch.randn(3, 5, 4, requires_grad=True)
    keep = torch.tensor([[True] * 5, [False, False, True, True, True], [False] * 5])
    out = m(x, mask=masks.padding_mask(keep))
    before_proj = out - m.out_proj.bias  # an empty row is zero before the output projection
    assert torch.all(before_proj[1, :2] == 0) and torch.all(before_proj[2] == 0)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    for p in m.parameters():
        assert torch.isfinite(p.grad).all()


def test_dropout_only_in_training():
    torch.manual_seed(9)
    m = MultiHeadAttention(4, 8, 8, 0.5, 2)
    x = torch.randn(2, 8, 4)
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(x), m(x), rtol=0, atol=0)
        m.train()
        assert not torch.allclose(m(x), m(x))
        _, weights = m(x, need_weights=True)
        assert (weights == 0).any()  # dropped weights are the ones returned
    no_dropout = MultiHeadAttention(4, 8, 8, 0.0, 2)
    with torch.no_grad():
        torch.testing.assert_close(no_dropout.train()(x), no_dropout.eval()(x), rtol=0, atol=0)


def test_any_number_of_tokens_up_to_context_length():
    torch.manual_seed(10)
    m = MultiHeadAttention(4, 4, 5, 0.0, 2)
    for tokens in (1, 3, 5):
        assert m(torch.randn(2, tokens, 4)).shape == (2, tokens, 4)
    with pytest.raises(ValueError, match=r"x has 6 tokens, more than context_length \(5\)"):
        m(torch.randn(2, 6, 4))


def test_cross_attention_is_not_causal_and_needs_its_context():
    torch.manual_seed(11)
    m = MultiHeadAttention(4, 6, 8, 0.0, 3, context_dim=5)
    x, context = torch.randn(2, 3, 4), torch.randn(2, 7, 5)
    out, weights = m(x, context, need_weights=True)
    assert out.shape == (2, 3, 6) and weights.shape == (2, 3, 3, 7)
    assert (weights[..., -1] > 0).all()  # the first query sees the last context token
    with pytest.raises(ValueError, match=r"context_dim \(5\) != d_in \(4\): pass context"):
        m(x)


def test_loads_a_book_state_dict_nested_in_a_model():
    torch.manual_seed(12)
    oracle = nn.Sequential(nn.Identity(), book.MultiHeadAttention(3, 4, 6, 0.0, 2))
    ours = nn.Sequential(nn.Identity(), MultiHeadAttention(3, 4, 6, 0.0, 2))
    ours.load_state_dict(oracle.state_dict())
    x = book.example_batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), oracle(x), rtol=1e-5, atol=1e-6)


def test_book_state_dict_with_missing_weights_is_reported():
    state = book.MultiHeadAttention(3, 4, 6, 0.0, 2).state_dict()
    del state["W_value.weight"]
    with pytest.raises(RuntimeError, match=r"W_query\.weight"):
        MultiHeadAttention(3, 4, 6, 0.0, 2).load_state_dict(state)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_follow_the_module(dtype):
    torch.manual_seed(13)
    m = MultiHeadAttention(4, 8, 8, 0.0, 2)
    x = torch.randn(2, 5, 4)
    expected = m(x)
    converted = MultiHeadAttention(4, 8, 8, 0.0, 2, dtype=dtype)
    converted.load_state_dict(m.state_dict())
    got = converted(x.to(dtype))
    assert got.dtype == dtype
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


def module(**kwargs):
    args = dict(d_in=4, d_out=8, context_length=6, dropout=0.0, num_heads=4)
    args.update(kwargs)
    return MultiHeadAttention(**args)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(num_kv_heads=3), ValueError, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads must be >= 1"),
        (dict(num_heads=3), ValueError, r"num_heads \(3\) must divide d_out \(8\)"),
        (dict(context_dim=2.0), TypeError, "context_dim must be an int"),
        (dict(causal="yes"), TypeError, "causal must be a bool"),
        (dict(dropout=1.0), ValueError, r"dropout must be in \[0, 1\)"),
        (dict(backend="xformers"), ValueError, "backend must be one of"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        module(**kwargs)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m, x: m(x[0]), ValueError, r"x must have shape \(batch, tokens, d_in\)"),
        (lambda m, x: m(x[..., :3]), ValueError, "x has last dimension 3 but d_in is 4"),
        (lambda m, x: m(x.double()), TypeError, "x has dtype torch.float64"),
        (lambda m, x: m(torch.randn(2, 7, 4)), ValueError, "more than context_length"),
        (
            lambda m, x: m(x, torch.randn(2, 3, 5)),
            ValueError,
            "context has last dimension 5 but context_dim is 4",
        ),
        (lambda m, x: m(x, torch.randn(3, 3, 4)), ValueError, "context has batch size 3"),
        (
            lambda m, x: m(x, mask=torch.ones(2, 1, 5, 6, dtype=torch.bool)),
            ValueError,
            r"mask of shape \(2, 1, 5, 6\) does not broadcast",
        ),
        (lambda m, x: m(x, mask=torch.ones(5, 5, dtype=torch.long)), TypeError, "mask must be"),
        (lambda m, x: m(x, need_weights="yes"), TypeError, "need_weights must be a bool"),
    ],
)
def test_bad_forward_input(call, error, message):
    m, x = module(), torch.randn(2, 5, 4)
    with pytest.raises(error, match=message):
        call(m, x)


def test_need_weights_with_the_sdpa_backend_is_refused():
    with pytest.raises(ValueError, match="need_weights=True needs backend 'math' or 'auto'"):
        module(backend="sdpa")(torch.randn(1, 3, 4), need_weights=True)


def test_book_state_dict_into_grouped_query_heads_is_refused():
    state = book.MultiHeadAttention(4, 8, 6, 0.0, 4).state_dict()
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\) != num_heads \(4\)"):
        module(num_kv_heads=2).load_state_dict(state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs_give_empty_or_zero_outputs(backend):
    torch.manual_seed(14)
    m = MultiHeadAttention(4, 8, 8, 0.0, 2, backend=backend)
    assert m(torch.randn(2, 0, 4)).shape == (2, 0, 8)
    assert m(torch.randn(0, 3, 4)).shape == (0, 3, 8)
    no_keys = m(torch.randn(2, 3, 4), torch.randn(2, 0, 4))  # nothing to attend to: zeros
    torch.testing.assert_close(no_keys, m.out_proj.bias.expand(2, 3, 8), rtol=0, atol=0)


def test_three_dimensional_mask_is_refused_as_ambiguous():
    m, x = module(), torch.randn(4, 5, 4)
    with pytest.raises(ValueError, match=r"mask of shape \(4, 5, 5\) is 3-D"):
        m(x, mask=torch.ones(4, 5, 5, dtype=torch.bool))


@pytest.mark.parametrize("window", [1, 5, 40])
def test_the_flash_backend_runs_a_window(window):
    """MultiHeadAttention(backend='flash', window=...) built, loaded and then raised on
    every forward; it now runs, equal to the math backend, with and without a cache."""
    if not flash_cpu.available():
        pytest.skip("the CPU kernel is not built here")
    torch.manual_seed(7)
    flash = MultiHeadAttention(8, 16, 64, 0.0, 4, backend="flash", window=window).eval()
    math_ = MultiHeadAttention(8, 16, 64, 0.0, 4, backend="math", window=window).eval()
    math_.load_state_dict(flash.state_dict())
    x = torch.randn(2, 50, 8)
    with torch.no_grad():
        expected = math_(x)
        torch.testing.assert_close(flash(x), expected, atol=1e-5, rtol=1e-5)
        cache = flash.make_cache(2, max_tokens=60)
        steps = [flash(x[:, :30], cache=cache)] + [
            flash(x[:, t : t + 1], cache=cache) for t in range(30, 50)
        ]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            dict(dtype=torch.int64),
            TypeError,
            "dtype must be a floating-point dtype, got torch.int64",
        ),
        (dict(dtype="float16"), TypeError, "dtype must be a torch.dtype, got str"),
        (dict(device="cpux"), ValueError, "device 'cpux' is not a device torch knows"),
        (dict(device=1.5), TypeError, "device must be a torch.device, str or None, got float"),
        (dict(rope_base=float("inf")), ValueError, "rope_base"),  # checked while rope is off
        (dict(rope_base="big"), TypeError, "rope_base"),
    ],
)
def test_constructor_refuses_bad_dtype_device_and_rope_base(kwargs, error, message):
    with pytest.raises(error, match=message):
        MultiHeadAttention(4, 8, 16, 0.0, 2, **kwargs)


def test_numpy_integers_are_plain_ints_in_the_config():
    """A config of numpy integers could not be saved as JSON; it is normalised at the door."""
    np = pytest.importorskip("numpy")
    m = MultiHeadAttention(np.int64(4), np.int64(8), np.int64(16), 0.0, np.int64(2), rope=True)
    sizes = ("d_in", "d_out", "context_length", "num_heads", "num_kv_heads", "context_dim")
    assert all(type(m.config[name]) is int for name in sizes)
    assert type(m.num_kv_heads) is int and m.config["rope_base"] == 10000.0
    assert MultiHeadAttention(**m.config).config == m.config


def test_a_non_finite_input_is_refused_naming_it():
    m = MultiHeadAttention(4, 8, 16, 0.0, 2)
    x = torch.randn(1, 3, 4)
    x[0, 2, 1] = torch.inf
    with pytest.raises(ValueError, match=r"x has a non-finite value \(inf\) at index \(0, 2, 1\)"):
        m(x)


def test_scale_set_after_construction_is_checked_as_at_construction():
    m = MultiHeadAttention(8, 8, 16, 0.0, 2)
    for bad, error in ((-1.0, ValueError), (0.0, ValueError), (1e39, ValueError), ("2", TypeError)):
        with pytest.raises(error, match="scale"):
            m.scale = bad
    assert m.scale is None
    m.scale = 0.25
    assert m.attention_scale == 0.25 and m.config["scale"] == 0.25
    m.scale = None
    assert m.attention_scale == pytest.approx(4**-0.5)


def test_a_cache_inside_a_torch_func_transform_is_a_named_error():
    """torch.func refuses in-place writes to captured tensors: a cached call inside vmap or
    jvp is refused by name, the cache unchanged; without a cache the transforms run."""
    torch.manual_seed(1)
    m = MultiHeadAttention(8, 8, 16, 0.0, 2).eval()
    x = torch.randn(3, 2, 8)
    cache = m.make_cache(1, 8)
    with pytest.raises(ValueError, match=r"a torch\.func transform"):
        torch.func.vmap(lambda y: m(y[None], cache=cache))(x)
    with pytest.raises(ValueError, match=r"a torch\.func transform"):
        torch.func.jvp(lambda y: m(y, cache=cache), (x[:1],), (x[:1],))
    assert cache.position == 0
    batched = torch.func.vmap(lambda y: m(y[None])[0])(x)
    torch.testing.assert_close(batched, m(x), atol=1e-6, rtol=1e-6)
