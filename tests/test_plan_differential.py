"""A differential property test of the call plan: hypothesis draws what users do to a
MultiHeadAttention (replace a projection with the right or a wrong size, subclass or wrap
it, parametrize it, LoRA-style adapters, forward and backward hooks local and global,
in-place weight edits between calls, a rope swap, a dtype change, autocast, train mode,
inference mode, an instance-level forward as accelerate attaches, a weight held as a
buffer, an active torch function mode or dispatch mode, nn.Linear.forward or F.linear
patched on the class or module, a weight held as a lazily negated view), a head layout and the token
counts, and requires every path (full forwards of 1, <= 32 and > 32 tokens, cached decode
of several steps) to equal the float64 reference written out in tests/test_plan.py, or to
raise the same named error on every path."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

from attnlab.rope import RotaryEmbedding
from tests.test_plan import (
    DoubledLinear,
    LoRA,
    SeenProducts,
    Shifted,
    build,
    decode,
    reference,
)


class Doubled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class Halved(nn.Module):
    def forward(self, weight):
        return 0.5 * weight


def _right(m, name):
    layer = getattr(m, name)
    return nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is None)


def _global_hook():
    def scale(module, args, out):
        return out * 1.25 if isinstance(module, nn.Linear) else out

    return nn.modules.module.register_module_forward_hook(scale)


# action -> (what it does to the module, a context the calls run in, the error it must give:
# type, message, and the fewest tokens that meet it)
ACTIONS = {
    "nothing": (lambda m, name: None, None, None),
    "replace, right size": (lambda m, name: setattr(m, name, _right(m, name)), None, None),
    "replace, wrong size": (
        lambda m, name: setattr(m, name, nn.Linear(16, 24)),
        None,
        (ValueError, "must be a Linear of weight", 1),
    ),
    "subclass": (lambda m, name: setattr(m, name, _copy_into(Doubled, m, name)), None, None),
    "LoRA": (lambda m, name: setattr(m, name, LoRA(getattr(m, name))), None, None),
    "parametrize": (
        lambda m, name: parametrize.register_parametrization(getattr(m, name), "weight", Halved()),
        None,
        None,
    ),
    "forward hook": (
        lambda m, name: getattr(m, name).register_forward_hook(lambda mod, a, out: out * 1.5),
        None,
        None,
    ),
    "forward pre-hook": (
        lambda m, name: getattr(m, name).register_forward_pre_hook(lambda mod, a: (a[0] * 2,)),
        None,
        None,
    ),
    "backward hook": (
        lambda m, name: getattr(m, name).register_full_backward_hook(lambda *a: None),
        None,
        None,
    ),
    "global forward hook": (lambda m, name: None, _global_hook, None),
    "in-place weight edit": (lambda m, name: _edit_in_place(getattr(m, name)), None, None),
    "rope swap": (
        lambda m, name: setattr(m, "rope", RotaryEmbedding(8, 48, base=500.0)),
        None,
        None,
    ),
    "rope too short": (
        lambda m, name: setattr(m, "rope", RotaryEmbedding(8, 4)),
        None,
        (ValueError, "rope's tables hold 4 positions", 5),
    ),
    "float64": (lambda m, name: m.double(), None, None),
    "autocast": (
        lambda m, name: None,
        lambda: torch.autocast("cpu", torch.bfloat16),
        None,
    ),
    "train mode": (lambda m, name: m.train(), None, None),
    "inference mode": (lambda m, name: None, torch.inference_mode, None),
    "instance forward": (
        lambda m, name: setattr(getattr(m, name), "forward", Shifted(getattr(m, name))),
        None,
        None,
    ),
    "weight as a buffer": (lambda m, name: _weight_as_buffer(getattr(m, name)), None, None),
    "function mode": (lambda m, name: None, DoubledLinear, None),
    "dispatch mode": (lambda m, name: None, SeenProducts, None),
    "nn.Linear.forward patched": (lambda m, name: None, lambda: _patched_linear_forward(), None),
    "F.linear patched": (lambda m, name: None, lambda: _patched_f_linear(), None),
    "negated weight view": (lambda m, name: _negated_view(getattr(m, name)), None, None),
}


@contextlib.contextmanager
def _patched_linear_forward():
    """nn.Linear.forward replaced on the class, as stable-diffusion-webui's LoRA does."""
    original = nn.Linear.forward
    nn.Linear.forward = lambda self, x: original(self, x) + 0.5
    try:
        yield
    finally:
        nn.Linear.forward = original


@contextlib.contextmanager
def _patched_f_linear():
    """torch.nn.functional.linear replaced (what nn.Linear.forward calls)."""
    original = nn.functional.linear
    nn.functional.linear = lambda x, w, b=None: original(x, w, b) * 1.5
    try:
        yield
    finally:
        nn.functional.linear = original


def _negated_view(layer):
    """The same weight values held as a lazily negated view of their negation."""
    layer.weight = nn.Parameter(torch._neg_view(-layer.weight.detach()))


def _weight_as_buffer(layer):
    weight = layer.weight.detach().clone()
    del layer.weight
    layer.register_buffer("weight", weight)


def _copy_into(cls, m, name):
    layer = getattr(m, name)
    twin = cls(layer.in_features, layer.out_features, bias=layer.bias is not None)
    twin.load_state_dict(layer.state_dict())
    return twin


def _edit_in_place(layer):
    with torch.no_grad():
        layer.weight.mul_(-0.5)


@pytest.mark.parametrize("action", sorted(ACTIONS))  # every action on every run
@settings(max_examples=8, deadline=None)
@given(
    name=st.sampled_from(["qkv_proj", "out_proj"]),
    kv_heads=st.sampled_from([1, 2, 4]),
    bias=st.booleans(),
    rope=st.booleans(),
    short=st.integers(2, 32),
    long=st.integers(33, 48),
    steps=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_every_path_is_the_reference_or_the_same_named_error(
    action, name, kv_heads, bias, rope, short, long, steps, seed
):
    do, context, error = ACTIONS[action]
    m = build(kv_heads, bias, rope=rope or action.startswith("rope"), seed=seed)
    with torch.no_grad():
        m(torch.randn(1, 3, 16))  # a call before the change: nothing may be remembered
    hooks = do(m, name)
    dtype = torch.float64 if action == "float64" else torch.float32
    x = torch.randn(2, long, 16, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    tolerance = 3e-2 if action == "autocast" else 1e-4
    try:
        with (context or contextlib.nullcontext)(), torch.no_grad():
            for path, call in _paths(m, x, short, long, steps):
                tokens = _tokens(path, short, long, steps)
                if error is not None and tokens >= error[2]:
                    with pytest.raises(error[0], match=error[1]):
                        call()
                    continue
                got, want = call(), reference(m, x[:, :tokens])
                torch.testing.assert_close(
                    got.double(), want, rtol=tolerance, atol=tolerance, msg=f"{action}: {path}"
                )
    finally:
        if callable(getattr(hooks, "remove", None)):
            hooks.remove()


def _paths(m, x, short, long, steps):
    yield "1 token", lambda: m(x[:, :1])
    yield "short", lambda: m(x[:, :short])
    yield "long", lambda: m(x[:, :long])
    yield "decode", lambda: decode(m, x[:, :steps])


def _tokens(path, short, long, steps):
    return {"1 token": 1, "short": short, "long": long, "decode": steps}[path]
