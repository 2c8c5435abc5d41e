"""MultiHeadLatentAttention: equal to a float64 recomputation from its documented layout
(tests.definitions' attention and rotary), to the book's bonus-chapter MLA rewritten here,
by both paths (expanded keys and values, or attention absorbed into the latent space); a
cached decode in any chunks equal to the full forward; the absorbed path the default
exactly where it does fewer multiply-adds; checks at the door that leave the cache as it
was; no value read off the CPU (meta tensors); the native CPU step (decode_cpu.latent_step)
taken exactly where it applies, equal to the reference and to the Python path."""

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnlab import debug, decode_cpu, functional, plan
from attnlab.latent_cache import LatentCache
from attnlab.mla import MultiHeadLatentAttention, mscale_factor
from tests.definitions import reference, rope_reference

seeds = st.integers(0, 2**31 - 1)


def mla_reference(m, x, allowed=None):
    """`m` recomputed in float64 from its documented parameter layout: queries (q_proj, or
    q_a_proj -> RMSNorm -> q_b_proj) as heads of [nope, rope]; kv_a_proj_with_mqa's
    [latent, rotary key], the latent RMS-normalised and expanded by kv_b_proj into each
    head's [key nope, value]; only the rope features rotated (at positions 0 .. t - 1), one
    rotary key for every head; softmax at 1 / sqrt(dn + dr); o_proj. No attnlab code."""

    def linear(t, layer):
        bias = None if layer.bias is None else layer.bias.double()
        return F.linear(t, layer.weight.double(), bias)

    def rms(t, norm):
        if norm is None:
            return t
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()

    x = x.double()
    b, t, _ = x.shape
    h, r = m.num_heads, m.kv_lora_rank
    dn, dr, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    if m.q_lora_rank is None:
        q = linear(x, m.q_proj)
    else:
        q = linear(rms(linear(x, m.q_a_proj), m.q_a_layernorm), m.q_b_proj)
    q = q.view(b, t, h, dn + dr).transpose(1, 2)  # (b, h, t, dn + dr)
    compressed = linear(x, m.kv_a_proj_with_mqa)  # (b, t, r + dr)
    latent, k_rope = rms(compressed[..., :r], m.kv_a_layernorm), compressed[..., r:]
    kv = F.linear(latent, m.kv_b_proj.weight.double()).view(b, t, h, dn + dv).transpose(1, 2)
    q_rope, k_rope = q[..., dn:], k_rope[:, None]  # (b, h, t, dr), (b, 1, t, dr)
    if dr:
        positions = torch.arange(t)
        q_rope = rope_reference(q_rope, positions, m.rope_base)
        k_rope = rope_reference(k_rope, positions, m.rope_base)
    queries = torch.cat([q[..., :dn], q_rope], -1)
    keys = torch.cat([kv[..., :dn], k_rope.expand(b, h, t, dr)], -1)  # (b, h, t, dn + dr)
    out = reference(queries, keys, kv[..., dn:], allowed, scale=(dn + dr) ** -0.5)
    return linear(out.transpose(1, 2).reshape(b, t, h * dv), m.o_proj)  # (b, t, d_model)


@st.composite
def mla_configs(draw):
    dn = draw(st.integers(0, 3))
    return dict(
        seed=draw(seeds),
        b=draw(st.integers(1, 2)),
        tokens=draw(st.integers(1, 9)),
        chunks=draw(st.lists(st.integers(1, 4), min_size=1, max_size=9)),
        d_model=draw(st.integers(1, 8)),
        num_heads=draw(st.integers(1, 3)),
        q_lora_rank=draw(st.one_of(st.none(), st.integers(1, 6))),
        kv_lora_rank=draw(st.integers(1, 6)),
        qk_nope_head_dim=dn,
        qk_rope_head_dim=draw(st.sampled_from([2, 4] if dn == 0 else [0, 2, 4])),
        v_head_dim=draw(st.integers(1, 4)),
        down_bias=draw(st.booleans()),
        out_bias=draw(st.booleans()),
        latent_norm=draw(st.booleans()),
        pad=draw(st.booleans()),
        absorb=draw(st.sampled_from([None, True, False])),
    )


ARGUMENTS = ("d_model", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim")
ARGUMENTS += ("qk_rope_head_dim", "v_head_dim")
OPTIONS = ("down_bias", "out_bias", "latent_norm")


def build(c):
    torch.manual_seed(c["seed"])
    m = MultiHeadLatentAttention(
        *(c[name] for name in ARGUMENTS), 16, **{name: c[name] for name in OPTIONS}
    )
    _randomise(m)
    x = torch.randn(c["b"], c["tokens"], c["d_model"])
    keep = torch.ones(c["b"], c["tokens"], dtype=torch.bool)
    if c["pad"]:  # left padding, as batched generation has it
        lengths = torch.randint(0, c["tokens"] + 1, (c["b"],))
        keep = torch.arange(c["tokens"]) >= (c["tokens"] - lengths)[:, None]  # (b, t)
    return m, x, keep[:, None, None, :]  # (b, 1, 1, t)


def _randomise(m):
    """Random biases and norm weights too (fresh ones are 0 and 1: a swapped or skipped one
    would go unseen)."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p))


def decode(m, x, mask, chunks, absorb=None):
    """x through a fresh cache in chunks of the given sizes (the last one repeated)."""
    cache = m.make_cache(x.shape[0])
    outputs, start, i = [], 0, 0
    while start < x.shape[1]:
        end = min(start + chunks[min(i, len(chunks) - 1)], x.shape[1])
        step_mask = None if mask is None else mask[..., :end]  # keys: every position so far
        outputs.append(m(x[:, start:end], mask=step_mask, cache=cache, absorb=absorb))
        start, i = end, i + 1
    assert cache.position == x.shape[1]
    return torch.cat(outputs, dim=1)  # (b, t, d_model)


@given(mla_configs())
def test_both_paths_equal_the_float64_reference(c):
    m, x, keep = build(c)
    allowed = keep & torch.ones(c["tokens"], c["tokens"], dtype=torch.bool).tril()
    expected = mla_reference(m, x, allowed)
    with torch.no_grad():
        for absorb in (False, True):
            got = m(x, mask=keep, absorb=absorb)
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)


@given(mla_configs())
def test_cached_decoding_in_any_chunks_equals_the_full_forward(c):
    m, x, keep = build(c)
    with torch.no_grad():
        full = m(x, mask=keep)
        got = decode(m, x, keep, c["chunks"], c["absorb"])
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(decode(m, x, keep, [1], c["absorb"]), full, rtol=1e-5, atol=1e-5)


def test_the_weights_of_both_paths_are_the_reference_softmax():
    torch.manual_seed(1)
    m = MultiHeadLatentAttention(16, 2, 8, 6, 4, 2, 3, 16)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        out, weights = m(x, need_weights=True, absorb=False)
        out_absorbed, absorbed = m(x, need_weights=True, absorb=True)
    assert weights.shape == (2, 2, 5, 5)
    torch.testing.assert_close(absorbed, weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_absorbed, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 5), rtol=1e-6, atol=1e-6)
    assert weights.triu(1).eq(0).all()


def test_gradients_of_both_paths_and_through_the_cache_equal_the_full_forward():
    torch.manual_seed(2)
    m = MultiHeadLatentAttention(12, 3, None, 5, 2, 4, 3, 16, latent_norm=True)
    x = torch.randn(2, 7, 12)
    grads = []
    for run in ("full", "absorbed", "cached"):
        xx = x.clone().requires_grad_()
        m.zero_grad()
        if run == "cached":
            out = decode(m, xx, None, [3, 1, 2], absorb=True)
        else:
            out = m(xx, absorb=run == "absorbed")
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append((xx.grad, m.kv_b_proj.weight.grad.clone(), m.q_proj.weight.grad.clone()))
    for other in grads[1:]:
        for got, want in zip(other, grads[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- the book's bonus-chapter MLA ---------------------------------------------------------


class BookLatentAttention(nn.Module):
    """Multi-head latent attention as the book's bonus material writes it (LLMs-from-scratch
    ch04/05_mla, rewritten): per-head queries from W_query, a latent from W_DKV that the
    cache keeps, keys and values up-projected from the latent by W_UK and W_UV, a causal
    mask over absolute positions, scores / sqrt(head_dim), out_proj; no rotary positions
    and no norms."""

    def __init__(self, d_in, d_out, dropout, num_heads, qkv_bias=False, latent_dim=None):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.latent_dim = latent_dim if latent_dim is not None else max(16, d_out // 8)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_DKV = nn.Linear(d_in, self.latent_dim, bias=qkv_bias)  # down to the latent
        self.W_UK = nn.Linear(self.latent_dim, d_out, bias=qkv_bias)  # latent -> keys
        self.W_UV = nn.Linear(self.latent_dim, d_out, bias=qkv_bias)  # latent -> values
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("cache_c_kv", None, persistent=False)
        self.ptr_current_pos = 0

    def reset_cache(self):
        self.cache_c_kv, self.ptr_current_pos = None, 0

    def _heads(self, t):
        b, n, _ = t.shape  # (b, n, d_out) -> (b, heads, n, head_dim)
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, use_cache=False):
        b, n, _ = x.shape
        latent = self.W_DKV(x)  # (b, n, latent_dim)
        if use_cache:
            if self.cache_c_kv is not None:
                latent = torch.cat([self.cache_c_kv, latent], dim=1)
            self.cache_c_kv = latent
        queries = self._heads(self.W_query(x))
        keys, values = self._heads(self.W_UK(latent)), self._heads(self.W_UV(latent))
        scores = queries @ keys.transpose(-2, -1)
        first = self.ptr_current_pos if use_cache else 0
        self.ptr_current_pos = first + n if use_cache else 0
        query_positions = torch.arange(first, first + n)
        key_positions = torch.arange(keys.shape[2])
        future = query_positions[:, None] < key_positions[None, :]
        scores = scores.masked_fill(future, -torch.inf)
        weights = self.dropout(torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1))
        context = (weights @ values).transpose(1, 2).reshape(b, n, self.d_out)
        return self.out_proj(context)


def from_book(book, context_length):
    """attnlab's MLA with the book layer's weights: no rotary dims, no latent norms, an
    output bias; kv_b_proj's rows head by head [W_UK's rows, W_UV's rows]."""
    h, hd, r = book.num_heads, book.head_dim, book.latent_dim
    d_in = book.W_query.in_features
    m = MultiHeadLatentAttention(
        d_in, h, None, r, hd, 0, hd, context_length, out_bias=True, latent_norm=False
    )
    with torch.no_grad():
        m.q_proj.weight.copy_(book.W_query.weight)
        m.kv_a_proj_with_mqa.weight.copy_(book.W_DKV.weight)
        up = torch.cat([book.W_UK.weight.view(h, hd, r), book.W_UV.weight.view(h, hd, r)], 1)
        m.kv_b_proj.weight.copy_(up.reshape(h * 2 * hd, r))  # (h (hd + hd), r)
        m.o_proj.load_state_dict(book.out_proj.state_dict())
    return m


@pytest.mark.parametrize("latent_dim", [None, 4])
def test_equal_to_the_books_mla_full_and_cached(latent_dim):
    torch.manual_seed(3)
    book = BookLatentAttention(24, 24, 0.0, 4, latent_dim=latent_dim).eval()
    m = from_book(book, 32)
    x = torch.randn(2, 11, 24)
    with torch.no_grad():
        expected = book(x)
        for absorb in (False, True):
            torch.testing.assert_close(m(x, absorb=absorb), expected, rtol=1e-5, atol=1e-6)
        book.reset_cache()
        chunks = [book(x[:, s:e], use_cache=True) for s, e in ((0, 4), (4, 5), (5, 11))]
        torch.testing.assert_close(torch.cat(chunks, 1), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(decode(m, x, None, [4, 1, 6]), expected, rtol=1e-5, atol=1e-6)
    assert book.cache_c_kv.shape == (2, 11, book.latent_dim)  # the book's cache: the latent
    assert m.cache_values_per_token == book.latent_dim  # ours: the same, no rotary key


# --- the absorbed path: where it is the default ----------------------------------------


def _count_macs(m, tq, tk):
    """Multiply-adds per head of each path, counted from the shapes the paths multiply."""
    r, dn, dr, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    expanded = tk * r * (dn + dv) + tq * tk * (dn + dr) + tq * tk * dv
    absorbed = tq * dn * r + tq * tk * (r + dr) + tq * tk * r + tq * r * dv
    return absorbed, expanded


CELLS = [(1, 1), (1, 2), (1, 4096), (64, 256), (128, 256), (128, 512), (128, 4096)]
CELLS += [(170, 10**6), (171, 10**6), (256, 4096), (300, 300), (4, 4)]  # (128, 512): a tie


@pytest.mark.parametrize(("tq", "tk"), CELLS)
def test_absorbed_by_default_exactly_where_it_does_fewer_multiply_adds(tq, tk):
    m = MultiHeadLatentAttention(64, 2, None, 512, 128, 64, 128, 8, device="meta")
    absorbed, expanded = _count_macs(m, tq, tk)
    assert m.absorbs(tq, tk) == (absorbed < expanded)


def test_deepseek_v3_heads_cross_over_at_170_queries():
    m = MultiHeadLatentAttention(64, 2, None, 512, 128, 64, 128, 8, device="meta")
    assert m.absorbs(170, 10**6) and not m.absorbs(171, 10**6)
    assert m.absorbs(1, 2) and not m.absorbs(8, 8)  # decode; a forward without a cache


def _keys_per_call(monkeypatch):
    """The key heads functional.attend gets on each call: 1 absorbed, num_heads expanded;
    "native" for a call decode_cpu.latent_step computes (absorbed, in C++), or the lane
    (plan.latent_lane: the whole step in C++)."""
    heads = []
    original, native, lane = functional.attend, decode_cpu.latent_step, plan.latent_lane

    def spy(q, k, v, **kwargs):
        heads.append(k.shape[1])
        return original(q, k, v, **kwargs)

    def native_spy(*args):
        heads.append("native")
        return native(*args)

    def lane_spy(*args):
        out = lane(*args)
        if out is not None:
            heads.append("native")
        return out

    monkeypatch.setattr(functional, "attend", spy)
    monkeypatch.setattr(decode_cpu, "latent_step", native_spy)
    monkeypatch.setattr(plan, "latent_lane", lane_spy)
    return heads


def test_a_decode_step_absorbs_and_a_full_forward_expands_by_default(monkeypatch):
    torch.manual_seed(4)
    m = MultiHeadLatentAttention(16, 4, None, 32, 8, 4, 8, 64)
    heads = _keys_per_call(monkeypatch)
    cache = m.make_cache(1)
    with torch.no_grad():
        m(torch.randn(1, 20, 16), cache=cache)
        m(torch.randn(1, 1, 16), cache=cache)
        m(torch.randn(1, 20, 16))
    assert heads == [4, "native" if decode_cpu.available() else 1, 4]


NATIVE = decode_cpu.available()


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@settings(max_examples=30, deadline=None)
@given(mla_configs(), st.integers(0, 4))
def test_a_native_decode_equals_the_float64_reference_and_the_python_path(c, prompt):
    """A prompt, then one token per call, absorbed: the one-token calls go to
    decode_cpu.latent_step and equal the float64 reference and the same decode with the
    extension taken away (the Python absorbed path)."""
    m, x, _ = build(c)
    prompt = min(prompt, c["tokens"] - 1)
    expected = mla_reference(m, x, torch.ones(c["tokens"], c["tokens"]).tril().bool())
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        steps = _keys_per_call(patch)
        native = decode(m, x, None, [prompt or 1, 1], absorb=True)
        one_token_calls = c["tokens"] - (prompt if prompt > 1 else 0)
        assert steps.count("native") == one_token_calls
        patch.setattr(decode_cpu, "loaded", lambda: False)
        python = decode(m, x, None, [prompt or 1, 1], absorb=True)
        assert steps.count("native") == one_token_calls  # none more
    torch.testing.assert_close(native.double(), expected, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(native, python, rtol=1e-5, atol=1e-5)


class _Counting(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _native_cases():
    """Calls a native step must not compute (each with what makes it so), and one it must."""

    def grad(m, x, cache):
        m.requires_grad_(True)
        return m(x, cache=cache)

    def function_mode(m, x, cache):
        with _Counting():
            return m(x, cache=cache)

    def autocast(m, x, cache):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x, cache=cache)

    def forward_ad(m, x, cache):
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(x, torch.randn_like(x))
            out = m(dual, cache=cache)
            assert torch.autograd.forward_ad.unpack_dual(out).tangent is not None
            return torch.autograd.forward_ad.unpack_dual(out).primal

    def mask(m, x, cache):
        return m(x, cache=cache, mask=torch.ones(1, 6, dtype=torch.bool))

    def subclass(m, x, cache):
        class Traced(MultiHeadLatentAttention):
            def _attend_absorbed(self, *args):
                return super()._attend_absorbed(*args)

        m.__class__ = Traced  # the same module, its absorbed step overridden
        return m(x, cache=cache)

    def instance_step(m, x, cache):
        m._attend_absorbed = functools.partial(MultiHeadLatentAttention._attend_absorbed, m)
        return m(x, cache=cache)

    def hooked(name):
        def call(m, x, cache):
            getattr(m, name).register_forward_hook(lambda module, args, out: out * 1.0)
            return m(x, cache=cache)

        return call

    def global_hook(m, x, cache):
        hook = nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
        try:
            return m(x, cache=cache)
        finally:
            hook.remove()

    plain = (lambda m, x, cache: m(x, cache=cache), None, 2e-5)
    return {  # call, cache dtype, tolerance against float64; taken or not
        "no gradient, float32": (*plain, True),
        "gradients recorded": (grad, None, 2e-5, False),
        "need_weights": (
            lambda m, x, cache: m(x, cache=cache, need_weights=True)[0],
            None,
            2e-5,
            False,
        ),
        "a mask": (mask, None, 2e-5, False),
        "a bfloat16 cache": (plain[0], torch.bfloat16, 2e-2, False),
        "a function mode": (function_mode, None, 2e-5, False),
        "absorb=False": (lambda m, x, cache: m(x, cache=cache, absorb=False), None, 2e-5, False),
        "autocast": (autocast, None, 5e-2, False),
        "a forward-mode tangent": (forward_ad, None, 2e-5, False),
        "a subclass's absorbed step": (subclass, None, 2e-5, False),
        "a hooked latent norm": (hooked("kv_a_layernorm"), None, 2e-5, False),
        "a hooked rope": (hooked("rope"), None, 2e-5, False),
        "a global module hook": (global_hook, None, 2e-5, False),
        "the instance's own absorbed step": (instance_step, None, 2e-5, False),
    }


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
@pytest.mark.parametrize("case", _native_cases().values(), ids=_native_cases().keys())
def test_the_native_step_is_taken_only_where_it_applies(case, monkeypatch):
    call, cache_dtype, tolerance, native = case
    torch.manual_seed(9)
    m = MultiHeadLatentAttention(16, 4, None, 32, 8, 4, 8, 64).eval().requires_grad_(False)
    steps = _keys_per_call(monkeypatch)
    cache = m.make_cache(1, dtype=cache_dtype)
    x = torch.randn(1, 6, 16)
    m(x[:, :5], cache=cache)
    steps.clear()
    out = call(m, x[:, 5:], cache)
    assert ("native" in steps) is native
    expected = mla_reference(m, x, torch.ones(6, 6).tril().bool())[:, 5:]
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_a_hooked_kv_b_proj_is_called_not_read(monkeypatch):
    torch.manual_seed(5)
    m = MultiHeadLatentAttention(16, 4, None, 32, 8, 4, 8, 64)
    calls = []
    m.kv_b_proj.register_forward_hook(lambda *args: calls.append(1))
    heads = _keys_per_call(monkeypatch)
    cache = m.make_cache(1, 8)
    with torch.no_grad():
        m(torch.randn(1, 3, 16), cache=cache)
        m(torch.randn(1, 1, 16), cache=cache)
        with pytest.raises(ValueError, match="absorb=True reads kv_b_proj's weight directly"):
            m(torch.randn(1, 1, 16), cache=cache, absorb=True)
    assert heads == [4, 4] and len(calls) == 2 and cache.position == 4


# --- masks, rows with no key, dropout, config --------------------------------------------


def test_a_query_with_no_key_gets_zeros_and_finite_gradients():
    torch.manual_seed(6)
    m = MultiHeadLatentAttention(8, 2, 4, 6, 2, 2, 3, 16, out_bias=False)
    x = torch.randn(1, 4, 8, requires_grad=True)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[2] = False
    for absorb in (False, True):
        out = m(x, mask=mask, absorb=absorb)
        assert out[0, 2].eq(0).all() and out.isfinite().all()
        out.sum().backward()
        assert x.grad.isfinite().all()


def test_an_additive_mask_over_every_position_so_far_with_a_cache():
    torch.manual_seed(7)
    m = MultiHeadLatentAttention(8, 2, None, 6, 2, 2, 3, 16)
    x = torch.randn(2, 7, 8)
    bias = torch.randn(2, 1, 7, 7)
    with torch.no_grad():
        full = m(x, mask=bias)
        cache = m.make_cache(2)
        parts = [m(x[:, s:e], mask=bias[:, :, s:e, :e], cache=cache) for s, e in ((0, 3), (3, 7))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-6)


def test_dropout_applies_in_training_only():
    torch.manual_seed(8)
    m = MultiHeadLatentAttention(8, 2, None, 6, 2, 2, 3, 16, dropout=0.5)
    x = torch.randn(1, 6, 8)
    with torch.no_grad():
        assert torch.equal(m.eval()(x), m(x))
        assert not torch.allclose(m.train()(x), m.eval()(x))


def test_not_causal_attends_to_every_key():
    torch.manual_seed(9)
    m = MultiHeadLatentAttention(8, 2, None, 6, 2, 2, 3, 16, causal=False)
    _, weights = m(torch.randn(1, 5, 8), need_weights=True)
    assert weights.gt(0).all()
    with pytest.raises(ValueError, match="a cache is for causal attention"):
        m(torch.randn(1, 5, 8), cache=m.make_cache(1))


def test_config_builds_a_twin_that_loads_the_weights():
    torch.manual_seed(10)
    m = MultiHeadLatentAttention(16, 2, 8, 6, 4, 2, 3, 16, down_bias=True, norm_eps=1e-5)
    twin = MultiHeadLatentAttention(**m.config)
    twin.load_state_dict(m.state_dict())
    x = torch.randn(1, 5, 16)
    torch.testing.assert_close(twin(x), m(x), rtol=0, atol=0)
    assert set(m.state_dict()) == {
        "q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight", "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight",
        "kv_b_proj.weight", "o_proj.weight",
    }  # fmt: skip


def test_float64_and_bfloat16_modules_and_a_narrower_cache():
    torch.manual_seed(11)
    m = MultiHeadLatentAttention(16, 2, 8, 6, 4, 2, 3, 16, dtype=torch.float64)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    torch.testing.assert_close(m(x), mla_reference(m, x, torch.ones(6, 6).tril().bool()))
    half = MultiHeadLatentAttention(16, 2, 8, 6, 4, 2, 3, 16)
    with torch.no_grad():
        full = half(x.float())
        cache = half.make_cache(2, dtype=torch.bfloat16)
        assert cache.bytes_per_token == (6 + 2) * 2 * 2
        got = torch.cat([half(x[:, s : s + 2].float(), cache=cache) for s in range(0, 6, 2)], 1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, full, rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        bf16 = MultiHeadLatentAttention(16, 2, 8, 6, 4, 2, 3, 16, dtype=torch.bfloat16)
        assert bf16(x.bfloat16()).dtype == torch.bfloat16


def test_make_cache_holds_the_latent_and_the_rotary_key_per_token():
    m = MultiHeadLatentAttention(64, 8, 16, 32, 8, 4, 8, 100)
    cache = m.make_cache(3, 50)
    assert isinstance(cache, LatentCache) and cache.rows.shape == (3, 50, 36)
    assert cache.bytes_per_token == (32 + 4) * 4 * 3 == m.cache_values_per_token * 4 * 3
    assert cache.nbytes == cache.bytes_per_token * 50
    assert m.make_cache(1).max_tokens == 100
    with pytest.raises(ValueError, match=r"max_tokens \(101\) is past context_length \(100\)"):
        m.make_cache(1, 101)


def test_the_scale_is_one_over_the_root_of_the_query_key_width():
    m = MultiHeadLatentAttention(8, 2, None, 6, 5, 4, 3, 16)
    assert m.scale == pytest.approx(1 / 3)
    assert mscale_factor(None) == 1.0 == mscale_factor({"rope_type": "default", "factor": 40.0})
    deepseek = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert mscale_factor(deepseek) == pytest.approx((0.1 * math.log(40.0) + 1) ** 2)
    assert mscale_factor({**deepseek, "mscale_all_dim": 0.0}) == 1.0
    assert mscale_factor({**deepseek, "factor": 1.0}) == 1.0
    scaled = MultiHeadLatentAttention(
        8, 2, None, 6, 5, 4, 3, 16, rope_scaling={**deepseek, "original_max_position_embeddings": 4}
    )
    assert scaled.scale == pytest.approx((0.1 * math.log(40.0) + 1) ** 2 / 3)
    assert scaled.rope.scaling["factor"] == 40.0


# --- checks at the door -----------------------------------------------------------------

GOOD = dict(
    d_model=8, num_heads=2, q_lora_rank=None, kv_lora_rank=6, qk_nope_head_dim=2,
    qk_rope_head_dim=2, v_head_dim=3, context_length=16,
)  # fmt: skip
BAD_ARGUMENTS = {
    "d_model 0": ({"d_model": 0}, ValueError, "d_model must be >= 1, got 0"),
    "heads bool": ({"num_heads": True}, TypeError, "num_heads must be an int, got bool"),
    "q_lora_rank str": ({"q_lora_rank": "8"}, TypeError, "q_lora_rank must be an int, got str"),
    "rope odd": (
        {"qk_rope_head_dim": 3},
        ValueError,
        r"qk_rope_head_dim must be even \(rotary pairs\), got 3",
    ),
    "nope negative": ({"qk_nope_head_dim": -1}, ValueError, "qk_nope_head_dim must be >= 0"),
    "no features": ({"qk_nope_head_dim": 0, "qk_rope_head_dim": 0}, ValueError, "must be >= 1"),
    "huge": ({"num_heads": 2**30, "v_head_dim": 2**11}, ValueError, r"num_heads x \("),
    "dropout": ({"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\), got 1.0"),
    "eps": ({"norm_eps": 0.0}, ValueError, "norm_eps must be > 0.0"),
    "base": ({"rope_base": 1.0}, ValueError, "rope_base must be > 1.0"),
    "causal": ({"causal": "yes"}, TypeError, "causal must be a bool, got str"),
    "latent_norm": ({"latent_norm": 1}, TypeError, "latent_norm must be a bool, got int"),
    "dtype": ({"dtype": torch.int32}, TypeError, "dtype must be a floating-point dtype"),
    "device": ({"device": "nowhere"}, ValueError, "device 'nowhere' is not a device"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_constructor_arguments_are_named(case):
    changes, error, message = case
    with pytest.raises(error, match=message):
        MultiHeadLatentAttention(**{**GOOD, **changes})


def _held(cache):
    return cache.position, cache.rows.clone()


BAD_CALLS = {
    "x 2-D": (lambda m, c: m(torch.randn(3, 8), cache=c), ValueError, "x must have shape"),
    "x width": (lambda m, c: m(torch.randn(2, 1, 7), cache=c), ValueError, "d_model is 8"),
    "x dtype": (lambda m, c: m(torch.randn(2, 1, 8).double(), cache=c), TypeError, "float64"),
    "x ints": (lambda m, c: m(torch.ones(2, 1, 8, dtype=torch.long), cache=c), TypeError,
               "floating-point"),
    "nan": (lambda m, c: m(torch.full((2, 1, 8), torch.nan), cache=c), ValueError,
            "x has a non-finite value"),
    "need_weights": (lambda m, c: m(torch.randn(2, 1, 8), need_weights=1, cache=c), TypeError,
                     "need_weights must be a bool"),
    "absorb": (lambda m, c: m(torch.randn(2, 1, 8), absorb="yes", cache=c), TypeError,
               "absorb must be a bool"),
    "mask shape": (lambda m, c: m(torch.randn(2, 1, 8), mask=torch.ones(1, 3, dtype=torch.bool),
                                  cache=c), ValueError, r"queries, positions so far\)"),
    "mask nan": (lambda m, c: m(torch.randn(2, 1, 8), mask=torch.full((1, 4), torch.nan),
                                cache=c), ValueError, "mask holds nan"),
    "batch": (lambda m, c: m(torch.randn(1, 1, 8), cache=c), ValueError,
              "x has batch size 1 but the cache holds 2 sequences"),
    "full": (lambda m, c: m(torch.randn(2, 5, 8), cache=c), ValueError,
             r"holds 3 of at most max_tokens \(6\) tokens and cannot take 5 more"),
    "past context": (lambda m, c: m(torch.randn(2, 17, 8)), ValueError,
                     r"x has 17 tokens, more than context_length \(16\)"),
    "not a cache": (lambda m, c: m(torch.randn(2, 1, 8), cache=object()), TypeError,
                    "cache must be a LatentCache"),
    "other widths": (lambda m, c: m(torch.randn(2, 1, 8), cache=LatentCache(2, 6, 6, 4)),
                     ValueError, "the cache was made for kv_lora_rank=6, qk_rope_head_dim=4"),
    "cache dtype": (lambda m, c: m(torch.randn(2, 1, 8),
                                   cache=LatentCache(2, 6, 6, 2, dtype=torch.float64)),
                    TypeError, "the cache is torch.float64 on cpu"),
    "hook raises": (lambda m, c: _raising_o_proj(m)(torch.randn(2, 2, 8), cache=c), RuntimeError,
                    "o_proj failed"),
    "hook raises, grad": (lambda m, c: _raising_o_proj(m)(torch.randn(2, 2, 8).requires_grad_(),
                                                         cache=c), RuntimeError, "o_proj failed"),
}  # fmt: skip


def _raising_o_proj(m):
    def fail(*_):
        raise RuntimeError("o_proj failed")

    m.o_proj.register_forward_pre_hook(fail)
    return m


@pytest.mark.parametrize("case", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_a_bad_call_is_refused_by_name_and_leaves_the_cache_as_it_was(case):
    call, error, message = case
    torch.manual_seed(12)
    m = MultiHeadLatentAttention(**GOOD)
    cache = m.make_cache(2, 6)
    with torch.no_grad():
        m(torch.randn(2, 3, 8), cache=cache)
    position, rows = _held(cache)
    with pytest.raises(error, match=message):
        call(m, cache)
    assert cache.position == position == 3
    torch.testing.assert_close(cache.rows[:, :3], rows[:, :3], rtol=0, atol=0)


def test_an_empty_call_appends_nothing():
    m = MultiHeadLatentAttention(**GOOD)
    cache = m.make_cache(2)
    m(torch.randn(2, 3, 8), cache=cache)
    for absorb in (None, True, False):
        out, weights = m(torch.randn(2, 0, 8), cache=cache, need_weights=True, absorb=absorb)
        assert out.shape == (2, 0, 8) and weights.shape == (2, 2, 0, 3)
    assert cache.position == 3


def test_a_cache_made_under_inference_mode_is_refused_outside_it():
    m = MultiHeadLatentAttention(**GOOD)
    with torch.inference_mode():
        cache = m.make_cache(1)
        m(torch.randn(1, 2, 8), cache=cache)
    with pytest.raises(ValueError, match=r"made under torch\.inference_mode"):
        m(torch.randn(1, 1, 8), cache=cache)


# --- no value read off the CPU -----------------------------------------------------------

META = {
    "lora, rope": dict(q_lora_rank=8),
    "plain q, no rope": dict(qk_rope_head_dim=0, latent_norm=False, out_bias=True),
}


@pytest.mark.parametrize("options", META.values(), ids=META.keys())
def test_forward_backward_and_a_cached_decode_off_the_cpu_read_no_value(options):
    """Meta tensors take the GPU's path (every device but the CPU does) and raise on any
    read: the forward, its backward and a cached decode by both paths read no value."""
    m = MultiHeadLatentAttention(**{**GOOD, **options}, device="meta")
    x = torch.randn(2, 5, 8, device="meta", requires_grad=True)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool, device="meta")
    for absorb in (None, True, False):
        m(x, mask=mask, absorb=absorb).sum().backward()
    assert x.grad.shape == x.shape and m.kv_b_proj.weight.grad.device.type == "meta"
    with torch.no_grad():
        cache = m.make_cache(2, 16)
        m(x, cache=cache)
        for step, absorb in enumerate((None, True, False)):
            bias = torch.zeros(1, 6 + step, device="meta")  # (queries, positions so far)
            out = m(x.narrow(1, 0, 1), cache=cache, absorb=absorb, mask=bias)
    assert out.shape == (2, 1, 8) and cache.position == 8


def test_a_value_read_added_back_fails_the_meta_test(monkeypatch):
    monkeypatch.setattr(debug, "reads_values", lambda t: True)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        test_forward_backward_and_a_cached_decode_off_the_cpu_read_no_value(META["lora, rope"])


class _DoubledLinear(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is F.linear else out


def test_under_a_function_mode_or_a_patched_linear_kv_b_proj_is_called(monkeypatch):
    """The absorbed path reads kv_b_proj's weight: under a function mode that changes
    F.linear, or with nn.Linear.forward patched on the class, the default decode must equal
    absorb=False (which calls the layer), and absorb=True is refused by name."""
    torch.manual_seed(7)
    m = MultiHeadLatentAttention(16, 4, None, 32, 8, 4, 8, 64).eval()
    x = torch.randn(1, 4, 16)
    original = nn.Linear.forward

    def patched():
        nn.Linear.forward = lambda self, y: original(self, y) * 2

    for name, enter, leave in [
        ("function mode", _DoubledLinear().__enter__, None),
        ("class patch", patched, lambda: setattr(nn.Linear, "forward", original)),
    ]:
        mode = enter()
        try:
            outs = {}
            for absorb in (None, False):
                cache = m.make_cache(1, 8)
                with torch.no_grad():
                    m(x[:, :3], cache=cache)
                    outs[absorb] = m(x[:, 3:], cache=cache, absorb=absorb)
            torch.testing.assert_close(outs[None], outs[False], msg=name)
            with pytest.raises(ValueError, match="absorb=True reads kv_b_proj's weight"):
                m(x[:, 3:], cache=m.make_cache(1, 8), absorb=True)
        finally:
            if leave is None:
                mode.__exit__(None, None, None)
            else:
                leave()


@pytest.mark.parametrize("absorb", [None, True, False])
def test_scores_past_float32_are_the_float64_answer_full_and_cached(absorb):
    """Inputs of 1e25: the projections are finite, the scores (about 1e50) are not in
    float32 (every kernel gave NaN). Full and cached, both paths, they equal the float64
    reference, and the cache moves on."""
    torch.manual_seed(8)
    m = MultiHeadLatentAttention(16, 4, None, 32, 8, 4, 8, 64).eval()
    x = torch.randn(1, 4, 16) * 1e25
    expected = mla_reference(m, x, torch.ones(4, 4).tril().bool())
    size = float(expected.abs().max())
    with torch.no_grad():
        full = m(x, absorb=absorb if absorb is not True else None)
        cache = m.make_cache(1, 8)
        steps = [m(x[:, :3], cache=cache), m(x[:, 3:], cache=cache, absorb=absorb)]
    for got in (full, torch.cat(steps, dim=1)):
        torch.testing.assert_close(got.double(), expected, atol=1e-5 * size, rtol=1e-4)
    assert cache.position == 4


def test_a_float64_layer_computes_past_float32():
    """A float64 layer fed 1e40: its latent RMSNorm and its rotation computed in float32
    (inf, then a false overflow error); in float64 now, equal to the float64 reference
    (to the float32 rotary tables' precision)."""
    torch.manual_seed(8)
    m = MultiHeadLatentAttention(16, 4, None, 32, 8, 4, 8, 64).double().eval()
    x = torch.randn(1, 4, 16, dtype=torch.float64) * 1e40
    expected = mla_reference(m, x, torch.ones(4, 4).tril().bool())
    with torch.no_grad():
        got = m(x)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("absorb", [None, True, False])
def test_projections_that_overflow_are_a_value_error_and_the_cache_is_kept(absorb):
    """Finite inputs whose query projection is past float32 (3e38 x the signs of a weight
    row): a named ValueError (was NaN), and a latent cache keeps what it held."""
    torch.manual_seed(8)
    m = MultiHeadLatentAttention(16, 4, None, 32, 8, 4, 8, 64).eval()
    row = m.q_proj.weight.detach()[0]
    assert row.abs().sum() > 1.2
    prompt, big = torch.randn(1, 3, 16), (row.sign() * 3e38).view(1, 1, 16)
    with torch.no_grad():
        with pytest.raises(ValueError, match="overflowed"):
            m(torch.cat([prompt, big], dim=1), absorb=absorb if absorb is not True else None)
        cache = m.make_cache(1, 8)
        m(prompt, cache=cache)
        with pytest.raises(ValueError, match="overflowed"):
            m(big, cache=cache, absorb=absorb)
    assert cache.position == 3


@pytest.mark.parametrize("name", ["q_proj", "kv_b_proj", "o_proj"])
def test_a_projection_in_another_dtype_is_a_named_type_error(name):
    torch.manual_seed(9)
    m = MultiHeadLatentAttention(16, 4, None, 32, 8, 4, 8, 64)
    getattr(m, name).double()
    with pytest.raises(TypeError, match=f"{name}'s weight is torch.float64"):
        m(torch.randn(1, 3, 16))


@pytest.mark.parametrize(("dtype", "weights"), [(torch.float16, 300.0), (torch.float32, 3e19)])
def test_an_absorbed_query_past_its_dtype_is_computed_expanded(dtype, weights):
    """q_nope W_UK past q's dtype (65504 in float16 with weights x300; 3.4e38 in float32
    with x3e19), where the expanded path's keys are not: the absorbed path (absorb=True,
    and the default for a cached step) raised a false overflow error (the ninth pass);
    such a call is computed expanded, equal to the module in float64."""
    torch.manual_seed(1)
    m = MultiHeadLatentAttention(32, 4, None, 16, 8, 4, 8, 24).eval()
    with torch.no_grad():
        m.kv_b_proj.weight.mul_(weights)
        m.q_proj.weight.mul_(weights)
        m.o_proj.weight.div_(weights if dtype == torch.float32 else 1.0)
    wide = copy.deepcopy(m).double()
    m = m.to(dtype)
    x = (torch.randn(1, 8, 32) * 3).to(dtype)
    with torch.no_grad():
        expected = wide(x.double())
        full = m(x, absorb=True)
        cache = m.make_cache(1, 16)
        steps = [m(x[:, :7], cache=cache, absorb=False), m(x[:, 7:], cache=cache)]
    tolerance = 2e-3 if dtype == torch.float16 else 1e-5
    size = float(expected.abs().max())
    for got in (full, torch.cat(steps, dim=1)):
        torch.testing.assert_close(got.double(), expected, atol=tolerance * size, rtol=0)


def test_compiled_it_computes_expanded_and_absorb_true_is_named():
    """torch.compile traced kv_b_proj's pristine checks and failed on every call (Dynamo's
    TypeError on dict keys <= set); compiled, the default path is the expanded one, equal
    to eager, and absorb=True is a ValueError naming why."""
    torch.manual_seed(2)
    m = MultiHeadLatentAttention(16, 4, None, 32, 8, 4, 8, 64).eval()
    compiled = torch.compile(m, backend="aot_eager")
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match=r"torch\.compile does not trace"):
            compiled(x, absorb=True)


def test_absorb_true_under_torch_func_names_why():
    """The refusal said 'must be a plain nn.Linear ... got Linear' (the ninth pass)."""
    m = MultiHeadLatentAttention(16, 4, None, 32, 8, 4, 8, 64).eval()
    params = {name: p.detach().clone() for name, p in m.named_parameters()}  # plain tensors
    x = torch.randn(2, 3, 16)

    def call(rows):
        return torch.func.functional_call(m, params, (rows,), {"absorb": True})

    with pytest.raises(ValueError, match=r"its weight is not a registered nn\.Parameter"):
        call(x)
    with pytest.raises(ValueError, match=r"inside a torch\.func transform"):
        torch.func.vmap(call)(x.unsqueeze(1))
