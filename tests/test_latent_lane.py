"""attnlab.plan.latent_lane: multi-head latent attention's plan read in C++
(csrc/latent_plan.h), then its whole one-token step. It must take a call only where forward's
checks pass and the module's Python path would take the native step (the reference: a spy on
decode_cpu.latent_step with the lane off), equal that path and the float64 definition where
it takes one, see a class changed after it read it, leave the cache as it was when it
refuses, and never crash on a malformed module or cache."""

import contextlib
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnlab import KVCache, decode_cpu, plan
from attnlab.latent_cache import LatentCache
from attnlab.mla import MultiHeadLatentAttention
from attnlab.norms import RMSNorm
from attnlab.rope import RotaryEmbedding
from tests.test_mla import mla_reference
from tests.test_plan_lane import STATES

pytestmark = pytest.mark.skipif(
    not decode_cpu.available(), reason="the native decode step is unavailable here"
)

D_MODEL, TOKENS = 16, 6
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
YARN |= {"mscale": 1.0, "mscale_all_dim": 1.0}
# each a module the lane takes as built: (args after d_model, keyword options)
LAYOUTS = {
    "plain queries, rotary, latent norm": ((4, None, 32, 8, 4, 8), {}),
    "low-rank queries (DeepSeek-V3's kind)": ((4, 6, 32, 8, 4, 8), {}),
    "no latent norm (the book's MLA)": ((4, 6, 32, 8, 4, 8), {"latent_norm": False}),
    "no rotary dims": ((2, None, 8, 4, 0, 4), {}),
    "no position-free dims": ((3, None, 12, 0, 4, 5), {}),
    "biases on the down and output projections": (
        (4, 6, 32, 8, 4, 8),
        {"down_bias": True, "out_bias": True},
    ),
    "YaRN with mscale_all_dim (the scale's factor)": ((4, 6, 32, 8, 4, 8), {"rope_scaling": YARN}),
    "one head": ((1, None, 4, 2, 2, 3), {}),
}


def build(layout="plain queries, rotary, latent norm", seed=0):
    args, options = LAYOUTS[layout]
    torch.manual_seed(seed)
    m = MultiHeadLatentAttention(D_MODEL, *args, 64, **options).eval()
    with torch.no_grad():  # random norm weights and biases: a skipped one would show
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    return m


def takes(m, x, cache):
    """Whether the lane takes m(x, cache=cache) (nothing run or written)."""
    plan._lanes()  # set up once
    return decode_cpu.binding().latent_lane_takes(m, x, cache)


def filled(m, batch=2, tokens=TOKENS, **cache_kwargs):
    cache = m.make_cache(batch, **cache_kwargs)
    with torch.no_grad():
        m(torch.randn(batch, tokens, D_MODEL), cache=cache)
    return cache


def taken_layer(layout="plain queries, rotary, latent norm"):
    """A module, its filled cache and a token the lane takes (asserted)."""
    m = build(layout)
    cache = filled(m)
    x = torch.randn(2, 1, D_MODEL)
    with torch.no_grad():
        assert takes(m, x, cache)
    return m, cache, x


def python_path(m, x, cache, monkeypatch):
    """m(x, cache=cache) with the lane off: (whether the module's path took the native step,
    its output or the error it raised)."""
    native, steps = decode_cpu.latent_step, []

    def spy(*args):
        out = native(*args)
        steps.append(out is not None)
        return out

    with monkeypatch.context() as patched:
        patched.setattr(plan, "latent_lane", lambda *args: None)
        patched.setattr(decode_cpu, "latent_step", spy)
        try:
            result = m(x, cache=cache)
        except Exception as error:  # forward's refusal is an outcome here
            result = error
    return any(steps), result


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_is_taken_and_decodes_as_the_python_path_and_the_definition(
    layout, monkeypatch
):
    m = build(layout)
    twin = copy.deepcopy(m)
    x = torch.randn(2, 10, D_MODEL)
    with torch.no_grad():
        cache, twin_cache = m.make_cache(2, 12), twin.make_cache(2, 12)
        outputs = [m(x[:, :4], cache=cache)]
        twin(x[:, :4], cache=twin_cache)
        for t in range(4, 10):
            token = x[:, t : t + 1]  # a strided view of x, as a generation loop slices it
            assert takes(m, token, cache)
            outputs.append(m(token, cache=cache))
            native, want = python_path(twin, token, twin_cache, monkeypatch)
            assert native  # the reference takes it too
            torch.testing.assert_close(outputs[-1], want, rtol=1e-5, atol=1e-5)
            assert cache.position == twin_cache.position == t + 1
        torch.testing.assert_close(cache.rows, twin_cache.rows, rtol=1e-6, atol=1e-6)
    if m.rope_scaling is None:  # the definition's rotary is plain (YaRN's: test_deepseek.py)
        expected = mla_reference(m, x.double(), torch.ones(10, 10, dtype=torch.bool).tril())
        got = torch.cat(outputs, 1).double()
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_a_first_token_into_an_empty_cache_is_left_to_the_rule_as_the_module_leaves_it():
    """One query against one key: the absorbed path does more multiply-adds (absorbs is
    False), so the module expands, and the lane does not take it."""
    m = build()
    cache = m.make_cache(1)
    x = torch.randn(1, 1, D_MODEL)
    with torch.no_grad():
        assert not m.absorbs(1, 1)
        assert not takes(m, x, cache)
        m(x, cache=cache)
        assert m.absorbs(1, 2) and takes(m, x, cache)


# torch's states under which the lane must not run: the decode lane's (tests/test_plan_lane.py)


@pytest.mark.parametrize("state", sorted(STATES))
def test_torchs_state_the_native_step_does_not_stand_for_is_refused(state):
    m, cache, x = taken_layer()
    with torch.no_grad():
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
        torch.func.vmap(probe)(torch.randn(1, 1, D_MODEL))
        torch.jit.trace(probe, torch.randn(1, D_MODEL), check_trace=False)
        assert seen == [False, False]
        assert takes(m, torch.randn(1, 1, D_MODEL), cache)


def test_a_global_hook_or_torchs_f_linear_replaced_is_refused(monkeypatch):
    m, cache, x = taken_layer()
    with torch.no_grad():
        handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
        assert not takes(m, x, cache)
        handle.remove()
        assert takes(m, x, cache)
        monkeypatch.setattr(F, "linear", lambda *args: torch._C._nn.linear(*args))
        assert not takes(m, x, cache)
        monkeypatch.undo()
        assert takes(m, x, cache)


# each a class and one of its methods (a class-level patch): the type's version tag changes,
# so the lane reads plan.py's test again, which refuses
PATCHED = {
    "MultiHeadLatentAttention._combine": (MultiHeadLatentAttention, "_combine"),
    "MultiHeadLatentAttention.scale": (MultiHeadLatentAttention, "scale"),
    "MultiHeadLatentAttention.absorbs": (MultiHeadLatentAttention, "absorbs"),
    "nn.Linear.forward": (nn.Linear, "forward"),
    "nn.Module._call_impl (nn.Linear's base)": (nn.Module, "_call_impl"),
    "RotaryEmbedding.forward": (RotaryEmbedding, "forward"),
    "RMSNorm.forward": (RMSNorm, "forward"),
    "LatentCache.append": (LatentCache, "append"),
    "LatentCache.rows": (LatentCache, "rows"),
}


@pytest.mark.parametrize("case", sorted(PATCHED))
def test_a_class_patched_after_the_lane_read_it_is_seen_and_its_undo_too(case, monkeypatch):
    cls, name = PATCHED[case]
    m, cache, x = taken_layer("low-rank queries (DeepSeek-V3's kind)")  # the tags trusted
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


def _set(obj, name, value):
    setattr(obj, name, value)


def _hooked(name):
    return lambda m, c, x: getattr(m, name).register_forward_hook(lambda *a: None)


class _Adapter(nn.Module):
    """A LoRA-style wrapper, as peft puts one in a projection's place."""

    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        return self.base(x)


# each a change of one instance (the module, a layer, the cache) that the lane refuses, as the
# reference does or by its own stricter conditions
INSTANCE = {
    "an attribute of the module's own": lambda m, c, x: _set(m, "extra", 1),
    "the instance's own absorbed step": lambda m, c, x: _set(
        m, "_attend_absorbed", functools.partial(MultiHeadLatentAttention._attend_absorbed, m)
    ),
    "an instance forward on q_a_proj (accelerate's way)": lambda m, c, x: _set(
        m.q_a_proj, "forward", m.q_a_proj.forward
    ),
    "a hook on q_a_proj": _hooked("q_a_proj"),
    "a hook on q_a_layernorm": _hooked("q_a_layernorm"),
    "a hook on q_b_proj": _hooked("q_b_proj"),
    "a hook on kv_a_proj_with_mqa": _hooked("kv_a_proj_with_mqa"),
    "a hook on kv_a_layernorm": _hooked("kv_a_layernorm"),
    "a hook on kv_b_proj": _hooked("kv_b_proj"),
    "a hook on o_proj": _hooked("o_proj"),
    "a hook on the rope": _hooked("rope"),
    "a bias on kv_b_proj": lambda m, c, x: _set(
        m.kv_b_proj, "bias", nn.Parameter(torch.randn(m.kv_width))
    ),
    "o_proj wrapped as LoRA wraps it": lambda m, c, x: _set(m, "o_proj", _Adapter(m.o_proj)),
    "kv_a_layernorm replaced by torch's RMSNorm": lambda m, c, x: _set(
        m, "kv_a_layernorm", nn.RMSNorm(m.kv_lora_rank, eps=1e-6)
    ),
    "a float64 o_proj bias": lambda m, c, x: _set(
        m.o_proj, "bias", nn.Parameter(torch.zeros(D_MODEL, dtype=torch.float64))
    ),
    "a strided q_b_proj weight": lambda m, c, x: _set(
        m.q_b_proj, "weight", nn.Parameter(torch.randn(6, m.q_width).t())
    ),
    "the rope's tables too short": lambda m, c, x: _set(m.rope, "cos", m.rope.cos[:3]),
    "another eps on the latent norm (fine) and a float64 weight (not)": lambda m, c, x: (
        _set(m.kv_a_layernorm, "eps", 1e-3),
        _set(m.kv_a_layernorm, "weight", nn.Parameter(torch.ones(32, dtype=torch.float64))),
    ),
    "a module subclass": lambda m, c, x: _set(
        m, "__class__", type("M", (MultiHeadLatentAttention,), {})
    ),
    "training with dropout": lambda m, c, x: (_set(m, "dropout", 0.1), m.train()),
    "not causal": lambda m, c, x: _set(m, "causal", False),
    "a float64 layer beside the projections": lambda m, c, x: _set(
        m, "extra", nn.Linear(D_MODEL, 4, dtype=torch.float64)
    ),
    "q_proj beside the low-rank queries": lambda m, c, x: _set(
        m, "q_proj", nn.Linear(D_MODEL, m.q_width, bias=False)
    ),
    "the rope None in the dictionary over the module's own": lambda m, c, x: m.__dict__.__setitem__(
        "rope", None
    ),
    "a scaling the scale cannot read": lambda m, c, x: _set(
        m, "rope_scaling", {"rope_type": "yarn", "factor": "4", "mscale_all_dim": 1.0}
    ),
    "an attribute of the cache's own": lambda m, c, x: _set(c, "note", 1),
    "a cache subclass": lambda m, c, x: _set(c, "__class__", type("Sub", (LatentCache,), {})),
    "a cache that recorded grad": lambda m, c, x: c._rows.requires_grad_(True),
    "the cache at its capacity": lambda m, c, x: _set(c, "position", c.capacity),
    "a bfloat16 cache": lambda m, c, x: _set(c, "_rows", c._rows.bfloat16()),
    "a cache for another batch": lambda m, c, x: _set(c, "batch_size", 3),
    "a cache's rows strided": lambda m, c, x: _set(
        c, "_rows", c._rows.transpose(0, 1).contiguous().transpose(0, 1)
    ),
    "the latent norm's weight in the rows' memory": lambda m, c, x: _set(
        m.kv_a_layernorm, "weight", nn.Parameter(c._rows.view(-1)[-m.kv_lora_rank :])
    ),
}


@pytest.mark.parametrize("case", sorted(INSTANCE))
def test_a_changed_instance_is_refused_and_forward_still_right(case, monkeypatch):
    """The lane refuses; forward (its Python path) then gives what it gives without the
    lane: an output equal to it, or the same error."""
    m, cache, x = taken_layer("low-rank queries (DeepSeek-V3's kind)")
    with torch.no_grad():
        INSTANCE[case](m, cache, x)
        assert not takes(m, x, cache)
        position, rows = cache.position, (cache._rows, cache._rows.clone())
        torch.manual_seed(1)  # the same dropout draws on both calls
        _, want = python_path(m, x, cache, monkeypatch)
        cache.position, cache._rows = position, rows[0]
        rows[0].copy_(rows[1])  # in place: memory the module shares with it stays shared
        torch.manual_seed(1)
        try:
            got = m(x, cache=cache)
        except Exception as error:  # compared with the Python path's
            got = error
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# each an input the lane refuses (forward then checks it and decodes or names its error)
INPUTS = {
    "two tokens": lambda x: torch.cat([x, x], dim=1),
    "float64": lambda x: x.double(),
    "a subclass": lambda x: x.as_subclass(type("T", (torch.Tensor,), {})),
    "another batch": lambda x: x[:1],
    "another width": lambda x: torch.randn(2, 1, 8),
    "a negated view": lambda x: torch._neg_view(-x),
    "a NaN": lambda x: x.index_fill(2, torch.tensor([3]), float("nan")),
    "a list": lambda x: x.tolist(),
}


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_an_input_the_step_does_not_read_is_refused(case):
    m, cache, x = taken_layer()
    with torch.no_grad():
        assert not takes(m, INPUTS[case](x), cache)


def test_a_kv_cache_for_a_latent_module_is_refused_and_named():
    m, _, x = taken_layer()
    cache = KVCache(2, 8, 1, 8)
    with torch.no_grad():
        assert not takes(m, x, cache)
        with pytest.raises(TypeError, match="cache must be a LatentCache"):
            m(x, cache=cache)


def test_an_overflow_is_left_to_the_python_path_which_names_it_with_the_cache_as_it_was():
    """An o_proj whose float32 output overflows: the lane writes the row but not the position
    and gives None; forward's own path then raises its error, the cache as it was."""
    m, cache, x = taken_layer()
    with torch.no_grad():
        m.o_proj.weight.fill_(3e38)
        position = cache.position
        assert plan.latent_lane(m, x, cache) is None
        assert cache.position == position
        with pytest.raises(ValueError, match=r"not finite|overflow"):
            m(x, cache=cache)
        assert cache.position == position


def test_a_non_finite_x_is_forwards_error_with_nothing_written():
    m, cache, x = taken_layer()
    rows = cache.rows.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="x"):
        m(x * float("inf"), cache=cache)
    assert torch.equal(cache.rows, rows) and cache.position == TOKENS


# a field of an object set past any setter, as a mistake or a tool might: the lane refuses
# or takes only what the reference takes, and never crashes
MALFORMED = {
    "num_heads a float": ("module", "num_heads", 4.0),
    "num_heads a bool": ("module", "num_heads", True),
    "num_heads zero": ("module", "num_heads", 0),
    "num_heads too many for the weights": ("module", "num_heads", 8),
    "kv_lora_rank huge": ("module", "kv_lora_rank", 2**45),
    "qk_rope_head_dim odd": ("module", "qk_rope_head_dim", 3),
    "q_lora_rank a string": ("module", "q_lora_rank", "6"),
    "context_length negative": ("module", "context_length", -1),
    "training None": ("module", "training", None),
    "_modules a list": ("module", "_modules", []),
    "position negative": ("cache", "position", -1),
    "position a float": ("cache", "position", 6.0),
    "position huge": ("cache", "position", 2**62),
    "rows a list": ("cache", "_rows", []),
    "max_tokens past the rows": ("cache", "max_tokens", 10**6),
    "the weight a plain tensor": ("layer", "weight", torch.randn(16, 6)),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_module_or_cache_is_refused_without_a_crash(case, monkeypatch):
    where, name, value = MALFORMED[case]
    m, cache, x = taken_layer("low-rank queries (DeepSeek-V3's kind)")
    target = {"module": m, "cache": cache, "layer": m.q_a_proj}[where]
    if where == "layer":
        target._parameters[name] = value
    else:
        target.__dict__[name] = value  # as the object holds it, past any setter
    with torch.no_grad():
        if takes(m, x, cache):
            assert python_path(copy.deepcopy(m), x, copy.deepcopy(cache), monkeypatch)[0]
        with contextlib.suppress(Exception):  # forward's outcome or error, never a crash
            m(x, cache=cache)


# a class attribute over a name the lane reads from instances' dictionaries (where Python's
# reads would run it instead): the lane refuses
SHADOWED = {
    "LatentCache.position": (LatentCache, "position"),
    "LatentCache._rows": (LatentCache, "_rows"),
    "MultiHeadLatentAttention.num_heads": (MultiHeadLatentAttention, "num_heads"),
    "MultiHeadLatentAttention.kv_b_proj": (MultiHeadLatentAttention, "kv_b_proj"),
    "MultiHeadLatentAttention.training": (MultiHeadLatentAttention, "training"),
    "nn.Linear.bias": (nn.Linear, "bias"),
    "RMSNorm.offset": (RMSNorm, "offset"),
}


@pytest.mark.parametrize("case", sorted(SHADOWED))
def test_a_class_attribute_over_a_field_the_lane_reads_is_refused(case, monkeypatch):
    cls, name = SHADOWED[case]
    m, cache, x = taken_layer()
    with torch.no_grad():
        monkeypatch.setattr(cls, name, property(lambda self: 0), raising=False)
        assert not takes(m, x, cache)
        monkeypatch.undo()
        assert takes(m, x, cache)


CHANGES = [*sorted(INSTANCE), "none"]


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(sorted(LAYOUTS)),
    st.lists(st.sampled_from(CHANGES), max_size=3),
    st.integers(1, 3),
    st.integers(2, 9),
)
def test_the_lane_takes_a_call_only_where_the_reference_does(layout, changes, batch, held):
    """Random changes at once, any layout, batch and tokens held: taken here => the module's
    Python path takes the native step there, and then the outputs are equal."""
    m = build(layout, seed=len(changes))
    cache = filled(m, batch=batch, tokens=held)
    x = torch.randn(batch, 1, D_MODEL)
    for change in changes:
        with contextlib.suppress(AttributeError, TypeError):  # a change the layout lacks
            if change != "none":
                INSTANCE[change](m, cache, x)
    with torch.no_grad(), pytest.MonkeyPatch.context() as monkeypatch:
        if not takes(m, x, cache):
            return
        twin, twin_cache = copy.deepcopy(m), copy.deepcopy(cache)
        native, want = python_path(twin, x, twin_cache, monkeypatch)
        assert native
        torch.testing.assert_close(m(x, cache=cache), want, rtol=1e-5, atol=1e-5)


def test_inference_mode_is_taken_and_a_cache_it_locked_is_refused_outside_it():
    """Generation loops decode under torch.inference_mode(): taken there, with a cache made
    inside or outside it; a cache made inside it cannot be written outside it, so the lane
    refuses and forward names why."""
    m = build()
    x = torch.randn(2, 1, D_MODEL)
    with torch.inference_mode():
        locked = filled(m)
        assert takes(m, x, locked)
        assert takes(m, x, filled(m))
    with torch.no_grad():
        assert takes(m, x, filled(m))
        assert not takes(m, x, locked)
        with pytest.raises(ValueError, match="inference_mode"):
            m(x, cache=locked)
    assert locked.position == TOKENS
