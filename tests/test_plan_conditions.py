"""attnlab.plan's allow-list, one condition at a time (issue 37, item 17): for each condition
of plan.py, a case where dropping, negating or moving it changes what the user gets: a fast
path computing something other than the module's own Python path, a raw error where the
door names one, or the fast path no longer taken where it applies (the plan's contract, as
its docstrings state it). scripts/mutants.py applies those one-line mutants and runs these
tests (and the plan's others) against each."""

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._dynamo.testing import CompileCounter

from attnlab import KVCache, MultiHeadAttention, decode_cpu, plan
from attnlab.norms import RMSNorm
from attnlab.rope import RotaryEmbedding

needs_native = pytest.mark.skipif(
    not decode_cpu.available(), reason="the native decode step is unavailable here"
)


def build(seed=0, **kwargs):
    """16 -> 32 features, 4 query heads of 8, 2 key/value heads: the native step's shapes."""
    torch.manual_seed(seed)
    return MultiHeadAttention(16, 32, 48, 0.0, 4, **({"num_kv_heads": 2} | kwargs)).eval()


def python_twin(m):
    """A copy of m that the plan sends down the Python path (an attribute a fresh module does
    not hold): the module's own computation, to compare a fast path against."""
    twin = copy.deepcopy(m)
    twin.python_path = True
    assert plan.native_module(twin) is None
    return twin


def decode(m, x, cache=None):
    """x (b, t, d) fed one token per call through `cache` (default m.make_cache), each call
    after its own fixed seed (so that dropout draws alike in two modules): (b, t, width)."""
    cache = m.make_cache(x.shape[0]) if cache is None else cache
    outputs = []
    for i in range(x.shape[1]):
        torch.manual_seed(100 + i)
        outputs.append(m(x[:, i : i + 1], cache=cache))
    return torch.cat(outputs, dim=1)


def every_path(m, x):
    """m's outputs for full forwards of 1, 6 and 40 tokens (the native step's, the blocked
    projection's and the GEMM's row counts) and a decode of 6 tokens."""
    with torch.no_grad():
        outputs = [m(x[:, :t]) for t in (1, 6, 40)]
        return [*outputs, decode(m, x[:, :6])]


def assert_paths_close(got, want):
    for name, a, b in zip(("1 token", "6 tokens", "40 tokens", "decode"), got, want, strict=True):
        assert type(a) is type(b), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def _non_contiguous(t):
    """t's values held with other strides: a matrix column-major, a vector every second."""
    if t.dim() == 2:
        return t.t().contiguous().t()
    return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]


# The plan's contract, as native_module and native_decode state it: taken for the module as
# built (each layout, rope or not, bias or not, a window, training without dropout), refused
# for each condition it names.

TAKEN = {
    "plain": {},
    "rope": {"rope": True},
    "bias": {"qkv_bias": True},
    "mha": {"num_kv_heads": 4},
    "mqa": {"num_kv_heads": 1, "rope": True},
    "window": {"window": 3},
    "dropout in eval": {"dropout": 0.5},
    "query/key norms per head": {"qk_norm": "head", "rope": True},
    "query/key norms over the projection": {"qk_norm": "projection", "num_kv_heads": 1},
    "Gemma's 1 + weight norms": {"qk_norm": "head", "qk_norm_offset": 1.0, "rope": True},
}


@needs_native
@pytest.mark.parametrize("case", sorted(TAKEN))
def test_the_native_step_is_taken_for_the_module_as_built(case):
    kwargs = dict(TAKEN[case])
    dropout = kwargs.pop("dropout", 0.0)
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 32, 48, dropout, 4, **({"num_kv_heads": 2} | kwargs)).eval()
    x = torch.randn(2, 1, 16)
    with torch.no_grad():
        cache = m.make_cache(2)
        assert plan.native_module(m) is not None
        assert plan.native_decode(m, x, cache) is not None
        m(torch.randn(2, 5, 16), cache=cache)  # 5 tokens on: a rolling cache has wrapped
        assert plan.native_decode(m, x, cache) is not None
        unwindowed = build(**{k: v for k, v in kwargs.items() if k != "window"})
        assert plan.native_decode(m, x, unwindowed.make_cache(2)) is not None  # window or not
    assert plan.native_decode(m, x, cache) is None  # autograd would record the call
    m.requires_grad_(False)  # frozen weights, grad mode on: nothing to record
    assert plan.native_decode(m, x, cache) is not None


@needs_native
def test_training_without_dropout_takes_the_native_step_and_with_it_does_not():
    m = build().train()
    assert plan.native_module(m) is not None
    m.dropout = 0.5
    assert plan.native_module(m) is None
    m.eval()
    assert plan.native_module(m) is not None


def _changed(m, **attributes):
    """m with each attribute (a submodule, a flag) set, or with each rope table set."""
    for name, value in attributes.items():
        setattr(m.rope if name in ("cos", "sin") else m, name, value)
    return m


def _out_proj(bias=True, **where):
    return nn.Linear(32, 32, bias=bias, **where)


# each a module with query/key norms violating one condition the native step states of
# them; the ones with a forward to compare are decoded through their own call below
NORM_REFUSED = {
    "q_norm another module": lambda: _changed(build(qk_norm="head"), q_norm=nn.Identity()),
    "k_norm a subclass": lambda: _changed(build(qk_norm="head"), k_norm=_NormSubclass(8)),
    "k_norm of another eps": lambda: _norm_changed("k_norm", eps=1e-3),
    "q_norm of another offset": lambda: _norm_changed("q_norm", offset=1.0),
    "q_norm float64": lambda: _changed(build(qk_norm="head"), q_norm=RMSNorm(8).double()),
    "k_norm on meta": lambda: _changed(build(qk_norm="head"), k_norm=RMSNorm(8, device="meta")),
    "q_norm over the projection's width": lambda: _changed(
        build(qk_norm="head"), q_norm=RMSNorm(32)
    ),
    "k_norm weight a buffer": lambda: _norm_weight_as_buffer(build(qk_norm="projection")),
    "q_norm with a forward hook": lambda: _hooked(build(qk_norm="head")),
    "k_norm with an instance forward": lambda: _norm_changed("k_norm", forward=lambda x: x),
    "both eps a tensor": lambda: _norms_share(eps=torch.tensor(1e-3)),
    "both eps past float32": lambda: _norms_share(eps=1e39),
    "both offsets past float32": lambda: _norms_share(offset=-1e39),
    "q_norm weight a negated view": lambda: _norm_weight("q_norm", lambda w: torch._neg_view(-w)),
    "k_norm weight strided": lambda: _norm_weight("k_norm", lambda w: _non_contiguous(w)),
    "q_norm weight a subclass": lambda: _norm_weight("q_norm", lambda w: _DoubledTo(w)),
    "both offsets a tensor": lambda: _norms_share(offset=torch.tensor(1.0)),
}
# the door's errors, and an offset past float32, whose product overflows on the Python path
# (its ValueError)
_NO_FORWARD = {"k_norm on meta", "q_norm over the projection's width", "both offsets past float32"}


# each a module violating one condition the native step states (built in the test)
REFUSED = {
    "backend math": lambda: build(backend="math"),
    "not causal": lambda: _changed(build(), causal=False),
    "float64": lambda: build().double(),
    "float64 without biases": lambda: _changed(build(), out_proj=_out_proj(False)).double(),
    "out_proj float64": lambda: _changed(build(), out_proj=_out_proj(dtype=torch.float64)),
    "out_proj float64 without a bias": lambda: _changed(
        build(), out_proj=_out_proj(False, dtype=torch.float64)
    ),
    "out_proj on meta": lambda: _changed(build(), out_proj=_out_proj(device="meta")),
    "out_proj on meta without a bias": lambda: _changed(
        build(), out_proj=_out_proj(False, device="meta")
    ),
    "a float64 bias": lambda: _changed(
        build(), out_proj=_changed(_out_proj(), bias=nn.Parameter(torch.zeros(32).double()))
    ),
    "a bias on meta": lambda: _changed(
        build(), out_proj=_changed(_out_proj(), bias=nn.Parameter(torch.zeros(32, device="meta")))
    ),
    "another rope": lambda: _changed(build(rope=True), rope=nn.Identity()),
    "rope cos None": lambda: _changed(build(rope=True), cos=None),  # a buffer may hold None
    "rope sin None": lambda: _changed(build(rope=True), sin=None),
    **NORM_REFUSED,
}


class _NormSubclass(RMSNorm):
    """An RMSNorm subclass: whatever it changes, the kernel does not know it."""


def _norm_changed(name, **attributes):
    """A module with per-head norms whose `name` norm has each attribute set."""
    m = build(qk_norm="head")
    _changed(getattr(m, name), **attributes)
    return m


class _DoubledTo(nn.Parameter):
    """A parameter subclass whose .to() doubles (its own computation, as a quantised
    weight's): RMSNorm reads its weight through .to(), the kernel its memory."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is torch.Tensor.to else out


def _norm_weight(name, held):
    """A module with per-head norms whose `name` weight is held(weight) as a Parameter."""
    m = build(qk_norm="head")
    weight = held(torch.randn(8) + 1.0)
    getattr(m, name).weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
    return m


def _norms_share(**attributes):
    """A module with per-head norms both of which hold each attribute (one object)."""
    m = build(qk_norm="head")
    _changed(m.q_norm, **attributes)
    _changed(m.k_norm, **attributes)
    return m


def _norm_weight_as_buffer(m):
    weight = m.k_norm.weight.detach().clone()
    del m.k_norm.weight
    m.k_norm.register_buffer("weight", weight)
    return m


def _hooked(m):
    m.q_norm.register_forward_hook(lambda module, args, out: out * 2.0)
    return m


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_native_step_is_refused_for_each_condition_it_states(case):
    assert plan.native_module(REFUSED[case]()) is None


@pytest.mark.parametrize("strided", ["weight", "bias"])
def test_plain_linear_states_its_shapes_and_layout(strided):
    """plain_linear(layer, (out, in)) on its own: the shape asked (out None: any width of
    that input), contiguous parameters."""
    layer = nn.Linear(16, 32)
    assert plan.plain_linear(layer, (32, 16)) and plan.plain_linear(layer, (None, 16))
    assert not plan.plain_linear(layer, (None, 8))  # another input width
    assert not plan.plain_linear(layer, (16, 16)) and not plan.plain_linear(layer, (32, 8))
    assert not plan.plain_linear(nn.Linear(16, 32, bias=False), (None, 8))
    with torch.no_grad():
        parameter = getattr(layer, strided)
        setattr(layer, strided, nn.Parameter(_non_contiguous(parameter.detach())))
    assert not plan.plain_linear(layer, (32, 16)) and not plan.plain_linear(layer, (None, 16))
    squeezed = nn.Linear(16, 32)
    squeezed.weight = nn.Parameter(torch.randn(32 * 16))
    assert not plan.plain_linear(squeezed, (None, 16 * 32))


# Dropout, the cache's window and the rotary tables: what the native step computes
# otherwise.


@needs_native
def test_train_mode_decoding_applies_dropout_as_the_python_path_does():
    """The native step applies no dropout: in training with dropout > 0 each decode step is
    the module's Python path, dropout drawn as it draws it."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 32, 48, 0.5, 4, num_kv_heads=2).train()
    twin = python_twin(m)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        m(x)  # not the process's first call (the test below: it draws other numbers)
        got, want = decode(m, x), decode(twin, x)
        plain = decode(copy.deepcopy(m).eval(), x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, plain, atol=1e-3)  # dropout did change the outputs


@needs_native
def test_a_cache_keeping_a_wider_window_than_the_module_decodes_as_the_full_forward():
    """forward accepts a cache that keeps more tokens than the module's window; the native
    step would attend to all the cache holds (a rolling cache's keys are its window's)."""
    m = build(window=3)
    cache = build(window=5).make_cache(2)  # rolling, 5 tokens
    x = torch.randn(2, 12, 16)
    with torch.no_grad():
        torch.testing.assert_close(decode(m, x, cache), m(x), rtol=1e-5, atol=1e-5)


UNREAD_CACHES = {  # cache arguments beside make_cache's, and the decode's tolerance
    "rows (tokens_last=False)": ({"tokens_last": False}, 1e-5),
    "float16": ({"dtype": torch.float16}, 1e-2),
}


@needs_native
@pytest.mark.parametrize("case", sorted(UNREAD_CACHES))
def test_a_cache_the_kernel_does_not_read_decodes_as_the_full_forward(case):
    """forward takes a cache of rows, or of float16, on the CPU; the kernel reads neither."""
    m = build(rope=True)
    options, tolerance = UNREAD_CACHES[case]
    cache = KVCache(2, 48, 2, 8, **options)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        assert plan.native_decode(m, x[:, :1], cache) is None
        torch.testing.assert_close(decode(m, x, cache), m(x), rtol=tolerance, atol=tolerance)


TABLES = {
    "cos strided": lambda cos, sin: (_non_contiguous(cos), sin),
    "sin strided": lambda cos, sin: (cos, _non_contiguous(sin)),
    "float64": lambda cos, sin: (cos.double(), sin.double()),
    "cos float64": lambda cos, sin: (cos.double(), sin),
    "sin float64": lambda cos, sin: (cos, sin.double()),
    "cos negated view": lambda cos, sin: (torch._neg_view(-cos), sin),
    "sin negated view": lambda cos, sin: (cos, torch._neg_view(-sin)),
    "a longer sin": lambda cos, sin: (cos, RotaryEmbedding(8, 96).sin),  # the same 48 rows
}
BAD_TABLES = {  # the Python path's error (the rope's own, or reading the shape), no write
    "on meta": (lambda cos, sin: (cos.to("meta"), sin.to("meta")), ValueError),
    "3-d": (lambda cos, sin: (cos[..., None], sin[..., None]), ValueError),  # forward's
}


@needs_native
@pytest.mark.parametrize("change", sorted(TABLES) + sorted(BAD_TABLES))
def test_rotary_tables_the_kernel_does_not_read_take_the_python_path(change):
    """Tables replaced in the module's own rope: what the kernel does not read (strides,
    dtype, shapes that differ, another device) is the Python path's, which equals the full
    forward or raises its error before anything is written."""
    m = build(rope=True, qkv_bias=True)
    make, error = (TABLES[change], None) if change in TABLES else BAD_TABLES[change]
    m.rope.cos, m.rope.sin = make(m.rope.cos, m.rope.sin)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        cache = m.make_cache(2)
        assert plan.native_decode(m, x[:, :1], cache) is None
        if error is None:
            torch.testing.assert_close(decode(m, x, cache), m(x), rtol=1e-5, atol=1e-5)
            return
        with pytest.raises(error):
            m(x[:, :1], cache=cache)
    assert cache.position == 0


UNTAKEN = {"partial rotary": dict(rope=True, rotary_dim=4)}
ODD_HEADS = {  # head dims no vector width divides
    "head_dim 6, rotary": dict(d_out=24, rope=True),
    "head_dim 5": dict(d_out=20),
    "head_dim 3, one key/value head": dict(d_out=12, num_kv_heads=1),
}


@needs_native
@pytest.mark.parametrize("case", sorted(UNTAKEN))
def test_what_the_kernel_does_not_compute_decodes_as_the_full_forward(case):
    """Partial rotary positions: the native step does not compute them, the Python path
    does."""
    kwargs = dict(UNTAKEN[case])
    torch.manual_seed(0)
    m = MultiHeadAttention(16, kwargs.pop("d_out", 32), 48, 0.0, 4, num_kv_heads=2, **kwargs)
    m.eval()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        assert plan.native_decode(m, x[:, :1], m.make_cache(2)) is None
        torch.testing.assert_close(decode(m, x), m(x), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("case", sorted(ODD_HEADS))
def test_head_dims_of_any_size_decode_natively_as_the_full_forward(case):
    """Head dims that are not a multiple of 4 (nor even, without rotary positions): the
    native step takes a step, and decoding equals the full forward."""
    kwargs = {"num_kv_heads": 2} | ODD_HEADS[case]
    torch.manual_seed(0)
    m = MultiHeadAttention(16, kwargs.pop("d_out"), 48, 0.0, 4, **kwargs).eval()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        assert plan.native_decode(m, x[:, :1], m.make_cache(2)) is not None
        torch.testing.assert_close(decode(m, x), m(x), rtol=1e-5, atol=1e-5)


# Contiguity: a non-contiguous parameter is the Python path's (the blocked product views the
# weight in blocks of rows; the kernel reads contiguous tensors).


@pytest.mark.parametrize("what", ["weight", "bias"])
def test_non_contiguous_parameters_give_the_contiguous_ones_outputs_on_every_path(what):
    m = build(rope=True, qkv_bias=True)
    twin = copy.deepcopy(m)
    for name in ("qkv_proj", "out_proj"):
        layer = getattr(m, name)
        strided = _non_contiguous(getattr(layer, what).detach())
        assert not strided.is_contiguous()
        setattr(layer, what, nn.Parameter(strided))
    x = torch.randn(2, 40, 16)
    assert_paths_close(every_path(m, x), every_path(twin, x))


# A meta device and another dtype: the door's named errors, not the kernel's.


OTHER_PROJECTION = {
    "on meta": ({"device": "meta"}, ValueError, "out_proj's weight is on meta but x is on cpu"),
    "float64": ({"dtype": torch.float64}, TypeError, "out_proj's weight is torch.float64"),
}


@needs_native
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", sorted(OTHER_PROJECTION))
def test_an_output_projection_elsewhere_is_the_doors_named_error_when_decoding(case, bias):
    """Its weight on another device or in another dtype: forward's error, which names it,
    not the kernel's (with no bias, the weight's own check is all that refuses it)."""
    m = build()
    where, error, match = OTHER_PROJECTION[case]
    m.out_proj = nn.Linear(32, 32, bias=bias, **where)
    with torch.no_grad():
        cache = m.make_cache(1)
        with pytest.raises(error, match=match):
            m(torch.randn(1, 1, 16), cache=cache)
    assert cache.position == 0


@needs_native
@pytest.mark.parametrize("width", [16, 48])
@pytest.mark.parametrize("bias", [True, False])
def test_an_output_projection_of_another_width_decodes_natively(width, bias):
    """An out_proj narrower or wider than the heads (Qwen3's and Gemma 3's heads are not the
    model's width): the native step is taken and equals the Python path and the full
    forward."""
    m = build(7, rope=True, qk_norm="head")
    m.out_proj = nn.Linear(32, width, bias=bias)
    twin = python_twin(m)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        assert plan.native_decode(m, x[:, :1], m.make_cache(2)) is not None
        steps = decode(m, x)
        assert steps.shape == (2, 6, width)
        torch.testing.assert_close(steps, decode(twin, x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(steps, m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", ["float64", "meta"])
def test_a_bias_in_another_dtype_or_on_another_device_is_a_named_error(bias):
    m = build()
    data = m.out_proj.bias.detach()
    m.out_proj.bias = nn.Parameter(data.double() if bias == "float64" else data.to("meta"))
    with torch.no_grad(), pytest.raises((TypeError, ValueError), match="out_proj"):
        m(torch.randn(1, 1, 16), cache=m.make_cache(1))


def test_the_first_call_in_a_process_draws_the_dropout_a_later_one_draws():
    script = (
        "import torch\n"
        "from attnlab import MultiHeadAttention\n"
        "m = MultiHeadAttention(16, 32, 48, 0.5, 4).train()\n"
        "x = torch.randn(1, 5, 16)\n"
        "with torch.no_grad():\n"
        "    torch.manual_seed(0); first = m(x)\n"
        "    torch.manual_seed(0); second = m(x)\n"
        "print(torch.equal(first, second))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]


# Tensor subclasses: a parameter of a subclass, an input of one, a cache subclass.


class DoubledLinear(torch.Tensor):
    """A tensor subclass whose F.linear results are doubled (a quantised or sharded
    tensor's own computation)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is F.linear else out


class DoubledParameter(nn.Parameter):
    """DoubledLinear as a parameter (a quantised weight's own class)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is F.linear:
            return out * 2
        return out


def _doubled_projections(m):
    """m with every projection's weight and bias doubled: what F.linear doubled gives."""
    doubled = copy.deepcopy(m)
    with torch.no_grad():
        for layer in (doubled.qkv_proj, doubled.out_proj):
            layer.weight *= 2
            layer.bias *= 2
    return doubled


@pytest.mark.parametrize("what", ["weight", "bias"])
def test_a_parameter_of_a_tensor_subclass_computes_its_own_way_on_every_path(what):
    m = build(rope=True, qkv_bias=True)
    want = _doubled_projections(m)
    for layer in (m.qkv_proj, m.out_proj):
        tensor = getattr(layer, what).detach()
        setattr(layer, what, DoubledParameter(tensor))
    x = torch.randn(2, 40, 16)
    got = [t.as_subclass(torch.Tensor) for t in every_path(m, x)]
    assert_paths_close(got, every_path(want, x))


def test_an_input_of_a_tensor_subclass_computes_its_own_way_on_every_path():
    m = build(rope=True, qkv_bias=True)
    want = _doubled_projections(m)
    x = torch.randn(2, 40, 16)
    with torch.no_grad():
        got = [m(x[:, :t].as_subclass(DoubledLinear)) for t in (1, 6, 40)]
        cache = m.make_cache(2)
        steps = [m(x[:, i : i + 1].as_subclass(DoubledLinear), cache=cache) for i in range(6)]
        got.append(torch.cat([s.as_subclass(torch.Tensor) for s in steps], dim=1))
    got = [t.as_subclass(torch.Tensor) for t in got]
    assert_paths_close(got, every_path(want, x))


class CountingCache(KVCache):
    """A KVCache subclass that counts its appends (a paged or offloading cache's own)."""

    appends = 0

    def append(self, k, v):
        self.appends += 1
        return super().append(k, v)


@needs_native
def test_a_cache_subclass_is_written_through_its_own_methods():
    m = build(rope=True)
    cache = CountingCache(2, 48, 2, 8)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        torch.testing.assert_close(decode(m, x, cache), m(x), rtol=1e-5, atol=1e-5)
    assert cache.appends == 6


@needs_native
def test_a_stray_fused_projection_on_a_cross_attention_module_is_not_taken_for_its_own():
    """A module whose keys and values come from a context (context_dim != d_in) holds
    q_proj and kv_proj; a `qkv_proj` put beside them is not its projection: decoding it
    still asks for its context."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 32, 48, 0.0, 4, num_kv_heads=2, context_dim=8).eval()
    m.qkv_proj = nn.Linear(16, 64)
    with torch.no_grad():
        cache = m.make_cache(1)
        with pytest.raises(ValueError, match="pass context"):
            m(torch.randn(1, 1, 16), cache=cache)
    assert cache.position == 0


# Under torch.compile the plan takes the Python path: what compiled code traces.


@needs_native
def test_a_compiled_decode_step_traces_the_python_path_whole():
    """The native step is a C++ call dynamo cannot trace (fullgraph would break)."""
    torch._dynamo.reset()
    m = build(rope=True)
    x = torch.randn(2, 3, 16)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        got = decode(compiled, x)
        want = decode(m, x)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_compiled_projection_is_the_layers_call_for_every_row_count():
    """Compiled code fuses the projection itself; the blocked product's row-count test
    would be a guard there (a second graph past 32 rows)."""
    torch._dynamo.reset()
    layer = nn.Linear(16, 32)
    counter = CompileCounter()
    project = torch.compile(
        lambda x: plan.project(x, layer, (32, 16)), backend=counter, dynamic=True
    )
    with torch.no_grad():
        for rows in (2, 8, 40):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(project(x), layer(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    assert counter.frame_count == 1


# --- what the fast paths stand for, patched or overridden (the outside pass after issue 37) --


class _Plus100(MultiHeadAttention):
    """A subclass whose head-combining step adds 100: no fast path may skip it."""

    def _combine_heads(self, *args, **kwargs):
        return super()._combine_heads(*args, **kwargs) + 100.0


@pytest.mark.parametrize("where", ["subclass", "class patch"])
def test_a_step_overridden_or_patched_on_the_class_is_run_by_a_decode_step(where, monkeypatch):
    """Every method MultiHeadAttention defines is one the fast path stands for: a subclass
    overriding _combine_heads (not a listed step before), or the class itself patched, makes
    the 1-token cached step the Python path, equal to the same module's full forward."""
    m = build(3)
    if where == "subclass":
        m.__class__ = _Plus100
    else:
        original = MultiHeadAttention._combine_heads
        monkeypatch.setattr(
            MultiHeadAttention,
            "_combine_heads",
            lambda self, *a, **k: original(self, *a, **k) + 100.0,
        )
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        full = m(x)
        cache = m.make_cache(1, 8)
        m(x[:, :4], cache=cache)
        step = m(x[:, 4:], cache=cache)
    torch.testing.assert_close(step, full[:, 4:], atol=1e-5, rtol=1e-5)
    assert plan.native_module(m) is None


@pytest.mark.parametrize("patch", ["nn.Linear.forward", "nn.Module.__call__", "F.linear"])
def test_torchs_linear_code_patched_is_run_by_every_path(patch, monkeypatch):
    """A class-level patch of nn.Linear (stable-diffusion-webui's LoRA) or of F.linear: the
    blocked projection (1 and 8 rows) and the native decode step call the layers like the
    40-row path does."""
    m = build(4)
    x = torch.randn(40, 1, 16)
    with torch.no_grad():
        plain = m(x)
    if patch == "nn.Linear.forward":
        original = nn.Linear.forward
        monkeypatch.setattr(nn.Linear, "forward", lambda self, y: original(self, y) + 1.0)
    elif patch == "nn.Module.__call__":
        original = nn.Module.__call__
        monkeypatch.setattr(nn.Linear, "__call__", lambda self, y: original(self, y) + 1.0)
    else:
        original = F.linear
        monkeypatch.setattr(F, "linear", lambda y, w, b=None: original(y, w, b) + 1.0)
    assert not plan.linear_code_as_torch_wrote_it()
    with torch.no_grad():
        patched = m(x)
        assert (patched - plain).abs().max() > 0.1  # the patch changes the output
        torch.testing.assert_close(m(x[:1]), patched[:1])
        torch.testing.assert_close(m(x[:8]), patched[:8])
        torch.testing.assert_close(m(x[:1], cache=m.make_cache(1, 4)), patched[:1])
    monkeypatch.undo()
    assert plan.linear_code_as_torch_wrote_it()


@needs_native
def test_a_lazily_negated_view_is_read_by_its_values():
    """torch._neg_view holds values its memory does not: a weight or an input so held takes
    the Python path (equal outputs), and the op itself refuses one by name."""
    m = build(5)
    x = torch.randn(1, 1, 16)
    with torch.no_grad():
        want = m(x, cache=m.make_cache(1, 4))
        torch.testing.assert_close(m(torch._neg_view(-x), cache=m.make_cache(1, 4)), want)
        m.out_proj.weight = nn.Parameter(torch._neg_view(-m.out_proj.weight.detach()))
        torch.testing.assert_close(m(x, cache=m.make_cache(1, 4)), want)
    cache = m.make_cache(1, 4)
    weights = plan.native_module(build(5))
    with pytest.raises(RuntimeError, match="x is a lazily negated or conjugated view"):
        decode_cpu.step(torch._neg_view(-x), weights, 4, 0.25, cache, None)
    assert cache.position == 0


@pytest.mark.parametrize(
    "patch",
    [
        "lambda self, x: original(self, x) + 1.0",
        "functools.partialmethod(lambda self, x, shift: original(self, x) + shift, shift=1.0)",
    ],
    ids=["function", "no code object"],
)
def test_nn_linear_patched_before_attnlab_is_imported_is_seen(patch):
    """A patch made before `import attnlab` (a LoRA extension loaded first) is what attnlab
    finds at import: it is checked to be torch's own code, so the fast paths still call it
    (a patch without a code object of its own, a partialmethod, too)."""
    script = (
        "import functools\n"
        "import torch\n"
        "from torch import nn\n"
        "original = nn.Linear.forward\n"
        f"nn.Linear.forward = {patch}\n"
        "import attnlab\n"
        "from attnlab import plan\n"
        "torch.manual_seed(0)\n"
        "m = attnlab.MultiHeadAttention(16, 32, 48, 0.0, 4, num_kv_heads=2).eval()\n"
        "x = torch.randn(40, 1, 16)\n"
        "with torch.no_grad():\n"
        "    many, one = m(x), m(x[:1])\n"
        "    step = m(x[:1], cache=m.make_cache(1, 4))\n"
        "assert not plan.linear_code_as_torch_wrote_it()\n"
        "torch.testing.assert_close(one, many[:1])\n"
        "torch.testing.assert_close(step, many[:1])\n"
        "print('seen')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "seen" in result.stdout, result.stderr[-2000:]


# --- the second outside pass (issue 37): transforms, torch's functions, the mutation run ----


def test_forward_mode_ad_through_a_one_token_step_carries_its_tangent():
    """Under torch.autograd.forward_ad the native step (raw memory, no tangent) is not taken:
    the tangent of a 1-token cached step equals torch.func.jvp of the full forward's."""
    import torch.autograd.forward_ad as fwad

    m = build(6)
    x, t = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    t[:, :2] = 0.0  # the prefix is cached without a tangent
    _, want = torch.func.jvp(lambda y: m(y), (x,), (t,))
    cache = m.make_cache(1, 8)
    with torch.no_grad():
        m(x[:, :2], cache=cache)
        with fwad.dual_level():
            out = m(fwad.make_dual(x[:, 2:], t[:, 2:]), cache=cache)
            tangent = fwad.unpack_dual(out).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, want[:, 2:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["bmm", "baddbmm"])
def test_torchs_batched_products_patched_change_no_projection(name, monkeypatch):
    """The blocked projection stands for F.linear, which never calls torch.bmm or
    torch.baddbmm: patching those names changes neither the 1-row nor the 40-row output."""
    m = build(7)
    x = torch.randn(40, 1, 16)
    with torch.no_grad():
        want = m(x)
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, **k: original(*a, **k) + 1.0)
        torch.testing.assert_close(m(x[:1]), want[:1])
        torch.testing.assert_close(m(x), want)


def test_a_backward_pre_hook_on_a_projection_runs_for_a_few_rows():
    """A projection with a backward pre-hook is not pristine: the blocked projection, which
    computes the layer without calling it, must not skip the hook."""
    m = build(8)
    calls = []
    m.qkv_proj.register_full_backward_pre_hook(lambda module, grad: calls.append(1))
    x = torch.randn(1, 3, 16, requires_grad=True)
    m(x).sum().backward()
    assert calls == [1]


def test_a_lazily_negated_bias_is_read_by_its_values():
    m = build(9, qkv_bias=True)
    x = torch.randn(1, 1, 16)
    with torch.no_grad():
        want = m(x, cache=m.make_cache(1, 4))
        m.qkv_proj.bias = nn.Parameter(torch._neg_view(-m.qkv_proj.bias.detach()))
        torch.testing.assert_close(m(x, cache=m.make_cache(1, 4)), want)
        torch.testing.assert_close(m(x), want)


def test_a_patched_nn_linear_that_casts_is_called_not_refused_for_its_dtype(monkeypatch):
    """The named dtype error speaks for torch's own nn.Linear: a class-level patch that casts
    its input to the weight's dtype (what some adapters do) is called, not refused."""
    m = build(10)
    m.out_proj.double()
    original = nn.Linear.forward
    monkeypatch.setattr(
        nn.Linear,
        "forward",
        lambda self, y: original(self, y.to(self.weight.dtype)).to(y.dtype),
    )
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        out = m(x)
        want = build(10)(x)  # float32 weights of the same values: the patch casts to them
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_torchs_own_code_is_told_from_anything_else():
    """plan._is_torchs: nn.Linear's and nn.Module's functions are torch's; a function of
    another file, and a callable without a code object (functools.partial), are not."""
    import functools

    assert plan._is_torchs(nn.Linear.forward, "forward")
    assert plan._is_torchs(nn.Module._call_impl, "_call_impl")
    assert not plan._is_torchs(lambda self, x: x, "forward")
    assert not plan._is_torchs(functools.partial(nn.Linear.forward), "forward")
    assert not plan._is_torchs(nn.Module._call_impl, "forward")  # module.py, not linear.py


def _decodes_through_the_python_path_as_its_full_forward(m):
    """m's cached steps, which the native step does not take, equal its full forward."""
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        cache = m.make_cache(1, 8)
        assert plan.native_decode(m, x[:, :1], cache) is None
        torch.testing.assert_close(decode(m, x, cache), m(x), rtol=1e-5, atol=1e-5)


def test_rotary_embedding_patched_on_the_class_is_run_by_a_decode_step(monkeypatch):
    """RotaryEmbedding.forward patched on the class (any of its methods): the native step,
    which reads its tables, is not taken; the cached step equals the patched full forward."""
    m = build(11, rope=True)
    original = RotaryEmbedding.forward
    monkeypatch.setattr(
        RotaryEmbedding, "forward", lambda self, x, start=0: original(self, x, start) * 2.0
    )
    _decodes_through_the_python_path_as_its_full_forward(m)


@needs_native
@pytest.mark.parametrize("case", sorted(set(NORM_REFUSED) - _NO_FORWARD))
def test_a_norm_the_kernel_does_not_stand_for_decodes_through_its_own_call(case):
    """Each norm the native step refuses: the cached steps equal the module's own full
    forward (the norm called as it is: its hook, subclass, eps, offset, dtype)."""
    m = NORM_REFUSED[case]()
    _decodes_through_the_python_path_as_its_full_forward(m)


def test_a_norm_without_its_eps_is_left_to_its_own_call():
    """A norm whose eps was deleted: the plan declines (no KeyError of its own), and the call
    raises what the norm's forward raises."""
    m = build(qk_norm="head")
    del m.q_norm.eps
    assert plan.native_module(m) is None
    cache = m.make_cache(1)
    with torch.no_grad(), pytest.raises(AttributeError, match="eps"):
        m(torch.randn(1, 1, 16), cache=cache)
    assert cache.position == 0


@needs_native
@pytest.mark.parametrize("constant", ["qk_norm_eps", "qk_norm_offset"])
def test_a_norm_constant_at_float32s_largest_value_is_the_kernels(constant):
    """eps or offset exactly float32's largest value: within the kernel's range (the plan
    leaves only values past it to the Python path)."""
    largest = torch.finfo(torch.float32).max
    m = build(qk_norm="head", **{constant: largest})
    assert plan.native_module(m) is not None
    attribute = constant.removeprefix("qk_norm_")
    setattr(m.q_norm, attribute, largest * 1.01)
    setattr(m.k_norm, attribute, largest * 1.01)
    assert plan.native_module(m) is None


@needs_native
@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from(["head", "projection"]),
    st.sampled_from([0.0, 1.0]),
    st.sampled_from([4, 2, 1]),
    st.sampled_from(["q_norm", "k_norm"]),
)
def test_a_norm_weight_edited_between_steps_is_read_anew(mode, offset, kv_heads, name):
    """Steps before and after an in-place edit of a norm's weight (and its eps) equal the
    module's own Python path doing the same: the native step reads them on every call."""
    m = build(3, rope=True, qk_norm=mode, qk_norm_offset=offset, num_kv_heads=kv_heads)
    twin = python_twin(m)
    x = torch.randn(2, 6, 16)
    outputs = []
    with torch.no_grad():
        for module in (m, twin):
            cache = module.make_cache(2)
            steps = [module(x[:, i : i + 1], cache=cache) for i in range(3)]
            getattr(module, name).weight.mul_(-1.5)
            module.q_norm.eps = module.k_norm.eps = 1e-2
            steps += [module(x[:, i : i + 1], cache=cache) for i in range(3, 6)]
            outputs.append(torch.cat(steps, dim=1))
    assert plan.native_module(m) is not None
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_rms_norm_patched_on_the_class_is_run_by_a_decode_step(monkeypatch):
    """RMSNorm.forward patched on the class: the native step, which computes the norm
    itself, is not taken; the cached step equals the patched full forward."""
    m = build(11, rope=True, qk_norm="head")
    original = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: original(self, x) * 2.0)
    _decodes_through_the_python_path_as_its_full_forward(m)


class _CastingLinear(torch.overrides.TorchFunctionMode):
    """A function mode that runs F.linear in its weight's dtype (what a quantisation or
    offloading framework may do): a projection in another dtype then computes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            return func(x.to(weight.dtype), weight, bias).to(x.dtype)
        return func(*args, **kwargs)


def test_under_a_function_mode_a_projection_in_another_dtype_is_called_not_refused():
    """The named dtype error speaks for torch's own F.linear: under a function mode, which
    may cast (here to the weight's dtype), the projection is called and computes."""
    m = build(12)
    m.out_proj.double()
    x = torch.randn(1, 3, 16)
    with torch.no_grad(), _CastingLinear():
        out = m(x)
    with torch.no_grad():
        want = build(12)(x)  # float32 weights of the same values
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_under_autocast_a_float64_projection_is_a_named_type_error():
    """CPU autocast casts float32 parameters, not float64 ones: a float64 bias under
    autocast is the named TypeError, as outside it (was torch's raw dtype error)."""
    m = build(13, qkv_bias=True)
    m.out_proj.bias = nn.Parameter(m.out_proj.bias.detach().double())
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(TypeError, match=r"out_proj's bias is torch\.float64"),
    ):
        m(torch.randn(1, 3, 16))


def test_under_autocast_a_projection_in_a_narrower_dtype_computes():
    """CPU autocast casts a bfloat16 out_proj's inputs (and float32 parameters) itself: the
    call computes, as the same module does with every projection cast by autocast."""
    m = build(14)
    x = torch.randn(1, 3, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = m(x)
        m.out_proj.bfloat16()
        got = m(x)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outside_autocast_a_projection_in_a_narrower_dtype_is_a_named_type_error(dtype):
    """The same bfloat16 (or float16) out_proj as above, outside autocast: nothing casts
    its input, so the named TypeError (F.linear's raw dtype error otherwise)."""
    m = build(15)
    m.out_proj.to(dtype)
    with pytest.raises(TypeError, match=rf"out_proj's weight is torch\.{str(dtype)[6:]}"):
        m(torch.randn(1, 3, 16))
