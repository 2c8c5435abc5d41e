"""The causal rule has one owner, masks.position_mask: a query at position p_q may attend to
a key at p_k iff p_k <= p_q (and p_q - p_k < window). Its helpers equal a brute-force
definition, and every path that masks by other means (PyTorch's top-left is_causal where
it is square, the C++ causal kernel with and without key ranges, the C++ decode step over
KVCache.native_slots, the ring's layout blocks) attends to exactly the keys it allows.

Which keys a path attended to is read off its output: each key's value is one-hot (key j
is feature j), so output feature j is query i's weight on key j, > 0 exactly where it
attended; a one-hot gradient of the output reads the backward's weights the same way."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from attnlab import KVCache, MultiHeadAttention, alibi, decode_cpu, flash_cpu, masks, plan
from attnlab.functional import attention
from attnlab.interop import hf
from attnlab.parallel import layout, ring

FLASH = flash_cpu.available()
NATIVE = decode_cpu.available()
windows = st.one_of(st.none(), st.integers(1, 12), st.just(2**70))
CLOSE = dict(atol=1e-5, rtol=1e-5)


def rule(query: int, key: int, window: int | None) -> bool:
    """The definition, one pair at a time."""
    return key <= query and (window is None or query - key < window)


def brute_force(query_positions, key_positions, window=None) -> torch.Tensor:
    return torch.tensor(
        [[rule(int(p), int(k), window) for k in key_positions] for p in query_positions],
        dtype=torch.bool,
    ).view(len(query_positions), len(key_positions))


def bottom_right(tq: int, tk: int, window=None) -> torch.Tensor:
    """The rule for tq queries against tk keys laid in order: query i at i + tk - tq."""
    return brute_force(range(tk - tq, tk), range(tk), window)


def top_left(tq: int, tk: int) -> torch.Tensor:
    """PyTorch's is_causal: query i at position i."""
    return brute_force(range(tq), range(tk))


def assert_the_rule(got, query_positions, key_positions, window=None, also=None):
    """got (..., q, k) bool is what the predicate allows between these positions (and the
    `also` mask), and the definition: a path the predicate does not build fails the first
    check when the predicate changes, one it builds the second."""
    query_positions, key_positions = list(query_positions), list(key_positions)
    predicate = masks.position_mask(
        torch.tensor(query_positions, dtype=torch.long),
        torch.tensor(key_positions, dtype=torch.long),
        window=window,
    )
    definition = brute_force(query_positions, key_positions, window)
    if also is not None:
        predicate, definition = predicate & also, definition & also
    assert torch.equal(got, predicate.expand(got.shape)), "differs from the predicate"
    assert torch.equal(got, definition.expand(got.shape)), "differs from the definition"


# --- the predicate and its helpers against the definition -----------------------------------


@given(
    st.lists(st.integers(0, 40), max_size=12),
    st.lists(st.integers(0, 40), max_size=12),
    windows,
    st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8]),
)
def test_the_predicate_is_the_definition(query_positions, key_positions, window, dtype):
    got = masks.position_mask(
        torch.tensor(query_positions, dtype=dtype),
        torch.tensor(key_positions, dtype=dtype),
        window=window,
    )
    assert torch.equal(got, brute_force(query_positions, key_positions, window))


@given(st.integers(0, 10), st.integers(0, 10), st.one_of(st.none(), st.integers(0, 6)), windows)
def test_the_square_and_window_masks_are_the_predicate_on_aligned_positions(tq, tk, offset, window):
    query_positions, key_positions = masks.aligned_positions(tq, tk, offset=offset)
    first = tk - tq if offset is None else offset
    assert query_positions.tolist() == list(range(first, first + tq))
    assert key_positions.tolist() == list(range(tk))
    expected = brute_force(range(first, first + tq), range(tk), window)
    if window is None:
        assert torch.equal(masks.causal_mask(tq, tk, offset=offset), expected)
    else:
        assert torch.equal(
            masks.sliding_window_mask(tq, tk, window=window, offset=offset), expected
        )


@given(st.integers(0, 60), windows)
def test_visible_keys_are_the_keys_the_predicate_allows(query_position, window):
    keys = masks.visible_keys(query_position, window)
    assert list(keys) == [k for k in range(query_position + 20) if rule(query_position, k, window)]


def test_alibi_aligns_its_queries_as_the_causal_mask_does():
    query_positions, key_positions = masks.aligned_positions(3, 5)
    distance = alibi.bias(torch.tensor([1.0]), 3, 5)[0, 0]  # (tq, tk): key - query
    assert torch.equal(distance, (key_positions[None] - query_positions[:, None]).float())
    assert torch.equal(distance <= 0, masks.causal_mask(3, 5))


# --- paths that mask by other means, against the predicate -----------------------------------


def one_hot_inputs(b, hq, hkv, tq, tk, seed):
    """Random q, k (small scores: every allowed weight is clearly > 0) and one-hot values:
    key j's value is feature j (max(tq, tk) features, room for a one-hot gradient too)."""
    d = max(tq, tk)
    g = torch.Generator().manual_seed(seed)
    q = 0.3 * torch.randn(b, hq, tq, d, generator=g)
    k = 0.3 * torch.randn(b, hkv, tk, d, generator=g)
    v = torch.eye(tk, d).expand(b, hkv, tk, d).contiguous()
    return q, k, v


def attended(out: torch.Tensor, tk: int) -> torch.Tensor:
    """(.., tq, tk) bool: the keys each query attended to, read off one-hot values."""
    return out[..., :tk] > 0


def backward_attended(out, v, tq: int, tk: int) -> torch.Tensor:
    """(b, hkv, tq, tk) bool: the weights the backward used, read off d out / d v with a
    one-hot gradient (query i's gradient is feature i), summed over each key/value head's
    query heads (which share one mask here)."""
    grad_out = torch.eye(tq, out.shape[-1]).expand(out.shape)
    (grad_v,) = torch.autograd.grad(out, v, grad_out)
    return grad_v[..., :tk, :tq].transpose(-2, -1) > 0  # grad_v[j, i] = w[i, j]


def float64_attention(q, k, v, allowed):
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    scores = q.double() @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(~allowed, -torch.inf).softmax(-1).nan_to_num(0.0)
    return weights @ v


# (tq, tk): one token, more keys, square, more queries (the first see no key), past the
# kernel's diagonal and query blocks, past the backward's 128-key blocks
SHAPES = [(1, 1), (3, 7), (7, 7), (7, 3), (40, 40), (33, 70), (70, 33), (130, 130)]
SHAPES += [(20, 300), (300, 300)]


@pytest.mark.parametrize(("tq", "tk"), [(1, 1), (3, 7), (7, 7), (7, 3), (33, 70), (40, 40)])
def test_sdpa_is_causal_is_top_left_and_the_rule_only_when_square(tq, tk):
    """PyTorch's is_causal puts query i at position i; attnlab passes it only where that is
    the bottom-right rule (square), and attention() masks by the predicate elsewhere."""
    q, k, v = one_hot_inputs(1, 2, 2, tq, tk, seed=tq * tk)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_the_rule(attended(out, tk), range(tq), range(tk))  # top-left
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
    assert_the_rule(attended(fused, tk), range(tq), range(tk))
    assert torch.equal(top_left(tq, tk), bottom_right(tq, tk)) == (tq == tk)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "math", "flash"])
@pytest.mark.parametrize(("tq", "tk"), SHAPES)
def test_every_backend_attends_where_the_predicate_allows(backend, tq, tk):
    """Forward and backward of attention(causal=True): SDPA's is_causal (square), the C++
    kernel (flash, auto) forward and its own backward, the predicate's mask elsewhere."""
    if backend == "flash" and not FLASH:
        pytest.skip("the C++ causal kernel is unavailable here")
    q, k, v = one_hot_inputs(2, 4, 2, tq, tk, seed=tq + tk)
    v.requires_grad_()
    out = attention(q, k, v, causal=True, backend=backend)
    assert_the_rule(attended(out, tk), range(tk - tq, tk), range(tk))
    assert_the_rule(backward_attended(out, v, tq, tk), range(tk - tq, tk), range(tk))
    allowed = bottom_right(tq, tk).expand(2, 4, tq, tk)
    torch.testing.assert_close(out.double(), float64_attention(q, k, v, allowed), **CLOSE)


@pytest.mark.skipif(not FLASH, reason="the C++ causal kernel is unavailable here")
@pytest.mark.parametrize(("tq", "tk"), SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_the_cpp_kernel_with_key_ranges_attends_where_the_predicate_allows(tq, tk, causal):
    """flash_cpu's kernel, causal with its tk - tq offset or not, every sequence reading
    its own key range [start, end): the predicate (if causal) and the range, nothing else;
    rows with no key are zeros."""
    b = 4
    q, k, v = one_hot_inputs(b, 2, 1, tq, tk, seed=tq * 3 + tk)
    v.requires_grad_()
    starts = torch.tensor([0, 0, tk // 3, tk // 2])
    ends = torch.tensor([tk, tk // 2, tk, max(tk // 2, tk - 1)])
    for key_ranges in (None, (starts, ends)):
        out = flash_cpu.attention(q, k, v, None, q.shape[-1] ** -0.5, causal, key_ranges)
        inside = torch.ones(b, 1, 1, tk, dtype=torch.bool)
        if key_ranges is not None:
            keys = torch.arange(tk)
            inside = ((keys >= starts[:, None]) & (keys < ends[:, None]))[:, None, None, :]
        forward, backward = attended(out, tk), backward_attended(out, v, tq, tk)
        if causal:  # the causal cut is the rule; each sequence's range comes on top
            assert_the_rule(forward, range(tk - tq, tk), range(tk), also=inside)
            assert_the_rule(backward, range(tk - tq, tk), range(tk), also=inside)
        allowed = (
            bottom_right(tq, tk) if causal else torch.ones(tq, tk, dtype=torch.bool)
        ) & inside
        assert torch.equal(forward, allowed.expand(b, 2, tq, tk))
        assert torch.equal(backward, allowed.expand(b, 1, tq, tk))
        torch.testing.assert_close(out.double(), float64_attention(q, k, v, allowed), **CLOSE)


def _one_hot_decoder(tokens: int, window: int | None) -> MultiHeadAttention:
    """One head whose queries and keys are zero and whose value is its input: each decode
    step's output is the mean of the one-hot inputs it attended to."""
    m = MultiHeadAttention(tokens, tokens, tokens, 0.0, 1, window=window).eval()
    with torch.no_grad():
        m.qkv_proj.weight.zero_()
        m.qkv_proj.weight[2 * tokens :] = torch.eye(tokens)  # values = x
        m.out_proj.weight.copy_(torch.eye(tokens))
        m.out_proj.bias.zero_()
    return m


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize(
    ("rolling", "window"), [(False, None), (False, 1), (False, 5), (True, 1), (True, 3), (True, 5)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_decoding_attends_where_the_predicate_allows(path, rolling, window, dtype):
    """A prompt of 4 tokens, then one token per call: the native C++ step reads the slots
    KVCache.native_slots names, the Python path ("math") masks by the cache's slot
    positions; a rolling cache holds the window's tokens, a plain one every token (the
    module's window then limits them). Token t's input is one-hot at t, so its output is
    nonzero exactly at the positions it saw."""
    if path == "native" and not NATIVE:
        pytest.skip("the native decode step is unavailable here")
    tokens, prompt = 12, 4
    m = _one_hot_decoder(tokens, window)
    m.backend = "auto" if path == "native" else "math"
    cache = m.make_cache(1, dtype=dtype) if rolling else KVCache(1, tokens, 1, tokens, dtype=dtype)
    assert cache.rolling == rolling
    x = torch.eye(tokens)[None]  # (1, t, t): token t is e_t
    with torch.no_grad():
        outputs = [m(x[:, :prompt], cache=cache)]
        for t in range(prompt, tokens):
            slot, first, count = cache.native_slots(t, window)
            native = plan.native_decode(m, x[:, t : t + 1], cache) is not None
            assert native == (path == "native")
            outputs.append(m(x[:, t : t + 1], cache=cache))
            held = cache.slot_positions()  # the position of the token in each slot
            assert held[slot] == t
            seen = torch.zeros(1, tokens, dtype=torch.bool)
            seen[0, held[first : first + count]] = True  # the positions the kernel reads
            assert_the_rule(seen, [t], range(tokens), window)
    out = torch.cat(outputs, dim=1)[0]  # (t, t)
    assert_the_rule(out > 0, range(tokens), range(tokens), window)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_the_ring_layout_blocks_attend_where_the_predicate_allows(world, kind, monkeypatch):
    """For every rank and every source chunk: layout.block_for's rows and columns, and the
    ring's block kernel (PyTorch's fused CPU flash, then the explicit product), attend to
    exactly the keys the predicate allows between the two ranks' positions; the scores
    each rank computes are the predicate's count."""
    tokens, local = 8 * world, 8

    def positions(rank):
        pieces = torch.arange(tokens).chunk(world * layout.pieces_per_rank(kind))
        if kind == "contiguous":
            return pieces[rank]
        return torch.cat([pieces[rank], pieces[2 * world - 1 - rank]])

    counts = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(ring, "_fused", lambda q: False)
        for rank in range(world):
            queries = positions(rank)
            total = 0
            for source in range(world):
                keys = positions(source)
                got = torch.zeros(local, local, dtype=torch.bool)
                block = layout.block_for(rank, source, local, causal=True, layout=kind)
                if block is not None:
                    q, k, v = one_hot_inputs(1, 2, 1, local, local, seed=rank * world + source)
                    q, k, v = q[:, :, block.rows], k[:, :, block.cols], v[:, :, block.cols]
                    out, _ = ring._block(q, k, v, block, SimpleNamespace(scale=0.5, acc=q.dtype))
                    cols = range(local)[block.cols]
                    got[block.rows, block.cols] = attended(out[0, 0], local)[:, cols]
                assert_the_rule(got, queries.tolist(), keys.tolist())
                total += int(brute_force(queries, keys).sum())
            counts.append(total)
    assert counts == 2 * layout.scores_per_rank(world, tokens, causal=True, layout=kind)


@pytest.mark.parametrize(("tq", "tk"), [(3, 3), (3, 7), (5, 12)])
def test_hf_calls_without_a_mask_are_top_left_causal(tq, tk):
    """transformers skips its mask where SDPA's top-left is_causal would build it: attnlab
    keeps the keys query tq - 1 sees at position tq - 1 (visible_keys) and matches."""
    module = nn.Module().eval()
    module.is_causal = True
    q, k, v = one_hot_inputs(1, 2, 2, tq, tk, seed=tq + tk)
    out, _ = hf.attention_forward(module, q, k, v, None)  # (b, tq, h, d)
    assert_the_rule(attended(out.transpose(1, 2), tk), range(tq), range(tk))  # top-left


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(0, 9), st.integers(1, 5))
def test_the_python_paths_attend_where_the_predicate_allows(tq, extra, window):
    """functional.attention with the sliding-window mask, more keys than queries (the
    module's positional mask with a window: see the decoding test), against the definition."""
    tk = tq + extra
    q, k, v = one_hot_inputs(1, 1, 1, tq, tk, seed=tq * 10 + tk)
    mask = masks.sliding_window_mask(tq, tk, window=window)
    out = attention(q, k, v, mask=mask, causal=True, backend="math")
    assert_the_rule(attended(out, tk), range(tk - tq, tk), range(tk), window)
