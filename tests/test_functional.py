"""attnlab.functional.attention: both backends equal an explicit per-head reference, the
book's classes and PyTorch's SDPA; empty rows are zero with finite gradients."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from attnlab import book, flash_cpu, masks
from attnlab.functional import attention
from tests.definitions import reference


@st.composite
def configs(draw):
    b, hkv = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    hq = hkv * draw(st.integers(1, 3))
    tq = draw(st.integers(1, 7))
    tk = tq + draw(st.integers(0, 4))
    return dict(
        b=b,
        hq=hq,
        hkv=hkv,
        tq=tq,
        tk=tk,
        hd=draw(st.integers(1, 6)),
        hdv=draw(st.integers(1, 6)),
        seed=draw(st.integers(0, 2**31 - 1)),
        causal=draw(st.booleans()),
        pad=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.integers(1, 5))),
    )


def build(c):
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["b"], c["hq"], c["tq"], c["hd"], generator=g)
    k = torch.randn(c["b"], c["hkv"], c["tk"], c["hd"], generator=g)
    v = torch.randn(c["b"], c["hkv"], c["tk"], c["hdv"], generator=g)
    lengths = torch.randint(0, c["tk"] + 1, (c["b"],), generator=g)
    mask = masks.combine_masks(
        masks.padding_mask_from_lengths(lengths, c["tk"]) if c["pad"] else None,
        masks.sliding_window_mask(c["tq"], c["tk"], window=c["window"]) if c["window"] else None,
    )
    return q, k, v, mask


@given(configs())
def test_backends_equal_the_reference(c):
    q, k, v, mask = build(c)
    allowed = masks.combine_masks(
        mask, masks.causal_mask(c["tq"], c["tk"]) if c["causal"] else None
    )
    expected = reference(q, k, v, allowed)
    for backend in ("math", "sdpa", "auto"):
        out = attention(q, k, v, mask=mask, causal=c["causal"], backend=backend)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    additive = None if mask is None else masks.to_additive(mask)
    torch.testing.assert_close(
        attention(q, k, v, mask=additive, causal=c["causal"]), expected, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_fully_masked_rows_are_zero_with_finite_gradients(backend):
    torch.manual_seed(0)
    q = torch.randn(2, 2, 4, 3, requires_grad=True)
    k = torch.randn(2, 2, 4, 3, requires_grad=True)
    v = torch.randn(2, 2, 4, 3, requires_grad=True)
    mask = masks.padding_mask_from_lengths(torch.tensor([0, 2]), 4)  # sequence 0: all padding
    out = attention(q, k, v, mask=mask, causal=True, backend=backend)
    assert torch.all(out[0] == 0) and torch.isfinite(out).all()
    (out * torch.randn_like(out)).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[0] == 0)


def test_gradients_agree_between_backends():
    torch.manual_seed(1)
    q, k, v = (
        torch.randn(2, 4, 6, 5, dtype=torch.float64, requires_grad=True),
        torch.randn(2, 2, 6, 5, dtype=torch.float64, requires_grad=True),
        torch.randn(2, 2, 6, 5, dtype=torch.float64, requires_grad=True),
    )
    mask = masks.padding_mask_from_lengths(torch.tensor([6, 3]), 6)
    grads = []
    for backend in ("math", "sdpa"):
        out = attention(q, k, v, mask=mask, causal=True, backend=backend)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def test_equals_book_multi_head_attention_before_out_proj():
    torch.manual_seed(123)
    mha = book.MultiHeadAttention(3, 4, 6, 0.0, num_heads=2)
    x = book.example_batch()

    def heads(p):
        return p.view(2, 6, 2, 2).transpose(1, 2)  # (b, t, d_out) -> (b, h, t, hd)

    with torch.no_grad():
        out = attention(
            heads(mha.W_query(x)), heads(mha.W_key(x)), heads(mha.W_value(x)), causal=True
        )
        out = mha.out_proj(out.transpose(1, 2).reshape(2, 6, 4))  # (b, t, d_out)
        torch.testing.assert_close(out, mha(x), rtol=1e-5, atol=1e-6)


def test_need_weights_returns_the_weights_used():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 3)
    out, weights = attention(q, k, v, causal=True, need_weights=True)
    assert weights.shape == (1, 2, 5, 5) and torch.all(weights.triu(1) == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 5))
    torch.testing.assert_close(out, weights @ v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_with_dropout_the_weights_returned_are_the_dropped_ones_the_output_used(backend):
    """need_weights promises the weights used: with dropout in training, output = the
    returned (dropped, rescaled) weights times the values."""
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 3)
    out, weights = attention(
        q, k, v, causal=True, dropout_p=0.5, training=True, need_weights=True, backend=backend
    )
    assert (weights == 0).sum() > (torch.ones(6, 6).triu(1) == 1).sum() * 4  # some dropped
    torch.testing.assert_close(out, weights @ v, rtol=1e-5, atol=1e-6)


def test_dropout_only_when_training():
    torch.manual_seed(3)
    q = k = v = torch.randn(1, 1, 8, 4)
    plain = attention(q, k, v, backend="math")
    torch.testing.assert_close(attention(q, k, v, dropout_p=0.5, backend="math"), plain)
    assert not torch.allclose(
        attention(q, k, v, dropout_p=0.5, training=True, backend="math"), plain
    )


def test_half_precision_matches_float32():
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    expected = attention(q, k, v, causal=True, backend="math")
    got = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, backend="math")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(expected, sdpa, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            dict(k=torch.randn(1, 3, 4, 8), v=torch.randn(1, 3, 4, 8)),
            ValueError,
            r"key/value heads \(3\) must divide query heads \(4\)",
        ),
        (dict(mask=torch.ones(1, 1, 4, 5, dtype=torch.bool)), ValueError, "does not broadcast"),
        (dict(mask=torch.ones(4, 4, dtype=torch.long)), TypeError, "mask must be bool"),
        (dict(need_weights=True, backend="sdpa"), ValueError, "need_weights=True needs backend"),
        (dict(backend="xformers"), ValueError, "backend must be one of"),
        (dict(dropout_p=1.0, training=True), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(scale=0.0), ValueError, "scale must be a positive"),
        (dict(q=torch.randn(4, 4, 8)), ValueError, r"q must have shape \(batch, heads, tokens"),
        (dict(v=torch.randn(1, 2, 5, 8)), ValueError, "must agree in batch, heads and tokens"),
        (dict(k=torch.randn(1, 2, 4, 7), v=torch.randn(1, 2, 4, 8)), ValueError, "head_dim"),
        (dict(v=torch.randn(1, 2, 4, 8, dtype=torch.float64)), TypeError, "share a dtype"),
        # flags are bools: the string "False" is truthy and once meant causal, dropout on
        (dict(causal="False"), TypeError, r"causal must be a bool, got str \('False'\)"),
        (dict(training="False"), TypeError, r"training must be a bool"),
        (dict(need_weights="no"), TypeError, r"need_weights must be a bool"),
        (
            dict(dropout_p=2.0),
            ValueError,
            r"dropout_p must be in \[0, 1\), got 2.0",
        ),  # not training
        (dict(dropout_p="0.1"), TypeError, r"dropout_p must be a float"),
        (dict(q=torch.randn(1, 4, 4, 0), k=torch.randn(1, 2, 4, 0)), ValueError, "no features"),
    ],
)
def test_bad_input(kwargs, error, message):
    args = dict(q=torch.randn(1, 4, 4, 8), k=torch.randn(1, 2, 4, 8), v=torch.randn(1, 2, 4, 8))
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=message):
        attention(q, k, v, **args)


def _qkv(seed=0, tq=6, tk=6):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, 4, tq, 8, generator=g),
        torch.randn(2, 2, tk, 8, generator=g),
        torch.randn(2, 2, tk, 8, generator=g),
    )


ALL_BACKENDS = ["math", "sdpa", "auto", "flash"]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_additive_mask_with_nan_or_plus_inf_is_refused(backend, bad):
    """NaN was read as 'blocked' and +inf made the row NaN, differently per backend."""
    q, k, v = _qkv()
    mask = torch.zeros(6, 6)
    mask[2, 3] = bad
    with pytest.raises(ValueError, match=rf"mask holds {bad} at index \(2, 3\)"):
        attention(q, k, v, mask=mask, causal=True, backend=backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_a_non_finite_input_is_refused_on_every_backend(backend, name):
    """NaN in a future value once leaked into different rows on different backends: one
    contract everywhere, a ValueError naming the tensor and the index."""
    tensors = dict(zip("qkv", _qkv(), strict=True))
    tensors[name][1, 0, 5, 3] = torch.nan
    with pytest.raises(ValueError, match=rf"{name} has a non-finite value \(nan\) at index"):
        attention(tensors["q"], tensors["k"], tensors["v"], causal=True, backend=backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_a_keys_mask_of_any_rank_works_on_every_backend(backend, causal):
    """A 1-D (keys) and a 2-D (queries, keys) mask broadcast as documented on every backend
    (1-D raised IndexError on sdpa and auto)."""
    if backend == "flash" and not flash_cpu.available():
        pytest.skip("the CPU kernel is not built here")
    q, k, v = _qkv(1, tq=40, tk=40)
    keys = torch.arange(40) % 3 != 0  # (tk,)
    allowed = keys.expand(40, 40)
    if causal:
        allowed = allowed & masks.causal_mask(40, 40)
    expected = reference(q.double(), k.double(), v.double(), allowed).to(q.dtype)
    for mask in (keys, keys.expand(40, 40), keys.view(1, 1, 1, 40)):
        out = attention(q, k, v, mask=mask, causal=causal, backend=backend)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa", "flash"])
def test_forward_mode_ad_takes_math_or_is_refused_by_name(backend):
    """Under torch.autograd.forward_ad, "auto" computes on math (whose ops carry tangents):
    the tangent equals torch.func.jvp's through the math backend; "sdpa" and "flash", which
    have none, are a named ValueError (was torch's NotImplementedError)."""
    import torch.autograd.forward_ad as fwad

    g = torch.Generator().manual_seed(3)
    q, k, v, t = (torch.randn(1, 2, 130, 8, generator=g) for _ in range(4))
    _, want = torch.func.jvp(lambda y: attention(y, k, v, causal=True, backend="math"), (q,), (t,))
    with fwad.dual_level():
        dual = fwad.make_dual(q, t)
        if backend in ("sdpa", "flash"):
            with pytest.raises(ValueError, match=f"the '{backend}' backend has no forward-mode"):
                attention(dual, k, v, causal=True, backend=backend)
            return
        out = attention(dual, k, v, causal=True, backend=backend)
        tangent = fwad.unpack_dual(out).tangent
    torch.testing.assert_close(tangent, want, atol=1e-5, rtol=1e-5)
