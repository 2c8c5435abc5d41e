"""attnlab.plan: whatever a user does to a MultiHeadAttention (replace, wrap or hook a
projection, swap the rope, autocast, inference mode), every path (1 token, a few rows, more
than 32 rows, cached decode) gives the module's own result or the same named error at the
door. Each test here is a reproducer of something a fast path once got wrong."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from attnlab import MultiHeadAttention, decode_cpu, plan
from attnlab.rope import RotaryEmbedding

NATIVE = decode_cpu.available()
LAYOUTS = {"mha": 4, "gqa": 2, "mqa": 1}


def build(kv_heads=2, bias=False, rope=False, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(
        16, 32, 48, 0.0, 4, qkv_bias=bias, num_kv_heads=kv_heads, rope=rope
    ).eval()


def decode(m, x):
    """x (b, t, d) fed one token at a time through a cache: the outputs (b, t, width)."""
    cache = m.make_cache(x.shape[0])
    return torch.cat([m(x[:, i : i + 1], cache=cache) for i in range(x.shape[1])], dim=1)


def reference(m, x):
    """The module's computation in float64, written out here: its own submodules called (hooks
    included), heads split, rotary positions from the definition, causal softmax by hand."""
    m64 = copy.deepcopy(m).double()
    b, t, _ = x.shape
    x = x.detach()
    h, hkv, hd = m.num_heads, m.num_kv_heads, m.head_dim
    qkv = m64.qkv_proj(x.double())  # (b, t, d_out + 2 kv_dim)
    q, k, v = qkv.split([h * hd, hkv * hd, hkv * hd], dim=-1)
    q, k, v = (y.view(b, t, -1, hd).transpose(1, 2) for y in (q, k, v))  # (b, heads, t, hd)
    if m.rope is not None:
        q, k = _rotate(q, m.rope.base), _rotate(k, m.rope.base)
    k, v = (y.repeat_interleave(h // hkv, dim=1) for y in (k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)  # (b, h, t, t)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, -math.inf).softmax(-1)
    heads = (weights @ v).transpose(1, 2).reshape(b, t, h * hd)  # (b, t, d_out)
    return m64.out_proj(heads)


def _rotate(y, base):
    """Rotary positions by their definition: pairs (i, i + hd/2) turned by position * theta_i."""
    t, hd = y.shape[-2], y.shape[-1]
    theta = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (hd/2,)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * theta  # (t, hd/2)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)  # (t, hd)
    first, second = y[..., : hd // 2], y[..., hd // 2 :]
    return y * cos + torch.cat([-second, first], dim=-1) * sin


def every_path(m, tokens=(1, 6, 40)):
    """The module's output on every path: full forwards of 1, 6 and 40 tokens, and a cached
    decode of 6 tokens; each beside the float64 reference."""
    torch.manual_seed(1)
    x = torch.randn(2, max(tokens), 16, dtype=next(m.parameters()).dtype)
    with torch.no_grad():
        for t in tokens:
            yield f"{t} tokens", m(x[:, :t]), reference(m, x[:, :t])
        yield "cached decode", decode(m, x[:, :6]), reference(m, x[:, :6])


def assert_every_path_is_the_reference(m):
    for path, got, want in every_path(m):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg=path)


def assert_every_path_raises(m, error, match):
    torch.manual_seed(1)
    x = torch.randn(2, 40, 16)
    with torch.no_grad():
        for t in (1, 6, 40):
            with pytest.raises(error, match=match):
                m(x[:, :t])
        cache = m.make_cache(2)
        with pytest.raises(error, match=match):
            m(x[:, :1], cache=cache)
        assert cache.position == 0


# Replaced projections: the right size is the reference, a wrong one a named error.

WRONG = {
    "out_proj in 16": ("out_proj", lambda bias: nn.Linear(16, 32, bias=bias)),
    "out_proj in 64": ("out_proj", lambda bias: nn.Linear(64, 32, bias=bias)),
    "qkv_proj out 32": ("qkv_proj", lambda bias: nn.Linear(16, 32, bias=bias)),
    "qkv_proj out 96": ("qkv_proj", lambda bias: nn.Linear(16, 96, bias=bias)),
    "qkv_proj in 8": ("qkv_proj", lambda bias: nn.Linear(8, 64, bias=bias)),
}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", sorted(WRONG))
def test_a_projection_of_the_wrong_size_is_a_named_error_on_every_path(case, layout, bias):
    m = build(LAYOUTS[layout], bias)
    name, make = WRONG[case]
    if name == "qkv_proj" and case == "qkv_proj out 96" and layout == "mha":
        pytest.skip("96 = 32 + 2 * 32 is the right size for four key/value heads")
    setattr(m, name, make(bias))
    assert_every_path_raises(m, ValueError, rf"{name} must be a Linear of weight")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_bias_of_the_wrong_width_is_a_named_error_not_broadcast(layout):
    m = build(LAYOUTS[layout], bias=True)
    m.qkv_proj.bias = nn.Parameter(torch.randn(4))
    assert_every_path_raises(m, ValueError, r"qkv_proj must be .* bias of its output width")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rope", [False, True])
def test_a_replaced_projection_of_the_right_size_is_the_reference(layout, rope):
    m = build(LAYOUTS[layout], rope=rope)
    m.qkv_proj = nn.Linear(16, m.qkv_proj.out_features, bias=True)
    m.out_proj = nn.Linear(32, 32, bias=False)
    assert_every_path_is_the_reference(m)


def test_an_output_projection_to_another_width_is_the_reference_on_every_path():
    """out_proj may map d_out to another width: the native step, which reads head_dim from
    its weight, must not take it."""
    m = build(2, rope=True)
    m.out_proj = nn.Linear(32, 16)
    for path, got, want in every_path(m):
        assert got.shape[-1] == 16, path
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg=path)


class LoRA(nn.Module):
    """A LoRA-style adapter without .weight: a frozen base Linear plus a low-rank path."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


@pytest.mark.parametrize("name", ["qkv_proj", "out_proj"])
def test_a_lora_wrapper_without_weight_is_the_reference(name):
    m = build(2, rope=True)
    setattr(m, name, LoRA(getattr(m, name)))
    assert_every_path_is_the_reference(m)


def test_a_wrapper_that_returns_the_wrong_width_is_a_named_error():
    m = build(2)
    m.qkv_proj = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 40))
    assert_every_path_raises(m, ValueError, r"qkv_proj \(Sequential\) returned")


def test_a_parametrized_projection_is_the_reference():
    from torch.nn.utils import parametrize

    class Scaled(nn.Module):
        def forward(self, weight):
            return 0.5 * weight

    m = build(2, rope=True)
    parametrize.register_parametrization(m.out_proj, "weight", Scaled())
    assert_every_path_is_the_reference(m)


# Hooks, local and global, forward and backward: honoured on every path.


@pytest.mark.parametrize("name", ["qkv_proj", "out_proj"])
def test_a_forward_hook_on_a_projection_is_honoured_on_every_path(name):
    m = build(2, rope=True)
    getattr(m, name).register_forward_hook(lambda mod, args, out: out * 1.5)
    assert_every_path_is_the_reference(m)


def test_a_global_forward_hook_is_honoured_on_every_path():
    m = build(2, rope=True)

    def scale_projections(module, args, out):
        return out * 1.5 if isinstance(module, nn.Linear) else out

    handle = nn.modules.module.register_module_forward_hook(scale_projections)
    try:
        assert_every_path_is_the_reference(m)
        x = torch.randn(1, 6, 16)
        with torch.no_grad():
            hooked = m(x)
    finally:
        handle.remove()
    with torch.no_grad():
        assert not torch.allclose(hooked, m(x))  # the hook changed the output


@pytest.mark.parametrize("tokens", [1, 6, 40])
@pytest.mark.parametrize("name", ["qkv_proj", "out_proj"])
def test_a_full_backward_hook_on_a_projection_fires(name, tokens):
    m = build(2)
    seen = []
    getattr(m, name).register_full_backward_hook(lambda mod, gi, go: seen.append(go[0].shape))
    m(torch.randn(2, tokens, 16)).sum().backward()
    width = m.qkv_proj.out_features if name == "qkv_proj" else 32
    assert seen == [(2, tokens, width)]


@pytest.mark.skipif(not NATIVE, reason="the native decode step is unavailable here")
def test_the_plan_takes_the_native_step_only_for_the_module_as_built():
    m = build(2, rope=True)
    x = torch.randn(1, 1, 16)
    cache = m.make_cache(1)
    with torch.no_grad():
        assert plan.native_decode(m, x, cache) is not None
        handle = m.out_proj.register_forward_hook(lambda mod, args, out: out)
        assert plan.native_decode(m, x, cache) is None
        handle.remove()
        handle = nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None)
        assert plan.native_decode(m, x, cache) is None
        handle.remove()
        with torch.autocast("cpu", torch.bfloat16):
            assert plan.native_decode(m, x, cache) is None
        m.out_proj = nn.Linear(32, 16)  # another width: the kernel takes any
        assert plan.native_decode(m, x, cache) is not None
        m.out_proj = nn.Linear(16, 32)  # not the heads' width (d_out): the door's error
        assert plan.native_decode(m, x, cache) is None


# The rotary tables, autocast, inference mode.


def test_a_rope_table_shorter_than_the_call_is_a_named_error():
    m = build(2, rope=True)
    m.rope = RotaryEmbedding(8, 4)
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        m(x[:, :4])  # positions 0..3: within the table
        with pytest.raises(ValueError, match=r"rope's tables hold 4 positions"):
            m(x)
        cache = m.make_cache(1)
        m(x[:, :4], cache=cache)
        with pytest.raises(ValueError, match=r"rope's tables hold 4 positions.* 4\.\.4"):
            m(x[:, 4:5], cache=cache)
        assert cache.position == 4


def test_a_rope_of_another_head_dim_is_a_named_error():
    m = build(2, rope=True)
    m.rope = RotaryEmbedding(4, 48)
    assert_every_path_raises(m, ValueError, r"rope's tables hold 48 positions of 4 features")


def test_autocast_gives_one_output_dtype_on_every_path():
    m = build(2, rope=True)
    x = torch.randn(1, 40, 16)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        dtypes = {m(x[:, :t]).dtype for t in (1, 6, 40)}
        cache = m.make_cache(1)
        dtypes |= {m(x[:, i : i + 1], cache=cache).dtype for i in range(4)}
    assert dtypes == {torch.bfloat16}


def test_a_cache_made_in_inference_mode_continued_outside_is_a_named_error():
    m = build(2)
    with torch.inference_mode():
        cache = m.make_cache(1)
        m(torch.randn(1, 3, 16), cache=cache)
    with torch.no_grad(), pytest.raises(ValueError, match=r"made under torch\.inference_mode"):
        m(torch.randn(1, 1, 16), cache=cache)
    assert cache.position == 3


# The kernels' Python faces sit below the module: none imports it (the package had one
# import cycle, attention <-> decode_cpu).


@pytest.mark.parametrize("name", ["decode_cpu", "matvec", "kv_cache", "rope", "fake_ops"])
def test_a_kernel_below_the_module_never_imports_it(name):
    import ast
    from pathlib import Path

    import attnlab

    source = Path(attnlab.__file__).with_name(f"{name}.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:  # the names, as modules too
            imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            imported.discard("attnlab")  # `from attnlab import x` imports attnlab.x
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    assert not imported & {"attnlab.attention", "attnlab.plan"}, imported


def test_both_projections_of_a_plain_module_take_the_blocks_on_few_rows(monkeypatch):
    """out_proj's output width is the module's to choose, so its expected shape has no out
    width; the blocked product must still serve it."""
    from attnlab import matvec

    seen = []
    linear = matvec.linear
    monkeypatch.setattr(matvec, "linear", lambda x, w, b: seen.append(w.shape) or linear(x, w, b))
    m = build(2)
    with torch.no_grad():
        m(torch.randn(1, 6, 16))
    assert seen == [m.qkv_proj.weight.shape, m.out_proj.weight.shape]


# A pristine state, stated positively: what users and their tools do that the fast paths
# must not skip (issue 37's cases 1, 2, 3 and 7).


class Shifted:
    """An instance-level forward wrapping the class's, as accelerate's add_hook_to_module
    attaches (and many LoRA and quantisation shims): the layer's output plus 0.5."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        return type(self.layer).forward(self.layer, x) + 0.5


@pytest.mark.parametrize("name", ["qkv_proj", "out_proj"])
def test_an_instance_forward_on_a_projection_runs_on_every_path(name):
    m = build(2, bias=True, rope=True)
    layer = getattr(m, name)
    layer.forward = Shifted(layer)
    assert_every_path_is_the_reference(m)
    x = torch.randn(1, 1, 16)
    with torch.no_grad():
        assert not torch.allclose(m(x), build(2, bias=True, rope=True)(x), atol=0.1)


@pytest.mark.parametrize("name", ["qkv_proj", "out_proj"])
@pytest.mark.parametrize("kind", ["buffer", "plain attribute"])
def test_a_weight_held_as_a_buffer_or_a_plain_attribute_is_the_reference(name, kind):
    """Compared with a twin holding the same weight as its parameter (the reference's
    float64 copy would not convert a plain attribute)."""
    m, twin = build(2, bias=False), build(2, bias=False)
    layer = getattr(m, name)
    weight = layer.weight.detach().clone() * 0.5
    del layer.weight
    if kind == "buffer":
        layer.register_buffer("weight", weight)
    else:
        layer.weight = weight
    with torch.no_grad():
        getattr(twin, name).weight.copy_(weight)
    x = torch.randn(2, 40, 16)
    with torch.no_grad():
        for t in (1, 6, 40):
            torch.testing.assert_close(m(x[:, :t]), twin(x[:, :t]), atol=1e-6, rtol=1e-5)
        got, want = decode(m, x[:, :6]), decode(twin, x[:, :6])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


class DoubledLinear(torch.overrides.TorchFunctionMode):
    """A function mode that doubles every F.linear (op-level instrumentation that changes
    values, as a quantisation or sharding framework's would)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.nn.functional.linear else out


class SeenProducts(TorchDispatchMode):
    """A dispatch mode that counts the matrix products it sees (a FlopCounter's view)."""

    def __init__(self):
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm, torch.ops.aten.bmm):
            self.products += 1
        return func(*args, **(kwargs or {}))


def test_an_active_function_mode_runs_on_every_path():
    m = build(2, bias=True, rope=True)
    with DoubledLinear():
        assert_every_path_is_the_reference(m)


@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_an_active_dispatch_mode_sees_the_products_on_every_path(tokens):
    """At least two products per call, the fused projection and the output one; a decode
    step too (the native step and the blocked projection would run them unseen)."""
    m = build(2, rope=True)
    with torch.no_grad():
        cache = m.make_cache(2)
        m(torch.randn(2, 3, 16), cache=cache)
        calls = (
            lambda: m(torch.randn(2, tokens, 16)),
            lambda: m(torch.randn(2, 1, 16), cache=cache),
        )
        for call in calls:
            with SeenProducts() as seen:
                call()
            assert seen.products >= 2


def test_the_rope_runs_through_its_call_so_its_hooks_run_on_every_path():
    """module.rope is called (rope(x, start)), so a forward hook on it runs on every path,
    the decode steps included (which the native step would otherwise take): a hook
    doubling the rotated queries and keys equals doubling their projection rows (rotation
    is linear), and it fires once for q and once for k per call."""
    torch.manual_seed(2)
    x = torch.randn(2, 40, 16)
    hooked, doubled = build(2, bias=True, rope=True), build(2, bias=True, rope=True)
    calls = []
    hooked.rope.register_forward_hook(lambda mod, args, out: calls.append(1) or out * 2)
    with torch.no_grad():
        rows = 32 + 16  # the query rows (d_out 32), then the key rows (kv_dim 16)
        doubled.qkv_proj.weight[:rows] *= 2
        doubled.qkv_proj.bias[:rows] *= 2
        for t in (1, 6, 40):
            torch.testing.assert_close(hooked(x[:, :t]), doubled(x[:, :t]), atol=1e-5, rtol=1e-5)
        got, want = decode(hooked, x[:, :6]), decode(doubled, x[:, :6])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 * (3 + 6)  # q and k: three full forwards, six decode steps


def test_an_attribute_of_its_own_on_the_module_or_a_projection_takes_the_python_path():
    """Anything a fresh instance does not hold leaves the fast path (slower, never wrong)."""
    m = build(2)
    assert plan.native_module(m) is not None
    m.qkv_proj.tag = "mine"
    assert plan.native_module(m) is None and not plan.plain_linear(m.qkv_proj, (64, 16))
    del m.qkv_proj.tag
    assert plan.native_module(m) is not None
    m.note = 1
    assert plan.native_module(m) is None


@pytest.mark.parametrize("name", ["qkv_proj", "out_proj"])
def test_one_projection_in_another_dtype_is_a_named_type_error_on_every_path(name):
    """Issue 37, case 12: torch's raw dtype RuntimeError from inside the Linear before."""
    m = build(2, rope=True)
    getattr(m, name).double()
    match = rf"{name}'s weight is torch\.float64 but the module computes in torch\.float32"
    if name == "qkv_proj":  # the first projection's dtype is the module's: x is refused
        match = "float32"
    assert_every_path_raises(m, TypeError, match)
