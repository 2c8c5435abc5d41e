"""attnlab.plan.decode_lane: the decode step's call plan read in C++ (csrc/decode_plan.h).
It must take a call only where forward's checks pass and plan.native_decode (the reference)
takes it, take the module as built, see every change of a class's code through CPython's
type version tags, and never crash on a malformed module or cache."""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from attnlab import KVCache, MultiHeadAttention, decode_cpu, plan
from attnlab.norms import RMSNorm
from attnlab.rope import RotaryEmbedding
from tests import products
from tests.test_plan_conditions import REFUSED, TAKEN, build

pytestmark = pytest.mark.skipif(
    not decode_cpu.available(), reason="the native decode step is unavailable here"
)


def takes(m, x, cache):
    """Whether the lane takes m(x, cache=cache) (nothing run or written)."""
    plan._lane()  # set up once
    return decode_cpu.binding().lane_takes(m, x, cache)


def filled(m, batch=2, tokens=5, **cache_kwargs):
    cache = m.make_cache(batch, **cache_kwargs)
    with torch.no_grad():
        m(torch.randn(batch, tokens, m.d_in), cache=cache)
    return cache


def taken_layer():
    """A layer with rope and per-head norms, its filled cache and a token, which the lane
    takes (asserted)."""
    m = build(rope=True, qk_norm="head")
    cache = filled(m)
    x = torch.randn(2, 1, 16)
    with torch.no_grad():
        assert takes(m, x, cache)
    return m, cache, x


def reference_takes(m, x, cache):
    """plan.native_decode's verdict, None where forward would raise first."""
    try:
        return plan.native_decode(m, x, cache) is not None
    except Exception:  # a malformed state forward refuses before the plan is asked
        return False


@pytest.mark.parametrize("case", sorted(TAKEN))
def test_the_module_as_built_is_taken_and_decodes_as_the_python_path(case):
    """Every layout the native step takes, with a cache that does not roll (a window larger
    than the cache's tokens), under no_grad: the lane takes it, and a decode through it
    equals the same module's decode with the lane and the native step off."""
    kwargs = dict(TAKEN[case])
    dropout = kwargs.pop("dropout", 0.0)
    if "window" in kwargs:
        kwargs["window"] = 40  # a window over more than the cache: no rolling
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 32, 48, dropout, 4, **({"num_kv_heads": 2} | kwargs)).eval()
    twin = copy.deepcopy(m)
    twin.python_path = True  # an attribute a fresh module lacks: the Python path
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        cache, twin_cache = m.make_cache(2, 12), twin.make_cache(2, 12)
        m(x[:, :4], cache=cache)
        twin(x[:, :4], cache=twin_cache)
        for t in range(4, 9):
            assert takes(m, x[:, t : t + 1], cache)
            assert not takes(twin, x[:, t : t + 1], twin_cache)
            got = m(x[:, t : t + 1], cache=cache)
            want = twin(x[:, t : t + 1], cache=twin_cache)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert cache.position == twin_cache.position == t + 1
        torch.testing.assert_close(cache.keys, twin_cache.keys, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_each_condition_the_reference_refuses_is_refused(case):
    m = REFUSED[case]()
    x = torch.randn(2, 1, 16, dtype=m.out_proj.weight.dtype)
    cache = KVCache(2, 8, m.num_kv_heads, m.head_dim, dtype=torch.float32, block_tokens=256)
    with torch.no_grad():
        assert not takes(m, x, cache)


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# each a context under which the lane must not run (what plan.native_decode or the lane's
# own conditions refuse): torch's state, not the module's
STATES = {
    "grad mode": lambda: torch.enable_grad(),
    "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "a function mode": lambda: _Mode(),
    "a dispatch mode": lambda: _Dispatch(),
    "forward-mode AD": lambda: torch.autograd.forward_ad.dual_level(),
}


@pytest.mark.parametrize("state", sorted(STATES))
def test_torchs_state_the_native_step_does_not_stand_for_is_refused(state):
    m = build()
    cache = filled(m)
    x = torch.randn(2, 1, 16)
    with torch.no_grad():
        assert takes(m, x, cache)
        with STATES[state]():
            assert not takes(m, x, cache)
        assert takes(m, x, cache)


def test_inside_vmap_and_a_jit_trace_it_is_refused():
    m = build()
    cache = filled(m, batch=1)
    seen = []

    def probe(x):
        seen.append(takes(m, x.unsqueeze(0), cache))
        return x

    with torch.no_grad():
        torch.func.vmap(probe)(torch.randn(1, 1, 16))
        torch.jit.trace(probe, torch.randn(1, 16), check_trace=False)
        assert seen == [False, False]
        assert takes(m, torch.randn(1, 1, 16), cache)


def test_a_global_hook_or_torchs_f_linear_replaced_is_refused(monkeypatch):
    m = build()
    cache = filled(m)
    x = torch.randn(2, 1, 16)
    with torch.no_grad():
        handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
        assert not takes(m, x, cache)
        handle.remove()
        assert takes(m, x, cache)
        monkeypatch.setattr(F, "linear", lambda *args: torch._C._nn.linear(*args))
        assert not takes(m, x, cache)
        monkeypatch.undo()
        assert takes(m, x, cache)


# each a class and one of its methods (a class-level patch of it): the type's version tag
# changes, so the lane reads plan.py's test again, which refuses
PATCHED = {
    "MultiHeadAttention._combine_heads": (MultiHeadAttention, "_combine_heads"),
    "MultiHeadAttention.attention_scale": (MultiHeadAttention, "attention_scale"),
    "nn.Linear.forward": (nn.Linear, "forward"),
    "nn.Module.__call__ (nn.Linear's base)": (nn.Module, "_call_impl"),
    "RotaryEmbedding.forward": (RotaryEmbedding, "forward"),
    "RMSNorm.forward": (RMSNorm, "forward"),
    "KVCache.native_slots": (KVCache, "native_slots"),
    "KVCache.keys_t": (KVCache, "keys_t"),
}


@pytest.mark.parametrize("case", sorted(PATCHED))
def test_a_class_patched_after_the_lane_read_it_is_seen_and_its_undo_too(case, monkeypatch):
    cls, name = PATCHED[case]
    m, cache, x = taken_layer()  # the tags read and trusted
    with torch.no_grad():
        original = cls.__dict__[name]
        monkeypatch.setattr(
            cls,
            name,
            property(original.fget)  # a new property of the same getter
            if isinstance(original, property)
            else (lambda *a, **k: original(*a, **k)),
        )
        assert not takes(m, x, cache)
        assert not takes(m, x, cache)  # twice: a refusal is not cached as a pass
        monkeypatch.undo()
        assert takes(m, x, cache)


# each a change of one instance (the module, a layer, the cache, x) that the lane refuses,
# as the reference does or by its own stricter conditions
def _set(obj, name, value):
    setattr(obj, name, value)


INSTANCE = {
    "an attribute of the module's own": lambda m, c, x: _set(m, "extra", 1),
    "an instance forward on qkv_proj": lambda m, c, x: _set(m.qkv_proj, "forward", print),
    "a forward pre-hook on out_proj": lambda m, c, x: m.out_proj.register_forward_pre_hook(
        lambda *a: None
    ),
    "a backward hook on the rope": lambda m, c, x: m.rope.register_full_backward_hook(
        lambda *a: None
    ),
    "a hook on k_norm": lambda m, c, x: m.k_norm.register_forward_hook(lambda *a: None),
    "a float64 qkv bias": lambda m, c, x: _set(
        m.qkv_proj, "bias", nn.Parameter(torch.zeros(64, dtype=torch.float64))
    ),
    "a strided qkv weight": lambda m, c, x: _set(
        m.qkv_proj, "weight", nn.Parameter(torch.randn(16, 64).t())
    ),
    "the rope's tables too short": lambda m, c, x: _set(m.rope, "cos", m.rope.cos[:3]),
    "an attribute of the cache's own": lambda m, c, x: _set(c, "note", 1),
    "a cache subclass": lambda m, c, x: _set(c, "__class__", type("Sub", (KVCache,), {})),
    "a cache that recorded grad": lambda m, c, x: c._keys_t.requires_grad_(
        c._keys_t.is_floating_point()  # int8 buffers cannot: then the cache is as it was
    ),
    "the cache at its capacity": lambda m, c, x: _set(c, "position", c.capacity),
    "a module subclass": lambda m, c, x: _set(m, "__class__", type("M", (MultiHeadAttention,), {})),
    "training with dropout": lambda m, c, x: (_set(m, "dropout", 0.1), m.train()),
    "another eps on q_norm": lambda m, c, x: _set(m.q_norm, "eps", 1e-3),
    "a scale given as an int": lambda m, c, x: m.__dict__.__setitem__("_scale", 1),
}


@pytest.mark.parametrize("case", sorted(INSTANCE))
def test_a_changed_instance_is_refused(case):
    m, cache, x = taken_layer()
    with torch.no_grad():
        INSTANCE[case](m, cache, x)
        assert not takes(m, x, cache)


# each an input the lane refuses (forward then checks it and decodes or names its error)
INPUTS = {
    "two tokens": lambda x: torch.cat([x, x], dim=1),
    "float64": lambda x: x.double(),
    "a subclass": lambda x: x.as_subclass(type("T", (torch.Tensor,), {})),
    "another batch": lambda x: x[:1],
    "another width": lambda x: torch.randn(2, 1, 8),
    "a negated view": lambda x: torch._neg_view(-x),
    "a list": lambda x: x.tolist(),
}


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_an_input_the_kernel_does_not_read_is_refused(case):
    m = build()
    cache = filled(m)
    with torch.no_grad():
        assert not takes(m, INPUTS[case](torch.randn(2, 1, 16)), cache)


def test_a_cache_of_a_wider_window_is_left_to_the_python_face():
    m = build(window=3)
    with torch.no_grad():
        assert takes(m, torch.randn(2, 1, 16), filled(m))  # make_cache: the window's slots
        wider = KVCache(2, 40, 2, 8, window=5, block_tokens=256)
        assert not takes(m, torch.randn(2, 1, 16), wider)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_rolling_cache_decodes_as_the_python_path_and_an_overflow_leaves_it_as_it_was(dtype):
    """A window of 3 over 9 tokens (the slots overwritten twice over): each step equals the
    Python path's; a step whose scores overflow float32 (a scale of 1e38) is refused by the
    lane with the overwritten slot put back bit for bit."""
    m = build(window=3, rope=True)
    twin = copy.deepcopy(m)
    twin.python_path = True
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        cache, twin_cache = m.make_cache(2, dtype=dtype), twin.make_cache(2, dtype=dtype)
        assert cache.rolling
        for t in range(9):
            assert takes(m, x[:, t : t + 1], cache)
            got = m(x[:, t : t + 1], cache=cache)
            want = twin(x[:, t : t + 1], cache=twin_cache)
            tolerance = products.tolerance(dtype, 2, 1e-5)  # the twin multiplies in float32
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        held = [t.clone() for t in cache._tensors()]
        m.scale = 1e38  # every score past float32
        assert decode_cpu.binding().decode_lane(m, x[:, :1] * 1e3, cache) is None
        assert cache.position == 9
        for now, before in zip(cache._tensors(), held, strict=True):
            assert torch.equal(now, before)


# malformed values the Python objects can hold: the lane refuses each without a crash, and
# forward then does what it did before (decodes or names its error)
MALFORMED = {
    "num_heads 0": ("module", "num_heads", 0),
    "num_kv_heads past int64": ("module", "num_kv_heads", 2**70),
    "d_in a string": ("module", "d_in", "16"),
    "d_out negative": ("module", "d_out", -32),
    "window 0": ("module", "window", 0),
    "window a float": ("module", "window", 3.0),
    "backend None": ("module", "backend", None),
    "causal 1": ("module", "causal", 1),
    "training None": ("module", "training", None),
    "_modules a list": ("module", "_modules", []),
    "scale nan": ("module", "_scale", math.nan),
    "scale inf": ("module", "_scale", math.inf),
    "position -1": ("cache", "position", -1),
    "position a float": ("cache", "position", 2.0),
    "block 0": ("cache", "block", 0),
    "capacity None": ("cache", "capacity", None),
    "keys None": ("cache", "_keys_t", None),
    "keys float64": ("cache", "_keys_t", torch.zeros(2, 2, 8 * 48, dtype=torch.float64)),
    "keys of another shape": ("cache", "_keys_t", torch.zeros(2, 2, 4)),
    "one scale missing": ("cache", "_key_scales", torch.zeros(2, 2, 48)),
    "hooks a list": ("layer", "_forward_hooks", []),
    "parameters a tuple": ("layer", "_parameters", ()),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_module_or_cache_is_refused_without_a_crash(case):
    where, name, value = MALFORMED[case]
    m = build()
    cache = filled(m)
    x = torch.randn(2, 1, 16)
    target = {"module": m, "cache": cache, "layer": m.qkv_proj}[where]
    target.__dict__[name] = value  # as the object holds it, past any setter
    with torch.no_grad():
        assert not takes(m, x, cache) or reference_takes(m, x, cache)
        with contextlib.suppress(Exception):  # forward's outcome or error, never a crash
            m(x, cache=cache)


# a random set of changes at once: the lane takes the call only where the reference does,
# and then gives the Python path's output
CHANGES = [*sorted(INSTANCE), "none"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(CHANGES), max_size=3),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
    st.integers(1, 3),
)
def test_the_lane_takes_a_call_only_where_the_reference_does(changes, dtype, batch):
    torch.manual_seed(len(changes))
    m = build(rope=True, qk_norm="head")
    cache = filled(m, batch=batch, dtype=dtype)
    x = torch.randn(batch, 1, 16)
    for change in changes:
        if change != "none":
            INSTANCE[change](m, cache, x)
    with torch.no_grad():
        taken = takes(m, x, cache)
        if not taken:
            return
        assert reference_takes(m, x, cache)
        twin, twin_cache = copy.deepcopy(m), copy.deepcopy(cache)
        twin.__dict__["python_path"] = True
        got, want = m(x, cache=cache), twin(x, cache=twin_cache)
        tolerance = products.tolerance(dtype, m.num_heads // m.num_kv_heads, 1e-5)
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


# a class attribute added for a name the plans read from instances' dictionaries (where
# Python's reads would run it instead): the lane refuses, and so does the reference
SHADOWED = {
    "KVCache.position": (KVCache, "position"),
    "KVCache.batch_size": (KVCache, "batch_size"),
    "MultiHeadAttention.num_heads": (MultiHeadAttention, "num_heads"),
    "MultiHeadAttention.causal": (MultiHeadAttention, "causal"),
    "MultiHeadAttention.qkv_proj": (MultiHeadAttention, "qkv_proj"),
    "nn.Linear.weight": (nn.Linear, "weight"),
    "RotaryEmbedding.cos": (RotaryEmbedding, "cos"),
    "RMSNorm.eps": (RMSNorm, "eps"),
    "nn.Module.__getattr__": (nn.Module, "__getattr__"),
}


@pytest.mark.parametrize("case", sorted(SHADOWED))
def test_a_class_attribute_over_a_field_the_lane_reads_is_refused(case, monkeypatch):
    cls, name = SHADOWED[case]
    m, cache, x = taken_layer()
    with torch.no_grad():
        if name == "__getattr__":
            original = nn.Module.__getattr__
            monkeypatch.setattr(cls, name, lambda self, key: original(self, key))
        else:
            monkeypatch.setattr(cls, name, property(lambda self: 0), raising=False)
        assert not takes(m, x, cache)
        assert plan.native_module(m) is None
        monkeypatch.undo()
        assert takes(m, x, cache)


@pytest.mark.parametrize("buffer", ["_keys_t", "_values_t", "weight"])
def test_a_storage_resized_in_place_is_refused_and_named_not_read_past(buffer):
    """untyped_storage().resize_ keeps a tensor's shape over fewer bytes: the lane refuses,
    and the Python plan's native step names it (the op's check, or torch's own where the
    rolling cache's transaction views the slot first) instead of reading or writing past
    the storage (a crash)."""
    m = build(window=3)  # a rolling cache: the lane would keep its slot first
    cache = filled(m)
    x = torch.randn(2, 1, 16)
    held = cache.__dict__[buffer] if buffer != "weight" else m.qkv_proj.weight
    with torch.no_grad():
        held.untyped_storage().resize_(4)
        assert not takes(m, x, cache)
        with pytest.raises(RuntimeError, match="storage"):  # the op's, or torch's view check
            m(x, cache=cache)


def test_a_deleted_rope_is_the_modules_own_error_on_every_path():
    m = build(rope=True)
    cache = filled(m)
    del m.rope
    with torch.no_grad():
        assert not takes(m, torch.randn(2, 1, 16), cache)
        assert plan.native_module(m) is None
        with pytest.raises(AttributeError, match="rope"):
            m(torch.randn(2, 1, 16), cache=cache)


def test_a_rope_set_to_none_after_construction_decodes_natively_without_one():
    """m.rope = None on a module built with rope (nn.Module keeps None in _modules): no
    rotary positions on every path, and both plans take the native step."""
    m = build(rope=True)
    m.rope = None
    twin = copy.deepcopy(m)
    twin.python_path = True
    x = torch.randn(2, 1, 16)
    cache, twin_cache = filled(m), filled(twin)
    twin_cache.__dict__.update(copy.deepcopy(cache.__dict__))  # the same tokens held
    with torch.no_grad():
        assert takes(m, x, cache) and plan.native_module(m) is not None
        torch.testing.assert_close(m(x, cache=cache), twin(x, cache=twin_cache))


def test_keys_and_values_in_one_storage_are_refused():
    m = build()
    cache = filled(m)
    cache._values_t = cache._keys_t
    with torch.no_grad():
        assert not takes(m, torch.randn(2, 1, 16), cache)
