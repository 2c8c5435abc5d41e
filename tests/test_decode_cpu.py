"""The native decode step (attnlab.decode_cpu) and the narrower caches (bfloat16, int8):
token-by-token decoding equals the full forward on every head layout (float32: 1e-5;
bfloat16/int8: within their storage error), the native step equals the Python path it
replaces, and the cache contract (rollback, crop, reset, refusals) holds for every dtype;
the op's other two faces (linear_rows, latent_step) equal float64 references and refuse by
name what they cannot read."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import KVCache, MultiHeadAttention, _build, decode_cpu, plan
from attnlab.kv_cache import quantize
from tests import products

NATIVE = decode_cpu.available()
DTYPES = [torch.float32, torch.bfloat16, torch.int8]
# storage error bound on these small random layers (measured max: bf16 0.004, int8 0.007)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.int8: 6e-2}


def _native(m, x, cache) -> bool:
    """Whether the call plan sends m(x, cache=cache), a call forward accepts, to the native
    decode step."""
    return plan.native_decode(m, x, cache) is not None


def build(
    seed, num_heads, num_kv_heads, head_dim=4, rope=False, window=None, bias=False, qk_norm=None,
    norm_offset=0.0,
):  # fmt: skip
    """A layer of 6 input features; query/key norms (if any) with random weights."""
    torch.manual_seed(seed)
    m = MultiHeadAttention(
        6,
        num_heads * head_dim,
        24,
        0.0,
        num_heads,
        qkv_bias=bias,
        num_kv_heads=num_kv_heads,
        rope=rope,
        window=window,
        qk_norm=qk_norm,
        qk_norm_offset=norm_offset,
    ).eval()
    if qk_norm is not None:
        with torch.no_grad():
            m.q_norm.weight.normal_()
            m.k_norm.weight.normal_()
    return m


def decode(m, x, dtype, prompt=1, backend="auto"):
    """A prompt of `prompt` tokens, then one token per call, through a cache of `dtype`."""
    m.backend = backend
    cache = m.make_cache(x.shape[0], dtype=dtype)
    outputs = [m(x[:, :prompt], cache=cache)]
    outputs += [m(x[:, t : t + 1], cache=cache) for t in range(prompt, x.shape[1])]
    m.backend = "auto"
    return torch.cat(outputs, dim=1), cache


@st.composite
def layouts(draw):
    num_kv_heads = draw(st.integers(1, 3))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        num_heads=num_kv_heads * draw(st.integers(1, 3)),
        num_kv_heads=num_kv_heads,
        head_dim=4 * draw(st.integers(1, 2)),
        rope=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.integers(1, 6))),
        bias=draw(st.booleans()),
        qk_norm=draw(st.sampled_from([None, "head", "projection"])),
        norm_offset=draw(st.sampled_from([0.0, 1.0])),
    )


@settings(max_examples=25, deadline=None)
@given(layouts(), st.sampled_from(DTYPES), st.integers(1, 3), st.integers(1, 4))
def test_decoding_equals_the_full_forward_for_every_layout_and_cache_dtype(c, dtype, b, prompt):
    m = build(**c)
    x = torch.randn(b, 12, 6)
    with torch.no_grad():
        full = m(x)
        decoded, cache = decode(m, x, dtype, prompt)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(decoded, full, rtol=tolerance, atol=tolerance)
    assert cache.position == 12 and cache.dtype == dtype


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize(
    ("rope", "window", "bias", "qk_norm"),
    [(False, None, False, None), (True, 5, True, None), (True, None, False, "head"),
     (False, 5, True, "projection")],
)  # fmt: skip
def test_the_native_step_equals_the_python_path(dtype, num_kv_heads, rope, window, bias, qk_norm):
    """Same cache dtype, the same stored tokens and outputs (backend "math" is the Python
    path, "auto" the native step), batch 2, past a rolling window; query/key norms per head
    (Gemma's 1 + weight) and over the projections."""
    offset = 1.0 if qk_norm == "head" else 0.0
    m = build(5, 4, num_kv_heads, 8, rope, window, bias, qk_norm=qk_norm, norm_offset=offset)
    x = torch.randn(2, 20, 6)
    with torch.no_grad():
        assert _native(m, x[:, :1], m.make_cache(2, dtype=dtype))
        native, native_cache = decode(m, x, dtype, prompt=3)
        python, python_cache = decode(m, x, dtype, prompt=3, backend="math")
    # a narrower store may round a key the two paths computed 1e-7 apart to neighbouring
    # steps (exact comparison against the stored tokens: the test below)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.int8: 1e-2}[dtype]
    tolerance = products.tolerance(dtype, 4 // num_kv_heads, tolerance)  # see tests/products.py
    torch.testing.assert_close(native, python, rtol=tolerance, atol=tolerance)
    for got, want in zip(_stored(native_cache), _stored(python_cache), strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def _stored(cache):
    """Keys and values (b, hkv, capacity, hd) as the cache gives them back (float32)."""
    keys, values = cache.keys.float(), cache.values.float()
    if cache.key_scales is not None:
        keys, values = keys * cache.key_scales[..., None], values * cache.value_scales[..., None]
    return keys, values


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize(("rope", "window", "hd"), [(False, None, 8), (True, 5, 8), (False, 3, 7)])
def test_the_native_step_attends_to_the_tokens_it_stored(dtype, num_kv_heads, rope, window, hd):
    """Each output equals attention, in float64, of the token's query over the keys and
    values the cache holds (read back after decoding: a cache without a window keeps every
    token, the module's window then limits what each query sees); an odd head dim leaves
    the bfloat16 products a last feature without its pair."""
    m = build(8, 4, num_kv_heads, head_dim=hd, rope=rope, window=window, bias=True)
    b, t = 2, 16
    x = torch.randn(b, t, 6)
    cache = KVCache(b, t, num_kv_heads, hd, dtype=dtype)  # no window: nothing overwritten
    with torch.no_grad():
        got = torch.cat([m(x[:, i : i + 1], cache=cache) for i in range(t)], dim=1)
        q = m.qkv_proj(x)[..., : m.d_out].view(b, t, 4, hd).transpose(1, 2)  # (b, h, t, hd)
        if rope:
            q = m.rope(q, 0)
    keys, values = (s.double().repeat_interleave(4 // num_kv_heads, 1) for s in _stored(cache))
    position = torch.arange(t)
    allowed = position[None, :] <= position[:, None]
    if window is not None:
        allowed &= position[None, :] > position[:, None] - window
    rounded = products.rounds(dtype, 4 // num_kv_heads)
    heads, bound = products.attention64(q, keys, values, hd**-0.5, allowed, rounded)
    _assert_within(got, heads, bound, m.out_proj)


def _assert_within(got, heads, bound, out_proj):
    """got (b, t, d_out) equals out_proj(heads) (heads (b, h, t, hd) in float64) within 1e-5
    and the bound on the heads (tests/products.py) carried through the projection."""
    b, h, t, hd = heads.shape
    # (b, h, t, hd) -> (b, t, d_out)
    heads, bound = (x.transpose(1, 2).reshape(b, t, h * hd) for x in (heads, bound))
    weight = out_proj.weight.double()
    want = heads @ weight.T + out_proj.bias.double()
    slack = bound @ weight.abs().T + 1e-5 * (1 + want.abs())
    excess = (got.double() - want).abs() - slack
    assert excess.max() <= 0, f"off by {excess.max():.3g} past the bound {slack.max():.3g}"
    if not bound.any():  # float32 products: the float32 comparison's own message
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "num_kv_heads", "hd", "held"),
    [(4, 1, 7, 12), (4, 2, 5, 20), (4, 1, 7, 300), (14, 1, 8, 40)],
)
def test_the_step_reads_no_slot_past_the_tokens_it_attends_to(dtype, heads, num_kv_heads, hd, held):
    """Every slot of the cache NaN but the tokens held and the new one's: the output is
    finite and equals float64 attention over those (an odd number of tokens and an odd head
    dim leave the bfloat16 products an element without its pair, which must meet a zero,
    not the memory after it); 14 query heads on one key/value head take a block of 12 and
    one of 2 (bfloat16 products), or blocks of 6, 6 and 2."""
    torch.manual_seed(held)
    m = MultiHeadAttention(
        6, heads * hd, 2 * held + 40, 0.0, heads, num_kv_heads=num_kv_heads
    ).eval()
    cache = m.make_cache(2, dtype=dtype)
    x = torch.randn(2, 1, 6)
    with torch.no_grad():
        for buffer in (cache.keys_t, cache.values_t):
            buffer.fill_(float("nan"))
        cache.update(torch.randn(2, num_kv_heads, held, hd), torch.randn(2, num_kv_heads, held, hd))
        got = decode_cpu.step(x, plan.native_module(m), heads, hd**-0.5, cache, None)
        q = m.qkv_proj(x)[..., : m.d_out].view(2, 1, heads, hd).transpose(1, 2)  # (b, h, 1, hd)
    assert got is not None, "the native step refused its own result (not finite)"
    groups = heads // num_kv_heads
    held_now = (s.double()[:, :, : held + 1] for s in _stored(cache))
    keys, values = (s.repeat_interleave(groups, 1) for s in held_now)
    rounded = products.rounds(dtype, groups)
    heads, bound = products.attention64(q, keys, values, hd**-0.5, rounded=rounded)
    _assert_within(got, heads, bound, m.out_proj)


@st.composite
def model_sized_steps(draw):
    """Model-sized steps: 12 query heads, head dims up to 100 and contexts up to 1,600
    tokens, long enough for every vector width's loops, the key chunks split over the
    threads, and the blocks of query heads summed in registers (up to 12 at a time); value
    rows read four vectors, one vector and a last part at a time (100 features); up to
    9 sequences, so that the projections take their rows of x four, two and one at a time,
    over widths with and without a last part shorter than a vector."""
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        num_kv_heads=draw(st.sampled_from([12, 6, 4, 3, 2, 1])),
        head_dim=draw(st.sampled_from([4, 6, 12, 16, 64, 100])),
        held=draw(st.integers(0, 1600)),
        batch=draw(st.integers(1, 9)),
        d_in=draw(st.sampled_from([16, 37, 100])),
        window=draw(st.one_of(st.none(), st.integers(1, 900))),
        dtype=draw(st.sampled_from(DTYPES)),
    )


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@settings(max_examples=30, deadline=None)
@given(model_sized_steps())
def test_a_model_sized_native_step_equals_float64_attention_over_the_cache(c):
    """One step appended to `held` random tokens equals attention, in float64, of its query
    over the keys and values the cache then holds (its window's most recent ones)."""
    torch.manual_seed(c["seed"])
    b, hd, hkv, held, window = c["batch"], c["head_dim"], c["num_kv_heads"], c["held"], c["window"]
    m = MultiHeadAttention(
        c["d_in"], 12 * hd, held + 1, 0.0, 12, num_kv_heads=hkv, rope=True, window=window
    ).eval()
    cache = m.make_cache(b, dtype=c["dtype"])
    x = torch.randn(b, 1, c["d_in"])
    with torch.no_grad():
        if held:
            cache.update(torch.randn(b, hkv, held, hd), torch.randn(b, hkv, held, hd))
        assert _native(m, x, cache)
        got = m(x, cache=cache)
        q = m.qkv_proj(x)[..., : m.d_out].view(b, 1, 12, hd).transpose(1, 2)  # (b, h, 1, hd)
        q = m.rope(q, held)
    keys, values = (s.double().repeat_interleave(12 // hkv, 1) for s in _stored(cache))
    slots = torch.arange(held + 1) % cache.capacity
    seen = slots[-(window or held + 1) :]  # the slots of the keys the token attends to
    rounded = products.rounds(c["dtype"], 12 // hkv)
    heads, bound = products.attention64(
        q, keys[:, :, seen], values[:, :, seen], hd**-0.5, rounded=rounded
    )
    _assert_within(got, heads, bound, m.out_proj)


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@pytest.mark.parametrize("num_kv_heads", [2, 1])
@pytest.mark.parametrize("held", [19, 40])
def test_scores_far_below_zero_are_computed_natively(held, num_kv_heads):
    """Every score near -1000 (each key points away from its query) over a count of keys no
    vector width divides: the native step computes the step itself (the softmax's largest
    score is a key's, never a padding lane's 0, whose exponentials would all underflow) and
    equals float64 attention over the cache."""
    m = build(4, 2, num_kv_heads, head_dim=4)
    hd, groups = m.head_dim, 2 // num_kv_heads
    with torch.no_grad():
        w = m.qkv_proj.weight  # rows: queries (2 heads), keys, values
        if groups > 1:
            w[hd : 2 * hd] = w[:hd]  # the group's queries alike
        w[m.d_out : m.d_out + m.kv_dim] = -w[: m.kv_dim]  # each key head = -its first query's
        x = torch.randn(1, 1, 6)
        q = m.qkv_proj(x)[..., : m.d_out].view(1, 2, 1, hd)  # (b, h, 1, hd)
        x = x * (2000 / q.square().sum(-1).min()).sqrt()  # the least |q|^2 2000
        q = m.qkv_proj(x)[..., : m.d_out].view(1, 2, 1, hd)
        cache = m.make_cache(1, held + 1)
        away = -q[:, ::groups] * torch.empty(1, 1, held, 1).uniform_(0.8, 1.2)  # (b, hkv, held, hd)
        cache.update(away, torch.randn(1, num_kv_heads, held, hd))
        got = decode_cpu.step(x, plan.native_module(m), 2, hd**-0.5, cache, None)
    assert got is not None, "the native step refused its own result"
    keys, values = (t.double().repeat_interleave(groups, 1) for t in _stored(cache))
    scores = q.double() @ keys[:, :, : held + 1].transpose(-2, -1) / hd**0.5  # (b, h, 1, t)
    assert scores.max() < -500
    heads = (scores.softmax(-1) @ values[:, :, : held + 1]).transpose(1, 2).reshape(1, 1, -1)
    want = heads @ m.out_proj.weight.double().T + m.out_proj.bias.double()
    # float32 scores of magnitude 1000 are rounded by about 1e-4: so are the weights
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
def test_the_native_step_is_taken_only_where_it_applies():
    m = build(1, 4, 2)
    cache = m.make_cache(1)
    x = torch.randn(1, 1, 6)
    with torch.no_grad():
        assert _native(m, x, cache)
        assert not _native(m, torch.randn(1, 2, 6), cache)  # a prompt
        m.backend = "math"
        assert not _native(m, x, cache)
    m.backend = "auto"
    assert not _native(m, x, cache)  # autograd records the call


class _ShiftedQueries(MultiHeadAttention):
    """A subclass that changes a step of the Python path (as a LoRA or a query norm would)."""

    def _project(self, x, context):
        q, k, v = super()._project(x, context)
        return q + 0.5, k, v


def test_a_subclass_that_changes_the_python_path_decodes_through_it():
    torch.manual_seed(9)
    m = _ShiftedQueries(6, 16, 24, 0.0, 4, num_kv_heads=2, rope=True).eval()
    _decodes_through_its_own_steps(m, torch.randn(2, 9, 6))


def _decodes_through_its_own_steps(m, x):
    """Token-by-token decoding of x takes the Python path and equals m's full forward."""
    with torch.no_grad():
        assert not _native(m, x[:, :1], m.make_cache(x.shape[0]))
        decoded, _ = decode(m, x, torch.float32)
        torch.testing.assert_close(decoded, m(x), rtol=1e-5, atol=1e-5)


def _refused_calls():
    """Calls forward refuses, each as (module, x, cache) beside the error it raises: the
    native step's gate must let every one through to forward's checks."""
    m = build(1, 4, 2)
    full = m.make_cache(1, max_tokens=2)
    full.update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    at_end = m.make_cache(1)
    at_end.update(torch.zeros(1, 2, 24, 4), torch.zeros(1, 2, 24, 4))
    x = torch.randn(1, 1, 6)
    windowed = build(1, 4, 2, window=4)
    return [
        ((m, x.double(), m.make_cache(1)), TypeError),  # not the parameters' dtype
        ((m, x.half(), m.make_cache(1)), TypeError),
        ((m, torch.randn(2, 1, 6), m.make_cache(1)), ValueError),  # batch
        ((m, torch.randn(1, 1, 5), m.make_cache(1)), ValueError),  # width
        ((m, torch.randn(1, 6), m.make_cache(1)), ValueError),  # rank
        ((m, x.numpy(), m.make_cache(1)), TypeError),
        ((m, x, full), ValueError),  # no room
        ((m, x, at_end), ValueError),  # past context_length
        ((m, x, KVCache(1, 24, 4, 4)), ValueError),  # made for other heads
        ((m, x, build(1, 4, 1).make_cache(1)), ValueError),
        ((m, x, "a cache"), TypeError),
        ((windowed, x, KVCache(1, 24, 2, 4, window=2)), ValueError),  # a narrower window
        ((m, torch.full((1, 1, 6), float("nan")), m.make_cache(1)), ValueError),
        ((m, torch.tensor([[[1.0, float("inf"), 0, 0, 0, 0]]]), m.make_cache(1)), ValueError),
    ]


@pytest.mark.parametrize("case", _refused_calls())
def test_every_call_forward_refuses_is_refused_with_the_cache_unchanged(case):
    """The native gate reads attributes only and the kernel checks x's values before it
    writes: whatever forward refuses still gets forward's error, and the cache is left as
    it was."""
    (m, x, cache), error = case
    before = None
    if isinstance(cache, KVCache):
        before = [t.clone() for t in cache._tensors()], cache.position
    with torch.no_grad(), pytest.raises(error):
        m(x, cache=cache)
    if before is not None:
        assert cache.position == before[1]
        for got, kept in zip(cache._tensors(), before[0], strict=True):
            assert torch.equal(got, kept)


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
def test_strided_tokens_decode_natively_and_equal_the_full_forward():
    """x as a model slices it, hidden[:, -1:] of a (b, t, d) tensor, is not contiguous."""
    m = build(7, 4, 2, rope=True)
    x = torch.randn(3, 9, 6)
    with torch.no_grad():
        cache = m.make_cache(3)
        m(x[:, :8], cache=cache)
        last = x[:, -1:]
        assert not last.is_contiguous() and _native(m, last, cache)
        got = m(last, cache=cache)
        torch.testing.assert_close(got, m(x)[:, -1:], rtol=1e-5, atol=1e-5)


def test_without_the_extension_decoding_takes_the_python_path(monkeypatch):
    m = build(2, 4, 1, rope=True)
    x = torch.randn(1, 9, 6)
    monkeypatch.setattr(decode_cpu, "load_error", lambda: "turned off")
    with torch.no_grad():
        assert not _native(m, x[:, :1], m.make_cache(1))
        decoded, _ = decode(m, x, torch.float32)
        torch.testing.assert_close(decoded, m(x), rtol=1e-5, atol=1e-5)


@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.integers(1, 5))
def test_int8_stores_each_token_and_head_within_half_a_step(seed, heads, tokens):
    """Symmetric per-token, per-head: scale = max |x| / 127 and |x - q * scale| <= scale / 2,
    the largest value stored exactly as +-127; update returns the stored values."""
    torch.manual_seed(seed)
    k = torch.randn(2, heads, tokens, 8) * torch.rand(2, heads, tokens, 1) * 10
    k[0, 0, 0] = 0.0  # an all-zero head: scale 0, stored as zeros
    cache = KVCache(2, 8, heads, 8, dtype=torch.int8)
    with torch.no_grad():
        keys, values, _ = cache.update(k, -k)
    scales = cache.key_scales[..., :tokens]  # (b, hkv, t)
    torch.testing.assert_close(scales, k.abs().amax(-1) / 127, rtol=0, atol=0)
    assert (keys - k).abs().le(scales.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-12).all()
    assert keys.dtype == torch.float32 and torch.equal(keys[0, 0, 0], torch.zeros(8))
    assert cache.keys[..., :tokens, :].abs().amax(-1)[scales > 0].eq(127).all()
    torch.testing.assert_close(values, -keys, rtol=0, atol=0)
    assert cache.nbytes == 2 * 2 * heads * 8 * 8 + 2 * 2 * heads * 8 * 4  # int8 + scales


def test_bfloat16_stores_the_rounded_values():
    torch.manual_seed(0)
    k = torch.randn(1, 2, 3, 4)
    cache = KVCache(1, 8, 2, 4, dtype=torch.bfloat16)
    keys, _, _ = cache.update(k, k)
    torch.testing.assert_close(keys, k.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert keys.dtype == torch.float32 and cache.keys.dtype == torch.bfloat16


def held_tokens(cache: KVCache) -> list[torch.Tensor]:
    """Copies of the keys, values and any scales of the tokens the cache holds."""
    held = cache.num_tokens
    scales = [s[..., :held].clone() for s in cache.scales]
    return [cache.keys[:, :, :held].clone(), cache.values[:, :, :held].clone(), *scales]


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("window", [None, 3])
def test_a_failure_after_the_native_write_is_rolled_back(dtype, window, monkeypatch):
    """A step that writes garbage into the slot (and scale) the token goes to, overwriting
    a held token in a rolling cache, then raises: the cache is left bit-identical, and the
    retry equals an undisturbed decode."""
    m = build(3, 4, 2, window=window)
    x = torch.randn(1, 8, 6)
    with torch.no_grad():
        want, _ = decode(m, x, dtype)
        cache = m.make_cache(1, dtype=dtype)
        for t in range(7):
            m(x[:, t : t + 1], cache=cache)
        state = held_tokens(cache), cache.position
        slot = torch.tensor([cache.native_slots(cache.position, window)[0]])
        # where the slot lives in each tensor: keys, values (laid out apart), then scales
        places = [cache._key_layout.columns(slot), cache._value_layout.columns(slot), slot, slot]

        def broken(*args, **kwargs):
            for t, place in zip(cache._tensors(), places, strict=False):
                t[..., place.flatten()] = 3
            raise RuntimeError("out of memory")

        with monkeypatch.context() as patch:
            patch.setattr(decode_cpu, "_call", broken)  # inside step's transaction
            patch.setattr(plan, "decode_lane", lambda *args: None)  # step's own face
            with pytest.raises(RuntimeError, match="out of memory"):
                m(x[:, 7:], cache=cache)
        assert cache.position == state[1]
        for got, kept in zip(held_tokens(cache), state[0], strict=True):
            assert torch.equal(got, kept)
        torch.testing.assert_close(m(x[:, 7:], cache=cache), want[:, 7:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_crop_and_reset_with_every_cache_dtype(dtype):
    m = build(4, 4, 2, rope=True)
    x, other = torch.randn(1, 10, 6), torch.randn(1, 10, 6)
    with torch.no_grad():
        want, _ = decode(m, x, dtype)
        cache = m.make_cache(1, dtype=dtype)
        for t in range(10):
            m(other[:, t : t + 1], cache=cache)
        cache.reset()
        for t in range(6):
            m(x[:, t : t + 1], cache=cache)
        m(other[:, :3], cache=cache)  # a rejected draft of three tokens
        cache.crop(6)
        got = torch.cat([m(x[:, t : t + 1], cache=cache) for t in range(6, 10)], dim=1)
    torch.testing.assert_close(got, want[:, 6:], rtol=1e-5, atol=1e-5)


def test_narrow_cache_refusals_leave_the_cache_as_it_was():
    m = build(6, 4, 2)
    with torch.no_grad():
        cache = m.make_cache(1, dtype=torch.int8)
        m(torch.randn(1, 3, 6), cache=cache)
    state = [t.clone() for t in cache._tensors()], cache.position
    with pytest.raises(ValueError, match="int8 cache stores rounded"):
        m(torch.randn(1, 1, 6), cache=cache)  # parameters require grad: autograd records
    with pytest.raises(ValueError, match="int8 cache stores rounded"):
        cache.update(torch.randn(1, 2, 1, 4, requires_grad=True), torch.randn(1, 2, 1, 4))
    with pytest.raises(TypeError, match=r"cache is torch\.int8"), torch.no_grad():
        cache.update(torch.ones(1, 2, 1, 4, dtype=torch.int8), torch.ones(1, 2, 1, 4))
    assert cache.position == state[1]
    for got, kept in zip(cache._tensors(), state[0], strict=True):
        assert torch.equal(got, kept)
    half = m.make_cache(1, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"cache is torch\.bfloat16 on cpu but x is torch\.float16"):
        m.half()(torch.randn(1, 1, 6, dtype=torch.float16), cache=half)  # not wider than bf16


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64, "int8"])
def test_a_cache_dtype_must_be_floating_point_or_int8(dtype):
    with pytest.raises(TypeError, match="dtype must be"):
        KVCache(1, 4, 1, 4, dtype=dtype)


def test_bfloat16_cache_under_autograd_equals_the_rounded_reference():
    """Under autograd a bfloat16 cache writes out of place and its gradients flow (through
    the rounding, as .to() has them): a backward through two chunks works."""
    m = build(7, 4, 2).train()
    x = torch.randn(1, 6, 6)
    cache = m.make_cache(1, dtype=torch.bfloat16)
    out = torch.cat([m(x[:, :4], cache=cache), m(x[:, 4:], cache=cache)], dim=1)
    out.square().sum().backward()
    assert m.qkv_proj.weight.grad is not None and m.qkv_proj.weight.grad.isfinite().all()
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=3e-2, atol=3e-2)


def test_quantize_rounds_half_to_even_and_clamps():
    x = torch.tensor([[[[127.0, 0.5, 1.5, -2.5]]]])  # scale 1: q = round(x)
    q, scales = quantize(x)
    assert scales.item() == 1.0
    assert q.tolist() == [[[[127, 0, 2, -2]]]]


def test_without_the_step_there_are_no_bfloat16_products(monkeypatch):
    """bfloat16_products answers False where the native step is unavailable (rather than
    reaching for a binding that was never loaded)."""
    monkeypatch.setattr(decode_cpu, "available", lambda: False)
    assert decode_cpu.bfloat16_products() is False


def _other_builds() -> list[str]:
    """The ATTNLAB_VECTORS values that build another decode step on this CPU than its own:
    avx2 on an AVX-512 CPU, avx512 (without bfloat16 products) on one with them."""
    if not NATIVE:
        return []
    others = ["avx2"] if _build.vector_flags(wide=True) != _build.vector_flags() else []
    return others + (["avx512"] if products.PRODUCTS else [])


@pytest.mark.skipif(not _other_builds(), reason="this CPU builds one decode step only")
@pytest.mark.parametrize("vectors", _other_builds() or ["none"])
def test_the_other_builds_pass_the_native_tests_too(vectors):
    """On an AVX-512 CPU the step is built with 16-float vectors and 12 query heads summed in
    registers, with AVX512_BF16 bfloat16 products for the narrower caches; the AVX2 build (8
    floats, 6 heads), which AVX2-only CPUs get, and the AVX-512 build without the products,
    which AVX-512 CPUs without AVX512_BF16 get, are built and run through the native tests
    here as well (ATTNLAB_VECTORS=avx2, avx512)."""
    tests = "model_sized or equals_the_python_path or attends_to_the_tokens or strided or latent"
    tests += " or linear_rows"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
        env={**os.environ, _build.VECTORS_VARIABLE: vectors},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout


def _backends_agree(run):
    """run(backend) -> what happened; the native step ("auto") must do as the Python path."""
    return run("auto"), run("math")


def test_an_int8_cache_is_refused_when_any_parameter_records_gradients():
    """forward refuses an int8 cache under autograd when any parameter of the module requires
    grad, not only the projections'."""

    def run(backend):
        torch.manual_seed(1)
        m = MultiHeadAttention(8, 16, 64, 0.0, 4, num_kv_heads=2, backend=backend).eval()
        m.register_parameter("gate", torch.nn.Parameter(torch.ones(1)))
        for p in (*m.qkv_proj.parameters(), *m.out_proj.parameters()):
            p.requires_grad_(False)
        cache = m.make_cache(1, dtype=torch.int8)
        with pytest.raises(ValueError, match="int8 cache stores rounded"):
            m(torch.randn(1, 1, 8), cache=cache)
        return cache.position

    assert _backends_agree(run) == (0, 0)


def test_a_method_replaced_on_the_instance_decodes_through_it():
    torch.manual_seed(2)
    m = MultiHeadAttention(6, 16, 24, 0.0, 4, num_kv_heads=2).eval()
    plain = m._project

    def shifted(x, context):
        q, k, v = plain(x, context)
        return q + 0.5, k, v

    m._project = shifted
    _decodes_through_its_own_steps(m, torch.randn(1, 7, 6))


def test_buffers_autograd_saved_are_never_written_behind_its_back():
    """A step recorded by autograd through a rolling cache saves views of its buffers; a later
    step under no_grad overwrites a held slot. Neither path writes the saved buffers in place
    (the native step is not taken; the Python path writes out of place), so the backward of
    the recorded step gives the gradient it gives without the later step."""

    def run(backend, later_step):
        torch.manual_seed(0)
        m = MultiHeadAttention(8, 16, 64, 0.0, 4, num_kv_heads=2, window=4, backend=backend)
        m.eval()
        cache = m.make_cache(1)
        x = torch.randn(1, 8, 8)
        with torch.no_grad():
            m(x[:, :5], cache=cache)
        y = m(x[:, 5:6], cache=cache)  # autograd saves the buffers
        if later_step:
            with torch.no_grad():
                assert not _native(m, x[:, 6:7], cache)
                m(x[:, 6:7], cache=cache)  # overwrites a slot y's graph saved
        (grad,) = torch.autograd.grad(y.sum(), m.qkv_proj.weight)
        return grad

    for backend in ("auto", "math"):
        torch.testing.assert_close(run(backend, True), run(backend, False))


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_native_step_bumps_the_version_of_every_buffer_it_writes(dtype):
    """The module calls the op's direct binding (decode_cpu._op), not torch.ops, which bumps
    the version counter of each Tensor(a!) argument: the binding must too, so that autograd
    still refuses a graph whose saved buffers were overwritten."""
    m = build(0, 4, 2)
    x = torch.randn(1, 5, 6)
    with torch.no_grad():
        cache = m.make_cache(1, dtype=dtype)
        m(x[:, :4], cache=cache)
        written = [t for t in cache._tensors() if t.numel()]
        before = [t._version for t in written]
        assert _native(m, x[:, 4:], cache)
        m(x[:, 4:], cache=cache)
    assert all(t._version > v for t, v in zip(written, before, strict=True))


def test_a_cache_filled_in_inference_mode_is_not_written_outside_it():
    def run(backend):
        torch.manual_seed(0)
        m = MultiHeadAttention(8, 16, 64, 0.0, 4, num_kv_heads=2, backend=backend).eval()
        with torch.inference_mode():
            cache = m.make_cache(1)
            m(torch.randn(1, 3, 8), cache=cache)
        with torch.no_grad(), pytest.raises(ValueError, match=r"made under torch\.inference_mode"):
            m(torch.randn(1, 1, 8), cache=cache)
        return cache.position

    assert _backends_agree(run) == (3, 3)


def test_append_past_a_full_cache_raises_instead_of_wrapping():
    cache = KVCache(1, 4, 1, 2, block_tokens=2)
    cache.append(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    with pytest.raises(ValueError, match="cannot take 3 more"):
        cache.append(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    assert cache.position == 3


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_a_jit_trace_never_takes_the_native_step():
    """A trace would bake the native call's slots into its graph as constants."""
    m = build(3, 4, 2)
    x = torch.randn(1, 1, 6)
    cache = m.make_cache(1)
    seen = []

    def probe(x):
        seen.append(_native(m, x, cache))
        return x * 2

    with torch.no_grad():
        seen.append(_native(m, x, cache))
        torch.jit.trace(probe, x, check_trace=False)
    assert seen == [NATIVE, False]


# (num_heads, num_kv_heads): multi-head, grouped-query (3 and 2 query heads per key/value
# head), multi-query (12 and 4)
NAMED_LAYOUTS = [(12, 12), (12, 4), (4, 2), (12, 1), (4, 1)]


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), NAMED_LAYOUTS)
@pytest.mark.parametrize("window", [None, 37])
@settings(max_examples=2, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.integers(1, 4), st.booleans())
def test_native_decoding_of_every_named_layout_equals_the_full_forward(
    dtype, num_heads, num_kv_heads, window, seed, b, prompt, rope
):
    """90 tokens decoded one by one through the native step (every count of keys from the
    prompt's to 90, or a rolling cache of 37 that wraps): each key count meets the grouped
    kernel's full tiles of keys (up to 64), its one-vector steps and its last keys one by
    one, for every query group size of the named layouts."""
    torch.manual_seed(seed)
    m = MultiHeadAttention(
        6,
        num_heads * 8,
        90,
        0.0,
        num_heads,
        qkv_bias=True,
        num_kv_heads=num_kv_heads,
        rope=rope,
        window=window,
    ).eval()
    x = torch.randn(b, 90, 6)
    with torch.no_grad():
        full = m(x)
        assert _native(m, x[:, :1], m.make_cache(b, dtype=dtype))
        decoded, cache = decode(m, x, dtype, prompt)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(decoded, full, rtol=tolerance, atol=tolerance)
    assert cache.position == 90 and cache.rolling == (window is not None)


@st.composite
def latent_steps(draw):
    """Shapes of a latent step: up to 600 rows held (several chunks per sequence), any
    widths, with or without a latent norm and rotary tables."""
    b, h = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    dn, dv, r = (draw(st.integers(lo, hi)) for lo, hi in [(0, 5), (1, 5), (1, 40)])
    rotary = draw(st.booleans())
    dr = 2 * draw(st.integers(1, 3)) if rotary else draw(st.integers(0, 5))
    position = draw(st.integers(0, 600))
    return dict(seed=draw(st.integers(0, 2**31 - 1)), b=b, h=h, dn=dn, dr=dr, dv=dv, r=r,
                position=position, capacity=position + 1 + draw(st.integers(0, 5)),
                rotary=rotary, norm=draw(st.booleans()), offset=draw(st.sampled_from([0.0, 1.0])),
                scale=draw(st.floats(0.05, 2.0)))  # fmt: skip


def _rotated(x, cos, sin):
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (the rotate-half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def latent_reference(query, compressed, tables, position, rows, w, scale):
    """Multi-head latent attention's absorbed step in float64 from its definition: the
    token's row (the latent times rsqrt(mean square + eps) times (offset + weight), the
    rotary key rotated) at `position`; each head's rotated query, its first dn features
    folded through its dn key rows of w; softmax over rows [0, position], their latents
    weighted, then the head's dv value rows. Returns (output, the rows as written). No
    attnlab code."""
    norm, eps, offset, cos, sin = tables
    _, h, _ = query.shape
    r = w.shape[1]
    dn = query.shape[-1] - (rows.shape[-1] - r)
    row = compressed.double()
    latent, k_rope = row[:, :r], row[:, r:]
    if norm.numel():
        latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps)
        latent = latent * (offset + norm.double())
    q_nope, q_rope = query.double()[..., :dn], query.double()[..., dn:]
    if cos.numel():
        c, s = cos[position].double(), sin[position].double()
        k_rope, q_rope = _rotated(k_rope, c, s), _rotated(q_rope, c, s)
    held = rows.double().clone()
    held[:, position] = torch.cat([latent, k_rope], -1)
    w = w.double().view(h, -1, r)  # (h, dn + dv, r)
    keys = held[:, : position + 1]  # (b, count, r + dr)
    q = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope, w[:, :dn]), q_rope], -1)
    weights = torch.softmax(torch.einsum("bhc,btc->bht", q, keys) * scale, dim=-1)
    latents = torch.einsum("bht,btr->bhr", weights, keys[..., :r])  # (b, h, r)
    return torch.einsum("bhr,hvr->bhv", latents, w[:, dn:]), held  # (b, h, dv)


def latent_inputs(c):
    torch.manual_seed(c["seed"])
    b, h, dr, r = c["b"], c["h"], c["dr"], c["r"]
    query, compressed = torch.randn(b, h, c["dn"] + dr), torch.randn(b, r + dr) * 3
    empty = decode_cpu.EMPTY
    norm = torch.randn(r) if c["norm"] else empty
    angles = torch.rand(c["capacity"], dr // 2 if c["rotary"] else 0) * 6.0
    cos, sin = (
        (angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)) if c["rotary"] else (empty, empty)
    )
    tables = decode_cpu.LatentTables(norm, 1e-6, c["offset"], cos, sin)
    rows = torch.randn(b, c["capacity"], r + dr)
    w = torch.randn(h * (c["dn"] + c["dv"]), r) / r**0.5
    return query, compressed, tables, c["position"], rows, w, c["scale"]


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@settings(max_examples=40, deadline=None)
@given(latent_steps())
def test_the_latent_step_writes_the_row_and_equals_float64_attention_over_the_rows(c):
    query, compressed, tables, position, rows, w, scale = latent_inputs(c)
    expected, held = latent_reference(query, compressed, tables, position, rows, w, scale)
    got = decode_cpu.latent_step(query, compressed, tables, position, rows, w, scale)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rows.double(), held, rtol=1e-5, atol=1e-5)  # that row only


def _latent_refusals():
    empty = decode_cpu.EMPTY
    query, compressed, rows, w = (
        torch.randn(1, 2, 7),
        torch.randn(1, 12),
        torch.randn(1, 9, 12),
        torch.randn(2 * 5, 8),
    )
    cos = torch.randn(9, 4)
    good = dict(query=query, compressed=compressed, norm=torch.randn(8), eps=1e-6, offset=0.0,
                cos=cos, sin=cos.clone(), position=8, rows=rows, weight=w, scale=0.5)  # fmt: skip
    bad = {
        "query float64": (dict(query=query.double()), "query must be float32"),
        "query 2-D": (dict(query=query[0]), "query must be .b 1, heads >= 1"),
        "query narrower than dr": (dict(query=torch.randn(1, 2, 3)), "query must be"),
        "compressed width": (dict(compressed=torch.randn(1, 11)), "compressed must be"),
        "rows strided": (
            dict(rows=torch.randn(1, 12, 9).transpose(1, 2)),
            "rows must be contiguous",
        ),
        "rows 2-D": (dict(rows=rows[0]), "rows must be"),
        "w rows": (dict(weight=torch.randn(7, 8)), "w's rows .7. must be heads"),
        "w wider than rows": (dict(weight=torch.randn(10, 13)), "w must be"),
        "w no values": (dict(weight=torch.randn(6, 8)), "w's rows .6. must be"),
        "position past": (dict(position=9), "position .9. must be in"),
        "position negative": (dict(position=-1), "position .-1. must be in"),
        "scale 0": (dict(scale=0.0), "scale"),
        "scale nan": (dict(scale=float("nan")), "scale"),
        "scale past float32": (dict(scale=1e39), "scale"),
        "norm width": (dict(norm=torch.randn(7)), "norm must be of shape"),
        "norm eps 0": (dict(eps=0.0), "norm_eps"),
        "norm offset inf": (dict(offset=float("inf")), "norm_offset"),
        "cos short": (
            dict(cos=torch.randn(8, 4), sin=torch.randn(8, 4)),
            "cos must be .rows > position",
        ),
        "sin shape": (dict(sin=torch.randn(9, 2)), "sin must be of shape"),
        "odd dr with tables": (
            dict(
                query=torch.randn(1, 2, 6),
                compressed=torch.randn(1, 11),
                rows=torch.randn(1, 9, 11),
                cos=torch.randn(9, 3),
                sin=torch.randn(9, 3),
            ),
            "rotary positions rotate pairs of features: dr .3. must be even",
        ),
        "meta rows": (dict(rows=rows.to("meta")), "rows is on meta"),
        "negated view": (dict(weight=torch._neg_view(w)), "w is a lazily negated"),
        "rows overlap query": (
            dict(query=rows.view(-1)[:14].view(1, 2, 7)),
            "rows and query overlap",
        ),
    }
    del empty
    return [(name, {**good, **change}, match) for name, (change, match) in bad.items()]


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@pytest.mark.parametrize(
    ("name", "kwargs", "match"), _latent_refusals(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_the_latent_step_refuses_what_it_cannot_read_by_name_and_writes_nothing(
    name, kwargs, match
):
    rows = kwargs["rows"]
    before = rows.clone() if rows.device.type == "cpu" and rows.is_contiguous() else None
    tables = decode_cpu.LatentTables(
        *(kwargs.pop(k) for k in ("norm", "eps", "offset", "cos", "sin"))
    )
    with pytest.raises(RuntimeError, match=f"latent_step: {match}"):
        decode_cpu.latent_step(tables=tables, **kwargs)
    if before is not None:
        assert torch.equal(rows, before)


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
def test_a_latent_step_past_float32_is_none():
    c = dict(seed=1, b=1, h=2, dn=3, dr=2, dv=2, r=4, position=4, capacity=5, rotary=False,
             norm=False, offset=0.0, scale=1.0)  # fmt: skip
    query, compressed, tables, position, rows, w, scale = latent_inputs(c)
    assert (
        decode_cpu.latent_step(query * 1e30, compressed, tables, position, rows, w * 1e10, scale)
        is None
    )


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 40), in_features=st.integers(1, 300),
    out_features=st.integers(1, 70), bias=st.booleans(),
)  # fmt: skip
def test_linear_rows_equals_float64_linear(seed, rows, in_features, out_features, bias):
    torch.manual_seed(seed)
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    got = decode_cpu.linear_rows(x, w, b)
    expected = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@pytest.mark.parametrize(
    ("x", "w", "bias", "match"),
    [
        (torch.randn(2, 3, dtype=torch.float64), torch.randn(4, 3), None, "x must be float32"),
        (torch.randn(3, 2).t(), torch.randn(4, 3), None, "x must be contiguous"),
        (torch.randn(1, 2, 3), torch.randn(4, 3), None, "x must be .rows, in."),
        (torch.randn(2, 3), torch.randn(4), None, "w must be .out, in."),
        (torch.randn(2, 3), torch.randn(4, 5), None, "x's last dimension .3. must be w's in .5."),
        (torch.randn(2, 3), torch.randn(4, 3), torch.randn(3), "bias must be of shape"),
        (torch.randn(2, 3), torch.randn(4, 3), torch.randn(4).to("meta"), "bias is on meta"),
        (torch.randn(2, 3), torch.randn(0, 3), None, "w must be .out, in. with out >= 1"),
    ],
)
def test_linear_rows_refuses_what_it_cannot_read_by_name(x, w, bias, match):
    with pytest.raises(RuntimeError, match=f"linear_rows: {match}"):
        decode_cpu.linear_rows(x, w, bias)
