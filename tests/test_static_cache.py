"""attnlab.static_cache: decoding through a StaticKVCache equals the full forward on every
layout and storage dtype; a decode loop compiles once for every position; a step
dispatches no more ops than a minimal static-cache SDPA layer; errors leave the cache as it
was."""

import pytest
import torch
import torch._dynamo
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch._dynamo.testing import CompileCounter

from attnlab import MultiHeadAttention
from attnlab.static_cache import StaticKVCache
from tests import products
from tests.decode_reference import DispatchedOps, GptFastLayer

D_IN = 32


def _module(num_heads=4, num_kv_heads=None, rope=False, window=None, context_length=24):
    torch.manual_seed(0)
    return MultiHeadAttention(
        D_IN,
        D_IN,
        context_length,
        0.0,
        num_heads,
        num_kv_heads=num_kv_heads,
        rope=rope,
        window=window,
    ).eval()


def _decode(module, x, prefill, cache):
    """x's tokens through `cache`: a prefill of `prefill` tokens, then one token a step."""
    outs = [module(x[:, :prefill], cache=cache)] if prefill else []
    outs += [module(x[:, i : i + 1], cache=cache) for i in range(prefill, x.shape[1])]
    return torch.cat(outs, dim=1)  # (b, t, d_out)


@given(
    layout=st.sampled_from([(4, None), (4, 2), (4, 1)]),
    rope=st.booleans(),
    window=st.sampled_from([None, 1, 3, 7]),
    batch=st.integers(1, 3),
    tokens=st.integers(1, 12),
    prefill=st.integers(0, 12),
)
def test_decoding_equals_the_full_forward(layout, rope, window, batch, tokens, prefill):
    module = _module(*layout, rope=rope, window=window)
    x = torch.randn(batch, tokens, D_IN)
    with torch.no_grad():
        expected = module(x)
        cache = module.make_cache(batch, 16, static=True)
        got = _decode(module, x, min(prefill, tokens), cache)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    assert cache.tokens == tokens and cache.position.tolist() == [tokens]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("layout", [(4, None), (4, 1)])
def test_a_narrower_store_equals_the_dynamic_cache_of_the_same_store(dtype, layout):
    """The same rounding (the same quantize for int8) as KVCache's narrower stores."""
    module = _module(*layout, rope=True)
    x = torch.randn(2, 10, D_IN)
    with torch.no_grad():
        expected = _decode(module, x, 3, module.make_cache(2, 16, dtype=dtype))
        got = _decode(module, x, 3, module.make_cache(2, 16, static=True, dtype=dtype))
        full = module(x)
    # the dynamic cache's native step may multiply in bfloat16 (tests/products.py), the static
    # cache's SDPA multiplies in float32
    heads, kv_heads = layout
    tolerance = products.tolerance(dtype, heads // (kv_heads or heads), 1e-5)
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert (got - full).abs().max() > 0  # the store really rounds
    torch.testing.assert_close(got, full, atol=0.05, rtol=0)


def test_the_weights_and_a_mask_span_the_capacity():
    module = _module()
    x = torch.randn(2, 6, D_IN)
    keep = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    keep[1, ..., 0] = False  # sequence 1 may not see its first token
    with torch.no_grad():
        mask = keep[..., :6].expand(2, 1, 6, 6) & torch.ones(6, 6, dtype=torch.bool).tril()
        expected, expected_weights = module(x, mask=mask, need_weights=True)
        cache = module.make_cache(2, 16, static=True)
        out, weights = module(x, cache=cache, mask=keep, need_weights=True)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert weights.shape == (2, 4, 6, 16)
    torch.testing.assert_close(weights[..., :6], expected_weights, atol=2e-6, rtol=1e-5)
    assert not weights[..., 6:].any()


def test_reset_and_crop_move_the_position_back():
    module = _module()
    x = torch.randn(1, 8, D_IN)
    with torch.no_grad():
        cache = module.make_cache(1, 16, static=True)
        first = _decode(module, x, 4, cache)
        cache.crop(5)
        again = _decode(module, x[:, 5:], 0, cache)
        cache.reset()
        fresh = _decode(module, x, 2, cache)
    torch.testing.assert_close(again, first[:, 5:], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(fresh, first, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"num_tokens \(9\) is more than the cache holds \(8\)"):
        cache.crop(9)


def test_a_full_cache_raises_and_changes_nothing():
    module = _module()
    with torch.no_grad():
        cache = module.make_cache(1, 4, static=True)
        module(torch.randn(1, 3, D_IN), cache=cache)
        keys = cache.keys.clone()
        with pytest.raises(ValueError, match=r"holds 3 of at most max_tokens \(4\).*2 more"):
            module(torch.randn(1, 2, D_IN), cache=cache)
    assert cache.tokens == 3 and cache.position.tolist() == [3]
    assert torch.equal(cache.keys, keys)


def test_a_step_that_raises_after_writing_leaves_the_position():
    """Slots past the position are masked: the failed step's writes are never read."""
    module = _module()
    x = torch.randn(1, 6, D_IN)
    with torch.no_grad():
        expected = module(x)
        cache = module.make_cache(1, 16, static=True)
        module(x[:, :4], cache=cache)
        good_out = module.out_proj
        # an output forward refuses, after the keys and values are written
        module.out_proj = nn.Sequential(nn.Linear(D_IN, D_IN), nn.Flatten(0))
        with pytest.raises(ValueError, match="out_proj"):
            module(torch.randn(1, 1, D_IN), cache=cache)
        assert cache.tokens == 4 and cache.position.tolist() == [4]
        module.out_proj = good_out
        got = _decode(module, x[:, 4:], 0, cache)
    torch.testing.assert_close(got, expected[:, 4:], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m, c: m(torch.randn(2, 1, D_IN), cache=c), ValueError, "batch size 2"),
        (lambda m, c: m(torch.randn(1, 1, D_IN).double(), cache=c), TypeError, "float64"),
        (
            lambda m, c: m(torch.randn(1, 1, D_IN, requires_grad=True), cache=c),
            ValueError,
            "for inference",
        ),
        (
            lambda m, c: m(torch.randn(1, 1, D_IN), cache=c, mask=torch.ones(1, 5, dtype=bool)),
            ValueError,
            "static cache's capacity",
        ),
    ],
)
def test_a_call_that_does_not_fit_is_refused_by_name(call, error, message):
    module = _module()
    cache = module.make_cache(1, 16, static=True)
    with pytest.raises(error, match=message), torch.set_grad_enabled(message == "for inference"):
        call(module, cache)
    assert cache.tokens == 0 and cache.position.tolist() == [0]


def test_a_cache_longer_than_the_context_or_made_for_other_heads_is_refused():
    module = _module(context_length=24)
    with pytest.raises(ValueError, match=r"max_tokens \(25\).*context_length \(24\)"):
        module.make_cache(1, 25, static=True)
    other = StaticKVCache(1, 16, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        module(torch.randn(1, 1, D_IN), cache=other)
    with pytest.raises(TypeError, match="static must be a bool"):
        module.make_cache(1, 16, static="yes")


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_a_decode_step_dispatches_no_more_ops_than_a_minimal_static_cache_layer(kv_heads):
    """Counted on the meta device, which takes the GPU's path (no CPU kernel, no value
    read): what a decode step launches on a GPU, SDPA's own ops alike on both sides."""
    module = MultiHeadAttention(64, 64, 64, 0.0, 4, num_kv_heads=kv_heads, device="meta")
    reference = GptFastLayer(64, 4, kv_heads, 64, batch=2, device="meta")
    x = torch.randn(2, 1, 64, device="meta")
    with torch.no_grad():
        cache = module.make_cache(2, 64, static=True)
        module(torch.randn(2, 5, 64, device="meta"), cache=cache)
        with DispatchedOps() as ours:
            module(x, cache=cache)
        with DispatchedOps() as theirs:
            reference(x, torch.tensor([5], device="meta"))
    assert sum(ours.ops.values()) <= sum(theirs.ops.values()), (ours.ops, theirs.ops)
    assert not {"_local_scalar_dense", "clone", "_to_copy"} & {
        op.split(".")[-1] for op in ours.ops if ours.ops[op] > theirs.ops.get(op, 0)
    }


class _Tiny(nn.Module):
    """Embedding, two attnlab layers with their static caches, a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(50, D_IN)
        self.layers = nn.ModuleList(
            MultiHeadAttention(D_IN, D_IN, 128, 0.0, 4, num_kv_heads=2, rope=True, window=9)
            for _ in range(2)
        )
        self.head = nn.Linear(D_IN, 50)

    def forward(self, ids, caches):
        h = self.embedding(ids)
        for layer, cache in zip(self.layers, caches, strict=True):
            h = h + layer(h, cache=cache)
        return self.head(h)


def _greedy(model, step, steps, dtype):
    caches = [layer.make_cache(1, 128, static=True, dtype=dtype) for layer in model.layers]
    with torch.no_grad():
        token = model(torch.tensor([[3, 1, 4, 1, 5]]), caches)[:, -1:].argmax(-1)
        tokens = []
        for _ in range(steps):
            token = step(token, caches)[:, -1:].argmax(-1)  # (1, 1)
            tokens.append(token)
    return torch.cat(tokens, dim=1), caches


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.int8])
def test_a_compiled_decode_loop_compiles_once_for_every_position(dtype):
    model = _Tiny().eval()
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    got, caches = _greedy(model, compiled, 100, dtype)
    expected, _ = _greedy(model, model, 100, dtype)
    assert counter.frame_count == 1
    assert torch.equal(got, expected)
    assert [c.position.tolist() for c in caches] == [[105], [105]]


def test_the_decode_loop_under_inductor_reduce_overhead_equals_eager():
    model = _Tiny().eval()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    got, _ = _greedy(model, compiled, 12, None)
    expected, _ = _greedy(model, model, 12, None)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch.equal(got, expected)


def _compiled_steps(module, cache, steps):
    step = torch.compile(lambda t, c: module(t, cache=c), fullgraph=True, backend=CompileCounter())
    torch._dynamo.reset()
    for _ in range(steps):
        step(torch.randn(1, 1, D_IN), cache)


def test_eager_calls_after_compiled_steps_see_the_devices_position():
    """Compiled steps move the position on the device only; the next eager check reads it
    back once: crop accepts what the cache holds, a full cache is refused by name."""
    module = _module(context_length=8)
    with torch.no_grad():
        cache = module.make_cache(1, 8, static=True)
        module(torch.randn(1, 2, D_IN), cache=cache)
        _compiled_steps(module, cache, 6)  # position 8: full
        with pytest.raises(ValueError, match=r"holds 8 of at most max_tokens \(8\)"):
            module(torch.randn(1, 1, D_IN), cache=cache)
        assert cache.position.tolist() == [8]
        cache.crop(5)
        assert cache.tokens == 5 and cache.position.tolist() == [5]
        module(torch.randn(1, 1, D_IN), cache=cache)
    assert cache.tokens == 6


def test_a_compiled_step_past_the_capacity_stays_in_range():
    """The caller owns the bound under compile: a step past it rotates and writes as the
    last slot (never an out-of-range read of the rotary tables or write of the buffers)."""
    module = _module(rope=True, context_length=8)
    with torch.no_grad():
        cache = module.make_cache(1, static=True)
        _compiled_steps(module, cache, 10)
    assert cache.position.tolist() == [10]


def test_a_static_cache_made_in_inference_mode_is_refused_outside_it_by_name():
    module = _module()
    with torch.inference_mode():
        cache = module.make_cache(1, 8, static=True)
    with torch.no_grad(), pytest.raises(ValueError, match=r"made under torch\.inference_mode"):
        module(torch.randn(1, 2, D_IN), cache=cache)
    assert cache.tokens == 0
    with torch.inference_mode():
        module(torch.randn(1, 2, D_IN), cache=cache)
    assert cache.tokens == 2


def test_check_room_refuses_what_is_not_a_count():
    cache = StaticKVCache(1, 4, 1, 8)
    with pytest.raises(ValueError, match="num_new must be >= 1"):
        cache.check_room(-3)
