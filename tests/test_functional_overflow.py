"""Scores past float32's largest value: every input finite, scale x q . k (or a partial sum
of its products, or a score plus a bias) past 3.4e38. Every kernel computes in float32 and
gave zeros, NaN, a wrong sign under softcap, or a wrong non-zero row (the sixth outside
pass of issue 37). Where values are read (the CPU by default) attend() bounds the scores
first and computes such calls in float64: each result here is compared with a float64
softmax written out below. A module's decode step takes the same route (the native step
refuses its own overflowed float32 result, -inf scores included); a projection that
overflows is a ValueError and the cache keeps what it held."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import MultiHeadAttention, alibi, debug, decode_cpu, flash_cpu, functional, plan
from attnlab.functional import attention

BACKENDS = ["auto", "math", "sdpa", "flash"]
NATIVE = decode_cpu.available()


def _skip_unless_runs(backend):
    if backend == "flash" and not flash_cpu.available():
        pytest.skip(f"the flash kernel is unavailable: {flash_cpu.load_error()}")


def reference(
    q, k, v, *, allowed=None, causal=False, scale=None, sinks=None, softcap=None, bias=None
):
    """softmax(scale q k^T [softcapped] + bias + mask [+ sink column]) v in float64, by
    hand; allowed is a bool (tq, tk) mask, bias an additive one broadcast to the scores;
    grouped heads repeat their key/value head."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale  # (b, h, tq, tk)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.double()
    tq, tk = scores.shape[-2:]
    seen = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        seen = torch.ones(tq, tk).tril(tk - tq).bool()
    if allowed is not None:
        seen = seen & allowed
    scores = scores.masked_fill(~seen, -math.inf)
    if sinks is not None:  # a column per head, in the denominator only
        column = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    top = scores.amax(dim=-1, keepdim=True).clamp(min=-1e300)  # a row with no key: zeros
    weights = (scores - top).exp()
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-300)
    return weights[..., :tk] @ v


def close(got, expected):
    """got equals the float64 answer to float32's rounding, relative to its largest value."""
    size = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(got.double(), expected, atol=1e-6 * size, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_scores_past_float32_get_the_float64_answer(backend, causal):
    """scale=1e38 x q . k: every kernel's float32 result held NaN; it is the float64 answer
    (with the checks off, the kernels' own NaN, which shows the scores overflow float32)."""
    _skip_unless_runs(backend)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    out = attention(q, k, v, scale=1e38, causal=causal, backend=backend)
    close(out, reference(q, k, v, scale=1e38, causal=causal))
    with debug.checks(False):
        unchecked = attention(q, k, v, scale=1e38, causal=causal, backend=backend)
    assert not torch.isfinite(unchecked).all()


def _partial_sum_overflow(head_dim=8):
    """q . k of each key exact and finite (0, or -3e38 for the last key), but the first two
    products, -2e38 each, sum past float32 in any kernel that adds them first."""
    q = torch.full((1, 1, 4, head_dim), 1e19)
    k = torch.zeros(1, 1, 4, head_dim)
    k[..., :4] = torch.tensor([-2e19, -2e19, 2e19, 2e19])
    k[..., 3, 2:4] = torch.tensor([0.5e19, 0.5e19])  # its score: -4e38 + 1e38 = -3e38
    v = torch.arange(4.0).view(1, 1, 4, 1).expand(1, 1, 4, head_dim)
    return q, k, v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_a_partial_sum_past_float32_gets_the_exact_answer(backend, causal):
    """Every score finite in float32, a partial sum of one is not: zeros (auto, sdpa,
    flash) or a wrong non-zero causal row (flash) before; the exact answer now."""
    _skip_unless_runs(backend)
    q, k, v = _partial_sum_overflow()
    exact = (q.double() @ k.double().transpose(-1, -2)).abs().max()
    assert exact < torch.finfo(torch.float32).max  # each score is finite in float32
    close(
        attention(q, k, v, scale=1.0, causal=causal, backend=backend),
        reference(q, k, v, scale=1.0, causal=causal),
    )


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_softcapped_scores_past_float32_keep_their_sign(backend):
    """q, k of about 1e19, head_dim 64: a fifth of the float32 scores overflowed with the
    wrong sign, and tanh took them to the wrong end of (-softcap, softcap)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 64, generator=g) for _ in range(3))
    q, k = q * 1e19, k * 1e19
    out = attention(q, k, v, softcap=30.0, backend=backend)
    close(out, reference(q, k, v, softcap=30.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_real_score_far_below_the_sink_gives_the_sink_all_the_weight(backend):
    """Real scores of about -1e41 and a finite sink: the answer is zeros (every weight on
    the sink); before, each backend raised that the scores overflowed."""
    _skip_unless_runs(backend)
    q = torch.full((1, 2, 3, 8), 1e20)
    k, v = -q, torch.ones(1, 2, 3, 8)
    sinks = torch.tensor([0.5, -2.0])
    out = attention(q, k, v, sinks=sinks, backend=backend)
    close(out, reference(q, k, v, sinks=sinks))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_masked_key_holding_huge_values_changes_nothing(backend):
    """A key the mask hides holds 1e20s: the answer is that of the other keys (before, it
    depended on the backend)."""
    _skip_unless_runs(backend)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g) for _ in range(3))
    k[:, :, 1] = 1e20
    allowed = torch.ones(4, 4, dtype=torch.bool)
    allowed[:, 1] = False
    out = attention(q, k, v, mask=allowed, backend=backend)
    close(out, reference(q, k, v, allowed=allowed))


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa"])
@pytest.mark.parametrize(
    "bias",
    [
        {"mask": torch.tensor([-1e5, -1e5, -1e5 + 1])},  # -inf in float16: a row of zeros
        {"mask": torch.tensor([0.0, 1e5, 0.0])},  # +inf in float16: NaN, named as overflow
        {"sinks": torch.tensor([1e5])},  # the sink takes every weight
    ],
    ids=["mask_minus_1e5", "mask_plus_1e5", "sink_1e5"],
)
def test_a_float32_bias_past_float16_is_taken_as_it_is(backend, bias):
    """float16 q, k, v with a float32 mask or sinks past 65504: SDPA took them in float16
    (zeros, or a false overflow error); they are the float64 answer (the seventh pass)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 2 if i == 0 else 3, 8, generator=g) for i in range(3))
    half = [t.half() for t in (q, k, v)]
    out = attention(*half, backend=backend, **bias)
    mask = bias.get("mask")
    expected = reference(*half, sinks=bias.get("sinks"), bias=mask)
    torch.testing.assert_close(out, expected.half(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa"])
@pytest.mark.parametrize(
    ("dtype", "bias"),
    [
        (torch.float16, {"mask": torch.tensor([2000.3, 2001.0])}),
        (torch.bfloat16, {"mask": torch.tensor([150.3, 150.7])}),
        (torch.float16, {"mask": torch.tensor([-1e9, 2001.0]), "sinks": torch.tensor([2000.3])}),
        (
            torch.bfloat16,
            {"mask": torch.tensor([150.3, 150.7]), "sinks": torch.tensor([3.0]).bfloat16()},
        ),
    ],
    ids=["float16_mask", "bfloat16_mask", "float16_sink", "bfloat16_mask_and_sink"],
)
def test_a_wider_bias_keeps_its_differences_in_a_narrower_dtype(backend, dtype, bias):
    """float16 or bfloat16 q, k, v with a float32 mask (or sinks) of large, close values:
    SDPA took the bias in q's dtype, which rounded 2000.3 and 2001.0 to 2000 and 2001 (the
    weights 0.27 and 0.73 for 0.33 and 0.67; the eighth pass). Each row is shifted by its
    largest value first, as softmax allows: every backend agrees with float64."""
    q = torch.zeros(1, 1, 1, 8, dtype=dtype)
    k = torch.zeros(1, 1, 2, 8, dtype=dtype)
    v = torch.tensor([[1.0] * 8, [0.0] * 8]).view(1, 1, 2, 8).to(dtype)
    out = attention(q, k, v, backend=backend, **bias)
    expected = reference(q, k, v, sinks=bias.get("sinks"), bias=bias["mask"])
    torch.testing.assert_close(out.double(), expected, atol=4e-3, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_dtype", [torch.float64, torch.float32, torch.float16])
@pytest.mark.parametrize("mask_dtype", [torch.float64, torch.float32])
def test_transformers_eager_mask_of_the_dtypes_minimum_is_a_mask(
    backend, q_dtype, mask_dtype, monkeypatch
):
    """transformers' eager masks hold finfo(dtype).min where a query may not attend: the
    bound counted it as a bias past float64 and refused every float64 model swapped in
    eager mode (the tenth pass), and sent float32 ones to the float64 route. It equals the
    same mask with -inf, on the kernels' own path."""
    if backend == "flash" and (q_dtype != torch.float32 or not flash_cpu.available()):
        pytest.skip("the flash kernel takes float32 only")
    monkeypatch.setattr(functional, "_attend_in_float64", None)  # any call fails
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g).to(q_dtype) for _ in range(3))
    allowed = torch.ones(5, 5).tril().bool()
    allowed[:, 0] = allowed[0, 0] = True  # every row keeps a key
    minimum = torch.zeros(5, 5, dtype=mask_dtype).masked_fill(~allowed, torch.finfo(mask_dtype).min)
    out = attention(q, k, v, mask=minimum, backend=backend)
    tolerance = 2e-3 if q_dtype == torch.float16 else 1e-5
    torch.testing.assert_close(
        out.double(), reference(q, k, v, allowed=allowed), atol=tolerance, rtol=tolerance
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_row_shift_reads_only_the_keys_the_causal_rule_shows(backend, dtype):
    """A mask of [-3e38, 3e38] with causal=True: the first query sees only the first key.
    Shifted by the hidden key's 3e38, its bias overflowed to -inf: zeros from sdpa, flash
    and auto, a false overflow error from math (the eleventh pass)."""
    if backend == "flash" and (dtype != torch.float32 or not flash_cpu.available()):
        pytest.skip("the flash kernel takes float32 only")
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 1, 2, 4, generator=g).to(dtype) for _ in range(3))
    bias = torch.tensor([-3e38, 3e38])
    out = attention(q, k, v, mask=bias, causal=True, backend=backend)
    expected = reference(q, k, v, causal=True, bias=bias.double())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "math"])
@pytest.mark.parametrize(
    ("dtype", "bias"),
    [
        (torch.float16, torch.tensor([1e5])),
        (torch.float32, torch.tensor([1e300], dtype=torch.float64)),
    ],
)
def test_a_row_that_sees_no_key_is_zeros_whatever_its_bias(backend, dtype, bias):
    """causal with more queries than keys: the first query sees none. Its unshifted bias
    (1e5 in float16, 1e300 in float32) was inf once SDPA opened the row: a false overflow
    error (the twelfth pass). Zeros, and the other row its one key's value."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 1, 2, 4, generator=g).to(dtype)
    k, v = (torch.randn(1, 1, 1, 4, generator=g).to(dtype) for _ in range(2))
    out = attention(q, k, v, mask=bias, causal=True, backend=backend)
    assert torch.equal(out[0, 0, 0], torch.zeros(4, dtype=dtype))
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, 0])


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa"])
def test_a_float_mask_over_no_key_gives_zeros(backend):
    """No key and a float mask of zero keys: amax over the empty keys axis raised an
    IndexError (the twelfth pass); zeros, as with no mask or a bool one."""
    q, kv = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4)
    out = attention(q, kv, kv, mask=torch.zeros(1, 1, 3, 0), backend=backend)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("backend", ["auto", "sdpa", "math"])
def test_alibi_with_causal_in_bfloat16_as_documented(backend):
    """alibi.bias is positive on future keys; passed with causal=True (as the docs show),
    each row was shifted by its hidden keys' largest value and bfloat16 rounded the seen
    ones coarsely: 0.53 off at 512 tokens."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 512, 16, generator=g).bfloat16() for _ in range(3))
    bias = alibi.bias(alibi.slopes(4) * 4, num_queries=512)  # (1, 4, 512, 512)
    out = attention(q, k, v, mask=bias, causal=True, backend=backend)
    expected = reference(q, k, v, causal=True, bias=bias.double())
    error = float((out.double() - expected).abs().max() / expected.abs().max())
    assert error < 2e-2, error


def test_the_shift_is_computed_in_the_wider_dtype():
    """A bfloat16 mask with float64 q: the shift was computed in bfloat16 (weights 0.9519 /
    0.0481 for 0.9521 / 0.0479); it is computed in float64, exactly."""
    q = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    k, v = torch.zeros(1, 1, 2, 4, dtype=torch.float64), torch.eye(2, 4).double().view(1, 1, 2, 4)
    bias = torch.tensor([3.0, 0.0100098]).bfloat16()
    _, weights = attention(q, k, v, mask=bias, need_weights=True, backend="math")
    exact = torch.softmax(bias.double(), dim=-1)
    torch.testing.assert_close(weights.flatten(), exact, atol=1e-15, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_softcap_past_float32_is_named(dtype):
    """softcap=1e39 is inf in float32, and inf x tanh(s / inf) NaN: a ValueError naming it
    (was 'the output is not finite'); float64 scores take it."""
    q = torch.randn(1, 1, 2, 8)
    with pytest.raises(ValueError, match=r"^softcap \(1e\+39\) is not finite in torch\.float32"):
        attention(q.to(dtype), q.to(dtype), q.to(dtype), softcap=1e39, backend="math")
    wide = q.double()
    close(attention(wide, wide, wide, softcap=1e39, backend="math"), reference(wide, wide, wide))


def test_bfloat16_scores_past_float32_are_computed_and_float64_past_float64_are_named():
    q = torch.full((1, 1, 2, 8), 100.0, dtype=torch.bfloat16)
    v = torch.arange(16.0).view(1, 1, 2, 8).to(torch.bfloat16)
    out = attention(q, -q, v, scale=1e36, backend="sdpa")
    torch.testing.assert_close(out, reference(q, -q, v, scale=1e36).to(torch.bfloat16))
    q64 = torch.full((1, 1, 1, 8), 1e20, dtype=torch.float64)
    out = attention(q64, -q64, torch.ones_like(q64), backend="sdpa")  # 1e40 is finite here
    assert torch.equal(out, torch.ones_like(out))
    with pytest.raises(ValueError, match=r"the scores could overflow float64: head_dim \(8\)"):
        attention(q64 * 1e140, -q64 * 1e140, q64, backend="math")


def test_weights_and_gradients_past_float32_are_the_float64_ones():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) * 1e19 for _ in range(3))
    v = v / 1e19
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, weights = attention(*leaves, causal=True, need_weights=True, backend="math")
    close(out, reference(q, k, v, causal=True))
    assert weights.dtype == torch.float32 and torch.isfinite(weights).all()
    out.sum().backward()
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    reference(*wide, causal=True).sum().backward()
    for leaf, exact in zip(leaves, wide, strict=True):
        close(leaf.grad, exact.grad)


@st.composite
def overflowing_calls(draw):
    kv_heads = draw(st.integers(1, 2))
    shape = dict(
        b=draw(st.integers(1, 2)),
        hq=kv_heads * draw(st.integers(1, 2)),
        hkv=kv_heads,
        tq=draw(st.integers(1, 5)),
        tk=draw(st.integers(1, 5)),
        hd=draw(st.sampled_from([4, 8, 16])),
    )
    return dict(
        shape=shape,
        seed=draw(st.integers(0, 2**31 - 1)),
        # q and k's: scores of order one, or from about 1e38 (at the bound) to 1e50. Between,
        # float32's own rounding of large scores is the error (tests/test_functional_layouts)
        magnitude=10.0 ** draw(st.sampled_from([0, 18, 19, 20, 22, 25])),
        causal=draw(st.booleans()),
        backend=draw(st.sampled_from(BACKENDS)),
        transposed=draw(st.booleans()),  # keys laid out tokens-last, as a CPU cache holds them
    )


@settings(max_examples=60, deadline=None)
@given(call=overflowing_calls())
def test_any_magnitude_gives_the_float64_answer(call):
    """Shapes, grouped heads, strides and magnitudes of 1 and from 1e18 to 1e25: the
    float64 answer (to float32's rounding) on every backend."""
    if call["backend"] == "flash" and not flash_cpu.available():
        return
    s = call["shape"]
    g = torch.Generator().manual_seed(call["seed"])
    q = torch.randn(s["b"], s["hq"], s["tq"], s["hd"], generator=g) * call["magnitude"]
    k = torch.randn(s["b"], s["hkv"], s["tk"], s["hd"], generator=g) * call["magnitude"]
    v = torch.randn(s["b"], s["hkv"], s["tk"], s["hd"], generator=g)
    if call["transposed"]:
        k = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # (b, hkv, tk, hd), strided
    causal = call["causal"] and s["tq"] <= s["tk"]
    out = attention(q, k, v, causal=causal, backend=call["backend"])
    close(out, reference(q, k, v, causal=causal))


# --- a module: the scores of its projections past float32


def module_reference(m, x):
    """m's causal forward in float64 (no rotary, no bias), written out."""
    w = m.qkv_proj.weight.detach().double()
    h, hkv, hd = m.num_heads, m.num_kv_heads, m.head_dim
    b, t, _ = x.shape
    q, k, v = (x.double() @ w.T).split([h * hd, hkv * hd, hkv * hd], dim=-1)
    q = q.view(b, t, h, hd).transpose(1, 2)  # (b, h, t, hd)
    k = k.view(b, t, hkv, hd).transpose(1, 2)  # (b, hkv, t, hd)
    v = v.view(b, t, hkv, hd).transpose(1, 2)
    context = reference(q, k, v, causal=True, scale=m.attention_scale)  # (b, h, t, hd)
    context = context.transpose(1, 2).reshape(b, t, h * hd)  # (b, t, d_out)
    return context @ m.out_proj.weight.detach().double().T + m.out_proj.bias.detach().double()


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("store", ["float32", "static"])
def test_a_module_whose_scores_pass_float32_decodes_the_float64_answer(kv_heads, store):
    """x of 1e25: the projections are finite, the scores (1e50) are not in float32. The full
    forward and every cached step (the native one where it runs: it refuses its own result
    and the Python path computes the step) equal the float64 forward, and the cache moves."""
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 8, 16, 0.0, 2, num_kv_heads=kv_heads).eval()
    x = torch.randn(1, 6, 8) * 1e25
    expected = module_reference(m, x)
    with torch.no_grad():
        close(m(x), expected)
        cache = m.make_cache(1, 8, static=True) if store == "static" else m.make_cache(1, 8)
        steps = [m(x[:, :2], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(2, 6)]
    close(torch.cat(steps, dim=1), expected)
    assert (cache.tokens if store == "static" else cache.position) == 6


@pytest.mark.skipif(not NATIVE, reason=f"the decode step is unavailable: {decode_cpu.load_error()}")
def test_the_native_step_refuses_a_score_whose_partial_sum_overflowed_to_minus_infinity():
    """One key's q . k is 0 but its first products sum to -inf in float32: the native step
    weighed that key 0 (a finite, wrong output). It refuses, and the step is the float64
    answer. q reads x's first 8 features, k the next 8, v the last 8."""
    m = MultiHeadAttention(24, 8, 8, 0.0, 1).eval()
    with torch.no_grad():
        m.qkv_proj.weight.zero_()
        for part in range(3):  # rows part*8.. read features part*8..
            m.qkv_proj.weight[part * 8 : part * 8 + 8, part * 8 : part * 8 + 8] = torch.eye(8)
    x = torch.zeros(1, 3, 24)
    x[0, 0, 8:12] = torch.tensor([-2e19, -2e19, 2e19, 2e19])  # the key that overflows
    x[0, 0, 16:] = 100.0  # its value
    x[0, 1, 16:] = -1.0
    x[0, 2, :8] = 1e19  # the query; its own key 0
    cache = m.make_cache(1, 4)
    with torch.no_grad():
        m(x[:, :2], cache=cache)
        assert plan.native_decode(m, x[:, 2:], cache) is not None  # the native step is asked
        step = m(x[:, 2:], cache=cache)
    close(step, module_reference(m, x)[:, 2:])  # every score 0: the mean of the 3 values
    assert cache.position == 3


@pytest.mark.parametrize("rolling", [False, True])
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("store", ["float32", "float16", "static"])
def test_a_module_whose_projections_overflow_names_it_and_keeps_its_cache(rolling, tokens, store):
    """Finite x whose first query feature is past float32 (3e38 x the signs of its weight
    row, whose magnitudes sum past 1): the full
    forward and a cached call of 1 token (the native step where it runs) or 2 (the Python
    path) raise a ValueError, and the cache keeps its position and what it held: the next
    step equals that of a twin cache that never saw the call (a static cache's slots past
    its tokens kept the infinities, which made every later step NaN)."""
    if store == "static" and rolling:
        pytest.skip("a static cache holds every position: no rolling window")
    torch.manual_seed(0)
    module = MultiHeadAttention(8, 8, 16, 0.0, 2, window=2 if rolling else None).eval()
    prompt, after = torch.randn(1, 3, 8), torch.randn(1, 1, 8)
    row = module.qkv_proj.weight.detach()[0]
    assert row.abs().sum() > 1.2
    big = (row.sign() * 3e38).expand(1, tokens, 8)

    def make():
        if store == "static":
            return module.make_cache(1, 8, static=True)
        return module.make_cache(1, 8, dtype=getattr(torch, store))

    with torch.no_grad():
        with pytest.raises(ValueError, match="overflowed"):
            module(torch.cat([prompt, big], dim=1))
        cache, twin = make(), make()
        module(prompt, cache=cache)
        module(prompt, cache=twin)
        buffers = [t.clone() for t in (cache.keys, cache.values)] if store == "static" else []
        # a float16 cache names first that it cannot hold keys and values of 1e38
        named = "past the torch.float16 cache" if store == "float16" else "overflowed"
        with pytest.raises(ValueError, match=named):
            module(big, cache=cache)
        held = cache.tokens if store == "static" else cache.position
        assert held == 3
        for kept, now in zip(buffers, (cache.keys, cache.values), strict=False):
            assert torch.equal(kept, now)  # every slot, the masked ones past the tokens too
        torch.testing.assert_close(module(after, cache=cache), module(after, cache=twin))
