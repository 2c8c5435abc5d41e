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
