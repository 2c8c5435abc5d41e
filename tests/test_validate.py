"""attnlab._validate's value reads, against independent references."""

import math

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab._validate import largest_magnitude

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SPECIALS = (math.nan, math.inf, -math.inf, 0.0, -0.0)


def numpy_largest(t: torch.Tensor) -> float:
    """max |t| by NumPy in float64: NaN if any value is, 0 for no values."""
    values = t.detach().to(torch.float64).numpy()
    if not values.size:
        return 0.0
    return float(np.max(np.abs(values)))  # NaN propagates through np.max


@st.composite
def tensors(draw):
    """A tensor of 0 to 3 dimensions (sizes 0 to 5) in one of DTYPES, with a few special
    values planted: every other element of a larger one (a strided view), transposed or
    not."""
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from((1e-3, 1.0, 1e3)))
    base = (torch.randn(tuple(2 * s for s in shape), dtype=torch.float64) * scale).to(dtype)
    t = base[tuple(slice(None, None, 2) for _ in shape)]  # every other element: strided
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, -1)
    for _ in range(draw(st.integers(0, 2)) if t.numel() else 0):
        index = tuple(draw(st.integers(0, size - 1)) for size in t.shape)
        t[index] = draw(st.sampled_from(SPECIALS))  # written through the view
    return t


@given(tensors())
def test_largest_magnitude_equals_numpy(t):
    got, want = largest_magnitude(t), numpy_largest(t)
    assert (math.isnan(got) and math.isnan(want)) or got == want


def test_largest_magnitude_reads_through_autograd_and_views():
    x = torch.tensor([[1.0, -7.5], [3.0, 2.0]], requires_grad=True)
    assert largest_magnitude(x) == 7.5
    assert largest_magnitude(x.t()[:1]) == 3.0  # column 0 of x: 1 and 3
    assert largest_magnitude(x[:0]) == 0.0
