"""attnlab.matvec.linear, as attnlab.plan.project takes it: the blocked matrix product for a
few rows, or the native projection kernel where no gradient is wanted, equals the layer's own
forward, values and gradients, and steps aside for layers it must not bypass (hooks local or
global, forward or backward; subclasses)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnlab import decode_cpu, matvec, plan


def project(x, layer):
    return plan.project(x, layer, tuple(layer.weight.shape))


@given(
    seed=st.integers(0, 2**31 - 1),
    lead=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    in_features=st.integers(1, 24),
    out_features=st.integers(1, 24),
    bias=st.booleans(),
)
def test_equals_the_layer_values_and_gradients(seed, lead, in_features, out_features, bias):
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(*lead, in_features, requires_grad=True)  # rows may be 0 to 64
    expected = layer(x)
    got = project(x, layer)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(expected)
    want = torch.autograd.grad(expected, [x, *layer.parameters()], grad)
    have = torch.autograd.grad(got, [x, *layer.parameters()], grad)
    for g, e in zip(have, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_a_layer_with_a_forward_hook_is_called_not_bypassed():
    layer = nn.Linear(8, 8)
    layer.register_forward_hook(lambda module, args, out: out * 0 + 7)  # e.g. an adapter
    torch.testing.assert_close(project(torch.randn(1, 8), layer), torch.full((1, 8), 7.0))


def test_a_linear_subclass_is_called_not_bypassed():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    layer = Doubled(8, 8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(project(x, layer), layer(x))


def test_a_non_contiguous_weight_still_gives_the_layer_output():
    layer = nn.Linear(8, 12)
    with torch.no_grad():
        layer.weight = nn.Parameter(torch.randn(8, 12).t())  # (12, 8), column-major
    x = torch.randn(2, 8)
    torch.testing.assert_close(project(x, layer), layer(x))


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 32), bias=st.booleans())
def test_the_blocked_product_itself_equals_f_linear(seed, rows, bias):
    torch.manual_seed(seed)
    weight, x = torch.randn(12, 7), torch.randn(rows, 7)
    b = torch.randn(12) if bias else None
    assert matvec.helps(x, weight)
    torch.testing.assert_close(
        matvec.linear(x, weight, b), nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5
    )


def test_a_global_forward_hook_is_honoured_on_few_rows():
    layer = nn.Linear(8, 8)
    x = torch.randn(6, 8)
    hook = nn.modules.module.register_module_forward_hook(lambda m, a, out: out * 0 + 7)
    try:
        torch.testing.assert_close(project(x, layer), torch.full((6, 8), 7.0))
    finally:
        hook.remove()
    torch.testing.assert_close(project(x, layer), layer(x))


def test_a_full_backward_hook_fires_on_few_rows():
    layer = nn.Linear(8, 8)
    seen = []
    layer.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(grad_out[0]))
    x = torch.randn(3, 8, requires_grad=True)
    project(x, layer).sum().backward()
    assert len(seen) == 1 and seen[0].shape == (3, 8)


def test_a_bias_of_the_wrong_shape_is_not_broadcast():
    layer = nn.Linear(8, 12)
    layer.bias = nn.Parameter(torch.randn(4))
    assert not plan.blocked_projection(torch.randn(6, 8), layer, (12, 8))


def _native_calls(monkeypatch):
    calls = []
    original = decode_cpu.linear_rows
    monkeypatch.setattr(
        decode_cpu, "linear_rows", lambda *a: calls.append(a[0].shape) or original(*a)
    )
    return calls


@pytest.mark.skipif(not decode_cpu.available(), reason="the native decode step is unavailable")
@pytest.mark.parametrize("loaded", [True, False])
@pytest.mark.parametrize("grad", [True, False])
def test_the_native_product_is_taken_without_gradients_once_loaded(loaded, grad, monkeypatch):
    """No gradient wanted and the extension loaded: decode_cpu.linear_rows; else the blocked
    batched product, which autograd records. Both equal F.linear."""
    calls = _native_calls(monkeypatch)
    monkeypatch.setattr(decode_cpu, "loaded", lambda: loaded)
    layer = nn.Linear(20, 12)
    x = torch.randn(3, 5, 20)
    with torch.set_grad_enabled(grad):
        got = project(x, layer)
    assert len(calls) == (loaded and not grad)
    assert got.requires_grad is grad
    torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not decode_cpu.available(), reason="the native decode step is unavailable")
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_take_the_batched_product(dtype, monkeypatch):
    calls = _native_calls(monkeypatch)
    layer = nn.Linear(8, 8).to(dtype)
    x = torch.randn(2, 8, dtype=dtype)
    with torch.no_grad():
        got = project(x, layer)
        torch.testing.assert_close(got, layer(x))
    assert calls == []
