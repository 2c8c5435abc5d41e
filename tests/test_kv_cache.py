"""KVCache and cached decoding: token by token or in chunks of any size, the outputs equal one
full causal forward, which itself equals the float64 reference; with rope, windows,
grouped-query heads, padding and batch > 1. The cache is preallocated and sized by the
key/value heads (and the window)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import KVCache, MultiHeadAttention, flash_cpu, functional, masks
from attnlab.kv_cache import BLOCK_TOKENS
from tests import products
from tests.decode_reference import DispatchedOps, GptFastLayer
from tests.definitions import decode, module_reference, window_allowed

seeds = st.integers(0, 2**31 - 1)
BACKENDS = ["math", "sdpa", "auto"] + (["flash"] if flash_cpu.available() else [])


@st.composite
def decoding_configs(draw):
    num_kv_heads = draw(st.integers(1, 3))
    num_heads = num_kv_heads * draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 12))
    chunks = draw(st.lists(st.integers(1, 5), min_size=1, max_size=12))
    return dict(
        seed=draw(seeds),
        b=draw(st.integers(1, 3)),
        tokens=tokens,
        chunks=chunks,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=2 * draw(st.integers(1, 3)),
        rope=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.integers(1, 5))),
        pad=draw(st.booleans()),
        bias=draw(st.booleans()),
        backend=draw(st.sampled_from(BACKENDS)),
    )


def build(c):
    torch.manual_seed(c["seed"])
    m = MultiHeadAttention(
        5,
        c["num_heads"] * c["head_dim"],
        16,
        0.0,
        c["num_heads"],
        qkv_bias=c["bias"],
        num_kv_heads=c["num_kv_heads"],
        rope=c["rope"],
        window=c["window"],
        backend=c["backend"],
    )
    x = torch.randn(c["b"], c["tokens"], 5)
    mask = None
    if c["pad"]:  # left padding, as batched generation has it
        lengths = torch.randint(0, c["tokens"] + 1, (c["b"],))
        keep = torch.arange(c["tokens"]) >= (c["tokens"] - lengths)[:, None]  # (b, t)
        mask = masks.padding_mask(keep)  # (b, 1, 1, t)
    return m, x, mask


@given(decoding_configs())
def test_cached_decoding_equals_the_full_forward_and_the_reference(c):
    m, x, mask = build(c)
    with torch.no_grad():
        full = m(x, mask=mask)
        allowed = masks.combine_masks(mask, window_allowed(c["tokens"], c["window"]))
        expected = module_reference(m, x, allowed=allowed, rope_base=1e4 if c["rope"] else None)
        torch.testing.assert_close(full.double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(decode(m, x, mask, c["chunks"]), full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(decode(m, x, mask, [1]), full, rtol=1e-5, atol=1e-5)


def test_additive_float_mask_with_a_rolling_cache():
    torch.manual_seed(1)
    m = MultiHeadAttention(4, 8, 16, 0.0, 2, window=3, rope=True)
    x = torch.randn(2, 9, 4)
    bias = torch.randn(2, 1, 9, 9)  # an additive bias per (query, key position)
    with torch.no_grad():
        full = m(x, mask=bias)
        cache, outputs = m.make_cache(2), []
        for s in range(0, 9, 2):
            e = min(s + 2, 9)
            outputs.append(m(x[:, s:e], mask=bias[:, :, s:e, :e], cache=cache))
        torch.testing.assert_close(torch.cat(outputs, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(12, 12), (12, 4), (12, 1)])
def test_memory_is_kv_heads_times_head_dim_times_tokens(num_heads, num_kv_heads):
    m = MultiHeadAttention(768, 768, 1024, 0.0, num_heads, num_kv_heads=num_kv_heads)
    cache = m.make_cache(2, 100)
    assert cache.nbytes == 2 * 2 * num_kv_heads * 64 * 100 * 4  # keys and values, fp32
    windowed = MultiHeadAttention(
        768, 768, 1024, 0.0, num_heads, num_kv_heads=num_kv_heads, window=16
    )
    assert windowed.make_cache(2, 100).nbytes == 2 * 2 * num_kv_heads * 64 * 16 * 4


def test_buffers_are_preallocated_and_written_in_place():
    torch.manual_seed(2)
    m = MultiHeadAttention(4, 8, 32, 0.0, 2, num_kv_heads=1)
    cache = m.make_cache(1)
    pointers = (cache.keys.data_ptr(), cache.values.data_ptr())
    with torch.no_grad():
        for t in range(10):
            m(torch.randn(1, 1, 4), cache=cache)
            assert cache.num_tokens == t + 1
    assert (cache.keys.data_ptr(), cache.values.data_ptr()) == pointers
    assert cache.keys.shape == (1, 1, 32, 4)


def test_rolling_buffer_holds_the_window_and_knows_its_positions():
    cache = KVCache(1, 100, 1, 2, window=4)
    for p in range(7):
        cache.update(torch.full((1, 1, 1, 2), float(p)), torch.zeros(1, 1, 1, 2))
    assert cache.position == 7 and cache.num_tokens == 4
    slots = cache.keys[0, 0, :, 0]
    torch.testing.assert_close(slots, torch.tensor([4.0, 5.0, 6.0, 3.0]))  # token p in p % 4
    torch.testing.assert_close(cache.slot_positions(), torch.tensor([4, 5, 6, 3]))


def test_reset_starts_a_new_sequence():
    torch.manual_seed(3)
    m = MultiHeadAttention(4, 8, 16, 0.0, 2, rope=True).eval()
    x = torch.randn(1, 5, 4)
    cache = m.make_cache(1)
    with torch.no_grad():
        first = m(x, cache=cache)
        cache.reset()
        assert cache.position == 0 and cache.num_tokens == 0
        torch.testing.assert_close(m(x, cache=cache), first, rtol=0, atol=0)


def test_windowed_cache_decodes_past_max_tokens_but_not_past_context_length():
    torch.manual_seed(4)
    m = MultiHeadAttention(4, 8, 12, 0.0, 2, window=3)
    cache = m.make_cache(1, max_tokens=3)
    with torch.no_grad():
        for _ in range(12):
            m(torch.randn(1, 1, 4), cache=cache)
        with pytest.raises(ValueError, match=r"at positions 12\.\.12, more than context_length"):
            m(torch.randn(1, 1, 4), cache=cache)


@pytest.mark.parametrize(
    ("cache", "error", "message"),
    [
        (
            KVCache(2, 4, 2, 4),
            ValueError,
            r"holds 0 of at most max_tokens \(4\) tokens and cannot take 5",
        ),
        (KVCache(3, 16, 2, 4), ValueError, "x has batch size 2 but the cache holds 3 sequences"),
        (
            KVCache(2, 16, 1, 4),
            ValueError,
            "made for num_kv_heads=1, head_dim=4; this module has num_kv_heads=2, head_dim=4",
        ),
        (KVCache(2, 16, 2, 8), ValueError, "made for num_kv_heads=2, head_dim=8"),
        (KVCache(2, 16, 2, 4, window=2), ValueError, "window of 2 tokens but this module"),
        (KVCache(2, 16, 2, 4, dtype=torch.float64), TypeError, "cache is torch.float64"),
        ("cache", TypeError, "cache must be a KVCache"),
    ],
)
def test_bad_cache(cache, error, message):
    m = MultiHeadAttention(4, 8, 16, 0.0, 2)
    with pytest.raises(error, match=message):
        m(torch.randn(2, 5, 4), cache=cache)


def test_decoding_past_max_tokens_is_refused_not_wrapped():
    m = MultiHeadAttention(4, 8, 16, 0.0, 2)
    cache = m.make_cache(1, 3)
    with torch.no_grad():
        m(torch.randn(1, 3, 4), cache=cache)
        with pytest.raises(ValueError, match=r"holds 3 of at most max_tokens \(3\)"):
            m(torch.randn(1, 1, 4), cache=cache)
    assert cache.position == 3


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: MultiHeadAttention(4, 6, 16, 0.0, 2, rope=True),
            r"rope=True needs an even head_dim",
        ),
        (lambda: MultiHeadAttention(4, 8, 16, 0.0, 2, window=0), "window must be >= 1"),
        (lambda: MultiHeadAttention(4, 8, 16, 0.0, 2, window=4, causal=False), "needs causal=True"),
        (
            lambda: MultiHeadAttention(4, 8, 16, 0.0, 2, rope=True, rope_base=0.5),
            "rope_base must be > 1",
        ),
        (lambda: KVCache(0, 16, 2, 4), "batch_size must be >= 1"),
    ],
)
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_cache_needs_causal_self_attention():
    with pytest.raises(ValueError, match="a cache is for causal self-attention"):
        m = MultiHeadAttention(4, 8, 16, 0.0, 2, causal=False)
        m(torch.randn(1, 2, 4), cache=m.make_cache(1))
    with pytest.raises(ValueError, match="a cache is for causal self-attention"):
        m = MultiHeadAttention(4, 8, 16, 0.0, 2)
        m(torch.randn(1, 2, 4), torch.randn(1, 3, 4), cache=m.make_cache(1))


def test_a_bad_mask_leaves_the_cache_unchanged():
    m = MultiHeadAttention(4, 8, 16, 0.0, 2)
    cache = m.make_cache(1)
    with torch.no_grad():
        m(torch.randn(1, 3, 4), cache=cache)
        wrong = torch.ones(1, 1, 1, 3, dtype=torch.bool)  # should cover 4 positions
        with pytest.raises(ValueError, match=r"positions so far\) = \(1, 2, 1, 4\)"):
            m(torch.randn(1, 1, 4), mask=wrong, cache=cache)
    assert cache.position == 3


def test_crop_rolls_back_to_an_earlier_token():
    torch.manual_seed(9)
    m = MultiHeadAttention(4, 8, 16, 0.0, 2, rope=True, num_kv_heads=1).eval()
    x, draft = torch.randn(1, 6, 4), torch.randn(1, 3, 4)
    with torch.no_grad():
        cache = m.make_cache(1)
        m(x[:, :4], cache=cache)
        m(draft, cache=cache)  # three draft tokens, then rejected
        cache.crop(4)
        assert cache.position == 4
        torch.testing.assert_close(m(x[:, 4:], cache=cache), m(x)[:, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("position", "window", "crop_to", "error", "message"),
    [
        (3, None, 4, ValueError, r"num_tokens \(4\) is more than the cache holds \(3\)"),
        (3, None, -1, ValueError, r"num_tokens must be >= 0, got -1"),
        (3, None, 1.0, TypeError, r"num_tokens must be an int"),
        (5, 4, 2, ValueError, r"overwritten tokens before position 1"),
    ],
)
def test_bad_crop(position, window, crop_to, error, message):
    cache = KVCache(1, 8, 1, 2, window=window)
    for _ in range(position):
        cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    with pytest.raises(error, match=message):
        cache.crop(crop_to)
    assert cache.position == position


def _state(cache):
    """Everything a cached call may change: the position and the tokens held."""
    held = cache.num_tokens
    return cache.position, cache.keys[:, :, :held].clone(), cache.values[:, :, :held].clone()


def _assert_state(cache, state):
    position, keys, values = state
    assert cache.position == position
    assert torch.equal(cache.keys[:, :, : cache.num_tokens], keys)
    assert torch.equal(cache.values[:, :, : cache.num_tokens], values)


def _refused_calls(m):
    """(name, call(m, cache, x)) for calls that must raise and change nothing."""
    flash = MultiHeadAttention(4, 8, 16, 0.0, 2, backend="flash", window=m.window).double()
    flash.load_state_dict(m.state_dict())
    sdpa = MultiHeadAttention(4, 8, 16, 0.0, 2, backend="sdpa", window=m.window)
    sdpa.load_state_dict(m.state_dict())
    return [
        ("need_weights on sdpa", lambda c, x: sdpa(x, need_weights=True, cache=c)),
        ("flash on float64", lambda c, x: flash(x.double(), cache=c)),
        ("mask shape", lambda c, x: m(x, mask=torch.ones(1, 1, 1, 2, dtype=torch.bool), cache=c)),
        ("mask dtype", lambda c, x: m(x, mask=torch.ones(1, 1, 1, c.position + 1).int(), cache=c)),
        ("overflow", lambda c, x: m(torch.randn(1, 17, 4), cache=c)),
        ("batch", lambda c, x: m(x.expand(2, 1, 4), cache=c)),
        ("x dtype", lambda c, x: m(x.double(), cache=c)),
        ("x NaN", lambda c, x: m(x * torch.nan, cache=c)),
    ]


@pytest.mark.parametrize("window", [None, 3])
def test_every_refused_cached_call_leaves_the_cache_as_it_was(window):
    """Each error path of a cached call, before or after the write: position and tokens
    bit-identical, and the retry equals the full forward (it once advanced the cache and
    the retry was 0.09 off)."""
    torch.manual_seed(3)
    m = MultiHeadAttention(4, 8, 16, 0.0, 2, window=window).eval()
    x = torch.randn(1, 6, 4)
    with torch.no_grad():
        full = m(x)
        for name, call in _refused_calls(m):
            cache = m.make_cache(1)
            m(x[:, :5], cache=cache)
            state = _state(cache)
            with pytest.raises((ValueError, TypeError)):
                call(cache, x[:, 5:])
            _assert_state(cache, state)
            retry = m(x[:, 5:], cache=cache)
            torch.testing.assert_close(retry, full[:, 5:], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("window", [None, 3])
def test_a_failure_after_the_write_is_rolled_back(window, monkeypatch):
    """Whatever raises once the keys are written (here: the attention itself) leaves the
    cache as it was: the transaction restores the position and the overwritten slots."""
    torch.manual_seed(4)
    m = MultiHeadAttention(4, 8, 16, 0.0, 2, window=window).eval()
    x = torch.randn(1, 8, 4)
    with torch.no_grad():
        full = m(x)
        cache = m.make_cache(1)
        m(x[:, :6], cache=cache)
        state = _state(cache)

        def broken(*args, **kwargs):
            raise RuntimeError("out of memory")

        with monkeypatch.context() as patch:
            patch.setattr(functional, "attend", broken)
            with pytest.raises(RuntimeError, match="out of memory"):
                m(x[:, 6:], cache=cache)
        _assert_state(cache, state)
        torch.testing.assert_close(m(x[:, 6:], cache=cache), full[:, 6:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [3, None])
def test_cached_weights_are_the_full_forwards_in_position_order(window):
    """A rolling cache holds keys in slot order; the weights come back over every position
    so far, as the full forward's rows (0 for keys that left the window)."""
    torch.manual_seed(5)
    m = MultiHeadAttention(4, 8, 16, 0.0, 2, window=window).eval()
    x = torch.randn(2, 9, 4)
    with torch.no_grad():
        _, full = m(x, need_weights=True)
        cache = m.make_cache(2)
        start = 0
        for size in (4, 1, 3, 1):
            _, weights = m(x[:, start : start + size], need_weights=True, cache=cache)
            expected = full[:, :, start : start + size, : start + size]
            torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)
            start += size


@pytest.mark.parametrize("tokens_last", [True, False])
@pytest.mark.parametrize("window", [None, 3])
def test_backward_through_two_cached_chunks_equals_the_full_forwards(window, tokens_last):
    """Training through a cache: the second chunk's write does not break the first chunk's
    backward (it once raised 'modified by an inplace operation'), and gradients equal the
    full forward's."""
    torch.manual_seed(6)
    m = MultiHeadAttention(4, 8, 16, 0.0, 2, window=window, rope=True).train()
    x = torch.randn(2, 7, 4)
    target = torch.randn(2, 7, 8)
    full_grads = torch.autograd.grad((m(x) * target).sum(), list(m.parameters()))
    cache = KVCache(2, 16, 2, 4, window=window, tokens_last=tokens_last)
    out = torch.cat([m(x[:, :4], cache=cache), m(x[:, 4:], cache=cache)], dim=1)
    grads = torch.autograd.grad((out * target).sum(), list(m.parameters()))
    for grad, full_grad in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(grad, full_grad, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(1, 400),
    rolling=st.booleans(),
    chunks=st.lists(st.integers(1, 150), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fail_last=st.booleans(),
    block=st.sampled_from([None, 16, BLOCK_TOKENS, "rows"]),
)
def test_the_blocked_storage_gives_back_every_token_it_holds(
    capacity, rolling, chunks, dtype, fail_last, block
):
    """Capacities across several blocks (the native step's, short ones, or the default: one
    block of the whole capacity), chunks across block edges, a rolling window wrapping around: every
    slot gives back the token written there last, and a write inside a transaction that
    raises is undone."""
    hkv, hd = 2, 4
    max_tokens = 10 * capacity if rolling else capacity
    window = capacity if rolling else None
    layout = {"tokens_last": False} if block == "rows" else {"block_tokens": block}
    cache = KVCache(1, max_tokens, hkv, hd, dtype=dtype, window=window, **layout)
    given = []  # every token's key, in position order
    for n in chunks:
        n = n if rolling else min(n, capacity - cache.position)
        if n == 0:
            break
        k = torch.randn(1, hkv, n, hd).to(dtype)
        held_before = cache.keys[:, :, : cache.num_tokens], cache.position
        if fail_last:
            with pytest.raises(RuntimeError, match="after the write"), cache.transaction(n):
                cache.update(k, -k)
                raise RuntimeError("after the write")
            assert cache.position == held_before[1]
            assert torch.equal(cache.keys[:, :, : cache.num_tokens], held_before[0])
        keys, values, positions = cache.update(k, -k)
        given.append(k)
        every = torch.cat(given, dim=2)  # (1, hkv, position, hd)
        if positions is None:
            positions = torch.arange(cache.position)
        assert torch.equal(keys, every[:, :, positions]) and torch.equal(values, -keys)
        held = torch.arange(cache.num_tokens)
        slot_positions = held if not rolling else cache.slot_positions()
        assert torch.equal(cache.keys[:, :, held], every[:, :, slot_positions])
        assert torch.equal(_documented_keys(cache)[:, :, held], every[:, :, slot_positions])
        assert torch.equal(_documented_values(cache)[:, :, held], -every[:, :, slot_positions])


def _documented_keys(cache: KVCache) -> torch.Tensor:
    """keys_t read as KVCache documents it for native kernels, (b, hkv, capacity, hd): each
    head's tokens in blocks of cache.block tokens, a block of n tokens (hd, n) row-major;
    rows (capacity, hd) with tokens_last=False."""
    b, hkv, hd, capacity = *cache.keys_t.shape[:2], cache.head_dim, cache.capacity
    if not cache.tokens_last:
        return cache.keys_t.view(b, hkv, capacity, hd)
    tokens = []
    for t in range(capacity):
        start = t // cache.block * cache.block
        length = min(cache.block, capacity - start)
        tokens.append(cache.keys_t[:, :, start * hd + torch.arange(hd) * length + t - start])
    return torch.stack(tokens, dim=2)


def _documented_values(cache: KVCache) -> torch.Tensor:
    """values_t read as documented: rows (capacity, hd) per head, in every layout."""
    b, hkv = cache.values_t.shape[:2]
    return cache.values_t.view(b, hkv, cache.capacity, cache.head_dim)


@pytest.mark.parametrize(
    ("stored", "given", "takes"),
    [
        (torch.bfloat16, torch.float16, False),  # the same width, another format: no
        (torch.float16, torch.bfloat16, False),
        (torch.bfloat16, torch.float32, True),
        (torch.int8, torch.float16, True),
        (torch.float32, torch.float32, True),
        (torch.float32, torch.float64, False),  # a float32 cache is not a narrower store
        (torch.float16, torch.float16, True),
    ],
)
def test_a_cache_accepts_its_own_dtype_or_a_strictly_wider_one(stored, given, takes):
    assert KVCache(1, 4, 1, 2, dtype=stored).accepts(given) is takes


def test_a_bfloat16_cache_refuses_float16_keys_at_the_door():
    m = MultiHeadAttention(8, 8, 16, 0.0, 2, dtype=torch.float16).eval()
    cache = m.make_cache(1, dtype=torch.bfloat16)
    with torch.no_grad(), pytest.raises(TypeError, match=r"the cache is torch\.bfloat16"):
        m(torch.randn(1, 2, 8, dtype=torch.float16), cache=cache)
    assert cache.position == 0


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("window", [None, 3])
def test_a_cache_of_rows_decodes_as_the_tokens_last_one(window, dtype):
    """The layout make_cache gives off the CPU (rows: what SDPA reads without a copy), on
    the CPU: the same outputs as the CPU's own layout, chunks wrapping a rolling window."""
    torch.manual_seed(7)
    m = MultiHeadAttention(8, 16, 32, 0.0, 4, num_kv_heads=2, window=window, rope=True).eval()
    x = torch.randn(2, 11, 8)
    outs = {}
    with torch.no_grad():
        for tokens_last in (True, False):
            cache = KVCache(2, 32, 2, 4, dtype=dtype, window=window, tokens_last=tokens_last)
            chunks = [m(x[:, :3], cache=cache), m(x[:, 3:7], cache=cache)]
            chunks += [m(x[:, i : i + 1], cache=cache) for i in range(7, 11)]
            outs[tokens_last] = torch.cat(chunks, dim=1)
            assert cache.values.shape == (2, 2, cache.capacity, 4)
    # the rows go down the Python path, which multiplies in float32 (tests/products.py)
    tolerance = products.tolerance(dtype, 2, 1e-5)
    torch.testing.assert_close(outs[False], outs[True], atol=tolerance / 10, rtol=tolerance)


def test_off_the_cpu_make_cache_lays_tokens_out_as_rows_and_reads_them_uncopied():
    m = MultiHeadAttention(8, 16, 32, 0.0, 4, device="meta")
    cache = m.make_cache(2)
    assert not cache.tokens_last and m.make_cache(2, device="cpu").tokens_last
    with torch.no_grad():
        m(torch.randn(2, 3, 8, device="meta"), cache=cache)
    keys, _, _ = cache.append(
        torch.randn(2, 4, 1, 4, device="meta"), torch.randn(2, 4, 1, 4, device="meta")
    )
    assert keys.stride(-1) == 1  # SDPA's rows: no copy (dense_rows keeps it)
    with pytest.raises(ValueError, match=r"block_tokens \(16\) lays out a tokens-last cache"):
        KVCache(1, 32, 1, 4, block_tokens=16, tokens_last=False)


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_a_cached_decode_step_off_the_cpu_dispatches_at_most_1_1x_a_minimal_layers_ops(kv_heads):
    """Counted on the meta device (the GPU's path): no copy of the cache, no clone for the
    transaction, no expand of the key/value heads beyond what SDPA does on both sides."""
    m = MultiHeadAttention(64, 64, 64, 0.0, 4, num_kv_heads=kv_heads, device="meta")
    reference = GptFastLayer(64, 4, kv_heads, 64, batch=2, device="meta")
    x = torch.randn(2, 1, 64, device="meta")
    with torch.no_grad():
        cache = m.make_cache(2)
        m(torch.randn(2, 5, 64, device="meta"), cache=cache)
        with DispatchedOps() as ours:
            m(x, cache=cache)
        with DispatchedOps() as theirs:
            reference(x, torch.tensor([5], device="meta"))
    assert sum(ours.ops.values()) <= 1.1 * sum(theirs.ops.values()), (ours.ops, theirs.ops)
    assert ours.ops["aten.clone"] <= theirs.ops["aten.clone"]


def test_a_step_under_no_grad_after_a_recorded_prefill_keeps_its_backward():
    """A prefill recorded by autograd, then a token decoded under no_grad (sampling), then
    the prefill's backward: the buffers autograd saved are not written in place, and the
    gradients equal those without the extra step."""
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 32, 64, 0.0, 4)
    x = torch.randn(1, 6, 32)
    grads = []
    for extra_step in (False, True):
        m.zero_grad()
        cache = m.make_cache(1, 16)
        y = m(x[:, :5], cache=cache)
        if extra_step:
            with torch.no_grad():
                m(x[:, 5:6], cache=cache)
        y.sum().backward()
        grads.append(m.qkv_proj.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("store", ["float16", "static_float16", "latent_float16"])
@pytest.mark.parametrize("past", ["keys", "values"])
def test_a_token_past_the_caches_dtype_is_named_and_the_cache_kept(store, past):
    """A float32 layer whose new key (or value) is 7e4, past float16's 65504: a float16
    cache stored inf, and the key weighed 0, silently (the eighth pass). A ValueError
    naming the cache's dtype; the cache keeps what it held, and the next step equals a
    twin's that never saw the call."""
    from attnlab import MultiHeadLatentAttention

    torch.manual_seed(0)
    if store == "latent_float16":  # the latent is normalised: its rotary key goes past
        m = MultiHeadLatentAttention(8, 2, None, 16, 4, 4, 4, 16).eval()
        with torch.no_grad():
            m.kv_a_proj_with_mqa.weight[16:].fill_(1e4)
        past_name = "rotary keys"
    else:
        m = MultiHeadAttention(8, 8, 16, 0.0, 2).eval()
        with torch.no_grad():  # row 8 is the first key feature, row 16 the first value one
            m.qkv_proj.weight[8 if past == "keys" else 16].fill_(1e4)
        past_name = past

    def make():
        if store == "static_float16":
            return m.make_cache(1, 8, dtype=torch.float16, static=True)
        return m.make_cache(1, 8, dtype=torch.float16)

    prompt, after = torch.randn(1, 2, 8) * 1e-3, torch.randn(1, 1, 8) * 1e-3
    big = torch.ones(1, 1, 8)  # 8e4 in the feature the weight row reads
    with torch.no_grad():
        cache, twin = make(), make()
        m(prompt, cache=cache)
        m(prompt, cache=twin)
        with pytest.raises(ValueError, match=rf"{past_name} hold .*past the torch\.float16 cache"):
            m(big, cache=cache)
        assert (cache.tokens if store == "static_float16" else cache.position) == 2
        torch.testing.assert_close(m(after, cache=cache), m(after, cache=twin))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("magnitude", [1e-50, 1e39])
def test_an_int8_cache_names_a_float64_token_its_float32_scales_cannot_hold(static, magnitude):
    """A float64 layer's tokens of 1e-50 were stored as zeros by an int8 cache (its scales
    are float32: the output 0 for 3e-51), and of 1e39 as inf, blamed on the projections
    (the ninth pass). A ValueError naming the range; the cache keeps what it held."""
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 8, 16, 0.0, 2, dtype=torch.float64).eval()
    cache = m.make_cache(1, 8, dtype=torch.int8, static=static)
    with torch.no_grad():
        m(torch.randn(1, 2, 8, dtype=torch.float64), cache=cache)
        with pytest.raises(ValueError, match=r"an int8 cache quantizes in float32"):
            m(torch.randn(1, 1, 8, dtype=torch.float64) * magnitude, cache=cache)
    assert (cache.tokens if static else cache.position) == 2
