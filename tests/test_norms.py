"""attnlab.norms.RMSNorm against its definition in float64, at any magnitude: a row whose
squares pass float32 (|x| past about 1.8e19) was normalised to zeros (the squares' mean was
inf); rows within 1 compute exactly as the plain float32 formula."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.norms import RMSNorm


def definition(x, weight, eps, offset):
    """x / sqrt(mean(x^2) + eps) * (offset + weight), in float64."""
    x = x.double()
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * (offset + weight.double())


@settings(max_examples=60, deadline=None)
@given(
    exponent=st.integers(-30, 37),
    dim=st.integers(1, 24),
    offset=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_magnitude_normalises_as_defined(exponent, dim, offset, seed):
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(dim, offset=offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
    x = torch.randn(3, dim, generator=g) * 10.0**exponent
    expected = definition(x, norm.weight, norm.eps, offset)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_rows_within_one_compute_as_the_plain_formula():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(16, eps=1e-5)
    x = torch.rand(4, 16, generator=g) * 2 - 1  # every |x| <= 1
    plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert torch.equal(norm(x), plain)


@pytest.mark.parametrize("magnitude", [1.0, 1e25])
def test_gradients_are_the_definitions(magnitude):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, generator=g) * magnitude
    norm = RMSNorm(8)
    leaf = x.clone().requires_grad_()
    wide = x.double().requires_grad_()
    direction = torch.randn(2, 8, generator=g)
    (norm(leaf) * direction).sum().backward()
    (definition(wide, norm.weight.detach(), norm.eps, 0.0) * direction.double()).sum().backward()
    scale = float(wide.grad.abs().max())
    torch.testing.assert_close(leaf.grad.double(), wide.grad, rtol=1e-4, atol=1e-5 * scale)


def test_float64_rows_normalise_in_float64_past_float32():
    """A float64 row of 1e39 was computed in float32: inf, then NaN (the seventh pass);
    it is normalised in float64, to float64's precision."""
    norm = RMSNorm(4).double()
    x = torch.tensor([[1e39, 2e39, -1e39, 3e39], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    expected = definition(x, norm.weight.detach(), norm.eps, 0.0)
    torch.testing.assert_close(norm(x), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("eps", [1e-50, 1e-45, 1e-39])
def test_an_eps_below_float32s_smallest_normal_keeps_a_zero_row_zero(eps):
    """An eps that float32 rounds to 0 or a subnormal counts as float32's smallest normal
    value: a row of zeros stays zeros (it gave 0 / 0, NaN), other rows as the formula."""
    norm = RMSNorm(8, eps=eps)
    x = torch.zeros(2, 8)
    x[1] = torch.arange(8.0) - 3.5
    y = norm(x)
    assert torch.equal(y[0], torch.zeros(8))
    want = x[1].double() / x[1].double().pow(2).mean().sqrt()
    torch.testing.assert_close(y[1].double(), want, rtol=1e-6, atol=1e-6)


def test_a_module_with_a_tiny_eps_decodes_a_zero_token_natively_as_its_forward():
    """The native decode step counts such an eps the same way (tests/test_decode_cpu.py
    compares the paths otherwise)."""
    from attnlab import MultiHeadAttention

    torch.manual_seed(0)
    m = MultiHeadAttention(16, 32, 16, 0.0, 4, rope=True, qk_norm="head", qk_norm_eps=1e-50)
    x = torch.randn(1, 6, 16)
    x[0, 3] = 0.0  # no bias: its queries and keys are zero rows
    with torch.no_grad():
        cache = m.make_cache(1)
        steps = torch.cat([m(x[:, i : i + 1], cache=cache) for i in range(6)], dim=1)
        torch.testing.assert_close(steps, m(x), rtol=1e-5, atol=1e-5)


def test_an_offset_whose_identity_weight_overflows_is_a_named_value_error():
    """1 - offset past the weight dtype's largest value (it was torch's RuntimeError from
    torch.full); the same offset in float64 is a weight float64 holds."""
    with pytest.raises(ValueError, match=r"offset \(1e\+39\) puts the weight's identity value"):
        RMSNorm(8, offset=1e39)
    assert RMSNorm(8, offset=1e39, dtype=torch.float64).weight.dtype == torch.float64


def test_the_modules_offset_past_the_weights_dtype_names_qk_norm_offset():
    from attnlab import MultiHeadAttention

    with pytest.raises(ValueError, match=r"^qk_norm_offset \(1e\+39\) puts the weight's"):
        MultiHeadAttention(16, 32, 8, 0.0, 4, qk_norm="head", qk_norm_offset=1e39)
